"""What the engine needs to know about a checkpoint, read from its config.json and generation_config.json.

Both the HF layout (`-PT` repos, transformers' save_pretrained) and the Paddle layout (`-Paddle` repos)
describe the model with the same field names; they differ in where the dtype (`torch_dtype` or `dtype`)
and the rotary base (top-level `rope_theta` or `rope_parameters.rope_theta`) are written; the rotary
scaling is read from `rope_parameters` (transformers 5) or `rope_scaling` (older configs): plain rope or
Llama 3's. Fields only one architecture has (MoE routing, q/k norms) are read by its model class through
`ModelConfig.fields()`. ERNIE-4.5-VL's text fields may be nested in `text_config`; its multimodal
settings are parsed into `multimodal` (models/ernie4_5_vl/config.py).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.model_executor.models.ernie4_5_vl.config import Ernie45VLConfig, is_ernie_vl, text_view

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json field -> SamplingParams field (vLLM also maps max_new_tokens onto max_tokens).
_GENERATION_FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "max_new_tokens": "max_tokens",
}
_INT_GENERATION_FIELDS = {"top_k", "max_new_tokens"}

# transformers' default for a missing `tie_word_embeddings` differs by model_type (Qwen's configs say False).
_UNTIED_BY_DEFAULT = {"qwen2", "qwen3", "qwen3_moe", "llama", "mistral"}
ROPE_TYPES = ("default", "llama3")  # rope_type values the rotary embedding implements
# transformers' MistralConfig: a config.json without `sliding_window` gets this window (null: full attention).
_MISTRAL_DEFAULT_WINDOW = 4096

_DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


@dataclass(slots=True)
class ModelConfig:
    model_path: str
    architectures: list[str]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None  # None: plain rope (rope_type default)
    tie_word_embeddings: bool = True
    use_bias: bool = False
    hidden_act: str = "silu"
    dtype: str = "float32"  # what the checkpoint stores (EngineConfig.dtype "auto" follows it)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # The whole config.json, for model-specific fields (MoE, multimodal) that later models read.
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    # ERNIE-4.5-VL: experts per modality, 3-D rotary split, special tokens (None for text-only models).
    multimodal: Ernie45VLConfig | None = None
    # Every layer's attention window (Mistral's `sliding_window`); None: full causal attention.
    sliding_window: int | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        model_path = os.fspath(path)
        if not os.path.isdir(model_path):
            raise ValueError(f"model path {model_path!r} is not a directory")
        config_file = os.path.join(model_path, CONFIG_FILE)
        raw = _read_json(config_file, required=True)
        assert raw is not None
        gen_file = os.path.join(model_path, GENERATION_CONFIG_FILE)
        gen = _read_json(gen_file, required=False) or {}

        architectures = raw.get("architectures")
        if (not isinstance(architectures, list) or not architectures
                or not all(isinstance(a, str) for a in architectures)):
            raise ValueError(f"{config_file}: field 'architectures' must be a non-empty list of strings, "
                             f"got {architectures!r}")
        multimodal = is_ernie_vl(architectures)
        if not multimodal and any("VL" in a or "Vl" in a for a in architectures):
            raise NotImplementedError(f"{architectures[0]} is a multimodal model (enable_mm): not supported yet")
        text = text_view(raw)  # ERNIE-4.5-VL (transformers) nests the text model's fields in text_config
        reader = FieldReader(text, config_file)
        hidden_size = reader.get_int("hidden_size")
        num_heads = reader.get_int("num_attention_heads")
        num_kv_heads = reader.get_int("num_key_value_heads", default=num_heads)
        if hidden_size % num_heads and "head_dim" not in text:
            raise ValueError(f"{config_file}: 'hidden_size' ({hidden_size}) is not a multiple of "
                             f"'num_attention_heads' ({num_heads}) and 'head_dim' is not given")
        head_dim = reader.get_int("head_dim", default=hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{config_file}: 'num_attention_heads' ({num_heads}) must be a multiple of "
                             f"'num_key_value_heads' ({num_kv_heads})")
        if head_dim < 2 or head_dim % 2:  # rotary embedding rotates pairs of a head's columns
            raise ValueError(f"{config_file}: 'head_dim' must be even and at least 2, got {head_dim}")

        eos_source, eos_value = (gen_file, gen["eos_token_id"]) if gen.get("eos_token_id") is not None \
            else (config_file, text.get("eos_token_id"))
        num_layers = reader.get_int("num_hidden_layers")
        max_positions = reader.get_int("max_position_embeddings")
        rope_theta, rope_scaling = _rope(text, reader, max_positions)
        return cls(
            model_path=model_path,
            architectures=list(architectures),
            hidden_size=hidden_size,
            intermediate_size=reader.get_int("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=reader.get_int("vocab_size"),
            max_position_embeddings=max_positions,
            rms_norm_eps=reader.get_float("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=reader.get_bool("tie_word_embeddings",
                                                default=text.get("model_type") not in _UNTIED_BY_DEFAULT),
            use_bias=reader.get_bool("use_bias", default=False),
            hidden_act=reader.get_str("hidden_act", default="silu"),
            dtype=_dtype(text, config_file),
            bos_token_id=reader.get_optional_int("bos_token_id"),
            eos_token_ids=_token_ids(eos_value, eos_source),
            pad_token_id=reader.get_optional_int("pad_token_id"),
            generation_defaults=_generation_defaults(gen, gen_file),
            hf_config=raw,
            multimodal=Ernie45VLConfig.from_hf_config(raw, config_file, num_layers, head_dim) if multimodal else None,
            sliding_window=_sliding_window(text, architectures, config_file),
        )

    def fields(self) -> FieldReader:
        """Typed access to config.json fields this class does not parse (errors name the file and field)."""
        return FieldReader(self.hf_config, os.path.join(self.model_path, CONFIG_FILE))


def _read_json(file: str, required: bool) -> dict[str, Any] | None:
    if not os.path.isfile(file):
        if required:
            raise ValueError(f"{file} not found: a model directory needs a config.json")
        return None
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


class FieldReader:
    """Typed access to config.json fields with errors that name the file and the field."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any], file: str) -> None:
        self.raw = raw
        self.file = file

    def _get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name, default)
        if value is self._MISSING or (value is None and default is self._MISSING):
            raise ValueError(f"{self.file}: required field '{name}' is missing")
        return default if value is None else value

    def get_int(self, name: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ValueError(f"{self.file}: field '{name}' must be {what}, got {value!r}")
        return value

    def get_optional_int(self, name: str) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{self.file}: field '{name}' must be a non-negative integer or null, got {value!r}")
        return value

    def get_float(self, name: str, default: Any = _MISSING) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{self.file}: field '{name}' must be a positive number, got {value!r}")
        return float(value)

    def get_bool(self, name: str, default: Any = _MISSING) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.file}: field '{name}' must be true or false, got {value!r}")
        return value

    def get_str(self, name: str, default: Any = _MISSING) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise ValueError(f"{self.file}: field '{name}' must be a string, got {value!r}")
        return value


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's rope scaling (`rope_type: llama3`): frequencies with wavelengths beyond
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
    original / high_freq_factor kept, those between interpolated (layers/rotary.py)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def _rope(raw: dict[str, Any], reader: FieldReader, max_positions: int) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling). transformers 5 nests both in rope_parameters; older configs keep rope_theta at the
    top level and the scaling in rope_scaling (`rope_type`, or `type` before transformers 4.45), Paddle's only
    the top-level rope_theta."""
    for name in ("rope_parameters", "rope_scaling"):
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise ValueError(f"{reader.file}: field '{name}' must be an object or null, got {raw[name]!r}")
    source = next((n for n in ("rope_parameters", "rope_scaling") if raw.get(n)), "rope_scaling")
    # Keys as written (`rope_scaling.factor`), so that errors say where a value came from.
    params = FieldReader({f"{source}.{k}": v for k, v in (raw.get(source) or {}).items()}, reader.file)
    nested_theta = f"{source}.rope_theta" in params.raw and params.raw[f"{source}.rope_theta"] is not None
    theta = params.get_float(f"{source}.rope_theta") if nested_theta else \
        reader.get_float("rope_theta", default=10000.0)
    type_field = f"{source}.rope_type" if f"{source}.rope_type" in params.raw else f"{source}.type"
    rope_type = params.raw.get(type_field) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{reader.file}: field '{type_field}' is {rope_type!r}; supported rope types: "
                         f"{', '.join(repr(t) for t in ROPE_TYPES)} (null or 'default' is plain rope)")
    if rope_type == "default":
        return theta, None
    # As transformers: a top-level original_max_position_embeddings first, else the rope dict's, else
    # max_position_embeddings.
    original = reader.get_int("original_max_position_embeddings") if raw.get("original_max_position_embeddings") \
        is not None else params.get_int(f"{source}.original_max_position_embeddings", default=max_positions)
    scaling = Llama3RopeScaling(
        factor=params.get_float(f"{source}.factor"),
        low_freq_factor=params.get_float(f"{source}.low_freq_factor"),
        high_freq_factor=params.get_float(f"{source}.high_freq_factor"),
        original_max_position_embeddings=original)
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(f"{reader.file}: field '{source}.high_freq_factor' ({scaling.high_freq_factor}) must "
                         f"exceed '{source}.low_freq_factor' ({scaling.low_freq_factor})")
    return theta, scaling


def _sliding_window(raw: dict[str, Any], architectures: list[str], file: str) -> int | None:
    # Only Mistral's is read here: Qwen2/3 configs carry a sliding_window that use_sliding_window switches
    # off (their model classes check that).
    if "MistralForCausalLM" not in architectures and raw.get("model_type") != "mistral":
        return None
    window = raw.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{file}: field 'sliding_window' must be a positive integer or null, got {window!r}")
    return window


def _dtype(raw: dict[str, Any], file: str) -> str:
    name, value = next(((k, raw[k]) for k in ("dtype", "torch_dtype") if raw.get(k) is not None),
                       ("dtype", "float32"))
    canonical = _DTYPE_ALIASES.get(str(value).removeprefix("torch.").lower()) if isinstance(value, str) else None
    if canonical is None:
        raise ValueError(f"{file}: field '{name}' must be one of bfloat16, float16, float32, got {value!r}")
    return canonical


def _token_ids(value: Any, file: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: field 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return list(ids)


def _generation_defaults(gen: dict[str, Any], file: str) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for src, dst in _GENERATION_FIELDS.items():
        value = gen.get(src)
        if value is None:
            continue
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if src in _INT_GENERATION_FIELDS:
            if not is_int:
                raise ValueError(f"{file}: field '{src}' must be an integer, got {value!r}")
        elif not (is_int or isinstance(value, float)):
            raise ValueError(f"{file}: field '{src}' must be a number, got {value!r}")
        defaults[dst] = value if src in _INT_GENERATION_FIELDS else float(value)
    if defaults:
        logger.debug("generation defaults from %s: %s", file, defaults)
    return defaults
