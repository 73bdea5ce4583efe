"""The `quantization` argument in FastDeploy's forms, validated into one QuantConfig.

FastDeploy takes a name ("wint8", "wint4") or a dict (on the command line a JSON string) whose
"quantization" key names the method, e.g. {"quantization": "mix_quant", "dense_quant_type": "wint8",
"moe_quant_type": "wint4", "kv_cache_quant_type": "block_wise_fp8"}: mix_quant quantizes the linear
layers outside the routed experts as dense_quant_type and the experts as moe_quant_type, and
kv_cache_quant_type chooses the KV cache's format. Of the KV formats, block_wise_fp8 (float8 e4m3fn
with a scale per row, computed as rows are written) is implemented (fastdeploy/ops/kv_cache.py); the
others need scales calibrated offline and stored in the checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

WEIGHT_QUANTIZATIONS = ("wint8", "wint4")
KV_CACHE_QUANT_TYPES = ("block_wise_fp8",)
# FastDeploy's other names: its GPU methods and its calibrated KV formats.
_NOT_IMPLEMENTED_METHODS = ("wint2", "weight_only", "block_wise_fp8", "w4afp8", "w8a8", "w4a8", "wfp8afp8",
                            "tensor_wise_fp8", "kvcache")
_NOT_IMPLEMENTED_KV = ("int8", "int8_zp", "int4_zp", "float8_e4m3fn", "float8_e4m3fn_zp")
# mix_quant's other keys at FastDeploy's defaults (any other value: NotImplementedError).
_MIX_DEFAULTS = {"is_channel_wise": False, "has_zero_point": False, "is_permuted": True, "is_quantized": False,
                 "hadamard_block_size": 128}


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """dense: the linear layers' weight format outside the routed experts (None: as stored); moe: the
    routed experts' (None: as dense); kv_cache: the KV cache's quantized format (None: the model's dtype)."""

    dense: str | None = None
    moe: str | None = None
    kv_cache: str | None = None


def _weight_type(key: str, value: Any) -> str:
    if value not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization {key} must be one of {list(WEIGHT_QUANTIZATIONS)}, got {value!r}")
    return value


def _kv_cache_type(value: Any) -> str | None:
    if value is None or value in KV_CACHE_QUANT_TYPES:
        return value
    if value in _NOT_IMPLEMENTED_KV:
        raise NotImplementedError(
            f"kv_cache_quant_type={value!r} is not implemented: it needs KV scales calibrated offline and stored "
            f"in the checkpoint; {list(KV_CACHE_QUANT_TYPES)} computes its scales as rows are written")
    raise ValueError(f"quantization kv_cache_quant_type must be one of {list(KV_CACHE_QUANT_TYPES)} or None, "
                     f"got {value!r}")


def parse_quantization(value: Any) -> QuantConfig:
    """None, a name, a dict or a JSON string of one -> QuantConfig; ValueError / NotImplementedError
    naming the key otherwise."""
    if value is None:
        return QuantConfig()
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization is not valid JSON: {e}") from None
    if isinstance(value, str):
        value = {"quantization": value}
    if not isinstance(value, dict):
        raise TypeError(f"quantization must be None, a name, a dict or a JSON object, got {type(value).__name__}")
    spec = dict(value)
    method = spec.pop("quantization", None)
    kv_cache = _kv_cache_type(spec.pop("kv_cache_quant_type", None))
    if method in WEIGHT_QUANTIZATIONS:
        if spec:
            raise ValueError(f"quantization {method!r} takes only kv_cache_quant_type besides its name; "
                             f"got {sorted(spec)} (mix_quant takes dense_quant_type and moe_quant_type)")
        return QuantConfig(method, None, kv_cache)
    if method == "mix_quant":
        missing = [k for k in ("dense_quant_type", "moe_quant_type") if k not in spec]
        if missing:
            raise ValueError(f"quantization 'mix_quant' needs {missing}")
        dense = _weight_type("dense_quant_type", spec.pop("dense_quant_type"))
        moe = _weight_type("moe_quant_type", spec.pop("moe_quant_type"))
        image = spec.pop("image_moe_quant_type", None)
        if image is not None and image != moe:
            raise NotImplementedError("image_moe_quant_type other than moe_quant_type is not implemented "
                                      "(ERNIE-4.5-VL's vision experts are quantized as its text experts)")
        for key in list(spec):
            if key not in _MIX_DEFAULTS:
                known = ["dense_quant_type", "moe_quant_type", "kv_cache_quant_type", "image_moe_quant_type",
                         *_MIX_DEFAULTS]
                raise ValueError(f"quantization 'mix_quant' got unknown key {key!r}; known: {known}")
            if spec[key] != _MIX_DEFAULTS[key] or type(spec[key]) is not type(_MIX_DEFAULTS[key]):
                raise NotImplementedError(f"quantization {key}={spec[key]!r} is not implemented (only "
                                          f"{_MIX_DEFAULTS[key]!r}: weights are quantized while loading)")
        return QuantConfig(dense, moe, kv_cache)
    if method is None and kv_cache is not None and not spec:
        return QuantConfig(None, None, kv_cache)  # only the KV cache quantized
    if method in _NOT_IMPLEMENTED_METHODS:
        raise NotImplementedError(f"quantization {method!r} is not implemented on CPU; use "
                                  f"{list(WEIGHT_QUANTIZATIONS)} or 'mix_quant' of them")
    raise ValueError(f"quantization must be None, one of {list(WEIGHT_QUANTIZATIONS)}, or a dict / JSON "
                     f"object naming one or 'mix_quant'; got {value!r}")
