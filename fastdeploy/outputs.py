"""The output objects handed back to the user (FastDeploy's names and fields): RequestOutput with its
CompletionOutput and RequestMetrics, and the Logprob entries. Plain data with no engine state; FastDeploy's
import paths (`fastdeploy.engine.request`, `fastdeploy.worker.output`) re-export them."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple


class Logprob(NamedTuple):
    """One token's log-probability entry (a NamedTuple, as FastDeploy's: compact and immutable)."""

    logprob: float
    rank: int | None = None  # 1-based rank in the vocabulary
    decoded_token: str | None = None


# Per prompt position ({token_id: Logprob}, None for position 0), and per generated token.
PromptLogprobs = list[dict[int, Logprob] | None]
SampleLogprobs = list[dict[int, Logprob]]


def _logprobs_to_dict(entries: list[dict[int, Logprob] | None] | None) -> list[dict[int, dict] | None] | None:
    """Logprob entries as plain dicts (Logprob fields by name), so json.dumps keeps their meaning."""
    if entries is None:
        return None
    return [None if e is None else {t: lp._asdict() for t, lp in e.items()} for e in entries]


def _logprobs_from_dict(entries: list | None) -> list[dict[int, Logprob] | None] | None:
    """Inverse of _logprobs_to_dict; token ids may come back as strings (JSON object keys)."""
    if entries is None:
        return None
    return [None if e is None else {int(t): Logprob(**lp) if isinstance(lp, dict) else Logprob(*lp)
                                    for t, lp in e.items()} for e in entries]


def _check_keys(cls: type, d: dict[str, Any]) -> None:
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__}.from_dict: unknown keys {sorted(unknown)}; "
                        f"allowed: {[f.name for f in fields(cls)]}")


@dataclass(slots=True)
class RequestMetrics:
    """FastDeploy's meanings: arrival_time, inference_start_time and request_start_time are time.time()
    timestamps; the others are durations in seconds. Updated as the request runs (each output carries a
    snapshot)."""

    arrival_time: float  # request received, before its prompt was templated/tokenized
    inference_start_time: float | None = None  # first scheduled
    first_token_time: float | None = None  # duration: inference_start_time -> first output token sampled
    time_in_queue: float | None = None  # duration: preprocessing done -> inference_start_time
    preprocess_cost_time: float | None = None  # duration: templating and tokenizing
    model_forward_time: float | None = None  # duration: inference_start_time -> latest output token
    model_execute_time: float | None = None  # duration: arrival_time -> latest output token (or finish)
    request_start_time: float | None = None  # as FastDeploy: the arrival_time again
    # Speculative decoding (speculative_config): tokens drafted for this request, and those the model accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestMetrics:
        _check_keys(cls, d)
        return cls(**d)


@dataclass(slots=True)
class CompletionOutput:
    index: int  # position of this output in the returned list
    send_idx: int  # index of the last token sent
    token_ids: list[int]
    decode_type: int = 0  # FastDeploy: 0 = text tokens (the only kind here)
    logprob: float | None = None  # the last token's logprob (None unless logprobs were asked for)
    top_logprobs: None = None  # FastDeploy's raw per-step lists; always None here (see `logprobs`)
    logprobs: list[dict[int, Logprob]] | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # always [] (drafts are verified in the engine)
    # Speculative decoding with MTP, when logprobs were asked for: per output token (as `logprobs`), the MTP
    # layer's logprobs where it drafted that token and the draft was accepted, else None.
    draft_logprobs: list[dict[int, Logprob] | None] | None = None
    text: str | None = None
    reasoning_content: str | None = None
    # OpenAI-shaped calls parsed from the text (chat with tools and an LLM tool_call_parser); in stream
    # deltas the new calls as delta items: {"index", "id", "type", "function": {"name", "arguments"}}.
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["logprobs"] = _logprobs_to_dict(self.logprobs)
        d["draft_logprobs"] = _logprobs_to_dict(self.draft_logprobs)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompletionOutput:
        _check_keys(cls, d)
        return cls(**{**d, "logprobs": _logprobs_from_dict(d.get("logprobs")),
                      "draft_logprobs": _logprobs_from_dict(d.get("draft_logprobs"))})


@dataclass(slots=True)
class RequestOutput:
    request_id: str  # a uuid4 string, as FastDeploy's LLM makes them
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    outputs: CompletionOutput | None = None
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    error_code: int = 200
    error_msg: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_input_image_tokens: int = 0  # image placeholder tokens in the prompt
    num_input_video_tokens: int = 0
    prompt_token_ids_len: int | None = None  # len(prompt_token_ids) unless given

    def __post_init__(self) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids = []
        if self.prompt_token_ids_len is None:
            self.prompt_token_ids_len = len(self.prompt_token_ids)

    def to_dict(self) -> dict[str, Any]:
        """A dict of plain values (json.dumps-able); RequestOutput.from_dict turns it back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["prompt_token_ids"] = list(self.prompt_token_ids)
        d["outputs"] = None if self.outputs is None else self.outputs.to_dict()
        d["metrics"] = None if self.metrics is None else self.metrics.to_dict()
        d["prompt_logprobs"] = _logprobs_to_dict(self.prompt_logprobs)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestOutput:
        _check_keys(cls, d)
        outputs, metrics = d.get("outputs"), d.get("metrics")
        return cls(**{**d, "outputs": None if outputs is None else CompletionOutput.from_dict(outputs),
                      "metrics": None if metrics is None else RequestMetrics.from_dict(metrics),
                      "prompt_logprobs": _logprobs_from_dict(d.get("prompt_logprobs"))})
