"""The response bodies of run-batch's lines: the server's own (serving_chat.py / serving_completion.py build
them), so a batch's results read as the API's."""
from __future__ import annotations

from typing import Any

from fastdeploy.cli.batch_engine import LineResult
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.serving import new_id, now
from fastdeploy.entrypoints.openai.serving_chat import chat_response
from fastdeploy.entrypoints.openai.serving_completion import completion_choice, completion_response
from fastdeploy.input.tokenizer import Tokenizer


def _usage(result: LineResult) -> dict[str, int]:
    """Prompt tokens once per prompt (not per sample), every returned sample's output tokens."""
    prompt = sum(map(len, result.prompt_token_ids))
    completion = sum(len(c.token_ids) for c in result.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_body(result: LineResult, model: str) -> dict[str, Any]:
    body = result.request.body
    assert isinstance(body, ChatCompletionRequest)
    # Only tool_choice 'auto' reaches here, whose calls finish with "tool_calls" (as the server's).
    return chat_response(body, new_id("chatcmpl"), now(), model, result.choices, result.prompt_token_ids[0],
                         _usage(result))


def completion_body(result: LineResult, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    request = result.request
    body = request.body
    assert isinstance(body, CompletionRequest)
    per_prompt = request.choices_per_prompt

    def echo(p: int) -> str:
        if not body.echo:
            return ""
        prompt = request.prompts[p]
        return prompt if isinstance(prompt, str) else tokenizer.decode(prompt["prompt_token_ids"],
                                                                       skip_special_tokens=False)

    choices = [completion_choice(body, i, echo(i // per_prompt), c, result.prompt_token_ids[i // per_prompt])
               for i, c in enumerate(result.choices)]
    return completion_response(new_id("cmpl"), now(), model, choices, _usage(result))
