"""TEMPORARY stand-in for the fused MoE op."""
from __future__ import annotations

import paddle


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
                h = silu_and_mul(weight_only_linear(x[t:t + 1], up_gate.expert(e)))
                out[t:t + 1] += float(wn[t, j]) * weight_only_linear(h, down.expert(e))
    if shared_up_gate is not None:
        out = out + weight_only_linear(silu_and_mul(weight_only_linear(x, shared_up_gate)), shared_down)
    return out
