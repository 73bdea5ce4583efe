"""TEMPORARY numpy stand-ins for empty_packed / pack_into (replaced by the compiled packing op)."""
from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.ops.quant import PackedWeight, pack_weight


def empty_packed(fmt: str, k: int, n: int, experts: int = 0) -> PackedWeight:
    single = pack_weight(np.zeros((k, n), np.float32), fmt)
    if not experts:
        return single
    data = paddle.stack([single.data] * experts)
    scales = paddle.stack([single.scales] * experts) if fmt in ("int8", "int4") else single.scales
    return PackedWeight(fmt, k, n, data, scales)


def pack_into(dst: PackedWeight, src: np.ndarray, col0: int = 0, expert: int | None = None) -> None:
    if dst.fmt == "bf16" and src.dtype == np.uint16:
        pw = pack_weight(np.ascontiguousarray(src), "bf16")
    else:
        f = src.view(np.float32) if False else np.asarray(src)
        if f.dtype == np.uint16:
            f = (f.astype(np.uint32) << 16).view(np.float32)
        pw = pack_weight(f.astype(np.float32), dst.fmt)
    n = src.shape[1]
    cols = col0 + np.arange(n)
    js = np.arange(n)
    d = np.from_dlpack(dst.data.view("int16") if dst.fmt == "bf16" else dst.data)
    s = np.from_dlpack(dst.scales)
    if expert is not None:
        d = d[expert]
        if dst.fmt in ("int8", "int4"):
            s = s[expert]
    sd, ss = (pw.data.view("int16") if dst.fmt == "bf16" else pw.data).numpy(), pw.scales.numpy()
    if dst.fmt in ("fp32", "bf16"):
        d[cols // 16, :, cols % 16] = sd[js // 16, :, js % 16]
    else:
        d[cols // 16, :, cols % 16, :] = sd[js // 16, :, js % 16, :]
        if dst.fmt == "int8":
            s[cols] = ss[js]
        else:
            s[cols // 16, :, cols % 16] = ss[js // 16, :, js % 16]


def expert_view(pw: PackedWeight, e: int) -> PackedWeight:
    return PackedWeight(pw.fmt, pw.k, pw.n, pw.data[e], pw.scales[e] if pw.fmt in ("int8", "int4") else pw.scales)


def fused_moe(x, router, correction_bias, up_gate, down, top_k, norm_min, expert_start, num_experts,
              shared_up_gate=None, shared_down=None):
    import paddle.nn.functional as F
    from fastdeploy.ops.activation import silu_and_mul
    from fastdeploy.ops.linear import weight_only_linear
    probs = F.softmax(weight_only_linear(x, router), axis=-1)
    choice = probs if correction_bias is None else probs + correction_bias
    _, ids = paddle.topk(choice, top_k, axis=-1)
    weights = paddle.take_along_axis(probs, ids, axis=-1)
    if norm_min is not None:
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=norm_min)
    count = up_gate.data.shape[0]
    out = paddle.zeros_like(x)
    idn, wn = ids.numpy(), weights.numpy()
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(idn[t, j]) - expert_start
            if 0 <= e < count:
                h = silu_and_mul(weight_only_linear(x[t:t + 1], expert_view(up_gate, e)))
                out[t:t + 1] += float(wn[t, j]) * weight_only_linear(h, expert_view(down, e))
    if shared_up_gate is not None:
        out = out + weight_only_linear(silu_and_mul(weight_only_linear(x, shared_up_gate)), shared_down)
    return out
