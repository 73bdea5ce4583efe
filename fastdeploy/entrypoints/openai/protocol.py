"""Request bodies of the OpenAI API (and FastDeploy's extra fields), and how they become SamplingParams.

Unknown fields are refused (400 naming them) rather than silently ignored; values are checked by
SamplingParams itself, so the server and LLM.generate accept exactly the same ranges. Python's json
parses NaN, Infinity and 1e400 (inf): every float field, nested ones included (logit_bias values),
refuses non-finite numbers already here (allow_inf_nan=False).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.guided_fields import guided_decoding_from


_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


MAX_REQUEST_ID_CHARS = 256
# Tokens of one SSE chunk: past the longest output a chunk could hold anyway, only bounds the number.
MAX_STREAMING_RESPONSE_TOKENS = 1 << 20
_OFFLINE = {f.name: f.default for f in dataclasses.fields(SamplingParams)}  # the same defaults as LLM.generate


class _SamplingFields(BaseModel):
    """Fields both endpoints share: SamplingParams' own (same names and defaults), OpenAI's and
    FastDeploy's extras."""

    model_config = _STRICT
    model: str | None = None
    n: int = _OFFLINE["n"]
    temperature: float | None = _OFFLINE["temperature"]
    top_p: float | None = _OFFLINE["top_p"]
    top_k: int = _OFFLINE["top_k"]
    min_p: float = _OFFLINE["min_p"]
    presence_penalty: float | None = _OFFLINE["presence_penalty"]
    frequency_penalty: float | None = _OFFLINE["frequency_penalty"]
    repetition_penalty: float | None = _OFFLINE["repetition_penalty"]
    seed: int | None = _OFFLINE["seed"]
    stop: str | list[str] | None = _OFFLINE["stop"]
    stop_token_ids: list[int] | None = _OFFLINE["stop_token_ids"]
    bad_words: list[str] | None = _OFFLINE["bad_words"]
    bad_words_token_ids: list[int] | None = _OFFLINE["bad_words_token_ids"]
    max_tokens: int | None = _OFFLINE["max_tokens"]
    min_tokens: int = _OFFLINE["min_tokens"]
    ignore_eos: bool = _OFFLINE["ignore_eos"]
    include_stop_str_in_output: bool = _OFFLINE["include_stop_str_in_output"]
    skip_special_tokens: bool = _OFFLINE["skip_special_tokens"]
    temp_scaled_logprobs: bool = _OFFLINE["temp_scaled_logprobs"]
    top_p_normalized_logprobs: bool = _OFFLINE["top_p_normalized_logprobs"]
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: only requests with the same salt share prefix-cache blocks (so cannot learn of each other's).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Output constraints (guided_fields.py): OpenAI's response_format or one of FastDeploy's extras.
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    # FastDeploy's extras (docs/online_serving.md#fastdeploys-request-extras). request_id becomes the response's
    # `id` only: the engine's own request ids stay its uuid4s, so a client cannot collide with another's.
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=r"^[!-~]+$")
    logits_processors_args: dict[str, Any] | None = None  # only {"logit_bias": ...}: SamplingParams checks it
    max_streaming_response_tokens: int | None = Field(None, ge=1, le=MAX_STREAMING_RESPONSE_TOKENS)
    # With logprobs and MTP drafts: `draft_logprobs` beside `logprobs`, the MTP layer's for each accepted draft.
    include_draft_logprobs: bool = False
    mm_hashes: list[Any] | None = None

    @field_validator("mm_hashes")
    @classmethod
    def _no_hashes(cls, value: list[Any] | None) -> list[Any] | None:
        # FastDeploy looks hashed media up in its processor cache (and may then skip them); this server keeps
        # none and reads every medium itself under its media policy, so a hash could only be ignored.
        if value:
            raise ValueError("this server keeps no processor cache to look media hashes up in; send the media "
                             "themselves (only null or [] is accepted)")
        return value

    def sampling_params(self, logprobs: int | None, max_tokens: int | None, **extra: Any) -> SamplingParams:
        """The SamplingParams of this request (ValueError/TypeError naming the field when a value is out
        of range)."""
        shared = {name: getattr(self, name) for name in _SHARED}
        args = dict(self.logits_processors_args) if self.logits_processors_args is not None else {}
        if self.logit_bias:
            if "logit_bias" in args:
                raise ValueError("logits_processors_args holds a logit_bias and so does the request: give it in one "
                                 "place")
            args["logit_bias"] = self.logit_bias
        if "guided_decoding" not in extra:
            extra["guided_decoding"] = guided_decoding_from(self)
        return SamplingParams(**shared, max_tokens=max_tokens, logprobs=logprobs,
                              logits_processors_args=args or None, **extra)


# SamplingParams fields taken as they are (max_tokens and logprobs are mapped per endpoint).
_SHARED = [name for name in _OFFLINE if name in _SamplingFields.model_fields
           and name not in ("max_tokens", "logprobs", "logits_processors_args")]


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI tool dicts, rendered by the chat template
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    # FastDeploy's: the prompt's ids, the messages then not rendered; or the one message's text as the prompt.
    prompt_token_ids: list[int] | None = None
    disable_chat_template: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _no_metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # FastDeploy merges metadata's keys into the request (a deprecated path with its own precedence rules);
        # rather than guess those, the keys are asked for at the top level.
        if value:
            raise ValueError(f"FastDeploy reads metadata's keys as request fields; send them as top-level fields "
                             f"instead (only null or {{}} is accepted), got keys {sorted(value)[:8]}")
        return value

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        k = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(k, max_tokens, reasoning_max_tokens=self.reasoning_max_tokens)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]], None] = None  # required unless prompt_token_ids
    prompt_token_ids: list[int] | list[list[int]] | None = None  # FastDeploy's: used instead of tokenizing
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = _OFFLINE["best_of"]  # only completions carry it (OpenAI's and FastDeploy's protocol)

    def to_sampling_params(self) -> SamplingParams:
        params = self.sampling_params(self.logprobs, self.max_tokens, best_of=self.best_of)
        if self.stream and params.ranks_candidates:  # as OpenAI: the ranked candidates cannot be streamed
            raise ValueError(f"best_of ({self.best_of}) > n ({self.n}) cannot be used with stream=true: the "
                             "candidates are ranked once finished")
        return params


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error",
               499: "client_closed_request", 500: "internal_server_error",
               503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param,
                                         code=status)).model_dump()


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
