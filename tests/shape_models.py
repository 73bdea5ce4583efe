"""Random small decoder checkpoints of any shape (HF layout, safetensors) and an independent numpy forward of
them, for tests/test_shape_sweep.py.

The reference is float64 numpy written from the model families' definitions (not from our ops): embedding,
RMSNorm, rotary (ERNIE-4.5 rotates interleaved pairs (x[2i], x[2i+1]); Qwen2/3 rotate the halves (x[i],
x[i + D/2])), grouped-query causal attention (query head h reads kv head h // (heads / kv_heads)), Qwen3's
per-head q/k RMSNorm before the rotary, SiLU-gated MLPs, ERNIE-4.5's MoE routing (softmax, correction bias
for choosing only, top-k, renormalised over the chosen with a floor of moe_norm_min, plus shared experts),
Qwen3-MoE's (softmax, top-k, renormalised over the chosen only with norm_topk_prob; layers placed by
decoder_sparse_step and mlp_only_layers; untied head), Llama 3.1's scaled rotary frequencies with q/k/v/o
and MLP biases, the final norm and the LM head (tied or not). `Numerics` rounds where a format documents
that the model rounds (bf16 or Q8_0 inputs of the linears, the KV cache's rows), so that each format can be held to a
tolerance near its own rounding rather than to the gap between float32 and it.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from make_tiny_models import (Shape, Weights, bf16_bits_to_f32, copy_tokenizer, to_bf16_bits,  # noqa: E402
                              write_safetensors)

FAMILIES = ("ernie45", "ernie45_moe", "qwen2", "qwen3", "qwen3_moe", "llama")
ARCH = {"ernie45": "Ernie4_5ForCausalLM", "ernie45_moe": "Ernie4_5_MoeForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}
TORCH_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
EPS = 1e-5
NORM_MIN = 1e-12
# Llama's shapes: Llama 3.1's rope scaling shrunk so that the schedules' positions (< 64) see all three bands
# (wavelengths under 8 kept, over 24 divided by the factor, interpolated between), every bias on, untied head.
LLAMA_ROPE_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 3.0,
                      "original_max_position_embeddings": 24}


@dataclass(frozen=True)
class SweepShape:
    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 0  # ernie45_moe and qwen3_moe only
    top_k: int = 0
    expert_ffn: int = 0
    shared: int = 0  # shared experts (one MLP of expert_ffn x shared; ernie45_moe)
    moe_start: int = 0  # ernie45_moe: first MoE layer; the ones before it are dense
    sparse_step: int = 1  # qwen3_moe: decoder_sparse_step, mlp_only_layers and norm_topk_prob
    mlp_only: tuple[int, ...] = ()
    norm_topk: bool = True
    dtype: str = "BF16"  # checkpoint dtype: F32, BF16, F16

    @property
    def interleaved(self) -> bool:
        return self.family.startswith("ernie")

    @property
    def theta(self) -> float:
        return 500000.0 if self.interleaved else 1000000.0

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def untied(self) -> bool:
        return self.family in ("qwen2", "qwen3_moe", "llama")

    def inv_freq(self) -> np.ndarray:
        """float64 inverse frequencies: theta^(-2i/D), for Llama scaled as Llama 3.1's paper and code describe
        (wavelength 2 pi / f: beyond original / low_freq_factor f / factor, below original / high_freq_factor
        f, between a linear blend of the two in original / wavelength)."""
        inv = self.theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if self.family != "llama":
            return inv
        r = LLAMA_ROPE_SCALING
        original, factor, low, high = (r["original_max_position_embeddings"], r["factor"], r["low_freq_factor"],
                                       r["high_freq_factor"])
        wavelen = 2 * np.pi / inv
        smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
        return (1 - smooth) * inv / factor + smooth * inv

    def is_moe(self, layer: int) -> bool:
        if self.family == "qwen3_moe":
            return layer not in self.mlp_only and (layer + 1) % self.sparse_step == 0
        return self.family == "ernie45_moe" and layer >= self.moe_start


class _Draw(Weights):
    """make_tiny_models' tensor layout; float32-exact values for an F32 checkpoint (bf16-exact otherwise)."""

    def __init__(self, rng: np.random.Generator, proj_std: float, exact: bool) -> None:
        super().__init__(rng, proj_std)
        self.exact = exact

    def normal(self, name: str, shape: tuple[int, ...], std: float | None = None, mean: float = 0.0,
               exact: bool = False) -> None:
        super().normal(name, shape, std, mean, exact or self.exact)


def _stored(x: np.ndarray, kind: str) -> np.ndarray:
    """The value a tensor written as `kind` holds (bf16 values are drawn exact; fp16 may round them)."""
    return x.astype(np.float16).astype(np.float32) if kind == "F16" else x


def _config(s: SweepShape) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": [ARCH[s.family]], "hidden_act": "silu", "hidden_size": s.hidden,
        "intermediate_size": s.ffn, "max_position_embeddings": 4096, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "num_hidden_layers": s.layers,
        "rms_norm_eps": EPS, "vocab_size": s.vocab, "torch_dtype": TORCH_DTYPE[s.dtype]}
    if s.interleaved:
        config.update(model_type="ernie4_5_moe" if s.experts else "ernie4_5", bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, use_bias=False, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": s.theta})
    elif s.family == "llama":
        config.update(model_type="llama", bos_token_id=1019, eos_token_id=1021, rope_theta=s.theta,
                      rope_scaling=LLAMA_ROPE_SCALING, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    else:  # Qwen: untied LM head for Qwen2 (as Qwen2.5-7B) and Qwen3-MoE, tied for Qwen3 (as the small ones)
        config.update(model_type=s.family, bos_token_id=1019, eos_token_id=1021, rope_theta=s.theta,
                      tie_word_embeddings=not s.untied, use_sliding_window=False, sliding_window=None)
    if s.family == "qwen3_moe":
        config.update(num_experts=s.experts, num_experts_per_tok=s.top_k, moe_intermediate_size=s.expert_ffn,
                      decoder_sparse_step=s.sparse_step, mlp_only_layers=list(s.mlp_only), norm_topk_prob=s.norm_topk)
    elif s.experts:
        config.update(moe_num_experts=s.experts, moe_k=s.top_k, moe_intermediate_size=s.expert_ffn,
                      moe_num_shared_experts=s.shared, moe_layer_start_index=s.moe_start, moe_layer_end_index=-1,
                      moe_layer_interval=1, moe_norm_min=NORM_MIN, moe_gate="topk", moe_use_aux_free=True)
    return config


def write_model(out: Path, s: SweepShape, seed: int) -> dict[str, np.ndarray]:
    """Writes config.json, model.safetensors and the fixture tokenizer into `out`; returns the tensors as
    stored (HF names, float32)."""
    rng = np.random.default_rng(seed)
    # Projections ~ 1.5 / sqrt(fan-in of the hidden side), so activations, attention scores and router logits
    # stay O(1) at every width (an O(10) score would make attention one-hot and hide its arithmetic).
    w = _Draw(rng, 1.5 / np.sqrt(s.hidden), exact=s.dtype == "F32")

    def mlp(p: str, layer: int) -> None:
        if not s.is_moe(layer):
            w.mlp(p, s.hidden, s.ffn)
            return
        w.normal(p + "gate.weight", (s.experts, s.hidden), 1.5 / np.sqrt(s.hidden), exact=True)
        if s.family == "ernie45_moe":
            w.normal(p + "moe_statics.e_score_correction_bias", (1, s.experts), 0.05, exact=True)
        for e in range(s.experts):
            w.mlp(p + f"experts.{e}.", s.hidden, s.expert_ffn)
        if s.shared:
            w.mlp(p + "shared_experts.", s.hidden, s.expert_ffn * s.shared)

    shape = Shape(s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.ffn)
    tensors = w.decoder(shape, mlp, qkv_bias=s.family in ("qwen2", "llama"), qk_norm=s.qk_norm,
                        embed_std=3.0 / np.sqrt(s.hidden))
    if s.family == "llama":  # attention_bias and mlp_bias: o_proj and gate / up / down biases too
        for i in range(s.layers):
            p = f"model.layers.{i}."
            w.normal(p + "self_attn.o_proj.bias", (s.hidden,), 0.3)
            for name, size in (("gate", s.ffn), ("up", s.ffn), ("down", s.hidden)):
                w.normal(p + f"mlp.{name}_proj.bias", (size,), 0.3)
    if s.untied:
        w.normal("lm_head.weight", (s.vocab, s.hidden), 3.0 / np.sqrt(s.hidden))

    def kind(name: str) -> str:  # the router and its bias stay float32, as transformers keeps them
        return "F32" if ".mlp.gate." in name or "moe_statics" in name else s.dtype

    tensors = {name: _stored(x, kind(name)) for name, x in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(s), indent=2))
    write_safetensors(out / "model.safetensors", tensors, kind)
    copy_tokenizer(out, "ernie_sp" if s.interleaved else "bpe_json")
    return tensors


# ---------------------------------------------------------------------------------- numpy reference


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (nearest even), as float64."""
    return bf16_bits_to_f32(to_bf16_bits(x.astype(np.float32))).astype(np.float64)


def e4m3(y: np.ndarray) -> np.ndarray:
    """y (|y| <= 448) rounded to float8 e4m3fn, nearest even: 3 mantissa bits, subnormals below 2^-6."""
    exponent = np.maximum(np.floor(np.log2(np.maximum(np.abs(y), 2.0 ** -9))), -6)
    step = 2.0 ** (exponent - 3)
    return np.clip(np.round(y / step) * step, -448, 448)


def kv_rounded(x: np.ndarray, kv_cache: str) -> np.ndarray:
    """Keys or values [T, kv heads, D] as a cache of `kv_cache` holds them (the format as ops/kv_cache.py
    documents it: bf16 rows, or e4m3fn codes of each row scaled to a largest |value| of 448)."""
    if kv_cache == "bfloat16":
        return bf16(x)
    if kv_cache == "block_wise_fp8":
        amax = np.abs(x).max(axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / 448.0, 1.0)
        return e4m3(x / scale) * scale
    return x


def q8(x: np.ndarray) -> np.ndarray:
    """x [..., K] as the int8 kernels see it: per row, per 32 inputs, rounded to multiples of max|x| / 127
    (llama.cpp's Q8_0, nearest even)."""
    k = x.shape[-1]
    blocks = np.concatenate([x, np.zeros((*x.shape[:-1], -k % 32))], axis=-1).reshape(*x.shape[:-1], -1, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return (np.round(blocks / safe) * scale).reshape(*x.shape[:-1], -1)[..., :k]


@dataclass(frozen=True)
class Numerics:
    """What the reference rounds as the model's formats do (docs/architecture.md, Weights): the inputs of the
    linears ("fp32"; "bf16": bf16 weights multiply bf16-rounded activations; "q8": int8/int4 weights multiply
    Q8_0 activations), and the KV cache's rows."""
    inputs: str = "fp32"
    kv_cache: str = "float32"

    def linear(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:  # weight [out, in], HF's layout
        x = bf16(x) if self.inputs == "bf16" else q8(x) if self.inputs == "q8" else x
        return x @ weight.T


def _rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def _silu_mlp(x: np.ndarray, w: dict[str, np.ndarray], p: str, num: Numerics) -> np.ndarray:
    gate, up = (num.linear(x, w[p + f"{n}_proj.weight"]) + w.get(p + f"{n}_proj.bias", 0.0) for n in ("gate", "up"))
    return num.linear(gate / (1.0 + np.exp(-gate)) * up, w[p + "down_proj.weight"]) + w.get(p + "down_proj.bias", 0.0)


def _rotate(x: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [T, heads, D] at positions 0..T-1; pair i turns by position * inv_freq[i]."""
    t, _, d = x.shape
    angle = np.arange(t, dtype=np.float64)[:, None] * inv_freq
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2:])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if not interleaved:
        return np.concatenate([ra, rb], axis=-1)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def _attention(x: np.ndarray, w: dict[str, np.ndarray], p: str, s: SweepShape, num: Numerics,
               interleaved: bool) -> np.ndarray:
    t, d = len(x), s.head_dim
    q, k, v = (num.linear(x, w[p + f"{n}_proj.weight"]) + w.get(p + f"{n}_proj.bias", 0.0) for n in "qkv")
    q, k, v = q.reshape(t, s.heads, d), k.reshape(t, s.kv_heads, d), v.reshape(t, s.kv_heads, d)
    if p + "q_norm.weight" in w:
        q, k = _rms(q, w[p + "q_norm.weight"]), _rms(k, w[p + "k_norm.weight"])
    q, k = _rotate(q, s.inv_freq(), interleaved), _rotate(k, s.inv_freq(), interleaved)
    k, v = kv_rounded(k, num.kv_cache), kv_rounded(v, num.kv_cache)  # attention reads them from the cache
    q = q / np.sqrt(d)
    if num.kv_cache == "bfloat16":  # scaled queries meet bf16 keys in a bf16 dot product
        q = bf16(q)
    group = s.heads // s.kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h reads kv head h // group
    scores = np.einsum("thd,shd->hts", q, k)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = num.linear(np.einsum("hts,shd->thd", probs, v).reshape(t, s.heads * d), w[p + "o_proj.weight"])
    return out + w.get(p + "o_proj.bias", 0.0)


def _moe(x: np.ndarray, w: dict[str, np.ndarray], p: str, s: SweepShape,
         num: Numerics) -> tuple[np.ndarray, np.ndarray]:
    """The MoE block's output, and per token the gap between the k-th and (k+1)-th choice score (how close
    the routing was to choosing otherwise; inf when every expert is chosen)."""
    logits = x @ w[p + "gate.weight"].T  # the router is float32 in every format
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    bias = w.get(p + "moe_statics.e_score_correction_bias")  # ERNIE's steers the choice only; Qwen3-MoE has none
    choice = probs if bias is None else probs + bias.reshape(-1)
    order = np.argsort(-choice, axis=-1, kind="stable")
    ranked = np.take_along_axis(choice, order, axis=-1)
    gap = ranked[:, s.top_k - 1] - ranked[:, s.top_k] if s.top_k < s.experts else np.full(len(x), np.inf)
    chosen = np.zeros_like(probs, dtype=bool)
    np.put_along_axis(chosen, order[:, :s.top_k], True, axis=-1)
    weights = np.where(chosen, probs, 0.0)
    if s.family == "ernie45_moe" or s.norm_topk:  # renormalised over the chosen k (ERNIE: with a floor)
        weights /= np.maximum(weights.sum(-1, keepdims=True), NORM_MIN if s.family == "ernie45_moe" else 0.0)
    out = _silu_mlp(x, w, p + "shared_experts.", num) if s.shared else np.zeros_like(x)
    for e in np.flatnonzero(chosen.any(axis=0)):  # each row is computed alone: batching an expert's tokens is exact
        rows = chosen[:, e]
        out[rows] += weights[rows, e:e + 1] * _silu_mlp(x[rows], w, p + f"experts.{e}.", num)
    return out, gap


def reference_logits(w: dict[str, np.ndarray], s: SweepShape, tokens: list[int], num: Numerics = Numerics(),
                     interleaved: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 logits [T, vocab] of one sequence from position 0, and per position the smallest routing gap
    of its MoE layers (inf for a dense model). `interleaved` overrides the family's rotary pairing."""
    w = {name: x.astype(np.float64) for name, x in w.items()}
    pairs = s.interleaved if interleaved is None else interleaved
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    gaps = np.full(len(tokens), np.inf)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        x = x + _attention(_rms(x, w[p + "input_layernorm.weight"]), w, p + "self_attn.", s, num, pairs)
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        if s.is_moe(i):
            out, gap = _moe(h, w, p + "mlp.", s, num)
            gaps = np.minimum(gaps, gap)
        else:
            out = _silu_mlp(h, w, p + "mlp.", num)
        x = x + out
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return num.linear(_rms(x, w["model.norm.weight"]), head), gaps


def unpacked_weights(model_weights: dict[str, np.ndarray], s: SweepShape) -> dict[str, np.ndarray]:
    """A loaded model's weights as our packing holds them (named_weights: fused q/k/v and gate/up, [in, out]),
    back in the checkpoint's names and layout: for quantized models, the dequantized values."""
    out: dict[str, np.ndarray] = {}
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for name, x in model_weights.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            kind = name.rsplit(".", 1)[1]
            parts = np.split(x, [q, q + kv], axis=-1)
            for n, part in zip("qkv", parts):
                out[name.replace("qkv_proj." + kind, f"{n}_proj.{kind}")] = part.T if kind == "weight" else part
        elif name.endswith("up_gate_proj.weight") or name.endswith("up_gate_proj.bias"):
            gate, up = np.split(x, 2, axis=-1)  # [gate | up] on the output axis
            gate, up = (gate.T, up.T) if x.ndim == 2 else (gate, up)
            out[name.replace("up_gate_proj", "gate_proj")], out[name.replace("up_gate_proj", "up_proj")] = gate, up
        elif x.ndim == 2 and "embed_tokens" not in name and "moe_statics" not in name:
            out[name] = x.T
        else:
            out[name] = x
    return out
