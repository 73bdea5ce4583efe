"""The messages rank 0 broadcasts to tensor-parallel ranks on other hosts, as fixed-schema binary (no pickle:
what comes off the network is only ever read as arrays of the types the schema names).

A message: a header (magic, version, kind, payload length, CRC-32 of the payload), then the payload: the
kind's fields in a fixed order, each as a dtype code, its number of dimensions, the dimensions (uint32) and
the little-endian data. `decode` refuses anything that does not match: a wrong magic, version, kind, length or
checksum, a field of another dtype or rank than the schema's, bytes left over, or a batch whose arrays
disagree in length.
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from fastdeploy.step_types import ForwardBatch, VisionSlice
from fastdeploy.worker import messages

MAGIC = b"FDTP"
VERSION = 1
_HEADER = struct.Struct("<4sHHII")  # magic, version, kind, payload bytes, crc32
_STEP, _MTP, _STOP, _NOOP = 1, 2, 3, 4
_DTYPES = {1: np.dtype("<i8"), 2: np.dtype("<f4"), 3: np.dtype("u1")}
_CODES = {v: k for k, v in _DTYPES.items()}
_I64, _F32, _U8 = _DTYPES[1], _DTYPES[2], _DTYPES[3]
_ABSENT = 0  # dtype code of an optional field that is None


class MessageError(ValueError):
    """A step message that does not follow the schema (corrupted, or from another version)."""


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def array(self, value: np.ndarray | None, dtype: np.dtype) -> None:
        if value is None:
            self.parts.append(bytes([_ABSENT, 0]))
            return
        a = np.asarray(value, dtype=dtype, order="C")  # (ascontiguousarray would make a scalar 1-d)
        self.parts.append(bytes([_CODES[dtype], a.ndim]) + struct.pack(f"<{a.ndim}I", *a.shape) + a.tobytes())

    def ints(self, values) -> None:
        self.array(np.asarray(values, np.int64).reshape(-1), _I64)

    def scalar(self, value: int) -> None:
        self.array(np.asarray(value, np.int64), _I64)


class _Reader:
    def __init__(self, payload: bytes) -> None:
        self.data, self.at = memoryview(payload), 0

    def _take(self, n: int) -> memoryview:
        if self.at + n > len(self.data):
            raise MessageError("step message: a field runs past its end")
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return chunk

    def array(self, dtype: np.dtype, ndims: tuple[int, ...], optional: bool = False) -> np.ndarray | None:
        code, ndim = self._take(2)
        if code == _ABSENT and optional and ndim == 0:
            return None
        if _DTYPES.get(code) != dtype or ndim not in ndims:
            raise MessageError(f"step message: a field of dtype code {code} and {ndim} dimensions where the schema "
                               f"has {dtype} with {' or '.join(map(str, ndims))}")
        shape = struct.unpack(f"<{ndim}I", self._take(4 * ndim))
        count = math.prod(shape)  # Python ints: forged dimensions cannot wrap around
        return np.frombuffer(self._take(count * dtype.itemsize), dtype).reshape(shape).astype(dtype.newbyteorder("="))

    def ints(self) -> np.ndarray:
        return self.array(_I64, (1,))

    def scalar(self) -> int:
        return int(self.array(_I64, (0,)))

    def done(self) -> None:
        if self.at != len(self.data):
            raise MessageError(f"step message: {len(self.data) - self.at} bytes after its last field")


def encode(message: object) -> bytes:
    w = _Writer()
    if isinstance(message, messages.Step):
        kind = _STEP
        _write_batch(w, message.batch)
    elif isinstance(message, messages.MtpStep):
        kind, step = _MTP, message.step
        for name in ("ids", "positions", "lens", "ends"):
            w.ints(getattr(step, name))
        w.array(step.table, _I64)
        w.scalar(int(step.from_main))
        w.ints(step.sources)
        w.ints(step.out_rows)
    elif isinstance(message, messages.Stop):
        kind = _STOP
    elif isinstance(message, messages.Noop):
        kind = _NOOP
    else:
        raise TypeError(f"no wire form for {type(message).__name__}")
    payload = b"".join(w.parts)
    return _HEADER.pack(MAGIC, VERSION, kind, len(payload), zlib.crc32(payload)) + payload


def decode(data: bytes) -> object:
    if len(data) < _HEADER.size:
        raise MessageError(f"step message of {len(data)} bytes is shorter than its header")
    magic, version, kind, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise MessageError(f"not a step message of version {VERSION} (magic {magic!r}, version {version}): every "
                           "node must run the same fastdeploy")
    payload = data[_HEADER.size:]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise MessageError("step message corrupted: its length or checksum does not match")
    r = _Reader(payload)
    if kind == _STEP:
        message: object = messages.Step(_read_batch(r))
    elif kind == _MTP:
        ids, positions, lens, ends = (r.ints().tolist() for _ in range(4))
        table = r.array(_I64, (2,))
        from_main = bool(r.scalar())
        message = messages.MtpStep(messages.MtpLayerStep(ids, positions, lens, ends, table, from_main,
                                                         r.ints().tolist(), r.ints().tolist()))
    elif kind == _STOP:
        message = messages.Stop()
    elif kind == _NOOP:
        message = messages.Noop()
    else:
        raise MessageError(f"step message of unknown kind {kind}")
    r.done()
    return message


def _write_batch(w: _Writer, b: ForwardBatch) -> None:
    for a in (b.token_ids, b.positions, b.query_lens, b.context_lens, b.block_tables, b.logit_rows):
        w.array(a, _I64)
    w.array(b.token_types, _I64)
    w.array(b.hidden_rows, _I64)
    w.scalar(len(b.vision))
    for v in b.vision:
        w.array(np.frombuffer(v.key.encode(), np.uint8), _U8)
        w.array(v.pixel_values, _F32)
        w.array(np.asarray(v.grid_thw, np.int64).reshape(-1, 3), _I64)
        w.array(v.row_order, _I64)
        w.scalar(v.lo)
        w.scalar(v.hi)


def _read_batch(r: _Reader) -> ForwardBatch:
    token_ids = r.ints()
    positions = r.array(_I64, (1, 2))
    query_lens, context_lens = r.ints(), r.ints()
    block_tables = r.array(_I64, (2,))
    logit_rows = r.ints()
    token_types = r.array(_I64, (1,), optional=True)
    hidden_rows = r.ints()
    count = r.scalar()
    if not 0 <= count <= len(token_ids):
        raise MessageError(f"step message: {count} vision slices in a batch of {len(token_ids)} tokens")
    vision = []
    for _ in range(count):
        key = r.array(_U8, (1,)).tobytes().decode(errors="strict")
        pixels = r.array(_F32, (2,))
        grid = [tuple(g) for g in r.array(_I64, (2,)).tolist()]
        vision.append(VisionSlice(key, pixels, grid, r.ints(), r.scalar(), r.scalar()))
    batch = ForwardBatch(token_ids, positions, query_lens, context_lens, block_tables, logit_rows, token_types, vision,
                         hidden_rows)
    _check_batch(batch)
    return batch


def _check_batch(b: ForwardBatch) -> None:
    n, t = len(b.query_lens), len(b.token_ids)
    if len(b.context_lens) != n or b.block_tables.shape[0] != n or b.positions.shape[-1] != t or \
            int(b.query_lens.sum()) != t or (b.token_types is not None and len(b.token_types) != t):
        raise MessageError(f"step message: a batch whose arrays disagree ({n} requests, {t} tokens, "
                           f"block tables {b.block_tables.shape}, positions {b.positions.shape})")

