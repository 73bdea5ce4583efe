"""FastDeploy's request extras that change what the endpoints do rather than the sampling: the response id a
client chooses (`request_id`), prompts given as token ids (`prompt_token_ids`) or as the raw text of one message
(`disable_chat_template`), and stream chunks holding several tokens (`max_streaming_response_tokens`).
The pure field checks (`include_draft_logprobs`, `mm_hashes`, `metadata`) live on the request models."""
from __future__ import annotations

from typing import Any

from fastdeploy.entrypoints.multimodal import Prepared
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.serving import APIError, ServingContext, new_id


def response_id(prefix: str, request_id: str | None) -> str:
    """The response's `id`: the client's request_id with the endpoint's prefix as FastDeploy adds it (kept if
    already there), else a fresh one. Only a label: the engine never sees it."""
    if request_id is None:
        return new_id(prefix)
    return request_id if request_id.startswith(f"{prefix}-") else f"{prefix}-{request_id}"


def skips_template(body: ChatCompletionRequest) -> bool:
    """Whether the chat's prompt is not rendered by the chat template (FastDeploy: prompt_token_ids win, then
    disable_chat_template; an empty prompt_token_ids list counts as not given, as there)."""
    return bool(body.prompt_token_ids) or body.disable_chat_template


def check_raw_chat(body: ChatCompletionRequest) -> None:
    """Refuse what a chat without its template could not honour (before any work): a request template, and
    media, which only the template places in the prompt."""
    if body.chat_template is not None or (body.chat_template_kwargs or {}).get("chat_template") is not None:
        field = "prompt_token_ids" if body.prompt_token_ids else "disable_chat_template"
        raise APIError(400, f"chat_template: no template is rendered with {field}", "chat_template")
    for message in body.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            raise APIError(400, "messages: media parts need the chat template to place them; they cannot go with "
                                "prompt_token_ids or disable_chat_template", "messages")
    if body.prompt_token_ids:
        return
    if len(body.messages) != 1 or not isinstance(body.messages[0].get("content"), str):
        # FastDeploy takes the first message's content and drops the rest; one message leaves nothing dropped.
        raise APIError(400, "disable_chat_template: send exactly one message, whose string content is the raw "
                            "prompt", "disable_chat_template")


def raw_chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> Prepared:
    """The prompt of a chat that skips its template: the ids as sent, or the message's text tokenized as a
    completion's prompt is (on a worker thread: tokenization)."""
    if body.prompt_token_ids:
        return None, list(body.prompt_token_ids), None
    text = body.messages[0]["content"]
    return text, ctx.engine.tokenizer.encode(text), None


def completion_prompts(ctx: ServingContext, body: CompletionRequest) -> list[Prepared]:
    """(text, ids, no media) of each prompt: `prompt` (a str, a list of str, a list of token ids or a list of
    those), or FastDeploy's prompt_token_ids (a list of ids or a list of those) used instead of tokenizing it.
    With prompt_token_ids the ids are the prompts and `prompt`, if sent, must count as many."""
    prompts = _as_list(body.prompt)
    ids = _as_list(body.prompt_token_ids)
    if ids:
        if prompts and len(prompts) != len(ids):
            raise APIError(400, f"prompt_token_ids holds {len(ids)} prompts but prompt holds {len(prompts)}; send "
                                "one id list per prompt (or leave prompt out)", "prompt_token_ids")
        if any(not isinstance(p, str) for p in prompts):
            raise APIError(400, "prompt: token ids go either in prompt or in prompt_token_ids, not both", "prompt")
        prepared: list[Prepared] = [(None, list(p), None) for p in ids]
    else:  # an empty prompt_token_ids counts as not given, as FastDeploy's
        if not prompts:
            raise APIError(400, "prompt must be a non-empty string, list of strings or list of token ids", "prompt")
        tokenizer = ctx.engine.tokenizer
        prepared = [(p, tokenizer.encode(p), None) if isinstance(p, str) else (None, list(p), None) for p in prompts]
    if any(len(p) == 0 for p in (ids or prompts)):
        field = "prompt_token_ids" if ids else "prompt"
        raise APIError(400, f"{field} must be a non-empty string, list of strings or list of token ids (each "
                            "prompt non-empty)", field)
    if len(prepared) > ctx.limits.max_prompts:
        field = "prompt_token_ids" if ids else "prompt"
        raise APIError(400, f"{field} holds {len(prepared)} prompts, over this server's "
                            f"--max-prompts={ctx.limits.max_prompts}", field)
    return prepared


def _as_list(prompt: Any) -> list[Any]:
    """A prompt field as a list of prompts: one str or one list of ints is one prompt."""
    if prompt is None:
        return []
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class ChunkGroups:
    """FastDeploy's max_streaming_response_tokens: a stream's choice deltas (one per engine step, so one token
    each) gathered into chunks of at most `size`; a chunk goes as soon as it is full or one of its choices
    finishes (a finish is never held back), and what is left at the end (`rest`)."""

    def __init__(self, size: int | None):
        self.size = size or 1  # FastDeploy's default: every delta its own chunk
        self.pending: list[dict[str, Any]] = []

    def add(self, part: dict[str, Any], finished: bool) -> list[dict[str, Any]] | None:
        """The choices of a chunk to send now, if this part completes one."""
        self.pending.append(part)
        return self.rest() if len(self.pending) >= self.size or finished else None

    def rest(self) -> list[dict[str, Any]] | None:
        out, self.pending = self.pending or None, []
        return out
