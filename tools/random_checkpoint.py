"""Random checkpoints of real model shapes, streamed to disk shard by shard (never held in memory).
Used by benchmarks/large_models.py, and by tests with small shapes.

Five shapes, HF (-PT) layout, bf16 (ERNIE's MoE router and its correction bias in float32, as transformers
keeps them):
  ernie-4.5-21b-a3b  vocab 103424, hidden 2560, 28 layers (layer 0 dense FFN 12288, then MoE: 64
                     experts, top-6, expert FFN 1536, 2 shared experts), 20 q / 4 kv heads x 128,
                     tied embeddings; 21.8 B parameters
  qwen2-7b           vocab 152064, hidden 3584, 28 layers, 28 q / 4 kv heads x 128, FFN 18944, q/k/v
                     biases, untied LM head; 7.6 B parameters
  qwen3-30b-a3b      vocab 151936, hidden 2048, 48 layers all MoE (128 experts, top-8, expert FFN 768,
                     norm_topk_prob, no shared experts; router [128, 2048] bf16 as the hub stores it), 32 q /
                     4 kv heads x 128 with q/k norms, untied LM head; 30.5 B parameters (3.3 B active)
  llama-3.1-8b       vocab 128256, hidden 4096, 32 layers, 32 q / 8 kv heads x 128, FFN 14336, llama3 rope
                     scaling (factor 8, low 1, high 4, original 8192, theta 500000), untied LM head; 8.0 B
                     parameters
  ernie-4.5-vl-28b-a3b  the 21B-A3B text shape with a second (vision) expert set per MoE layer (64 experts,
                     FFN 512, its own router and correction-bias row), 3-D rotary (t/h/w = 20/22/22 of
                     64 frequencies), and the vision side: a 32-block ViT (width 1280, 16 heads, FFN
                     5120, 14-pixel patches) and the resampler (2x2 spatial then 2-frame temporal merge
                     to the text width); tokenizer and processor configs of the tiny VL test fixture
`layers` cuts the depth (the first layers, so a cut ERNIE MoE model keeps its dense layer 0). Values come
from a pool of normal samples (std 0.02) read at rotating offsets: writing is bounded by the disk.
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_models import BASE_CONFIG, copy_tokenizer, to_bf16_bits  # noqa: E402

VL_FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models" / "ernie45_vl_tiny_hf"
SHARD_BYTES = 4 << 30
STD = 0.02


@dataclass(frozen=True)
class VisionShape:
    depth: int = 32
    width: int = 1280
    heads: int = 16
    ffn: int = 5120
    patch: int = 14
    merge: int = 2


@dataclass(frozen=True)
class ModelShape:
    family: str  # "ernie_moe", "ernie_vl", "qwen2", "qwen3_moe" or "llama"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    vision_expert_ffn: int = 0  # ernie_vl: the vision expert set's FFN
    vision: VisionShape | None = None


SHAPES = {
    "ernie-4.5-21b-a3b": ModelShape("ernie_moe", vocab=103424, hidden=2560, layers=28, heads=20, kv_heads=4,
                                    head_dim=128, ffn=12288, experts=64, top_k=6, expert_ffn=1536, shared_experts=2),
    "ernie-4.5-vl-28b-a3b": ModelShape("ernie_vl", vocab=103424, hidden=2560, layers=28, heads=20, kv_heads=4,
                                       head_dim=128, ffn=12288, experts=64, top_k=6, expert_ffn=1536,
                                       shared_experts=2, vision_expert_ffn=512, vision=VisionShape()),
    "qwen2-7b": ModelShape("qwen2", vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
                           ffn=18944),
    # Qwen/Qwen3-30B-A3B's config.json: intermediate_size 6144 is only for dense layers, which it has none of.
    "qwen3-30b-a3b": ModelShape("qwen3_moe", vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                                ffn=6144, experts=128, top_k=8, expert_ffn=768),
    "llama-3.1-8b": ModelShape("llama", vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                               ffn=14336),
}

# (name, safetensors dtype, shape, fill) with fill "normal", "ones" or "small" (router bias)
Spec = tuple[str, str, tuple[int, ...], str]


def tensor_specs(s: ModelShape, layers: int, mtp: bool = False) -> list[Spec]:
    """The checkpoint's tensors; `mtp` adds ERNIE-4.5's multi-token-prediction layer as the -PT repos store it (a
    decoder layer shaped as the model's last, `model.mtp_block.0.`, and its norms and projection)."""
    h = s.hidden
    specs: list[Spec] = [("model.embed_tokens.weight", "BF16", (s.vocab, h), "normal")]
    for i in range(layers):
        specs += _layer_specs(s, f"model.layers.{i}.", moe=i > 0 or s.family == "qwen3_moe")
    specs.append(("model.norm.weight", "BF16", (h,), "ones"))
    if s.family in ("qwen2", "qwen3_moe", "llama"):  # untied LM heads
        specs.append(("lm_head.weight", "BF16", (s.vocab, h), "normal"))
    if s.vision is not None:
        specs += _vision_specs(s.vision, h)
    if mtp:
        specs += [("model.mtp_emb_norm.0.weight", "BF16", (h,), "ones"),
                  ("model.mtp_hidden_norm.0.weight", "BF16", (h,), "ones"),
                  ("model.mtp_linear_proj.0.weight", "BF16", (h, 2 * h), "normal")]
        specs += _layer_specs(s, "model.mtp_block.0.", moe=layers > 1)
    return specs


def _layer_specs(s: ModelShape, p: str, moe: bool) -> list[Spec]:
    """One decoder layer's tensors under prefix `p` (MoE families: `moe` says whether its MLP has experts)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    specs = [(p + "input_layernorm.weight", "BF16", (h,), "ones"),
             (p + "post_attention_layernorm.weight", "BF16", (h,), "ones"),
             (p + "self_attn.q_proj.weight", "BF16", (q, h), "normal"),
             (p + "self_attn.k_proj.weight", "BF16", (kv, h), "normal"),
             (p + "self_attn.v_proj.weight", "BF16", (kv, h), "normal"),
             (p + "self_attn.o_proj.weight", "BF16", (h, q), "normal")]
    if s.family == "qwen2":
        specs += [(p + f"self_attn.{n}_proj.bias", "BF16", (size,), "normal") for n, size in
                  (("q", q), ("k", kv), ("v", kv))]
    if s.family == "qwen3_moe":
        specs += [(p + f"self_attn.{n}_norm.weight", "BF16", (s.head_dim,), "ones") for n in "qk"]
        specs.append((p + "mlp.gate.weight", "BF16", (s.experts, h), "normal"))
        for e in range(s.experts):
            specs += _mlp(f"{p}mlp.experts.{e}.", h, s.expert_ffn)
    elif s.family == "ernie_moe" and moe:
        specs += [(p + "mlp.gate.weight", "F32", (s.experts, h), "normal"),
                  (p + "mlp.moe_statics.e_score_correction_bias", "F32", (1, s.experts), "small")]
        for e in range(s.experts):
            specs += _mlp(f"{p}mlp.experts.{e}.", h, s.expert_ffn)
        specs += _mlp(p + "mlp.shared_experts.", h, s.expert_ffn * s.shared_experts)
    elif s.family == "ernie_vl" and moe:  # routers stored [hidden, experts]; experts: text, then vision
        specs += [(p + "mlp.gate.weight", "F32", (h, s.experts), "normal"),
                  (p + "mlp.gate.weight_1", "F32", (h, s.experts), "normal"),
                  (p + "mlp.moe_statics.e_score_correction_bias", "F32", (2, s.experts), "small")]
        for e in range(2 * s.experts):
            specs += _mlp(f"{p}mlp.experts.{e}.", h, s.expert_ffn if e < s.experts else s.vision_expert_ffn)
        specs += _mlp(p + "mlp.shared_experts.", h, s.expert_ffn * s.shared_experts)
    else:
        specs += _mlp(p + "mlp.", h, s.ffn)
    return specs


def _vision_specs(v: VisionShape, text_hidden: int) -> list[Spec]:
    w, merged = v.width, v.width * v.merge ** 2

    def linear(name: str, out: int, inp: int, bias: bool = True) -> list[Spec]:
        return [(name + ".weight", "BF16", (out, inp), "normal")] + ([(name + ".bias", "BF16", (out,), "normal")]
                                                                      if bias else [])

    def norm(name: str, size: int) -> list[Spec]:
        return [(name + ".weight", "BF16", (size,), "ones"), (name + ".bias", "BF16", (size,), "normal")]

    p = "model.vision_model."
    specs = linear(p + "patch_embed.proj", w, 3 * v.patch ** 2, bias=False)
    for i in range(v.depth):
        b = f"{p}blocks.{i}."
        specs += (norm(b + "norm1", w) + norm(b + "norm2", w) + linear(b + "attn.qkv", 3 * w, w)
                  + linear(b + "attn.proj", w, w) + linear(b + "mlp.fc1", v.ffn, w) + linear(b + "mlp.fc2", w, v.ffn))
    specs += norm(p + "ln", w)
    r = "model.resampler_model."
    for merge, inp in (("spatial_linear", merged), ("temporal_linear", 2 * merged)):
        specs += linear(f"{r}{merge}.0", merged, inp) + linear(f"{r}{merge}.2", merged, merged) + norm(f"{r}{merge}.3",
                                                                                                      merged)
    specs += linear(r + "mlp", text_hidden, merged)
    specs.append((r + "after_norm.weight", "BF16", (text_hidden,), "ones"))
    return specs


def _mlp(p: str, hidden: int, ffn: int) -> list[Spec]:
    return [(p + "gate_proj.weight", "BF16", (ffn, hidden), "normal"),
            (p + "up_proj.weight", "BF16", (ffn, hidden), "normal"),
            (p + "down_proj.weight", "BF16", (hidden, ffn), "normal")]


def config_for(s: ModelShape, layers: int) -> dict[str, object]:
    if s.family == "ernie_vl":
        return _vl_config(s, layers)
    common = dict(hidden_size=s.hidden, num_hidden_layers=layers, num_attention_heads=s.heads,
                  num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, intermediate_size=s.ffn,
                  torch_dtype="bfloat16", max_position_embeddings=131072)
    if s.family == "qwen2":
        return dict(BASE_CONFIG, **common, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)
    if s.family == "qwen3_moe":
        return dict(BASE_CONFIG, **common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    max_window_layers=layers, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    use_sliding_window=False, sliding_window=None, attention_bias=False, num_experts=s.experts,
                    num_experts_per_tok=s.top_k, moe_intermediate_size=s.expert_ffn, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[])
    if s.family == "llama":  # meta-llama/Llama-3.1-8B's config.json
        return dict(BASE_CONFIG, **common, architectures=["LlamaForCausalLM"], model_type="llama",
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                    mlp_bias=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192})
    return dict(BASE_CONFIG, **common, architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe",
                rope_theta=500000.0, moe_num_experts=s.experts, moe_k=s.top_k,
                moe_intermediate_size=s.expert_ffn, moe_num_shared_experts=s.shared_experts,
                moe_layer_start_index=1, moe_layer_end_index=layers - 1, moe_layer_interval=1, moe_norm_min=1e-12,
                moe_gate_act="softmax", tie_word_embeddings=True)


def _mrope_section(head_dim: int) -> list[int]:
    """[h, w, t] frequencies: the 28B model's 22/22/20 of 64, scaled to other head sizes."""
    half = head_dim // 2
    hw = (half - round(half * 20 / 64)) // 2
    return [hw, hw, half - 2 * hw]


def _vl_config(s: ModelShape, layers: int) -> dict[str, object]:
    """The tiny VL fixture's config (token ids, processor settings) with the real shape's sizes."""
    config = json.loads((VL_FIXTURE / "config.json").read_text())
    config["text_config"].update(
        hidden_size=s.hidden, num_hidden_layers=layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim, vocab_size=s.vocab, intermediate_size=s.ffn, moe_num_experts=s.experts, moe_k=s.top_k,
        moe_intermediate_size=[s.expert_ffn, s.vision_expert_ffn], moe_num_shared_experts=s.shared_experts,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        rope_parameters={"mrope_section": _mrope_section(s.head_dim), "rope_theta": 500000.0, "rope_type": "default"})
    v = s.vision
    config["vision_config"].update(depth=v.depth, hidden_size=v.width, num_heads=v.heads, intermediate_size=v.ffn,
                                   patch_size=v.patch, spatial_merge_size=v.merge)
    return config


_ITEM = {"BF16": 2, "F32": 4}


class _Pool:
    """Random bytes to write from: normal(0, STD) samples as bf16 and as float32."""

    def __init__(self, size: int = 1 << 25) -> None:
        normal = np.random.default_rng(0).standard_normal(size).astype(np.float32) * STD
        self.data = {"BF16": to_bf16_bits(normal).tobytes(), "F32": normal.tobytes()}
        self.offset = 0

    def write(self, f, dtype: str, count: int, fill: str) -> None:
        if fill == "ones":
            f.write((np.ones(count, np.float32) if dtype == "F32" else
                     to_bf16_bits(np.ones(count, np.float32))).tobytes())
            return
        if fill == "small":
            f.write((np.random.default_rng(count).standard_normal(count).astype(np.float32) * 1e-3).tobytes())
            return
        data, item = self.data[dtype], _ITEM[dtype]
        left = count * item
        while left:
            start = self.offset % len(data) // item * item
            n = min(left, len(data) - start)
            f.write(memoryview(data)[start:start + n])
            left -= n
            self.offset += n + 4099 * item  # a different phase next time


def write_checkpoint(out: Path, shape: ModelShape, layers: int, progress: bool = True, mtp: bool = False) -> None:
    """Write config, tokenizer and sharded safetensors (+ index) into `out` unless already complete."""
    done = out / "model.safetensors.index.json"
    if done.exists():
        return
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    specs = tensor_specs(shape, layers, mtp)
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[2])) * _ITEM[spec[1]]
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    total = sum(int(np.prod(s[2])) * _ITEM[s[1]] for s in specs)
    pool = _Pool()
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            header, offset = {}, 0
            for tname, dtype, tshape, _ in shard:
                nbytes = int(np.prod(tshape)) * _ITEM[dtype]
                header[tname] = {"dtype": dtype, "shape": list(tshape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                weight_map[tname] = name
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(out / name, "wb") as f:
                f.write(struct.pack("<Q", len(raw)) + raw)
                for tname, dtype, tshape, fill in shard:
                    count = int(np.prod(tshape))
                    pool.write(f, dtype, count, fill)
                    bar.update(count * _ITEM[dtype])
    (out / "config.json").write_text(json.dumps(config_for(shape, layers), indent=2))
    if shape.vision is not None:  # the fixture's tokenizer (with the image/video tokens) and processor configs
        for f in VL_FIXTURE.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                shutil.copy2(f, out / f.name)
    else:
        copy_tokenizer(out)  # token ids beyond its vocabulary are never decoded: detokenize=False
    done.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
