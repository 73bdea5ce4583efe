"""The whole forward step of a decoder model in one compiled call (custom_ops/decoder_step.cc).

`CompiledDecoder.build(model, ...)` hands a loaded `CausalLM` (ERNIE-4.5 dense or MoE, Qwen2, Qwen3, Llama,
Mistral) to the library once. What the model's tensors are (each layer's packed weights, norms, biases, router and
experts, which layers are dense, the rotary cos/sin table) is the model side's description
(model_executor/models/compiled_description.py); this module only mirrors decoder_step.cc's structures,
fills them from that description and the KV cache layers, and calls the library. ERNIE-4.5-VL runs its
text-only steps (decode, text chunks) here with the text experts; steps with vision rows take the layer
path. Each `forward` then runs embedding, every layer, the final norm and the LM head
without returning to Python. The kernels and their order are the layer-by-layer path's, so the logits
and the KV cache are the same bits; what goes away is ~10 Paddle op dispatches per layer and the
Python around them, which at one stream took longer than streaming the weights. The Paddle path
stays the reference, and runs what this does not cover (tensor parallel, shared experts with biases,
no compiled library).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.ops.build import OpsLibrary
from fastdeploy.ops.kv_cache import FP8_SCALE_BYTES, cache_kind
from fastdeploy.model_executor.models.compiled_description import CompiledLayer, describe, unsupported_reason
from fastdeploy.ops.quant import FORMATS, PackedWeight
from fastdeploy.sampling.policy import InForward
from fastdeploy.step_types import ForwardBatch, block_table_array

logger = logging.getLogger(__name__)

_i64, _f32, _i32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 1}
# Where a step's time goes, as decoder_step.cc's Phase enum counts it (GEMMs: qkv, out, mlp, moe, head).
PHASES = ("embed", "norm", "qkv", "rope", "attention", "out", "mlp", "activation", "moe", "head")
WEIGHT_PHASES = ("qkv", "out", "mlp", "moe", "head")  # the phases that stream weights (GEMV / GEMM)


# Mirrors of the structures in decoder_step.cc, field for field.
class _Weight(ctypes.Structure):
    _fields_ = [("w", _ptr), ("scales", _ptr), ("w_stride", _i64), ("s_stride", _i64), ("K", _i64), ("N", _i64),
                ("fmt", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Weight), ("qkv_bias", _ptr), ("o", _Weight),
                ("o_bias", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("up_gate", _Weight), ("up_gate_bias", _ptr),
                ("down", _Weight), ("down_bias", _ptr), ("router", _Weight), ("correction_bias", _ptr),
                ("experts_up_gate", _Weight), ("experts_down", _Weight), ("shared_up_gate", _Weight),
                ("shared_down", _Weight), ("num_experts", _i64), ("expert_start", _i64), ("local_experts", _i64),
                ("top_k", _i64), ("norm_min", _f32), ("renormalize", _i32), ("kv_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_Layer)), ("num_layers", _i64), ("hidden", _i64), ("heads", _i64),
                ("kv_heads", _i64), ("head_dim", _i64), ("max_ffn", _i64), ("max_top_k", _i64), ("cache_slots", _i64),
                ("block_size", _i64), ("eps", _f32), ("attn_scale", _f32), ("interleaved", _i32),
                ("embedding", _Weight), ("lm_head", _Weight), ("final_norm", _ptr), ("cos_table", _ptr),
                ("sin_table", _ptr), ("max_positions", _i64), ("cache_kind", _i32), ("mtp_emb_norm", _ptr),
                ("mtp_hidden_norm", _ptr), ("mtp_proj", _Weight)]


class _Batch(ctypes.Structure):
    _fields_ = [("ids", _ptr), ("positions", _ptr), ("q_lens", _ptr), ("ctx_lens", _ptr),
                ("blocks", _ptr), ("logit_rows", _ptr), ("logits", _ptr), ("T", _i64), ("B", _i64),
                ("max_blocks", _i64), ("R", _i64), ("argmax", _ptr), ("sample_params", _ptr),
                ("sample_lists", _ptr), ("n_sample_lists", _i64), ("hidden_rows", _ptr), ("hidden", _ptr),
                ("n_hidden", _i64), ("input_hidden", _ptr)]


def _address(t: paddle.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(pw: PackedWeight | None) -> _Weight:
    if pw is None:
        return _Weight()
    experts = max(pw.num_experts, 1)
    quantized = pw.fmt in ("int8", "int4")
    return _Weight(pw.data.data_ptr(), pw.scales.data_ptr() if quantized else None,
                   int(np.prod(pw.data.shape)) // experts * _ELEMENT_BYTES[pw.fmt],
                   int(np.prod(pw.scales.shape)) // experts if quantized else 0, pw.k, pw.n, FORMATS[pw.fmt])


def _layer(layer: CompiledLayer, kv_cache: paddle.Tensor) -> _Layer:
    out = _Layer(input_norm=_address(layer.input_norm), post_norm=_address(layer.post_norm), qkv=_weight(layer.qkv),
                 qkv_bias=_address(layer.qkv_bias), o=_weight(layer.o), o_bias=_address(layer.o_bias),
                 q_norm=_address(layer.q_norm), k_norm=_address(layer.k_norm), kv_cache=kv_cache.data_ptr())
    moe = layer.moe
    if moe is None:
        out.up_gate, out.up_gate_bias = _weight(layer.up_gate), _address(layer.up_gate_bias)
        out.down, out.down_bias = _weight(layer.down), _address(layer.down_bias)
        return out
    out.router, out.correction_bias = _weight(moe.router), _address(moe.correction_bias)
    out.experts_up_gate, out.experts_down = _weight(moe.experts_up_gate), _weight(moe.experts_down)
    out.shared_up_gate, out.shared_down = _weight(moe.shared_up_gate), _weight(moe.shared_down)
    out.num_experts, out.expert_start, out.local_experts = moe.num_experts, moe.expert_start, moe.local_experts
    out.top_k, out.norm_min, out.renormalize = moe.top_k, moe.norm_min or 0.0, moe.norm_min is not None
    return out


def _check_caches(kv_caches: Sequence[paddle.Tensor], layers: int, kv_heads: int, head_dim: int,
                  block_size: int) -> None:
    """The library reads a layer's cache as [2, blocks, KVH, block_size, row] of the first cache's kind and block
    count (the step's contract); anything else is refused here, before the library points into it."""
    first = kv_caches[0] if kv_caches else None
    row = head_dim + (FP8_SCALE_BYTES if first is not None and first.dtype == paddle.uint8 else 0)
    expected = [2, int(first.shape[1]) if first is not None else 0, kv_heads, block_size, row]
    if len(kv_caches) != layers or any(list(c.shape) != expected or c.dtype != first.dtype for c in kv_caches):
        raise ValueError(f"the compiled step needs {layers} KV caches of shape {expected} and one dtype, got "
                         f"{[(list(c.shape), str(c.dtype)) for c in kv_caches][:2]}...")


class CompiledDecoder:
    """One model's compiled forward step; holds references to everything the library points into."""

    def __init__(self, lib: OpsLibrary, model: nn.Layer, kv_caches: Sequence[paddle.Tensor],
                 block_size: int, max_positions: int, mtp: bool = False) -> None:
        described = describe(model, max_positions, mtp)
        _check_caches(kv_caches, len(described.layers), described.kv_heads, described.head_dim, block_size)
        self._keep: list[Any] = [model, list(kv_caches), described]  # described holds the rotary tables
        layers = [_layer(layer, cache) for layer, cache in zip(described.layers, kv_caches)]
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(
            layers=self._layers, num_layers=len(layers), hidden=described.hidden, heads=described.heads,
            kv_heads=described.kv_heads, head_dim=described.head_dim, max_ffn=described.max_ffn,
            max_top_k=described.max_top_k, cache_slots=int(kv_caches[0].shape[1]) * block_size,
            block_size=block_size, eps=described.eps, attn_scale=described.attn_scale,
            interleaved=described.interleaved, embedding=_weight(described.embedding),
            lm_head=_weight(described.lm_head), final_norm=_address(described.final_norm),
            cos_table=described.cos.data_ptr(), sin_table=described.sin.data_ptr(),
            max_positions=described.max_positions, cache_kind=cache_kind(kv_caches[0]),
            mtp_emb_norm=_address(described.mtp_emb_norm), mtp_hidden_norm=_address(described.mtp_hidden_norm),
            mtp_proj=_weight(described.mtp_proj))
        self.vocab = described.vocab
        self.hidden_size = described.hidden
        # What `hidden` answers after a step without hidden rows: one shared empty array, no allocation per step.
        self._no_hidden = np.empty((0, self.hidden_size), dtype=np.float32)
        self._no_hidden.flags.writeable = False
        self._hidden = self._no_hidden
        # forward_tokens' outputs: the logits (unread) and the tokens, as a view, and their addresses.
        self._scratch_logits = np.empty((0, self.vocab), dtype=np.float32)
        self._argmax = memoryview(b"")
        self._scratch_addresses = (0, 0, 0)
        self._keep_scratch: tuple[np.ndarray, ...] = ()  # the arrays behind those addresses
        self._dll = ctypes.CDLL(str(lib.path))  # the library Paddle already loaded: same handle
        self._step = self._dll.fd_decoder_step
        self._step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Batch), _ptr]
        self._step.restype = ctypes.c_int
        new, self._free = self._dll.fd_step_workspace_new, self._dll.fd_step_workspace_free
        new.restype, self._free.argtypes = _ptr, [_ptr]
        self._phases = self._dll.fd_step_phase_seconds
        self._phases.argtypes = [_ptr, _ptr]
        self._error = self._dll.fd_step_error
        self._error.restype = ctypes.c_char_p
        self._workspace = new()
        self._kept: tuple[tuple[Any, ...], _Batch] | None = None  # the last batch's arrays and _Batch

    def __del__(self) -> None:
        if getattr(self, "_workspace", None):
            self._free(self._workspace)
            self._workspace = None

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase of the steps since the last call (for benchmarks)."""
        out = np.zeros(len(PHASES), dtype=np.float64)
        self._phases(self._workspace, out.ctypes.data)
        return dict(zip(PHASES, out.tolist()))

    @property
    def hidden(self) -> np.ndarray:
        """float32 [len(hidden_rows), hidden_size]: the last step's final-normed hidden states of its batch's
        `hidden_rows` (the LM head's input), in their order; [0, hidden_size] when it asked for none."""
        return self._hidden

    @classmethod
    def build(cls, model: nn.Layer, kv_caches: Sequence[paddle.Tensor], block_size: int,
              max_positions: int, mtp: bool = False) -> CompiledDecoder | None:
        """The compiled step for `model` (`mtp`: for its MTP layer, whose calls give the main model's hidden
        states as input_hidden), or None (logged) when it must run layer by layer."""
        lib = ops.library()
        reason = "the compiled ops are unavailable" if lib is None else unsupported_reason(model, mtp)
        if reason is not None:
            logger.info("%s runs layer by layer: %s", "the MTP layer" if mtp else "forward", reason)
            return None
        return cls(lib, model, kv_caches, block_size, max_positions, mtp)

    @staticmethod
    def covers(inputs: ForwardBatch) -> ForwardBatch | None:
        """The batch as this step runs it, or None when it needs the layer path: a multimodal step with
        vision rows. A multimodal step of text tokens only has t = h = w, which is the 1-D rotary."""
        if inputs.token_types is None:
            return inputs
        positions = inputs.positions
        if inputs.vision or inputs.token_types.any() or not (positions == positions[0]).all():
            return None
        return dataclasses.replace(inputs, positions=positions[0], token_types=None)

    def forward(self, inputs: ForwardBatch, input_hidden: np.ndarray | None = None) -> paddle.Tensor | None:
        """The batch's forward pass (writing its K/V into the cache): logits [R, vocab] of `logit_rows`,
        None when no row needs them. Only batches `covers` returned. `input_hidden` (float32 [T, hidden]): the
        first layer's input rows instead of the tokens' embedding (an MTP step: the hidden states it starts from)."""
        rows = len(inputs.logit_rows)
        logits = paddle.empty([rows, self.vocab], dtype="float32")
        self._run(inputs, logits.data_ptr() if rows else None, None, input_hidden=input_hidden)
        return logits if rows else None

    def forward_tokens(self, inputs: ForwardBatch, how: InForward = InForward(None, None)) -> list[int]:
        """The forward pass and each logit row's token, taken inside the same call while the logits are in
        cache: the sampling op's greedy argmax (first maximum, first NaN) or, given `how.params`, the op's draw
        (with `how.token_lists`' bans and penalties); -1 for a sampled row without a finite largest logit. The
        logits themselves go to a scratch buffer."""
        rows = len(inputs.logit_rows)
        if not rows:
            self._run(inputs, None, None)
            return []
        if len(self._argmax) < rows:
            # Buffers and addresses made once: numpy's code is cold after a step's weight stream, and even
            # np.empty and .ctypes cost tens of microseconds at one stream.
            self._scratch_logits = np.empty((rows, self.vocab), dtype=np.float32)
            argmax = np.empty(rows, dtype=np.int64)
            self._argmax = memoryview(argmax).cast("B").cast(argmax.dtype.char)
            no_lists = np.zeros(3 * rows + 1, dtype=np.int64)  # every banned, prompt and output list empty
            self._scratch_addresses = (self._scratch_logits.ctypes.data, argmax.ctypes.data, no_lists.ctypes.data)
            self._keep_scratch = (argmax, no_lists)
        logits, tokens, no_lists = self._scratch_addresses
        if how.params is None:
            self._run(inputs, logits, tokens)
        else:
            params = np.ascontiguousarray(how.params, dtype=np.float64)
            if how.token_lists is None:
                lists = (no_lists, 3 * rows + 1)
            else:
                given = np.ascontiguousarray(how.token_lists, dtype=np.int64)
                lists = (given.ctypes.data, len(given))
            self._run(inputs, logits, tokens, params.ctypes.data, lists)
        return self._argmax[:rows].tolist()

    def _run(self, inputs: ForwardBatch, logits: int | None, tokens: int | None, sample_params: int | None = None,
             sample_lists: tuple[int, int] = (0, 0), input_hidden: np.ndarray | None = None) -> None:
        batch = self._batch(inputs)
        batch.input_hidden = None
        if input_hidden is not None:
            shape = (len(inputs.token_ids), self.hidden_size)
            if input_hidden.dtype != np.float32 or input_hidden.shape != shape or not input_hidden.flags.c_contiguous:
                raise ValueError(f"input_hidden must be a contiguous float32 array of shape {shape}, got "
                                 f"{input_hidden.dtype} {input_hidden.shape}")
            batch.input_hidden = input_hidden.ctypes.data
        batch.logits, batch.argmax, batch.sample_params = logits, tokens, sample_params
        batch.sample_lists, batch.n_sample_lists = sample_lists
        n = batch.n_hidden  # a fresh array per step with hidden rows: the caller may keep it past the next step
        hidden = np.empty((n, self.hidden_size), dtype=np.float32) if n else self._no_hidden
        batch.hidden = hidden.ctypes.data if n else None
        self._hidden = self._no_hidden  # until the call succeeds
        rc = self._step(ctypes.byref(self._model), ctypes.byref(batch), self._workspace)
        if rc == 0:
            self._hidden = hidden
        else:
            raise ValueError(f"the compiled step refused its arguments: {self._error().decode()}" if rc == 1 else
                             "the compiled step cannot run: this CPU has neither AVX2+FMA nor AVX-512")

    def _batch(self, inputs: ForwardBatch) -> _Batch:
        """The batch as the library takes it (it derives query starts and cache slots itself: at one stream
        the numpy calls that built them here cost about as much as the attention over a short context).
        The engine moves a decoding batch on by updating its arrays in place (engine/step_builder.py's SteadyDecode), so
        when the library reads the arrays themselves, not copies, their _Batch is kept for the next step."""
        arrays = (inputs.token_ids, inputs.positions, inputs.query_lens, inputs.context_lens, inputs.block_tables,
                  inputs.logit_rows, inputs.hidden_rows)
        if self._kept is not None and all(a is b for a, b in zip(arrays, self._kept[0])):
            return self._kept[1]
        ids, positions, q_lens, ctx_lens = (np.ascontiguousarray(a, dtype=np.int64) for a in arrays[:4])
        tables = np.ascontiguousarray(block_table_array(inputs.block_tables))
        rows = np.ascontiguousarray(inputs.logit_rows, dtype=np.int64)
        hidden_rows = np.ascontiguousarray(inputs.hidden_rows, dtype=np.int64)
        given = (ids, positions, q_lens, ctx_lens, tables, rows, hidden_rows)
        batch = _Batch(ids.ctypes.data, positions.ctypes.data, q_lens.ctypes.data, ctx_lens.ctypes.data,
                       tables.ctypes.data, rows.ctypes.data, None, len(ids), len(ctx_lens), tables.shape[1],
                       len(rows), None, hidden_rows=hidden_rows.ctypes.data, n_hidden=len(hidden_rows))
        batch.arrays = given  # the library reads them through raw addresses: copies made here must outlive the call
        self._kept = (arrays, batch) if all(a is b for a, b in zip(arrays, given)) else None
        return batch
