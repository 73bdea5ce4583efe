"""One Request from arrival to finish: the engine's record of it, private to engine/ (the output objects
handed back to the user live in fastdeploy/outputs.py and are re-exported here, FastDeploy's path)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from fastdeploy.config import EngineConfig
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.guided.matcher import GrammarState
from fastdeploy.model_executor.models.ernie4_5_vl.step_inputs import placeholder_error
from fastdeploy.model_executor.multimodal import MultimodalInputs
# The user-facing outputs, importable from here as FastDeploy's fastdeploy.engine.request path has them.
from fastdeploy.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: F401
from fastdeploy.speculative import MtpDrafter, NgramDrafter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestType(enum.Enum):
    """FastDeploy's task types. Here a request is PREFILL while prompt tokens remain to be computed and
    DECODE after; PREEMPTED and EXTEND (FastDeploy's worker-queue tasks) never occur in this engine."""

    PREFILL = 0
    DECODE = 1
    PREEMPTED = 2
    EXTEND = 3


@dataclass(slots=True, eq=False)
class Request:
    """A request's scheduling state. The scheduler owns its status, computed tokens and finishing;
    the block manager its blocks; the output processor its text (keyed by request_id)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # model defaults already filled in
    max_tokens: int  # resolved: never past max_model_len
    eos_token_ids: frozenset[int]
    generator: np.random.Generator
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)  # prompt + generated so far
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error_code: int = 200
    error_msg: str | None = None
    # Generation controls resolved from the params.
    bad_words: list[tuple[int, ...]] = field(default_factory=list)  # banned token sequences
    forced_tokens: list[int] = field(default_factory=list)  # emitted next instead of sampling
    prefix_leader: Request | None = None  # a sibling (n > 1) whose prompt blocks this one reuses
    mm: MultimodalInputs | None = None  # ERNIE-4.5-VL: the prompt's media, positions and token types
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    grammar: GrammarState | None = None  # guided decoding: the matcher of its constraint
    cumulative_logprob: float = 0.0  # sum of its sampled tokens' logprobs; kept only for best_of ranking
    # Speculative decoding: this step's drafts (set by the scheduler, verified by the step), the request's n-gram
    # index, and the uniforms drawn for output positions not yet emitted (see `uniform`).
    draft_token_ids: list[int] = field(default_factory=list)
    drafter: NgramDrafter | MtpDrafter | None = None
    pending_uniforms: list[float] = field(default_factory=list)
    spent_uniforms: list[float] = field(default_factory=list)  # those of the last step's tokens (see take_back)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def task_type(self) -> RequestType:
        return RequestType.PREFILL if self.num_computed_tokens < self.num_prompt_tokens else RequestType.DECODE

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def below_min_tokens(self) -> bool:
        """Fewer outputs than min_tokens: EOS and stop ids are banned from the next token, and do not
        stop the request if they come anyway (e.g. forced)."""
        return self.num_output_tokens < self.params.min_tokens

    def uniform(self, offset: int) -> float:
        """The uniform the sampler inverts at output position num_output_tokens + offset: the generator's draws
        in position order, so a position's draw does not depend on how many tokens a step tried (speculation
        samples several positions at once and emits only some; the rest are drawn again for the same uniforms).
        `use_uniforms` consumes them."""
        pending = self.pending_uniforms
        while len(pending) <= offset:
            pending.append(self.generator.random())
        return pending[offset]

    def use_uniforms(self, count: int) -> None:
        """`count` output positions were filled: their uniforms are used."""
        if self.pending_uniforms:
            self.spent_uniforms = self.pending_uniforms[:count]
            del self.pending_uniforms[:count]

    def unuse_uniforms(self, count: int) -> None:
        """The last `count` of the last step's output positions were taken back: their uniforms are again the
        next positions', as they would have been had the step not brought them."""
        if count and self.spent_uniforms:
            self.pending_uniforms[:0] = self.spent_uniforms[-count:]
            self.spent_uniforms = self.spent_uniforms[:-count]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished. Scheduled requests are finished through Scheduler.finish_request, which also
        frees their blocks; this alone is for requests rejected before scheduling."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.model_execute_time = time.time() - self.metrics.arrival_time


def request_error(request: Request, config: EngineConfig, vocab_size: int, room: int,
                  bad_words: list[tuple[int, ...]]) -> str | None:
    """Why this engine cannot run the request (for its error_code 400), or None. `room`: output tokens that
    fit after its prompt; `bad_words`: its bad-word strings as token sequences."""
    n, params = request.num_prompt_tokens, request.params
    if n == 0:
        return "the prompt is empty: it must have at least one token"
    bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"prompt_token_ids must be in [0, {vocab_size}), got {bad[:5]}"
    vl = config.model_config.multimodal
    if vl is not None and (error := placeholder_error(vl.tokens, request.prompt_token_ids, request.mm is not None)):
        return error
    if n >= config.max_model_len:
        return (f"the prompt has {n} tokens; max_model_len={config.max_model_len} leaves no room for output "
                "(the prompt must be shorter than max_model_len)")
    if room < 1:
        return f"the prompt has {n} tokens; the KV cache holds only {n + room}"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and config.max_logprobs != -1 and (k == -1 or k > config.max_logprobs):
            return f"{name}={k} is more than max_logprobs={config.max_logprobs}"
    if config.logprobs_mode != "raw_logprobs" and (params.temp_scaled_logprobs or params.top_p_normalized_logprobs):
        return (f"temp_scaled_logprobs / top_p_normalized_logprobs transform raw logprobs; this engine reports "
                f"logprobs_mode={config.logprobs_mode!r} (they need 'raw_logprobs')")
    ids = (params.stop_token_ids or []) + (params.bad_words_token_ids or []) + list(params.logit_bias)
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        return f"stop_token_ids, bad_words_token_ids and logit_bias keys must be < vocab size {vocab_size}, got {bad}"
    return _bans_everything(request, vocab_size, bad_words)


def _bans_everything(request: Request, vocab_size: int, bad_words: list[tuple[int, ...]]) -> str | None:
    """Why no token could ever be sampled, if the request's bans can cover the whole vocabulary (a step with
    every logit at -inf raises in the sampler, or a greedy row picks a banned id). Bad-word sequences sharing
    a prefix ban their last tokens together once it is output: counted as if it may be."""
    params = request.params
    always = set(params.bad_words_token_ids or ())
    after: dict[tuple[int, ...], set[int]] = {}
    for seq in bad_words:
        (always if len(seq) == 1 else after.setdefault(seq[:-1], set())).add(seq[-1])
    if params.min_tokens > 0:  # EOS and stop ids are banned until min_tokens outputs
        always |= set(request.eos_token_ids) | set(params.stop_token_ids or ())
    worst = always | max(after.values(), key=lambda s: len(s - always), default=set())
    if sum(0 <= t < vocab_size for t in worst) >= vocab_size:
        return (f"bad_words_token_ids, bad_words and (below min_tokens={params.min_tokens}) stop_token_ids and "
                f"EOS together ban all {vocab_size} tokens of the vocabulary: nothing could be sampled")
    return None
