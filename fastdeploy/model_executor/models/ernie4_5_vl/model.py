"""ERNIE-4.5-VL (ERNIE-4.5-VL-28B-A3B, -424B-A47B): the ERNIE-4.5 MoE decoder with one expert set per
modality (layers/moe_multimodal.py), 3-D rotary positions, and the vision encoder (vision.py)
whose output rows replace the embeddings of the image / video placeholder tokens.

Per step the model takes the ragged batch the engine builds, plus what only multimodal requests have:
- `positions` [3, T] (t, h, w) from `positions.py` (prompt tokens: the
  prompt's columns; later tokens: index + rope_delta on every axis). A [T] tensor is a text-only batch
  (t = h = w), what the engine passes today: exact for requests without images, since their
  rope_delta is 0 and every token is text.
- `token_type_ids` [T] (0 text, 1 image, 2 video), choosing each token's expert set; generated tokens are 0.
- `vision_features` [Nv, hidden]: `encode_vision`'s rows for exactly the placeholder tokens in this step,
  in batch order (a prefill chunk that cuts an image takes the rows of its own placeholders).
3-D rotary: ERNIE's interleaved pairs (2j, 2j+1) at inv_freq[j] = theta^(-2j/D); for j < h + w (the
`mrope_section`) even j turns with the h position and odd j with w, the last t frequencies with t. With
t = h = w every angle is the 1-D one, so text reproduces ERNIE-4.5's rotary bit for bit.
Checkpoints: the decoder as ERNIE-4.5-MoE's (`model.` / `ernie.`), with `mlp.gate.weight_1` and a [2, E]
correction bias; the vision tower and resampler are loaded by the encoder's own loader (load.py asks
`separately_loaded` / `load_separately`), bf16 as stored whatever the text model's quantization.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.model_executor.checkpoint import Checkpoint
from fastdeploy.model_executor.layers.moe_multimodal import ModalitySplit, MultimodalMoE
from fastdeploy.model_executor.layers.packed import Precision
from fastdeploy.model_executor.layers.rotary import CosSin
from fastdeploy.model_executor.model_config import CONFIG_FILE, ModelConfig
from fastdeploy.model_executor.models.decoder import dense_mlp
from fastdeploy.model_executor.models.ernie4_5 import Ernie4_5ForCausalLM
from fastdeploy.model_executor.models.ernie4_5_vl.vision import Ernie4_5_VLVisionEncoder, Grid, VisionConfig

logger = logging.getLogger(__name__)

# Checkpoint prefixes of the vision tower and resampler (every spelling vision.py reads).
VISION_PREFIXES = ("model.vision_model.", "vision_model.", "model.resampler_model.", "ernie.resampler_model.",
                   "resampler_model.")


class Rotary3D:
    """cos / sin [T, D/2] of the 3-D positions, for ops.apply_rotary_ (interleaved pairs)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int]) -> None:
        # The same float32 inv_freq as the 1-D rotary (ops.rotary), so that t = h = w gives its bits.
        self.inv_freq = paddle.to_tensor(ops.default_inv_freq(head_dim, theta))
        hw = mrope_section[0] + mrope_section[1]
        # Position row (0 t, 1 h, 2 w) of each frequency: h, w alternate over the first hw, then t.
        self.axis = paddle.to_tensor(np.array([1 + j % 2 if j < hw else 0 for j in range(head_dim // 2)]))

    def cos_sin(self, positions: paddle.Tensor) -> CosSin:
        rows = paddle.gather(positions.astype("float32"), self.axis, axis=0)  # [D/2, T]
        angles = rows.transpose([1, 0]) * self.inv_freq
        return paddle.cos(angles), paddle.sin(angles)


class Ernie4_5_VLMoeForConditionalGeneration(Ernie4_5ForCausalLM):
    # Skipped checkpoint tensors: the multi-token-prediction head, as for ERNIE-4.5-MoE.
    ignored_checkpoint_patterns: tuple[str, ...] = (r"(^|\.)mtp_",)

    def __init__(self, config: ModelConfig) -> None:
        if config.multimodal is None:
            raise ValueError(f"{config.model_path}: not an ERNIE-4.5-VL config (no multimodal settings)")
        self.vl = config.multimodal
        super().__init__(config)
        self.rotary_3d = Rotary3D(config.head_dim, config.rope_theta, self.vl.mrope_section)
        vision_config = VisionConfig.from_hf_config(config.hf_config, os.path.join(config.model_path, CONFIG_FILE))
        # Kept out of the layer tree: its weights have their own loader and formats (load_separately), and
        # it is replicated on every tensor-parallel rank.
        self.__dict__["vision_encoder"] = Ernie4_5_VLVisionEncoder(vision_config)
        self._placeholders = [self.vl.tokens.image, self.vl.tokens.video]

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        if layer_idx not in self.vl.moe_layers:
            return dense_mlp(config, layer_idx)
        widths = self.vl.moe_intermediate_size
        return MultimodalMoE(config.hidden_size, widths, self.vl.num_experts, self.vl.top_k, self.vl.norm_min,
                             shared_intermediate_size=widths[0] * self.vl.num_shared_experts,
                             hidden_act=config.hidden_act, shared_bias=config.use_bias)

    # ---- loading (called by load.py) ----
    @staticmethod
    def separately_loaded(checkpoint_name: str) -> bool:
        return checkpoint_name.startswith(VISION_PREFIXES)

    def load_separately(self, checkpoint: Checkpoint, precision: Precision, available_bytes: int | None) -> None:
        """The vision encoder's tensors: as the text model's `dtype` says for an unquantized model, int8
        under wint8 and wint4 alike. The tower is compute-bound (a 448x448 image is 1024 patch rows), where
        the int8 GEMM outruns the bf16 one; int4 would be no faster there and costs accuracy for ~0.3 GB."""
        vision = Precision(None if precision.quantization is None else "wint8", precision.dtype)
        layout = self.vision_encoder.load_weights(checkpoint, vision, available_bytes)
        self.vision_encoder.eval()
        logger.info("loaded the vision encoder (%s layout, %s)", layout, vision.describe())

    # ---- forward ----
    def encode_vision(self, pixel_values: paddle.Tensor, grid_thw: Grid) -> paddle.Tensor:
        """pixel_values [N, 3 * patch**2] float32 of the items (images and videos, in prompt order) with
        grid_thw (t, h, w) each -> the rows replacing their placeholders [sum of tokens, hidden]."""
        with paddle.no_grad():
            return self.vision_encoder(pixel_values, grid_thw)

    def embed(self, input_ids: paddle.Tensor, vision_features: paddle.Tensor | None) -> paddle.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        rows = np.flatnonzero(np.isin(input_ids.numpy(), self._placeholders))
        count = 0 if vision_features is None else vision_features.shape[0]
        if count != rows.size:
            raise ValueError(f"the step has {rows.size} image/video placeholder tokens but {count} vision "
                             f"feature rows")
        if count:
            hidden = paddle.scatter(hidden, paddle.to_tensor(rows), vision_features.astype("float32"), overwrite=True)
        return hidden

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, token_type_ids: paddle.Tensor | None = None,
                vision_features: paddle.Tensor | None = None) -> paddle.Tensor:
        """input_ids [T] int64, positions [3, T] int64 (or [T]: text only), token_type_ids [T] int64 (None:
        all text), vision_features [Nv, hidden] float32 -> final hidden states [T, hidden]."""
        if positions.ndim == 1:
            cos_sin = self.model.rotary.cos_sin(positions)  # t = h = w: the 1-D angles
        elif positions.ndim == 2 and positions.shape[0] == 3:
            cos_sin = self.rotary_3d.cos_sin(positions)
        else:
            raise ValueError(f"positions must be [3, T] or [T], got shape {list(positions.shape)}")
        types = None if token_type_ids is None else token_type_ids.numpy()
        if types is not None and types.shape != tuple(input_ids.shape):
            raise ValueError(f"token_type_ids {list(types.shape)} must match input_ids {list(input_ids.shape)}")
        split = ModalitySplit.from_token_types(types)
        # The rotary applies the interleaved pairs to whichever cos / sin rows it is given.
        return self.model.decode(self.embed(input_ids, vision_features), cos_sin,
                                 lambda mlp, x: mlp(x, split) if isinstance(mlp, MultimodalMoE) else mlp(x))

