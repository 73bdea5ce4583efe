"""Grammar matching for constrained requests (engine side): compile each distinct spec once, keep one
matcher per request in step with its output tokens, and compute the next-token bitmasks of a step on a
worker thread while the model's forward runs.

A request's matcher consumes every output token from the point its constraint starts (the first output
token, or the first after the thinking part of a reasoning model), forced tokens included. `sync`
compares what the matcher consumed with the request's output tokens and rolls back or feeds the
difference, so a request that was preempted (recomputed later with its tokens kept) or whose tokens
change in any other way stays consistent.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy as ll_numpy
import numpy as np

from fastdeploy.guided.ll_tokenizer import build_ll_tokenizer
from fastdeploy.guided.params import GuidedDecodingParams
from fastdeploy.input.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "llguidance", "guidance", "off")
CACHE_SIZE = 256  # compiled specs kept (least recently used dropped)


@dataclass(slots=True, eq=False)
class GrammarState:
    """One request's matcher. `start` is the output position where the constraint begins (None while a
    thinking part runs); `consumed` counts the output tokens from there the matcher has taken."""

    matcher: llguidance.LLMatcher
    start: int | None = 0
    consumed: int = 0
    conflict: str | None = None  # set when bans left no token the grammar allows: the request fails
    failure: Exception | None = None  # what its mask computation raised: the request alone fails (500)

    @property
    def active(self) -> bool:
        return self.start is not None

    def sync(self, output_ids: Sequence[int]) -> bool:
        """Make the matcher's consumed tokens equal output_ids[start:]; False when the grammar rejects one."""
        if self.start is None:
            return True
        have = len(output_ids) - self.start
        if have < self.consumed:
            self.matcher.rollback(self.consumed - have)
            self.consumed = have
        if have > self.consumed:
            ok = self.matcher.consume_tokens(list(output_ids[self.start + self.consumed:]))
            self.consumed = have
            return ok
        return not self.matcher.is_error()

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` (tokens proposed after the output so far) the grammar allows in a row, stopping
        before one that would complete it: the request ends at that token, so it must be the step's last."""
        if self.start is None:
            return len(drafts)  # the constraint has not begun (a thinking part)
        matcher, consumed, completes = self.matcher, 0, False
        for token in drafts[:matcher.validate_tokens(list(drafts))]:
            if matcher.is_stopped() or not matcher.consume_token(token):
                break
            consumed += 1
            if matcher.is_stopped():
                completes = True
                break
        if consumed:
            matcher.rollback(consumed)
        return consumed - completes

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return self.start is not None and self.matcher.is_stopped() and not self.matcher.is_error()


class GrammarMasks:
    """A step's bitmasks being filled on the worker thread."""

    def __init__(self, future: Future, owner: GuidedDecoding) -> None:
        self._future = future
        self._owner = owner

    def wait(self) -> None:
        if self._future.done():
            self._future.result()  # raises what the worker raised
            return
        start = time.perf_counter()
        self._future.result()
        self._owner.mask_wait_seconds += time.perf_counter() - start


class GuidedDecoding:
    """Per-LLM structured-output machinery: llguidance's token table (built at the first constrained
    request), the compiled specs, and the mask worker thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int], backend: str,
                 disable_any_whitespace: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.backend = backend
        self.whitespace_flexible = not disable_any_whitespace
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # requests may be made from several threads (the server's calls)
        self._pool: ThreadPoolExecutor | None = None
        self.compile_seconds: dict[str, float] = {}  # per cache key, for the benchmarks
        self.mask_wait_seconds = 0.0  # time steps waited for masks after their forward (benchmarks)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            start = time.perf_counter()
            self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            logger.info("llguidance token table built in %.2f s (vocab %d)", time.perf_counter() - start,
                        self._ll_tokenizer.vocab_size)
        return self._ll_tokenizer

    @property
    def mask_words(self) -> int:
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def compile(self, params: GuidedDecodingParams) -> llguidance.LLMatcher:
        """The spec's initial matcher, compiled once per distinct spec; ValueError when it is unusable."""
        if self.backend == "off":
            raise ValueError("guided decoding is off for this LLM (guided_decoding_backend='off'); create it "
                             "with guided_decoding_backend='auto' to use guided_decoding/response_format")
        key = params.cache_key(self.whitespace_flexible)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template
            start = time.perf_counter()
            template = llguidance.LLMatcher(self.ll_tokenizer, params.grammar_text(self.whitespace_flexible),
                                            log_level=0)
            # The lexer is built lazily: the first mask belongs to compiling (and shows a bad spec now).
            ll_numpy.fill_next_token_bitmask(template, np.zeros((1, self.mask_words), np.int32))
            if template.is_error():
                raise ValueError(f"guided_decoding.{params.kind} cannot be used: {template.get_error()}")
            self.compile_seconds[key] = time.perf_counter() - start
            self._compiled[key] = template
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return template

    def new_state(self, params: GuidedDecodingParams, after_reasoning: bool) -> GrammarState:
        """A fresh matcher for one request (a copy of the compiled one); with after_reasoning it waits for
        the end of the thinking part (the engine then sets `start`)."""
        template = self.compile(params)
        with self._lock:  # copies of one template are made from several threads
            matcher = template.deep_copy()
        return GrammarState(matcher, start=None if after_reasoning else 0)

    def start_masks(self, states: Sequence[GrammarState], banned: Sequence[Sequence[int]],
                    drafts: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, GrammarMasks]:
        """The bitmask [len(states), words] int32 of these sampling rows (bit t of a row: token t allowed),
        filled on the worker thread; wait on the returned handle before reading it. `banned`: each row's
        ids the sampler will ban (EOS below min_tokens, bad words). `drafts`: per row, the speculative drafts
        before its position (valid_drafts checked them): its mask is the one after them."""
        bitmask = np.empty((len(states), self.mask_words), dtype=np.int32)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdeploy-grammar")
        before = list(drafts) if drafts is not None else [()] * len(states)
        return bitmask, GrammarMasks(self._pool.submit(_fill, list(states), list(banned), before, bitmask), self)


def _fill(states: list[GrammarState], banned: list[Sequence[int]], drafts: list[Sequence[int]],
          bitmask: np.ndarray) -> None:
    for i, state in enumerate(states):
        try:
            if drafts[i]:  # the row after drafts: its mask from the state they lead to, then back
                state.matcher.consume_tokens(list(drafts[i]))
            ll_numpy.fill_next_token_bitmask(state.matcher, bitmask, i)  # drops the GIL
            if drafts[i]:
                state.matcher.rollback(len(drafts[i]))
        except Exception as e:  # noqa: BLE001 - this row's matcher only: its request fails after the step
            bitmask[i] = -1
            state.failure = e
            continue
        if len(banned[i]):
            # Bans that remove every token the grammar allows would leave the sampler nothing: the row is
            # left unmasked instead, and the request fails after the step (see GrammarState.conflict).
            row = bitmask[i].copy()
            ids = np.asarray(banned[i], dtype=np.int64)
            ids = ids[ids < row.size * 32]
            np.bitwise_and.at(row, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
            if not row.any():
                bitmask[i] = -1
                state.conflict = ("no token the guided_decoding grammar allows is left after the request's bans "
                                  "(min_tokens, bad_words)")

