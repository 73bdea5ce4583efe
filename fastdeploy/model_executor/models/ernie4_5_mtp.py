"""ERNIE-4.5's multi-token-prediction (MTP) layer, as FastDeploy's `ernie4_5_mtp` model computes it; speculative
decoding's `"method": "mtp"` drafts with it.

At position i, from the main model's final-normed hidden state h_i and the token x_{i+1} that follows it:

    z_i = mtp_linear_proj(concat(mtp_emb_norm(embed(x_{i+1})), mtp_hidden_norm(h_i)))   # [2H] -> [H]
    o_i = norm(mtp_block(z_i))        # one decoder layer of the model's own kind, at rotary position i

`norm`, `embed` and the LM head are the main model's. lm_head(o_i) predicts x_{i+2}; o_i is also the hidden
state a further draft starts from (FastDeploy feeds the MTP its own output for a second step). The layer's
attention has its own KV cache, the layer after the main model's (index num_hidden_layers).

Checkpoint tensors (Paddle layout under `ernie.`, HF layout under `model.`): mtp_emb_norm.0.weight,
mtp_hidden_norm.0.weight, mtp_linear_proj.0.weight ([2H, H] Paddle, [H, 2H] HF) and mtp_block.0.* named as a
decoder layer's. The block's MLP is routed experts when the checkpoint stores them there (ERNIE-4.5 MoE
checkpoints), else dense. FastDeploy's `speculative_config["model"]` may name another directory holding these
tensors (ERNIE-4.5's `mtp/` folders); they are then taken from there.
"""
from __future__ import annotations

import re

import paddle
from paddle import nn

from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.norm import RMSNorm
from fastdeploy.model_executor.models.decoder import CausalLM, DecoderLayer, dense_mlp

MTP_PATTERN = r"(^|\.)mtp_"  # the checkpoint tensors of the MTP layer (the models skip them otherwise)


def is_mtp_tensor(name: str) -> bool:
    return re.search(MTP_PATTERN, name) is not None


def mtp_layer_is_moe(names: list[str]) -> bool:
    return any(".mtp_block.0.mlp.experts." in n for n in names)


def attach_mtp(model: CausalLM, moe: bool) -> None:
    """Give the model's decoder the MTP layer's modules, named as the checkpoint names them, so the loader fills
    them like any other; `moe`: its MLP is the model's MoE (else dense)."""
    config = model.config
    decoder = model.model
    hidden, eps = config.hidden_size, config.rms_norm_eps
    index = config.num_hidden_layers  # its KV cache layer
    if moe:
        make_mlp = getattr(model, "make_mtp_moe_mlp", None)
        if make_mlp is None:
            raise ValueError(f"{type(model).__name__} has no MoE to give the checkpoint's MTP experts")
    else:
        make_mlp = dense_mlp
    decoder.mtp_emb_norm = nn.LayerList([RMSNorm(hidden, eps)])
    decoder.mtp_hidden_norm = nn.LayerList([RMSNorm(hidden, eps)])
    decoder.mtp_linear_proj = nn.LayerList([Linear(2 * hidden, hidden)])
    decoder.mtp_block = nn.LayerList([DecoderLayer(config, index, model.attention_options(config),
                                                   lambda c, _: make_mlp(c, index))])
    model.ignored_checkpoint_patterns = tuple(p for p in model.ignored_checkpoint_patterns if p != MTP_PATTERN)


@paddle.no_grad()
def mtp_forward(model: CausalLM, token_ids: paddle.Tensor, positions: paddle.Tensor,
                hidden: paddle.Tensor) -> paddle.Tensor:
    """The MTP layer over a ragged batch (under a forward context whose caches include its layer): token_ids
    [T] (each row's x_{i+1}), positions [T] (i), hidden [T, H] (h_i) -> o [T, H]. The compiled step computes the
    same (custom_ops/decoder_step.cc, an MTP model)."""
    decoder = model.model
    embedded = decoder.mtp_emb_norm[0](decoder.embed_tokens(token_ids))
    joined = paddle.concat([embedded, decoder.mtp_hidden_norm[0](hidden.astype(embedded.dtype))], axis=-1)
    out, residual = decoder.mtp_block[0](decoder.mtp_linear_proj[0](joined), None, decoder.rotary,
                                         decoder.rotary.cos_sin(positions))
    out, _ = decoder.norm(out, residual)
    return out
