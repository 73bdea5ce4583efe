"""Paged attention over a ragged batch, with the KV write into the block pool; and attention without a
causal mask over a ragged batch of sequences held in memory (a ViT's frames), on the same kernel.

One call serves decode tokens and prefill chunks alike: request b owns the new tokens
query_start_loc[b] .. query_start_loc[b+1]-1, which are the last tokens of its context_lens[b]; its
context position p lives in cache slot block_tables[b, p // block_size] * block_size + p % block_size,
whose keys are kv_cache[0, slot // block_size, :, slot % block_size] (values: kv_cache[1, ...]).
The new K/V are first written at slot_mapping (negative slots are skipped), then every query attends
causally to its request's context. GQA: query head h reads kv head h // (H / KVH). A bf16 cache holds
K/V rounded to bf16, and the scores take the queries, scaled, rounded to bf16 too (as a bf16 dot product
does; on CPUs with AVX512_BF16 the kernel uses one). A uint8 cache holds block_wise_fp8 rows
(fastdeploy/ops/kv_cache.py), read back as float32.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.ops.build import call_op, compiled
from fastdeploy.ops.kv_cache import dequantize_fp8_rows, quantize_fp8_rows



def paged_attention_reference(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, kv_cache: paddle.Tensor,
                              slot_mapping: paddle.Tensor, query_start_loc: paddle.Tensor,
                              context_lens: paddle.Tensor, block_tables: paddle.Tensor, block_size: int,
                              scale: float) -> paddle.Tensor:
    """Pure Paddle, one request at a time. Same contract as `paged_attention`."""
    t, h, d = q.shape
    kvh = k.shape[1]
    fp8 = kv_cache.dtype == paddle.uint8

    def head_rows(slots: np.ndarray) -> paddle.Tensor:
        """Rows of kv_cache[i] viewed as [num_blocks * kvh * block_size, d] holding each slot's kv heads."""
        rows = (slots[:, None] // block_size * kvh + np.arange(kvh)) * block_size + slots[:, None] % block_size
        return paddle.to_tensor(rows.reshape(-1))

    slots = slot_mapping.numpy().astype(np.int64)
    keep = np.nonzero(slots >= 0)[0]
    if len(keep):
        rows = paddle.to_tensor(keep)
        new_k, new_v = (paddle.gather(x, rows).reshape([-1, d]) for x in (k, v))
        cache = kv_cache
        if fp8:  # quantized rows, scattered as int32 words (head_dim + 4 is a multiple of 4)
            new_k, new_v = (paddle.to_tensor(quantize_fp8_rows(x.numpy()).view(np.int32)) for x in (new_k, new_v))
            cache = kv_cache.view("int32")
        elif kv_cache.dtype == paddle.bfloat16:
            # Rounded to nearest even (Paddle's cast), as the kernel stores them; scattered as int32 pairs of
            # bf16 (Paddle's CPU scatter has no 16-bit kernel; head_dim is even).
            new_k, new_v = (x.astype("bfloat16").view("int32") for x in (new_k, new_v))
            cache = kv_cache.view("int32")
        cache = cache.view([2, -1, cache.shape[-1]])
        index = head_rows(slots[keep])
        cache[0].scatter_(index, new_k, overwrite=True)
        cache[1].scatter_(index, new_v, overwrite=True)
    flat = kv_cache.view("int32").view([2, -1, kv_cache.shape[-1] // 4]) if fp8 else kv_cache.view([2, -1, d])

    def context_rows(i: int, index: paddle.Tensor) -> paddle.Tensor:
        rows = paddle.gather(flat[i], index)
        if fp8:
            return paddle.to_tensor(dequantize_fp8_rows(rows.numpy().view(np.uint8)))
        return rows.astype("float32")

    starts = query_start_loc.numpy().astype(np.int64)
    ctx_lens = context_lens.numpy().astype(np.int64)
    tables = block_tables.numpy().astype(np.int64)
    outs = []
    for b in range(len(ctx_lens)):
        n, c = int(starts[b + 1] - starts[b]), int(ctx_lens[b])
        if n == 0:
            continue
        pos = np.arange(c)
        index = head_rows(tables[b, pos // block_size] * block_size + pos % block_size)
        keys, values = (paddle.repeat_interleave(context_rows(i, index).reshape([c, kvh, d]), h // kvh, axis=1)
                        for i in (0, 1))  # [c, H, D]
        queries = q[int(starts[b]):int(starts[b + 1])].transpose([1, 0, 2])  # [H, n, D]
        if kv_cache.dtype == paddle.bfloat16:  # scaled queries rounded to the keys' precision
            scores = paddle.matmul((queries * scale).astype("bfloat16").astype("float32"), keys.transpose([1, 2, 0]))
        else:
            scores = paddle.matmul(queries, keys.transpose([1, 2, 0])) * scale  # [H, n, c]
        q_pos = c - n + np.arange(n)
        bias = np.where(pos[None, :] <= q_pos[:, None], 0.0, -np.inf).astype(np.float32)
        probs = F.softmax(scores + paddle.to_tensor(bias), axis=-1)
        out = paddle.matmul(probs, values.transpose([1, 0, 2]))  # [H, n, D]
        outs.append(out.transpose([1, 0, 2]).reshape([n, h * d]))
    if not outs:
        return paddle.zeros([t, h * d], dtype="float32")
    return paddle.concat(outs, axis=0)


def paged_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, kv_cache: paddle.Tensor,
                    slot_mapping: paddle.Tensor, query_start_loc: paddle.Tensor, context_lens: paddle.Tensor,
                    block_tables: paddle.Tensor, block_size: int, scale: float, *,
                    use_compiled: bool = True) -> paddle.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (float32), kv_cache [2, num_blocks, KVH, block_size, D] (float32 or
    bfloat16: new keys and values are stored rounded to nearest even) or [..., D + 4] uint8 (block_wise_fp8);
    slot_mapping [T], query_start_loc [B + 1], context_lens [B], block_tables [B, max_blocks] (int32 or
    int64). Writes k/v into kv_cache in place and returns the attention output [T, H * D]."""
    lib = compiled(use_compiled)
    if lib is None:
        return paged_attention_reference(q, k, v, kv_cache, slot_mapping, query_start_loc, context_lens,
                                         block_tables, block_size, scale)
    return call_op(lib, "fd_paged_attention", q, k, v, kv_cache, slot_mapping, query_start_loc, context_lens,
                   block_tables, int(block_size), float(scale), True)[1]


_SCORE_BYTES = 1 << 28  # the reference computes at most this many bytes of scores at once


def bidirectional_attention_reference(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, starts: np.ndarray,
                                      scale: float) -> paddle.Tensor:
    """Pure Paddle, one sequence at a time, queries chunked. Same contract as `bidirectional_attention`."""
    t, h, d = q.shape
    group = h // k.shape[1]
    outs = []
    for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist()):
        if hi == lo:
            continue
        keys = paddle.repeat_interleave(k[lo:hi], group, axis=1).transpose([1, 2, 0])  # [H, D, n]
        values = paddle.repeat_interleave(v[lo:hi], group, axis=1).transpose([1, 0, 2])  # [H, n, D]
        queries = q[lo:hi].transpose([1, 0, 2])  # [H, n, D]
        chunk = max(1, _SCORE_BYTES // (4 * h * (hi - lo)))
        for c in range(0, hi - lo, chunk):
            probs = F.softmax(paddle.matmul(queries[:, c:c + chunk], keys) * scale, axis=-1)
            outs.append(paddle.matmul(probs, values).transpose([1, 0, 2]).reshape([-1, h * d]))
    if not outs:
        return paddle.zeros([t, h * d], dtype="float32")
    return paddle.concat(outs, axis=0)


def bidirectional_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, starts: np.ndarray, scale: float,
                            *, use_compiled: bool = True) -> paddle.Tensor:
    """Attention without a causal mask inside each sequence of a ragged batch (a ViT's frames): q [T, H, D],
    k/v [T, KVH, D] float32, sequence b owning rows starts[b] .. starts[b + 1] - 1 (starts [B + 1] int64,
    from 0 to T). Returns [T, H * D]. The compiled op is the paged one reading k/v in place as its cache
    (block size 1, nothing written)."""
    starts = np.asarray(starts, dtype=np.int64)
    if starts.ndim != 1 or starts.size < 1 or starts[0] != 0 or starts[-1] != q.shape[0] or np.any(np.diff(starts) < 0):
        raise ValueError(f"starts must rise from 0 to T = {q.shape[0]}, got {starts.tolist()[:8]}...")
    lib = compiled(use_compiled)
    if lib is None:
        return bidirectional_attention_reference(q, k, v, starts, scale)
    lens = np.diff(starts)
    width = max(int(lens.max(initial=0)), 1)
    tables = np.minimum(starts[:-1, None] + np.arange(width), max(q.shape[0] - 1, 0))  # slot of each position
    return call_op(lib, "fd_paged_attention", q, k, v, paddle.stack([k, v]).unsqueeze(3),
                   paddle.full([q.shape[0]], -1, dtype="int64"), paddle.to_tensor(starts), paddle.to_tensor(lens),
                   paddle.to_tensor(tables), 1, float(scale), False)[1]
