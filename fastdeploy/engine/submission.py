"""The engine's doors for its callers (`LLM`, the server): what they hand in (a `Submission`: one prompt's
requests, made and checked but not yet queued), where each request's outputs go (its caller's `Sink`,
called on the stepping thread) and when, and `EngineStats`. The scheduler's `Request` records stay inside
the engine: a caller sees request ids, `RequestOutput`s and the prompt's verdict."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastdeploy.engine.request import Request
from fastdeploy.outputs import RequestOutput

Sink = Callable[[RequestOutput], None]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics and health."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of the KV blocks in use (1 = all)
    num_preemptions: int  # since the engine started
    num_blocks: int  # the KV pool
    num_free_blocks: int  # not held by a request (some still hold a cached prefix)
    num_cached_free_blocks: int  # free ones holding a cached prefix, reusable until evicted
    batch_size: int  # requests in the last step
    max_num_seqs: int


class Submission:
    """One prompt's requests: its n samples, or its best_of candidates (all accepted or all rejected)."""

    __slots__ = ("requests", "first_index")

    def __init__(self, requests: Sequence[Request], first_index: int):
        self.requests = list(requests)  # the engine's; callers use the properties below
        self.first_index = first_index

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.requests[0].prompt_token_ids

    @property
    def num_returned(self) -> int:
        """How many of its outputs a caller returns: n (of best_of candidates, the n best)."""
        return self.requests[0].params.n

    @property
    def max_tokens(self) -> int:
        """The output tokens each of its requests may make (max_tokens, cut to what fits after the prompt)."""
        return self.requests[0].max_tokens

    @property
    def error(self) -> tuple[int, str] | None:
        """(error_code, error_msg) when the prompt was rejected (too long, ids out of range, bad media, ...)."""
        rejected = next((r for r in self.requests if r.error_code != 200), None)
        return None if rejected is None else (rejected.error_code, rejected.error_msg or "invalid request")

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(slots=True, eq=False)
class Route:
    """Where one request's outputs go: every step it advanced (stream: deltas) or once, when finished; a
    ranked best_of group's finals all together when its last candidate finishes, best first."""

    request: Request
    sink: Sink
    stream: bool
    group: RankedGroup | None = None


@dataclass(slots=True, eq=False)
class RankedGroup:
    """The best_of candidates of one prompt (non-streamed): their final outputs, kept until all are done."""

    size: int
    first_index: int
    finals: list[tuple[float, int, RequestOutput]] = field(default_factory=list)  # (cumulative logprob, order, output)

    def add(self, request: Request, output: RequestOutput) -> list[RequestOutput]:
        """The group's outputs, best first (the highest cumulative logprob, as vLLM ranks them), once this
        was the last candidate; each numbered first_index + its rank. [] before."""
        self.finals.append((request.cumulative_logprob, len(self.finals), output))
        if len(self.finals) < self.size:
            return []
        ranked = sorted(self.finals, key=lambda item: (-item[0], item[1]))
        for rank, (_, _, out) in enumerate(ranked):
            out.outputs.index = self.first_index + rank
        return [out for _, _, out in ranked]
