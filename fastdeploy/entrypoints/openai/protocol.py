"""Request bodies of the OpenAI API (and FastDeploy's extra fields), and how they become SamplingParams.

Unknown fields are refused (400 naming them) rather than silently ignored; values are checked by
SamplingParams itself, so the server and LLM.generate accept exactly the same ranges.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from fastdeploy.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share, with FastDeploy's extras."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 1
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, logprobs: int | None, max_tokens: int | None, **extra: Any) -> SamplingParams:
        """The SamplingParams of this request (ValueError/TypeError naming the field when a value is out
        of range)."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, bad_words=self.bad_words, bad_words_token_ids=self.bad_words_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logits_processors_args={"logit_bias": self.logit_bias} if self.logit_bias else None, **extra)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_max_tokens: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        k = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(k, max_tokens, reasoning_max_tokens=self.reasoning_max_tokens)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.logprobs, self.max_tokens)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param,
                                         code=status)).model_dump()


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
