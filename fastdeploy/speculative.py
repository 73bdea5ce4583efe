"""Speculative decoding: the engine drafts a request's next tokens and the same step verifies them.

Drafting, "ngram" (prompt lookup; FastDeploy's `ngram` / `ngram_match`, vLLM's `ngram`): the last n tokens of
a request's context, n from max_ngram_size down to min_ngram_size, are looked up among its earlier tokens, and
the tokens that followed their most recent earlier occurrence are the draft. `NgramDrafter` keeps each
request's index of where every n-gram last ended, so a lookup costs one dict probe per n whatever the length.

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
drafted until the scheduler asks.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

METHODS = {"ngram": "ngram", "ngram_match": "ngram", "mtp": "mtp"}  # FastDeploy's docs / config names, vLLM's
MAX_SPECULATIVE_TOKENS = 16
MTP_LAYERS = 1  # MTP layers ERNIE-4.5 checkpoints ship (FastDeploy builds one as well); each has a KV cache layer
# The models that carry an MTP layer (HF and Paddle spellings).
MTP_ARCHITECTURES = ("Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM", "Ernie4_5_MoeForCausalLM")
# FastDeploy's keys this engine takes only at their defaults (MTP, draft models and their options).
_DEFAULTS_ONLY: dict[str, Any] = {"quantization": None, "num_model_steps": 1,
                                  "mtp_strategy": "default", "benchmark_mode": False}
_ALIASES = {"prompt_lookup_max": "max_ngram_size", "prompt_lookup_min": "min_ngram_size"}  # vLLM's names


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`speculative_config` checked: FastDeploy's dict (or vLLM's ngram keys)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    max_ngram_size: int = 5  # FastDeploy's defaults
    min_ngram_size: int = 2
    model: str | None = None  # mtp: a directory holding the MTP tensors (default: the model's checkpoint)

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
        known = {"num_speculative_tokens", "max_ngram_size", "min_ngram_size"}
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
        return config


def checkpoint_has_mtp(tensor_names: Sequence[str]) -> bool:
    """Whether a checkpoint carries ERNIE-4.5's MTP layer (either layout)."""
    return any(".mtp_linear_proj.0." in n for n in tensor_names)


PROBE_EVERY = 8  # a request whose drafts do not pay still drafts one token this often, to notice when they would


class Drafter:
    """A request's draft source, with how often its drafts were accepted: the scheduler drafts only as many tokens
    as pay for themselves in the step at hand (`length`)."""

    __slots__ = ("k", "verified", "accepted", "idle")
    runs_in_step = False  # whether the model runner makes the drafts (MTP) rather than the scheduler

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.verified = self.accepted = 0  # draft positions compared with the model's token, and kept
        self.idle = 0  # steps since it last drafted

    def record(self, verified: int, accepted: int) -> None:
        self.verified += verified
        self.accepted += accepted

    def length(self, threshold: float) -> int:
        """Drafts worth verifying when a draft must be kept with probability above `threshold` to pay for its
        position in the step (Scheduler._draft_threshold). The j-th draft is kept with about a^j, a being this
        request's acceptance so far (with a prior of one kept and one rejected)."""
        rate = (self.accepted + 1) / (self.verified + 2)
        n, kept = 0, rate
        while n < self.k and kept > threshold:
            n, kept = n + 1, kept * rate
        self.idle = 0 if n else self.idle + 1
        if self.idle >= PROBE_EVERY:
            n, self.idle = 1, 0
        return n


class NgramDrafter(Drafter):
    """One request's n-gram index: for every n-gram of min..max tokens of its context but those ending at the
    last token (the ones looked up), the end of its most recent occurrence."""

    __slots__ = ("min_n", "max_n", "ends", "indexed")

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.min_n, self.max_n = config.min_ngram_size, config.max_ngram_size
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the most recent earlier occurrence of the context's longest
        matching suffix; [] when none of its last max..min tokens occurred before."""
        last = len(tokens) - 1
        ends = self.ends
        for end in range(self.indexed, last):  # index the n-grams ending at positions indexed..last-1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                ends[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            start = ends.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return list(tokens[start:start + limit])
        return []


class MtpDrafter(Drafter):
    """One request's MTP drafts: the model runner drafts after each of the request's steps and update_from_output
    hands them over with the number of tokens they follow; `propose` gives them while they still follow the
    request's tokens (a stop string taken back or a preemption makes them stale)."""

    __slots__ = ("drafts", "logprobs", "after", "limit")
    runs_in_step = True  # every step of the request feeds the MTP layer

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.drafts: list[int] = []
        self.logprobs: list[Any] = []  # the drafts' TopLogprobs when the request asked for logprobs
        self.after = -1  # len(token_ids) the drafts follow
        self.limit = 0  # drafts the runner makes after this step (the scheduler sets it: see Scheduler._lookahead)

    def offer(self, drafts: list[int], num_tokens: int, logprobs: list[Any]) -> None:
        self.drafts, self.logprobs, self.after = drafts, logprobs, num_tokens

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        return self.drafts[:limit] if len(tokens) == self.after else []

    def accepted_logprobs(self, accepted: int) -> list[Any]:
        """The logprobs of the first `accepted` drafts proposed (those the step emitted), if any were made."""
        return self.logprobs[:accepted]
