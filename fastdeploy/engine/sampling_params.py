"""SamplingParams: FastDeploy's names and ranges, validated on construction."""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from fastdeploy.guided.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams", "RequestOutputKind", "SamplingParams"]

class RequestOutputKind(enum.Enum):
    """FastDeploy's names for what each RequestOutput of a request holds. FastDeploy's SamplingParams has no
    field taking it; here LLM.generate/chat give FINAL_ONLY (stream=False) or DELTA (stream=True)."""

    CUMULATIVE = 0  # the whole output so far, every time
    DELTA = 1  # only what is new since the last RequestOutput
    FINAL_ONLY = 2  # one RequestOutput, when the request has finished


MAX_SEED = 922337203685477580  # FastDeploy's upper bound
# Bounds that keep every value finite once the sampler holds it as float32 (JSON's 1e39 is a finite
# Python float but inf in float32, and NaN passes every `<` check), so no request makes a step raise.
# temperature: vLLM and FastDeploy only require >= 0; past 1e4 the logits of any model (|logit| well
# under 1e3) differ by at most 0.2 after the division, i.e. sampling is already near uniform, so the cap takes
# nothing away. An infinite temperature turned banned tokens' -inf into NaN.
MAX_TEMPERATURE = 1e4
# repetition_penalty: FastDeploy and vLLM only require > 0. It divides positive logits and multiplies
# negative ones; 1e-46 is 0 in float32 (logit / 0 = inf, 0 * inf = NaN). 100 already pushes a seen
# token far below the rest (1/100 of its logit), 0.01 far above; beyond is no more useful and the
# logits stay finite for |logit| < 3e36.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency: OpenAI's and FastDeploy's documented range
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_TOP_K = 2**31 - 1  # top_k above the vocabulary is off anyway; larger ints overflow the int64 step arrays
MAX_LOGPROBS = MAX_TOP_K  # k above the vocabulary is the whole vocabulary; 10**20 overflowed (max_logprobs=-1)

# Fields whose unset value (None) is filled from the model's generation_config.json, else these.
MODEL_DEFAULTS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


def _number(name: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")


def _bounded(name: str, value: Any, low: float, high: float, why: str = "") -> None:
    """value is a finite number in [low, high] (NaN fails no comparison, so finiteness is checked first)."""
    _number(name, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}]{why}, got {value}")


def _int_list(name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise TypeError(f"{name} must be a list of non-negative ints, got {value!r}")


@dataclass
class SamplingParams:
    """How to generate one request's output.

    temperature, top_p and the three penalties default to None, meaning "the model's
    generation_config.json value, else the neutral value" (temperature 1, top_p 1, penalties off);
    a value set here always wins.
    """

    # FastDeploy's fields, in FastDeploy's order (they may be passed positionally), then this project's.
    n: int = 1
    best_of: int | None = None  # generate best_of >= n candidates, return the n best by cumulative logprob
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_seqs_len: int | None = None  # FastDeploy fills it from `stop` internally; setting it is refused
    max_tokens: int | None = None
    reasoning_max_tokens: int | None = None
    min_tokens: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    temp_scaled_logprobs: bool = False  # logprobs of the logits divided by temperature
    top_p_normalized_logprobs: bool = False  # logprobs renormalised to the top_p nucleus
    bad_words: list[str] | None = None
    guided_decoding: GuidedDecodingParams | None = None  # constrain the output (JSON schema, regex, ...)
    bad_words_token_ids: list[int] | None = None
    logits_processors_args: dict[str, Any] | None = None  # {"logit_bias": {token_id: bias}}
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, text stays "" (vLLM's option)
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, req_dict: dict[str, Any]) -> SamplingParams:
        """SamplingParams from a dict of field values (missing fields take their defaults); a
        guided_decoding given as a dict becomes GuidedDecodingParams. Unknown keys are an error."""
        if not isinstance(req_dict, dict):
            raise TypeError(f"from_dict takes a dict, got {type(req_dict).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(req_dict) - names)
        if unknown:
            raise ValueError(f"from_dict got unknown SamplingParams field(s) {unknown}")
        values = dict(req_dict)
        if isinstance(values.get("guided_decoding"), dict):
            values["guided_decoding"] = GuidedDecodingParams(**values["guided_decoding"])
        return cls(**values)

    @classmethod
    def from_optional(cls, n: int | None, best_of: int | None, presence_penalty: float | None,
                      frequency_penalty: float | None, repetition_penalty: float | None,
                      temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None,
                      seed: int | None = None, stop: str | list[str] | None = None,
                      stop_token_ids: list[int] | None = None, max_tokens: int | None = None,
                      reasoning_max_tokens: int | None = None, min_tokens: int = 1, logprobs: int | None = None,
                      prompt_logprobs: int | None = None, bad_words: list[str] | None = None,
                      guided_decoding: GuidedDecodingParams | None = None,
                      bad_words_token_ids: list[int] | None = None,
                      logits_processors_args: dict[str, Any] | None = None) -> SamplingParams:
        """FastDeploy's constructor from optional values: a None takes FastDeploy's fixed fallback (n 1,
        penalties off, temperature 1, top_k 0, min_p 0, max_tokens 8192) instead of the model's
        generation_config.json default; top_p None stays None (model default)."""
        return cls(
            n=1 if n is None else n, best_of=best_of,
            presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            temperature=1.0 if temperature is None else temperature, top_p=top_p,
            top_k=0 if top_k is None else top_k, min_p=0.0 if min_p is None else min_p, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, max_tokens=8192 if max_tokens is None else max_tokens,
            reasoning_max_tokens=reasoning_max_tokens, min_tokens=min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, bad_words=bad_words, guided_decoding=guided_decoding,
            bad_words_token_ids=bad_words_token_ids, logits_processors_args=logits_processors_args)

    def __post_init__(self) -> None:
        self._verify()

    def _verify(self) -> None:
        _number("n", self.n, integer=True)
        if self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n}")
        if self.best_of is not None:
            _number("best_of", self.best_of, integer=True)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be an int >= n ({self.n}), got {self.best_of}")
        if self.stop_seqs_len is not None:
            raise NotImplementedError("stop_seqs_len is derived from `stop` internally; pass stop instead")
        for name in ("temp_scaled_logprobs", "top_p_normalized_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                _bounded(name, getattr(self, name), *PENALTY_RANGE)
        if self.repetition_penalty is not None:
            _bounded("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE, " (1 is off)")
        if self.temperature is not None:
            _bounded("temperature", self.temperature, 0.0, MAX_TEMPERATURE, " (0 means greedy)")
        if self.top_p is not None:
            _bounded("top_p", self.top_p, 0.0, 1.0)
        _number("top_k", self.top_k, integer=True)
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be 0 or -1 (off) or an int in [1, {MAX_TOP_K}], got {self.top_k}")
        _bounded("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _number("seed", self.seed, integer=True)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise TypeError(f"stop must be a non-empty str or a list of non-empty str, got {self.stop!r}")
        if self.stop_token_ids is not None:
            _int_list("stop_token_ids", self.stop_token_ids)
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) for w in self.bad_words)):
            raise TypeError(f"bad_words must be a list of str, got {self.bad_words!r}")
        if self.bad_words_token_ids is not None:
            _int_list("bad_words_token_ids", self.bad_words_token_ids)
        if self.max_tokens is not None:
            _number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _number(name, value, integer=True)
                if not -1 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (or -1 for the whole vocabulary), "
                                     f"got {value}")
        if self.reasoning_max_tokens is not None:
            _number("reasoning_max_tokens", self.reasoning_max_tokens, integer=True)
            if self.reasoning_max_tokens < 1:
                raise ValueError(f"reasoning_max_tokens must be >= 1, got {self.reasoning_max_tokens}")
            if self.max_tokens is not None and self.reasoning_max_tokens > self.max_tokens:
                raise ValueError(f"reasoning_max_tokens must be <= max_tokens ({self.max_tokens}), "
                                 f"got {self.reasoning_max_tokens}")

        if not self.detokenize and self.stop is not None:
            raise ValueError("stop strings need detokenize=True")
        if self.logits_processors_args is not None:
            self._verify_logits_processors_args()
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise TypeError("guided_decoding must be a GuidedDecodingParams (json=, regex=, choice=, grammar=, "
                            f"json_object= or structural_tag=), got {type(self.guided_decoding).__name__}")

    def _verify_logits_processors_args(self) -> None:
        args = self.logits_processors_args
        if not isinstance(args, dict):
            raise TypeError(f"logits_processors_args must be a dict, got {type(args).__name__}")
        unknown = sorted(set(args) - {"logit_bias"})
        if unknown:
            raise ValueError(f"logits_processors_args supports only 'logit_bias', got {unknown}")
        bias = args.get("logit_bias", {})
        if not isinstance(bias, dict):
            raise TypeError("logits_processors_args['logit_bias'] must be a dict {token_id: bias}")
        for token, value in bias.items():
            if isinstance(token, str) and token.isdigit():
                token = int(token)  # JSON turns keys into strings
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            _bounded("logit_bias values", value, *LOGIT_BIAS_RANGE)

    @property
    def ranks_candidates(self) -> bool:
        """Whether more candidates are generated than returned (best_of > n)."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def num_candidates(self) -> int:
        return self.n if self.best_of is None else self.best_of

    @property
    def logit_bias(self) -> dict[int, float]:
        bias = (self.logits_processors_args or {}).get("logit_bias") or {}
        return {int(k): float(v) for k, v in bias.items()}

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def with_model_defaults(self, generation_defaults: dict[str, Any]) -> SamplingParams:
        """A copy with every unset model-default field filled in."""
        filled = {}
        for name, neutral in MODEL_DEFAULTS.items():
            if getattr(self, name) is None:
                filled[name] = generation_defaults.get(name, neutral)
        return dataclasses.replace(self, **filled)
