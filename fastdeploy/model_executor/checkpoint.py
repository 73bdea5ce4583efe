"""Reading safetensors checkpoints without loading them: headers, memory-mapped lazy tensor views.

Files are parsed here (numpy has no bfloat16): 8-byte little-endian header length, JSON header, then
the raw data, memory-mapped. A tensor is a `LazyArray` view of the mapping: slicing and transposing
are free, and only what is finally converted or packed is read. Pages are dropped from the process
(`release`) once a tensor is packed, and read ahead (`prefetch`) before it is needed.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

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

    def packable(self) -> np.ndarray:
        """The stored values as a numpy view for `ops.pack_into` (no copy): raw bf16 bits as uint16,
        float16, or float32 (float64, rare, is converted)."""
        if self.kind == "f16bits":
            return self.raw.view(np.float16)
        if self.kind == "float" and self.raw.dtype == np.float64:
            return self.raw.astype(np.float32)
        return self.raw

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

    def overlay(self, model_dir: str, chosen: Callable[[str], bool]) -> None:
        """Take the `chosen` tensors from another directory instead of this one (ERNIE-4.5's MTP weights shipped
        apart): this checkpoint's chosen tensors are dropped, the other's are read from its files."""
        other = Checkpoint(model_dir, self.u16_dtype)  # reads headers only; files are mapped here when read
        taken = {name: info for name, info in other.tensors.items() if chosen(name)}
        if not taken:
            raise ValueError(f"{model_dir}: none of its tensors is one this model takes from it")
        self.tensors = {name: info for name, info in self.tensors.items() if not chosen(name)} | taken

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

    def kind(self, name: str) -> str:
        """How tensor `name` is stored: "bf16", "f16bits" (U16 holding float16) or "float"."""
        dtype = self.tensors[name].dtype
        if dtype == "BF16" or (dtype == "U16" and self.u16_dtype == "bfloat16"):
            return "bf16"
        return "f16bits" if dtype == "U16" else "float"

    def nbytes(self, name: str) -> int:
        info = self.tensors[name]
        return int(np.prod(info.shape, dtype=np.int64)) * _STORED_DTYPES[info.dtype].itemsize

    def _advise(self, name: str, advice: int) -> None:
        info = self.tensors[name]
        buf = self._map(info.file)
        page = mmap.PAGESIZE
        start = info.offset // page * page
        end = min(-(-(info.offset + self.nbytes(name)) // page) * page, len(buf))
        if end > start:
            buf.madvise(advice, start, end - start)

    def prefetch(self, name: str) -> None:
        """Ask the kernel to start reading tensor `name` now (it is read soon)."""
        self._advise(name, mmap.MADV_WILLNEED)

    def release(self, name: str) -> None:
        """Drop tensor `name`'s pages from this process (they stay in the page cache): a loaded
        checkpoint does not stay resident on top of the packed weights."""
        self._advise(name, mmap.MADV_DONTNEED)

    def _map(self, file: str) -> mmap.mmap:
        if file not in self._maps:
            f = open(file, "rb")
            self._maps[file] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        return self._maps[file][1]

    def lazy(self, name: str) -> LazyArray:
        """Tensor `name` as a lazy view of the file: slicing and transposing are free, and only the
        part finally converted (np.asarray) is read and decoded. Tensor-parallel loaders slice it,
        so no rank converts the whole tensor. Valid while the checkpoint is open."""
        info = self.tensors[name]
        count = int(np.prod(info.shape, dtype=np.int64))
        raw = np.frombuffer(self._map(info.file), dtype=_STORED_DTYPES[info.dtype], count=count, offset=info.offset)
        return LazyArray(raw.reshape(info.shape), self.kind(name))

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


