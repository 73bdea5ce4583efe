"""The response bodies of run-batch's lines, in the server's shape (serving_chat.py / serving_completion.py):
the same fields, logprobs objects and usage for the same outputs, so a batch's results read as the API's."""
from __future__ import annotations

from typing import Any

from fastdeploy.cli.batch_engine import LineResult
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.serving import Choice, new_id, now
from fastdeploy.entrypoints.openai.serving_chat import chat_logprobs
from fastdeploy.entrypoints.openai.serving_completion import completion_logprobs
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.tool_parsers import join_call_deltas


def _usage(result: LineResult) -> dict[str, int]:
    """Prompt tokens once per prompt (not per sample), every returned sample's output tokens."""
    prompt = sum(map(len, result.prompt_token_ids))
    completion = sum(len(c.token_ids) for c in result.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _message(body: ChatCompletionRequest, choice: Choice, prompt_ids: list[int]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant"}
    if choice.tool_call_deltas:  # content null when the answer is only calls, as OpenAI
        message.update(content=choice.text or None, tool_calls=join_call_deltas(choice.tool_call_deltas))
    else:
        message["content"] = choice.text
    message["reasoning_content"] = choice.reasoning
    if body.return_token_ids:
        message.update(prompt_token_ids=prompt_ids, completion_token_ids=choice.token_ids)
    return message


def chat_body(result: LineResult, model: str) -> dict[str, Any]:
    body = result.request.body
    assert isinstance(body, ChatCompletionRequest)
    k = body.top_logprobs or 0
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": model,
        "choices": [{
            "index": i,
            "message": _message(body, c, result.prompt_token_ids[0]),
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, k) if body.logprobs else None,
            # Only tool_choice 'auto' reaches here, whose calls finish with "tool_calls" (as the server's).
            "finish_reason": "tool_calls" if c.tool_call_deltas else c.finish_reason,
            "stop_reason": c.stop_reason,
        } for i, c in enumerate(result.choices)],
        "usage": _usage(result),
    }


def completion_body(result: LineResult, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    request = result.request
    body = request.body
    assert isinstance(body, CompletionRequest)
    k = body.logprobs or 0
    per_prompt = request.choices_per_prompt

    def echo(p: int) -> str:
        if not body.echo:
            return ""
        prompt = request.prompts[p]
        return prompt if isinstance(prompt, str) else tokenizer.decode(prompt["prompt_token_ids"],
                                                                       skip_special_tokens=False)

    choices = []
    for i, c in enumerate(result.choices):
        choice: dict[str, Any] = {
            "index": i, "text": echo(i // per_prompt) + c.text, "reasoning_content": c.reasoning,
            "logprobs": completion_logprobs(c.token_ids, c.logprobs, k, 0) if body.logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if body.return_token_ids:
            choice.update(prompt_token_ids=result.prompt_token_ids[i // per_prompt], completion_token_ids=c.token_ids)
        choices.append(choice)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model, "choices": choices,
            "usage": _usage(result)}
