"""Speculative decoding: the engine drafts a request's next tokens and the same step verifies them.

Drafting, "ngram" (prompt lookup; FastDeploy's `ngram` / `ngram_match`, vLLM's `ngram`): the last n tokens of
a request's context, n from max_ngram_size down to min_ngram_size, are looked up among its earlier tokens, and
the tokens that followed their most recent earlier occurrence are the draft; where those run into the end of the
context, the draft goes on as the text would if it kept repeating from that occurrence (a loop of d tokens drafts
k tokens, not d). `NgramDrafter` keeps each request's context packed and scans it from the end in C, so a token
costs nothing until a lookup. Which drafts a step verifies is the scheduler's (engine/drafting.py).

Verifying is exact. The scheduler gives a drafting request 1 + k new tokens (its last token and the k drafts);
the step builder makes each of those k + 1 positions a sampling row with the policy the row would have had if
the drafts before it were the output (penalties and bad words over them, min_tokens bans by position, the
uniform of that output position); the step samples every row as usual, and the request emits the sampled
tokens up to and including the first that differs from its draft. A draft is one token (a point mass), so
sampling the model's distribution and accepting on equality is speculative sampling's rule: the draft is
kept with probability p(draft), otherwise the token comes from p without it. As each output position's
uniform is fixed by the request's generator (Request.uniform), the tokens are the same as without
speculation, greedy or sampled, with bit-identical logits.

Drafting, "mtp" (FastDeploy's name): ERNIE-4.5's multi-token-prediction layer, run by the model runner after
every step of a request (model_executor/models/ernie4_5_mtp.py, worker/mtp_proposer.py). It drafts greedily, so a
draft is a point mass as well and the verification above is unchanged; `MtpDrafter` holds what the runner
drafted until the scheduler asks. With FastDeploy's `mtp_strategy` "with_ngram" the layer drafts
`num_model_steps` tokens and the n-gram lookup, run over the context followed by those drafts, adds the rest.
"""
from __future__ import annotations

import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

METHODS = {"ngram": "ngram", "ngram_match": "ngram", "mtp": "mtp"}  # FastDeploy's docs / config names, vLLM's
MAX_SPECULATIVE_TOKENS = 16
MTP_LAYERS = 1  # MTP layers ERNIE-4.5 checkpoints ship (FastDeploy builds one as well); each has a KV cache layer
# The models that carry an MTP layer (HF and Paddle spellings).
MTP_ARCHITECTURES = ("Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM", "Ernie4_5_MoeForCausalLM")
MTP_STRATEGIES = ("default", "with_ngram")
# FastDeploy's keys this engine takes only at their defaults (the MTP layer's own quantization, benchmarking).
_DEFAULTS_ONLY: dict[str, Any] = {"quantization": None, "benchmark_mode": False}
_ALIASES = {"prompt_lookup_max": "max_ngram_size", "prompt_lookup_min": "min_ngram_size"}  # vLLM's names


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`speculative_config` checked: FastDeploy's dict (or vLLM's ngram keys)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    max_ngram_size: int = 5  # FastDeploy's defaults
    min_ngram_size: int = 2
    model: str | None = None  # mtp: a directory holding the MTP tensors (default: the model's checkpoint)
    num_model_steps: int | None = None  # mtp: drafts the layer makes (default: all, or 1 with "with_ngram")
    mtp_strategy: str = "default"  # mtp: "with_ngram" extends the layer's drafts by n-gram lookup

    @classmethod
    def from_dict(cls, given: Mapping[str, Any]) -> SpeculativeConfig:
        if not isinstance(given, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(given).__name__}")
        values = {_ALIASES.get(k, k): v for k, v in given.items()}
        method = values.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {sorted(METHODS)}, got {method!r}")
        model = values.pop("model", None)
        if model is not None and (METHODS[method] != "mtp" or not isinstance(model, (str, os.PathLike))):
            raise ValueError("speculative_config model is the directory of the MTP weights (method 'mtp' only), "
                             f"got {model!r}")
        for key, default in _DEFAULTS_ONLY.items():
            if key in values and values.pop(key) != default:
                raise NotImplementedError(f"speculative_config {key} is only supported at {default!r}")
        known = {"num_speculative_tokens", "max_ngram_size", "min_ngram_size", "num_model_steps", "mtp_strategy"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: method, model, "
                             f"{', '.join(sorted(known | set(_ALIASES) | set(_DEFAULTS_ONLY)))}")
        config = cls(METHODS[method], **values, model=None if model is None else os.fspath(model))
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS), ("max_ngram_size", 1, 64),
                                ("min_ngram_size", 1, config.max_ngram_size)):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"speculative_config {name} must be an integer in [{low}, {high}], got {value!r}")
        config._check_mtp_options()
        return config

    def _check_mtp_options(self) -> None:
        if self.mtp_strategy not in MTP_STRATEGIES:
            raise ValueError(f"speculative_config mtp_strategy must be one of {list(MTP_STRATEGIES)}, "
                             f"got {self.mtp_strategy!r}")
        steps = self.num_model_steps
        if self.method != "mtp":
            if self.mtp_strategy != "default" or steps not in (None, 1):  # 1: FastDeploy's default, meaningless here
                raise ValueError("speculative_config num_model_steps and mtp_strategy apply to method 'mtp' only")
            return
        k = self.num_speculative_tokens
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= k):
            raise ValueError(f"speculative_config num_model_steps must be an integer in [1, num_speculative_tokens="
                             f"{k}], got {steps!r}")

    @property
    def mtp_steps(self) -> int:
        """Drafts the MTP layer makes per step at most: num_model_steps, by default all of them, or one when n-gram
        lookup adds the rest (FastDeploy's default num_model_steps)."""
        if self.num_model_steps is not None:
            return self.num_model_steps
        return 1 if self.mtp_strategy == "with_ngram" else self.num_speculative_tokens


def checkpoint_has_mtp(tensor_names: Sequence[str]) -> bool:
    """Whether a checkpoint carries ERNIE-4.5's MTP layer (either layout)."""
    return any(".mtp_linear_proj.0." in n for n in tensor_names)


# Weight of a lookup's outcome in a request's running means (Drafter.hit, .gain, .reach).
LOOKUP_SMOOTHING = 0.25


class Drafter:
    """A request's draft source, with how often its drafts were accepted: the scheduler drafts only as many tokens
    as pay for themselves in the step at hand (`length`)."""

    __slots__ = ("k", "verified", "accepted", "hit", "gain", "reach", "watched", "matched")
    runs_in_step = False  # whether the model runner makes the drafts (MTP) rather than the scheduler

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.verified = self.accepted = 0  # draft positions compared with the model's token, and kept
        # Running means over its lookups (a request that starts to repeat itself shows within a few): how often one
        # finds drafts, and then how many it verifies and how many of those are kept. An untried request is worth
        # a look: one found, one kept.
        self.hit = self.gain = self.reach = 1.0
        self.watched: list[int] = []  # drafts looked up but not verified (`watch`), and how many came true so far
        self.matched = 0

    def looked_up(self, drafts: int) -> None:
        """The scheduler asked for drafts and verifies `drafts` of them (their outcome: `settle`)."""
        self.hit += LOOKUP_SMOOTHING * (bool(drafts) - self.hit)
        if drafts:
            self.reach += LOOKUP_SMOOTHING * (drafts - self.reach)

    def watch(self, drafts: list[int]) -> None:
        """Drafts looked up while the batch does not verify any (DraftPacing): `witness` holds them against the
        tokens that follow, which keeps as many as verifying them would have, and counts those as a step's gain."""
        self.looked_up(len(drafts))
        self.watched, self.matched = drafts, 0

    def witness(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted, against the drafts being watched."""
        watched = self.watched
        for token in tokens:
            if token != watched[self.matched]:
                break
            self.matched += 1
            if self.matched == len(watched):
                break
        else:
            return  # all of them so far came true: the next tokens tell more
        self.gain += LOOKUP_SMOOTHING * (self.matched - self.gain)
        self.watched = []

    def record(self, verified: int, accepted: int) -> None:
        self.verified += verified
        self.accepted += accepted

    def settle(self, emitted: Sequence[int], drafts: Sequence[int]) -> int:
        """Record a step's outcome: the tokens it emitted against the drafts it verified (it stops at the first
        that differs); how many drafts were accepted."""
        accepted = sum(t == d for t, d in zip(emitted, drafts))
        self.record(min(len(emitted), len(drafts)), accepted)
        self.gain += LOOKUP_SMOOTHING * (accepted - self.gain)
        return accepted

    def accepted_logprobs(self, accepted: int) -> list[Any]:
        """The logprobs of the first `accepted` drafts, when the drafter made them (MTP)."""
        return []

    def rewind(self, num_tokens: int) -> None:
        """The request's tokens past the first num_tokens were taken back (Scheduler.take_back)."""
        self.watched = []

    def length(self, threshold: float, probe: bool = False) -> int:
        """Drafts worth verifying when a draft must be kept with probability above `threshold` to pay for its
        position in the step (engine/drafting.py's draft_threshold). The j-th draft is kept with about a^j, a being
        this request's acceptance so far (with a prior of one kept and one rejected). On a `probe` step one draft is
        tried even when none pays: the acceptance or the step's cost may have changed."""
        rate = (self.accepted + 1) / (self.verified + 2)
        n, kept = 0, rate
        while n < self.k and kept > threshold:
            n, kept = n + 1, kept * rate
        return 1 if n == 0 and probe else n


class NgramDrafter(Drafter):
    """One request's lookup: its context packed as int32 (extended as tokens arrive, cut back by `rewind`) and
    searched from the end with bytes.rfind, a C scan, so nothing is indexed per token: a step that does not look
    up costs nothing (~1 us a lookup over a few hundred tokens, ~20 us over 8k)."""

    __slots__ = ("min_n", "max_n", "packed")

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.min_n, self.max_n = config.min_ngram_size, config.max_ngram_size
        self.packed = bytearray()  # the context's first len(packed) // 4 tokens, int32

    def rewind(self, num_tokens: int) -> None:
        super().rewind(num_tokens)
        del self.packed[4 * num_tokens:]

    def propose(self, tokens: Sequence[int], limit: int, then: Sequence[int] = ()) -> list[int]:
        """Up to `limit` tokens that followed the most recent earlier occurrence of the longest matching suffix of
        the context, or of the context followed by `then` (drafts not yet verified), continued periodically past
        the end; [] when none of its last max..min tokens occurred before."""
        packed, last = self.packed, len(tokens) - 1
        if len(packed) < 4 * len(tokens):
            packed += array("i", tokens[len(packed) // 4:])
        longest = min(self.max_n, last + len(then))
        if longest < self.min_n:
            return []
        if then:
            tail = array("i", [*tokens[-longest:], *then][-longest:]).tobytes()
        else:
            tail = bytes(packed[-4 * longest:])
        # Where the shortest suffix never occurred, no longer one did: one scan, not max - min + 1.
        start = _last_end(packed, tail[-4 * self.min_n:], 4 * last)
        n = longest
        while start >= 0 and n > self.min_n:
            found = _last_end(packed, tail[-4 * n:], 4 * last)
            if found >= 0:
                start = found
                break
            n -= 1
        if start < 0:
            return []
        # start <= last: what follows is in the context, then in `then`.
        draft = [*tokens[start:start + limit], *then[:max(0, start + limit - len(tokens))]]
        # Past the end, the text repeats from the occurrence on (a loop, a repeated line): period `cycle`.
        cycle = len(tokens) + len(then) - start
        while len(draft) < limit:
            draft.append(draft[-cycle])
        return draft


def _last_end(packed: bytearray, needle: bytes, end: int) -> int:
    """The token position just past the most recent occurrence of the packed tokens `needle` within the first
    `end` bytes of `packed`, or -1 (a match across token boundaries is skipped)."""
    while True:
        at = packed.rfind(needle, 0, end)
        if at < 0:
            return -1
        if at % 4 == 0:
            return (at + len(needle)) // 4
        end = at + len(needle) - 1


class MtpDrafter(Drafter):
    """One request's MTP drafts: the model runner drafts after each of the request's steps and update_from_output
    hands them over with the number of tokens they follow; `propose` gives them while they still follow the
    request's tokens (a stop string taken back or a preemption makes them stale)."""

    __slots__ = ("drafts", "logprobs", "after", "limit", "steps", "worth", "ngram")
    runs_in_step = True  # every step of the request feeds the MTP layer

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.drafts: list[int] = []
        self.logprobs: list[Any] = []  # the drafts' TopLogprobs when the request asked for logprobs
        self.after = -1  # len(token_ids) the drafts follow
        self.steps = config.mtp_steps
        # Set by the scheduler each step (Scheduler._lookahead): drafts the runner makes after this step (at most
        # `steps`), and drafts worth verifying next step, n-gram ones included.
        self.limit = self.worth = 0
        self.ngram = NgramDrafter(config) if config.mtp_strategy == "with_ngram" else None

    def offer(self, drafts: list[int], num_tokens: int, logprobs: list[Any]) -> None:
        self.drafts, self.logprobs, self.after = drafts, logprobs, num_tokens

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        drafts = self.drafts[:limit] if len(tokens) == self.after else []
        if self.ngram is not None and len(drafts) < limit:
            drafts += self.ngram.propose(tokens, limit - len(drafts), drafts)
        return drafts

    def accepted_logprobs(self, accepted: int) -> list[Any]:
        """The logprobs of the first `accepted` drafts proposed (those the step emitted), if any were made."""
        return self.logprobs[:accepted]

    def rewind(self, num_tokens: int) -> None:
        super().rewind(num_tokens)
        if self.ngram is not None:
            self.ngram.rewind(num_tokens)
