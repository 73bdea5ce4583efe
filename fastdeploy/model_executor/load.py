"""Checkpoint loading: safetensors files -> float32 model parameters, for both checkpoint layouts.

- HF layout (`-PT` repos): decoder tensors under `model.`, linear weights [out, in], q/k/v and
  gate/up separate.
- Paddle layout (`-Paddle` repos): decoder tensors under the model's `paddle_prefix` (`ernie.`),
  linear weights [in, out], q/k/v and gate/up fused (`qkv_proj`, `up_gate_proj`) or separate, bf16
  sometimes stored as raw U16.
The layout is read from the tensor names and shapes. Files are parsed here (numpy has no bfloat16):
8-byte little-endian header length, JSON header, then the raw data, memory-mapped and converted one
tensor at a time so loading needs little more memory than the float32 model itself.
A model may list `ignored_checkpoint_patterns` (regexes of tensors it does not use, e.g. ERNIE's
multi-token-prediction head) and mark parameters `optional_in_checkpoint` (kept at their initial
value when the checkpoint lacks them, as transformers does).
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from paddle import nn

from fastdeploy.distributed.parallel_state import SINGLE, TPGroup, building_for
from fastdeploy.engine.model_config import ModelConfig
from fastdeploy.model_executor.models.registry import get_model_class

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> numpy dtype of the stored bytes (U16 is decoded as bf16 or fp16 bits, see read()).
_STORED_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"), "U16": np.dtype("<u2"), "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute byte offset in the file


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the high half of a float32: widen the 16 bits and shift them up."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


class LazyArray:
    """A not-yet-decoded view of stored tensor data (see Checkpoint.lazy).

    `np.asarray(lazy, dtype)` gives a fresh float32 array, never a view of the file."""

    __slots__ = ("raw", "kind")

    def __init__(self, raw: np.ndarray, kind: str) -> None:
        self.raw = raw  # a view of the memory map, in the stored dtype
        self.kind = kind  # "bf16" (u16 bits), "f16bits" (u16 bits of fp16) or "float"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw.shape

    @property
    def ndim(self) -> int:
        return self.raw.ndim

    @property
    def size(self) -> int:
        return self.raw.size

    @property
    def T(self) -> LazyArray:  # noqa: N802 - numpy's name
        return LazyArray(self.raw.T, self.kind)

    def __getitem__(self, index: Any) -> LazyArray:
        return LazyArray(self.raw[index], self.kind)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self.kind == "bf16":
            out = bf16_bits_to_float32(self.raw)
        elif self.kind == "f16bits":
            out = self.raw.view(np.float16).astype(np.float32)
        else:
            out = self.raw.astype(np.float32)  # astype copies even for F32, so no view of the mmap escapes
        return out if dtype is None else out.astype(dtype, copy=False)


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo, validated against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path}: not a safetensors file (header length {header_len} exceeds the file)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header must be a JSON object")
    data_start = 8 + header_len
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}") from e
        if dtype not in _STORED_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}; supported: {', '.join(_STORED_DTYPES)}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * _STORED_DTYPES[dtype].itemsize
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has data offsets "
                             f"[{begin}, {end}] that do not fit its shape or the file")
        infos[name] = TensorInfo(name, dtype, shape, path, data_start + begin)
    return infos


class Checkpoint:
    """The tensors of a model directory: one model.safetensors, a sharded index, or plain *.safetensors files."""

    def __init__(self, model_dir: str, u16_dtype: str = "bfloat16") -> None:
        if u16_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"u16_dtype must be 'bfloat16' or 'float16', got {u16_dtype!r}")
        self.model_dir = model_dir
        self.u16_dtype = u16_dtype
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[str, tuple[Any, mmap.mmap]] = {}
        for file, expected in self._files().items():
            infos = read_safetensors_header(file)
            if expected is not None:
                absent = sorted(set(expected) - set(infos))
                if absent:
                    raise ValueError(f"{file}: tensors listed for it in {INDEX_FILE} are absent: {absent[:10]}")
                infos = {n: infos[n] for n in expected}
            for name, info in infos.items():
                if name in self.tensors:
                    raise ValueError(f"tensor {name!r} appears in both {self.tensors[name].file} and {file}")
                self.tensors[name] = info

    def _files(self) -> dict[str, list[str] | None]:
        """File -> the tensor names the index assigns to it (None: all of the file's tensors)."""
        index = os.path.join(self.model_dir, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                assert isinstance(weight_map, dict)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
                raise ValueError(f"{index}: must be JSON with a 'weight_map' object of tensor -> file") from e
            files: dict[str, list[str] | None] = {}
            for name, file in weight_map.items():
                path = os.path.join(self.model_dir, str(file))
                if not os.path.isfile(path):
                    raise ValueError(f"{index}: tensor {name!r} is mapped to {file!r}, which does not exist")
                files.setdefault(path, []).append(name)  # type: ignore[union-attr]
            return files
        single = os.path.join(self.model_dir, SINGLE_FILE)
        if os.path.isfile(single):
            return {single: None}
        found = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        if not found:
            raise ValueError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file in {self.model_dir}")
        return {os.path.join(self.model_dir, f): None for f in found}

    def read(self, name: str) -> np.ndarray:
        """A fresh float32 array (never a view of the file) of tensor `name`."""
        return np.asarray(self.lazy(name))

    def lazy(self, name: str) -> LazyArray:
        """Tensor `name` as a lazy view of the file: slicing and transposing are free, and only the
        part finally converted (np.asarray) is read and decoded. Tensor-parallel loaders slice it,
        so no rank converts the whole tensor. Valid while the checkpoint is open."""
        info = self.tensors[name]
        if info.file not in self._maps:
            f = open(info.file, "rb")
            self._maps[info.file] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        buf = self._maps[info.file][1]
        count = int(np.prod(info.shape, dtype=np.int64))
        raw = np.frombuffer(buf, dtype=_STORED_DTYPES[info.dtype], count=count, offset=info.offset)
        if info.dtype == "BF16" or (info.dtype == "U16" and self.u16_dtype == "bfloat16"):
            kind = "bf16"
        elif info.dtype == "U16":
            kind = "f16bits"
        else:
            kind = "float"
        return LazyArray(raw.reshape(info.shape), kind)

    def close(self) -> None:
        for f, buf in self._maps.values():
            try:
                buf.close()
            except BufferError:
                pass  # a lazy view is still alive (e.g. in an error's traceback): the map closes when it goes
            f.close()
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Target:
    checkpoint_name: str
    param_name: str
    shard: str | None  # part of a fused parameter, None for the whole parameter


def _plan(model: nn.Layer, names: list[str], prefix: str) -> tuple[list[_Target], list[str]]:
    """Map checkpoint tensor names onto the model's parameters; returns (targets, unexpected names)."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    lm_head = getattr(model, "lm_head", None)
    tied = bool(getattr(lm_head, "tied", False))
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_patterns", ())]
    # Tensor parallel: sublayers that exist only on other ranks (e.g. their experts) are not read here.
    elsewhere = tuple(f"{layer_name}.{child}." for layer_name, layer in model.named_sublayers()
                      for child in getattr(layer, "other_rank_children", ()))
    targets, unexpected, skipped = [], [], []
    num_elsewhere = 0
    for ckpt_name in names:
        name = "model." + ckpt_name[len(prefix):] if ckpt_name.startswith(prefix) else ckpt_name
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # recomputed / tied to the embedding (transformers ignores a stored copy too)
        if any(p.search(ckpt_name) for p in ignored):
            skipped.append(ckpt_name)
            continue
        parts = name.split(".")
        shard = None
        if len(parts) >= 2 and parts[-2] in packed:
            fused, shard = packed[parts[-2]]
            name = ".".join(parts[:-2] + [fused, parts[-1]])
        if name not in params:
            if elsewhere and name.startswith(elsewhere):
                num_elsewhere += 1
            else:
                unexpected.append(ckpt_name)
            continue
        targets.append(_Target(ckpt_name, name, shard))
    if skipped:
        logger.info("skipped %d checkpoint tensors the model does not use (e.g. %s)", len(skipped), skipped[0])
    if num_elsewhere:
        logger.debug("left %d checkpoint tensors to the other tensor-parallel ranks", num_elsewhere)
    return targets, unexpected


def _stored_in_out(params: dict[str, Any], checkpoint: Checkpoint, targets: list[_Target], paddle_named: bool) -> bool:
    """Whether linear weights are stored [in, out] (Paddle) rather than [out, in] (HF), from their shapes.

    Only non-square tensors tell; a checkpoint without any (or a mixed one) falls back to / is checked
    against the naming."""
    votes: dict[bool, str] = {}
    for t in targets:
        param = params[t.param_name]
        if not getattr(param, "linear_in_out", False):
            continue
        shape = checkpoint.tensors[t.checkpoint_name].shape
        expected = list(getattr(param, "global_shape", param.shape))  # the unsharded shape
        if t.shard is not None:
            expected[-1] = param.part_sizes[t.shard]
        if len(shape) == 2 and expected[0] != expected[1]:
            if list(shape) == expected:
                votes.setdefault(True, t.checkpoint_name)
            elif list(shape) == expected[::-1]:
                votes.setdefault(False, t.checkpoint_name)
    if len(votes) == 2:
        raise ValueError(f"checkpoint mixes weight orientations: {votes[True]} is stored [in, out] "
                         f"but {votes[False]} is stored [out, in]")
    return next(iter(votes)) if votes else paddle_named


def load_weights(model: nn.Layer, checkpoint: Checkpoint) -> str:
    """Copy every checkpoint tensor into `model`; returns the detected layout ("hf" or "paddle")."""
    names = list(checkpoint.tensors)
    paddle_prefix = getattr(model, "paddle_prefix", None)
    paddle_named = bool(paddle_prefix) and any(n.startswith(paddle_prefix) for n in names)
    targets, unexpected = _plan(model, names, paddle_prefix if paddle_named else "model.")
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint {checkpoint.model_dir} "
                         f"({len(unexpected)}): {', '.join(sorted(unexpected)[:20])}")
    params = dict(model.named_parameters())
    in_out = _stored_in_out(params, checkpoint, targets, paddle_named)
    layout = "paddle" if paddle_named or in_out else "hf"

    filled: dict[str, dict[str | None, str]] = {}  # parameter -> part (None: whole) -> checkpoint tensor
    for t in targets:
        parts = filled.setdefault(t.param_name, {})
        clash = (parts.get(t.shard) or parts.get(None)) if t.shard else next(iter(parts.values()), None)
        if clash:
            raise ValueError(f"checkpoint tensors {clash} and {t.checkpoint_name} both fill {t.param_name}")
        parts[t.shard] = t.checkpoint_name
    missing = _missing(model, params, filled, layout, paddle_prefix)
    if missing:
        raise ValueError(f"checkpoint {checkpoint.model_dir} ({layout} layout) is missing tensors "
                         f"({len(missing)}): {', '.join(missing[:20])}")

    for t in targets:
        param = params[t.param_name]
        array = checkpoint.lazy(t.checkpoint_name)  # the loader converts only the slice its rank keeps
        if getattr(param, "linear_in_out", False) and not in_out:
            array = array.T  # still lazy; the loader copies it into the parameter
        # bf16 packing is exact only when every part was stored bf16 (see weight_format.py).
        param.stored_bf16 = getattr(param, "stored_bf16", True) and array.kind == "bf16"
        try:
            param.weight_loader(param, array, t.shard)
        except ValueError as e:
            stored = list(checkpoint.tensors[t.checkpoint_name].shape)
            raise ValueError(f"tensor {t.checkpoint_name} (stored shape {stored}, {layout} layout): {e}") from e
        del array
    return layout


def _missing(model: nn.Layer, params: dict[str, Any], filled: dict[str, dict[str | None, str]],
             layout: str, paddle_prefix: str | None) -> list[str]:
    """Names (as this layout would spell them) of the parameters or parts no tensor fills."""
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    by_fused: dict[str, list[tuple[str, str]]] = {}
    for module, (fused, part) in packed.items():
        by_fused.setdefault(fused, []).append((module, part))

    def spell(name: str) -> str:
        return paddle_prefix + name[len("model."):] if layout == "paddle" and name.startswith("model.") else name

    missing = []
    for name in params:
        parts_filled = filled.get(name, {})
        if None in parts_filled:
            continue
        if not parts_filled and getattr(params[name], "optional_in_checkpoint", False):
            logger.warning("checkpoint has no %s: keeping its initial value", spell(name))
            continue
        parts = name.split(".")
        module_parts = by_fused.get(parts[-2], []) if len(parts) >= 2 else []
        if not module_parts:
            missing.append(spell(name))
            continue
        absent = [(m, p) for m, p in module_parts if p not in parts_filled]
        if len(absent) == len(module_parts) and layout == "paddle":
            missing.append(spell(name))  # Paddle checkpoints usually store the fused tensor
        else:
            missing.extend(spell(".".join(parts[:-2] + [m, parts[-1]])) for m, _ in absent)
    return missing


def load_model(config: ModelConfig, tp: TPGroup = SINGLE) -> nn.Layer:
    """Build the model for `config.architectures` (this rank's shard of it when `tp` has several
    ranks), fill it from the checkpoint, and put it in eval mode."""
    model_class = get_model_class(config.architectures)
    start = time.perf_counter()
    with building_for(tp):
        model = model_class(config)
    # U16 holds raw 16-bit floats: which kind is only written in the config.
    u16 = "float16" if config.dtype == "float16" else "bfloat16"
    with Checkpoint(config.model_path, u16_dtype=u16) as checkpoint:
        layout = load_weights(model, checkpoint)
    model.eval()
    logger.info("loaded %s (%s layout, %d tensors) from %s in %.2f s", model_class.__name__, layout,
                len(checkpoint.tensors), config.model_path, time.perf_counter() - start)
    return model
