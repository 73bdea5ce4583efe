"""One Request from arrival to finish, and the output objects handed back to the user."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.output.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the vocabulary
    decoded_token: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps are time.time() seconds; the other fields are durations in seconds."""

    arrival_time: float
    inference_start_time: float | None = None  # first scheduled
    first_token_time: float | None = None  # first output token sampled
    time_in_queue: float | None = None  # arrival -> first scheduled
    model_forward_time: float | None = None  # forward+sampling time of the steps it was in
    model_execute_time: float | None = None  # arrival (after preprocessing) -> finished
    preprocess_cost_time: float | None = None  # tokenizing and templating


@dataclass(slots=True)
class CompletionOutput:
    index: int  # position of the prompt in the batch
    send_idx: int  # index of the last token sent
    token_ids: list[int]
    text: str | None = None
    reasoning_content: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: CompletionOutput
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error_code: int = 200
    error_msg: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True, eq=False)
class Request:
    """Everything the engine knows about one request; the scheduler, block manager and runner all
    read and update this one object."""

    request_id: str
    index: int
    prompt: str | None
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
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, in order
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error_code: int = 200
    error_msg: str | None = None
    # Generation controls resolved from the params.
    bad_words: list[tuple[int, ...]] = field(default_factory=list)  # banned token sequences
    forced_tokens: list[int] = field(default_factory=list)  # emitted next instead of sampling
    prefix_leader: Request | None = None  # a sibling (n > 1) whose prompt blocks this one reuses
    # Text state, kept by the OutputProcessor.
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""  # output text so far, cut at a matched stop string
    reasoning: bool = False  # the reasoning parser applies to this output
    num_reasoning_tokens: int = 0
    sent_tokens: int = 0  # for streaming: what earlier deltas carried
    sent_text: int = 0
    sent_reasoning: int = 0

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
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.model_execute_time = time.time() - self.metrics.arrival_time
