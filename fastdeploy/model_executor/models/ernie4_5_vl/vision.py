"""ERNIE-4.5-VL's vision side: the DFN-RoPE ViT (`vision_model`) and the variable-resolution resampler
(`resampler_model`) that turns its patch features into text-width tokens.

Input: `pixel_values` [N, in_channels * patch_size**2] float32 as `image_processor.py`
makes them (each frame's patches in merge-block order: every 2x2 block of patches is 4 consecutive rows)
and `grid_thw`, one (t, h, w) per image or video in patches, N = sum of t*h*w.
- Tower: patch embedding (linear, no bias), `depth` pre-LayerNorm blocks (eps 1e-6) of attention with 2-D
  rotary q/k (angles [h f, w f] repeated twice, rotating dim i with i + head_dim/2, f = theta^(-2j/(hd/2))),
  non-causal within each frame, and a quick-GELU MLP; then LayerNorm `ln`. Output [N, width].
- Resampler: each 2x2 block's 4 rows -> one [4C] row -> spatial MLP (fc, erf GELU, fc, LayerNorm); video
  frame 2i's rows beside frame 2i+1's (an image beside itself) -> temporal MLP (8C in) -> `mlp` to the text
  width -> RMSNorm (text eps). Output: one row per merged token, h*w/4 per image and t*h*w/8 per video,
  items in the order given.
Weights: linear layers are packed (bf16 as stored, or `quantization`) and multiplied by
`ops.weight_only_linear`; norms and biases are small float32 parameters. Checkpoint names: the tower under
`model.vision_model.` (transformers' save_pretrained) or `vision_model.` (Baidu's -PT and -Paddle repos), the
resampler under `model.resampler_model.` (both -PT spellings), `resampler_model.` or `ernie.resampler_model.`
(-Paddle); linear weights [out, in] (-PT) or [in, out] (-Paddle), told apart by the non-square ones' shapes.
The tower is replicated on every tensor-parallel rank.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.model_executor.checkpoint import Checkpoint
from fastdeploy.model_executor.layers.linear import Linear, default_weight_loader
from fastdeploy.model_executor.layers.norm import RMSNorm
from fastdeploy.model_executor.layers.packed import Precision, WeightSlot, packed_parameters
from fastdeploy.model_executor.load import loadable
from fastdeploy.model_executor.memory_plan import check_fits
from fastdeploy.model_executor.model_config import CONFIG_FILE, FieldReader

logger = logging.getLogger(__name__)

Grid = Sequence[Sequence[int]]  # (t, h, w) per item
# checkpoint prefix -> this module's prefix, the first match wins
_PREFIXES = (("model.vision_model.", "vision_model."), ("vision_model.", "vision_model."),
             ("model.resampler_model.", "resampler_model."), ("ernie.resampler_model.", "resampler_model."),
             ("resampler_model.", "resampler_model."))
_IGNORED_SUFFIXES = ("rotary_pos_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    width: int  # embed_dim
    num_heads: int
    intermediate_size: int
    text_hidden_size: int
    text_rms_norm_eps: float
    patch_size: int = 14
    in_channels: int = 3
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size ** 2

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], file: str = CONFIG_FILE) -> VisionConfig:
        """From a config.json: transformers' nested one (`vision_config` + `text_config`) or Baidu's flat
        one (text fields and `spatial_conv_size` / `temporal_conv_size` at the top, `vision_config` with
        `embed_dim` and `mlp_ratio`)."""
        if not isinstance(raw.get("vision_config"), dict):
            raise ValueError(f"{file}: an ERNIE-4.5-VL config needs a 'vision_config' object")
        vision = FieldReader(raw["vision_config"], f"{file} (vision_config)")
        nested = isinstance(raw.get("text_config"), dict)
        text = FieldReader(raw["text_config"] if nested else raw, f"{file} (text_config)" if nested else file)
        top = FieldReader(raw, file)
        width = vision.get_int("embed_dim" if "embed_dim" in vision.raw else "hidden_size")
        if "intermediate_size" in vision.raw:
            intermediate = vision.get_int("intermediate_size")
        else:
            intermediate = int(width * vision.get_float("mlp_ratio", default=4))
        rope = vision.raw.get("rope_parameters")
        rope_reader = FieldReader(rope, f"{file} (vision_config.rope_parameters)") if isinstance(rope, dict) else vision
        act = vision.get_str("hidden_act", default="quick_gelu")
        config = cls(
            depth=vision.get_int("depth"), width=width, num_heads=vision.get_int("num_heads"),
            intermediate_size=intermediate,
            text_hidden_size=vision.get_int("text_hidden_size") if "text_hidden_size" in vision.raw
            else text.get_int("hidden_size"),
            text_rms_norm_eps=text.get_float("rms_norm_eps", default=1e-5),
            patch_size=vision.get_int("patch_size", default=14), in_channels=vision.get_int("in_channels", default=3),
            spatial_merge_size=vision.get_int("spatial_merge_size", default=top.raw.get("spatial_conv_size", 2)),
            temporal_merge_size=vision.get_int("temporal_merge_size", default=vision.raw.get(
                "temporal_conv_size", top.raw.get("temporal_conv_size", 2))),
            # transformers 5 keeps the LayerNorm eps in vision_config.rms_norm_eps; Baidu's configs fix 1e-6
            layer_norm_eps=vision.get_float("vision_rms_norm_eps", default=vision.raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_reader.get_float("rope_theta", default=10000.0))
        if act != "quick_gelu":
            raise ValueError(f"{file}: vision hidden_act {act!r} is not supported (only 'quick_gelu')")
        if width % (config.num_heads * 4):
            raise ValueError(f"{file}: vision width {width} is not a multiple of 4 x num_heads ({config.num_heads}), "
                             f"as the 2-D rotary embedding needs")
        if config.temporal_merge_size != 2:
            raise ValueError(f"{file}: temporal merge size {config.temporal_merge_size} is not supported (only 2)")
        if raw.get("pixel_hidden_size", width) != width:
            raise ValueError(f"{file}: pixel_hidden_size {raw['pixel_hidden_size']} differs from the vision "
                             f"width {width}")
        return config


def _norm_param(layer: nn.Layer, size: int, value: float) -> paddle.Tensor:
    param = layer.create_parameter([size], dtype="float32", default_initializer=nn.initializer.Constant(value))
    param.stop_gradient = True
    param.weight_loader = default_weight_loader
    return param


class LayerNorm(nn.Layer):
    """LayerNorm with weight and bias, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _norm_param(self, size, 1.0)
        self.bias = _norm_param(self, size, 0.0)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def _merge_block_positions(grid: Grid, merge: int) -> np.ndarray:
    """[N, 2] (h, w) patch coordinates of every row, in the processor's merge-block order, frames repeated."""
    rows = []
    for t, h, w in grid:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = [a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1) for a in (hh, ww)]
        rows.append(np.tile(np.stack(blocks, axis=-1), (t, 1)))
    return np.concatenate(rows)


def frame_starts(grid: Grid) -> np.ndarray:
    """[frames + 1] row offsets of every frame of every item: attention stays within a frame."""
    sizes = [h * w for t, h, w in grid for _ in range(t)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


class VisionAttention(nn.Layer):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = Linear(config.width, 3 * config.width, bias=True)  # [q | k | v], heads inside each
        self.proj = Linear(config.width, config.width, bias=True)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, frames: np.ndarray) -> paddle.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).reshape([n, 3, self.num_heads, self.head_dim]).transpose([1, 0, 2, 3])
        q, k, v = qkv[0].contiguous(), qkv[1].contiguous(), qkv[2].contiguous()
        ops.apply_rotary_(q, k, cos, sin, interleaved=False)  # half-split pairs (i, i + head_dim / 2)
        return self.proj(ops.bidirectional_attention(q, k, v, frames, self.head_dim ** -0.5))


class VisionBlock(nn.Layer):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = LayerNorm(config.width, config.layer_norm_eps)
        self.norm2 = LayerNorm(config.width, config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = nn.Layer()
        self.mlp.fc1 = Linear(config.width, config.intermediate_size, bias=True)
        self.mlp.fc2 = Linear(config.intermediate_size, config.width, bias=True)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, frames: np.ndarray) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        hidden = self.mlp.fc1(self.norm2(x))
        return x + self.mlp.fc2(ops.quick_gelu(hidden))


class DFNRopeVisionTransformer(nn.Layer):
    """The ViT: pixel_values [N, patch_dim] -> patch features [N, width]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Layer()
        self.patch_embed.proj = Linear(config.patch_dim, config.width)
        self.blocks = nn.LayerList([VisionBlock(config) for _ in range(config.depth)])
        self.ln = LayerNorm(config.width, config.layer_norm_eps)
        quarter = config.head_dim // 2
        exponent = np.arange(0, quarter, 2, dtype=np.float32) / np.float32(quarter)
        self.inv_freq = paddle.to_tensor((np.float32(1) / np.power(np.float32(config.rope_theta), exponent)))

    def rotary(self, grid: Grid) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos, sin [N, head_dim / 2] of the angles [h f, w f] of every row."""
        positions = paddle.to_tensor(_merge_block_positions(grid, self.config.spatial_merge_size).astype(np.float32))
        angles = (positions.unsqueeze(-1) * self.inv_freq).reshape([positions.shape[0], -1])  # [h f | w f]
        return paddle.cos(angles), paddle.sin(angles)

    def forward(self, pixel_values: paddle.Tensor, grid_thw: Grid) -> paddle.Tensor:
        grid = check_grid(pixel_values, grid_thw, self.config)
        cos, sin = self.rotary(grid)
        frames = frame_starts(grid)
        x = self.patch_embed.proj(pixel_values)
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.ln(x)


def _merge_mlp(config: VisionConfig, in_features: int) -> nn.Sequential:
    """fc, erf GELU, fc, LayerNorm (checkpoint names .0, .2, .3)."""
    width = config.width * config.spatial_merge_size ** 2
    return nn.Sequential(Linear(in_features, width, bias=True), nn.GELU(), Linear(width, width, bias=True),
                         LayerNorm(width, config.layer_norm_eps))


class VariableResolutionResampler(nn.Layer):
    """Patch features [N, width] -> tokens [sum of t*h*w/4 over images, /8 over videos, text_hidden_size]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        spatial = config.width * config.spatial_merge_size ** 2
        self.spatial_linear = _merge_mlp(config, spatial)
        self.temporal_linear = _merge_mlp(config, spatial * config.temporal_merge_size)
        self.mlp = Linear(spatial, config.text_hidden_size, bias=True)
        self.after_norm = RMSNorm(config.text_hidden_size, config.text_rms_norm_eps)

    def forward(self, features: paddle.Tensor, grid_thw: Grid) -> paddle.Tensor:
        merge = self.config.spatial_merge_size ** 2
        x = self.spatial_linear(features.reshape([-1, features.shape[-1] * merge]))
        first, second, start = [], [], 0
        for t, h, w in grid_thw:  # rows of frames 2i and 2i+1 side by side; an image beside itself
            per_frame = h * w // merge
            frames = np.arange(start, start + t * per_frame).reshape(t, per_frame)
            first.append(frames[0::2].reshape(-1))
            second.append(frames[1::2].reshape(-1) if t > 1 else frames[0])
            start += t * per_frame
        pairs = [paddle.to_tensor(np.concatenate(a)) for a in (first, second)]
        x = paddle.concat([paddle.gather(x, pairs[0]), paddle.gather(x, pairs[1])], axis=-1)
        return self.after_norm(self.mlp(self.temporal_linear(x)))


def check_grid(pixel_values: paddle.Tensor, grid_thw: Grid, config: VisionConfig) -> list[tuple[int, int, int]]:
    """grid_thw as int triples, checked against pixel_values and the merge sizes."""
    grid = [tuple(int(v) for v in item) for item in grid_thw]
    merge = config.spatial_merge_size
    bad = [g for g in grid if len(g) != 3 or min(g) < 1 or g[1] % merge or g[2] % merge or (g[0] > 1 and g[0] % 2)]
    if not grid or bad:
        raise ValueError(f"grid_thw must list (t, h, w) per item with h, w multiples of {merge} and t 1 (image) "
                         f"or even (video), got {grid_thw!r}")
    rows = sum(t * h * w for t, h, w in grid)
    if pixel_values.dtype != paddle.float32 or list(pixel_values.shape) != [rows, config.patch_dim]:
        raise ValueError(f"pixel_values must be float32 [{rows}, {config.patch_dim}] for grid_thw {grid}, "
                         f"got {pixel_values.dtype} {list(pixel_values.shape)}")
    return grid


class Ernie4_5_VLVisionEncoder(nn.Layer):
    """vision_model + resampler_model. `forward(pixel_values, grid_thw)` gives the tokens that replace
    the items' placeholders, in order; `vision_model(...)` alone gives the patch features."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = DFNRopeVisionTransformer(config)
        self.resampler_model = VariableResolutionResampler(config)

    def forward(self, pixel_values: paddle.Tensor, grid_thw: Grid) -> paddle.Tensor:
        return self.resampler_model(self.vision_model(pixel_values, grid_thw), grid_thw)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], quantization: str | None = None,
                        available_bytes: int | None = None, dtype: str = "auto") -> Ernie4_5_VLVisionEncoder:
        """Build from the checkpoint's config.json and load its vision and resampler tensors."""
        start = time.perf_counter()
        file = os.path.join(model_dir, CONFIG_FILE)
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
        encoder = cls(VisionConfig.from_hf_config(raw, file))
        stored = str(raw.get("dtype") or raw.get("torch_dtype") or "").removeprefix("torch.")
        u16 = "float16" if stored in ("float16", "fp16", "half") else "bfloat16"  # what raw U16 tensors hold
        with Checkpoint(str(model_dir), u16_dtype=u16) as checkpoint:
            layout = encoder.load_weights(checkpoint, Precision(quantization, dtype), available_bytes)
        encoder.eval()
        logger.info("loaded the ERNIE-4.5-VL vision encoder (%s layout) from %s in %.2f s", layout, model_dir,
                    time.perf_counter() - start)
        return encoder

    def load_weights(self, checkpoint: Checkpoint, precision: Precision = Precision(),
                     available_bytes: int | None = None) -> str:
        """Fill every weight from `checkpoint` (its other tensors are not read); returns the layout of the
        linear weights, "hf" ([out, in]) or "paddle" ([in, out])."""
        names = vision_tensor_names(checkpoint.tensors)
        params = loadable(self)
        missing = sorted(set(params) - set(names))
        if missing:
            raise ValueError(f"checkpoint {checkpoint.model_dir} is missing vision tensors ({len(missing)}): "
                             f"{', '.join(_spell(m, names) for m in missing[:20])}")
        unexpected = sorted(names[n] for n in set(names) - set(params))
        if unexpected:
            raise ValueError(f"unexpected vision tensors in checkpoint {checkpoint.model_dir}: "
                             f"{', '.join(unexpected[:20])}")
        in_out = _stored_in_out(params, names, checkpoint)
        for name, param in params.items():
            if isinstance(param, WeightSlot):
                param.target.stored_kinds.add(checkpoint.kind(names[name]))
        weights = packed_parameters(self)
        check_fits(weights, precision, available_bytes=available_bytes)
        for weight in weights:
            weight.allocate(precision.format_for(weight))
        where = {name: checkpoint.tensors[names[name]] for name in params}
        order = sorted(params, key=lambda name: (where[name].file, where[name].offset))  # file order
        for i, name in enumerate(order):
            if i + 1 < len(order):
                checkpoint.prefetch(names[order[i + 1]])
            array = checkpoint.lazy(names[name])
            if isinstance(params[name], WeightSlot) and not in_out:
                array = array.T  # still lazy
            try:
                params[name].weight_loader(params[name], array, None)
            except ValueError as e:
                stored = list(checkpoint.tensors[names[name]].shape)
                raise ValueError(f"tensor {names[name]} (stored shape {stored}): {e}") from e
            del array
            checkpoint.release(names[name])
        return "paddle" if in_out else "hf"


def vision_tensor_names(checkpoint_names: Iterable[str]) -> dict[str, str]:
    """This encoder's parameter name -> checkpoint tensor name, for the vision and resampler tensors
    among `checkpoint_names` (the others are left out)."""
    out: dict[str, str] = {}
    for name in checkpoint_names:
        prefix, local = next(((p, l) for p, l in _PREFIXES if name.startswith(p)), (None, None))
        if prefix is None or name.endswith(_IGNORED_SUFFIXES):
            continue
        key = local + name[len(prefix):]
        if key in out:
            raise ValueError(f"checkpoint tensors {out[key]} and {name} are the same weight")
        out[key] = name
    return out


def _spell(param_name: str, names: dict[str, str]) -> str:
    """`param_name` with the prefix the checkpoint uses for its part (transformers' when unknown)."""
    part = param_name.split(".", 1)[0] + "."
    seen = next(((key, name) for key, name in names.items() if key.startswith(part)), None)
    return (seen[1][:len(seen[1]) - len(seen[0])] if seen else "model.") + param_name


def _stored_in_out(params: dict[str, Any], names: dict[str, str], checkpoint: Checkpoint) -> bool:
    """Whether the linear weights are stored [in, out], from the non-square ones (which must agree)."""
    votes: dict[bool, str] = {}
    for name, param in params.items():
        if not isinstance(param, WeightSlot) or param.global_shape[0] == param.global_shape[1]:
            continue
        expected = param.global_shape
        stored = list(checkpoint.tensors[names[name]].shape)
        if stored not in (expected, expected[::-1]):
            raise ValueError(f"tensor {names[name]} has shape {stored}; the model expects {expected} "
                             f"or {expected[::-1]}")
        votes.setdefault(stored == expected, names[name])
    if len(votes) == 2:
        raise ValueError(f"checkpoint mixes weight orientations: {votes[True]} is stored [in, out] "
                         f"but {votes[False]} is stored [out, in]")
    return next(iter(votes), False)
