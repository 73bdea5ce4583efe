"""ERNIE-4.5-VL's config.json: the text fields ModelConfig reads, and the multimodal settings
(`Ernie45VLConfig`) the model and the input side share.

Two spellings of one model:
- transformers (save_pretrained, the tiny fixture): text fields nested in `text_config`, the vision tower
  in `vision_config`, the special token ids at the top; `moe_num_experts` one int for both expert sets,
  `moe_intermediate_size` [text, vision], `mlp_layer_types` ("dense" / "sparse" per layer) and
  `text_config.rope_parameters.mrope_section` [h, w, t] (frequencies per axis).
- Baidu (-Paddle, and the remote-code -PT): flat. `moe_num_experts` [text, vision] (or one int),
  `moe_intermediate_size` [text, vision], `moe_layer_start_index` / `moe_layer_end_index` an int or
  [text, vision] and `moe_layer_interval`; `rope_3d: true` with `freq_allocation` (frequencies for t; h and
  w share the rest); `im_patch_id` (the image placeholder); `spatial_conv_size` / `temporal_conv_size`.
  The start/end and video placeholder ids are not written there: transformers' defaults (Baidu's
  vocabulary) are used unless the config names them, and a missing video placeholder means videos use
  the image placeholder (then the enclosing start token tells the modality).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("Ernie4_5_VLMoeForConditionalGeneration",  # transformers, Baidu's -PT and -Paddle, FastDeploy
                 "Ernie4_5_VL_MoeForConditionalGeneration")  # transformers' deprecated alias
# transformers' Ernie4_5_VLMoeConfig defaults: the ids of Baidu's vocabulary.
_DEFAULT_TOKENS = {"image_token_id": 100295, "image_start_token_id": 101304, "image_end_token_id": 101305,
                   "video_start_token_id": 101306, "video_end_token_id": 101307, "video_token_id": 103367}


def is_ernie_vl(architectures: list[str]) -> bool:
    return any(a in ARCHITECTURES for a in architectures)


def text_view(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields as one flat dict: a nested `text_config` overrides the top level."""
    if not isinstance(raw.get("text_config"), dict):
        return raw
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    return {**top, **raw["text_config"]}


@dataclass(frozen=True, slots=True)
class VLTokenIds:
    image: int  # one per merged image token
    image_start: int
    image_end: int
    video: int  # may equal `image` (Baidu's processor)
    video_start: int
    video_end: int


@dataclass(frozen=True, slots=True)
class Ernie45VLConfig:
    tokens: VLTokenIds
    num_experts: tuple[int, int]  # (text, vision)
    moe_intermediate_size: tuple[int, int]  # (text, vision); shared experts: text width x num_shared_experts
    top_k: int
    num_shared_experts: int
    norm_min: float
    moe_layers: tuple[int, ...]  # layers whose MLP is the dual-expert MoE (the others are dense)
    mrope_section: tuple[int, int, int]  # frequencies for h and w (interleaved, first) and t (last)
    spatial_merge_size: int
    temporal_merge_size: int

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], file: str, num_layers: int, head_dim: int) -> Ernie45VLConfig:
        text = text_view(raw)
        nested = text is not raw
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"{file}: an ERNIE-4.5-VL config needs a 'vision_config' object")
        experts = _pair(text, "moe_num_experts", file)
        widths = _pair(text, "moe_intermediate_size", file)
        top_k = _int(text, "moe_k", file)
        if top_k > min(experts):
            raise ValueError(f"{file}: field 'moe_k' ({top_k}) must not exceed 'moe_num_experts' ({list(experts)})")
        if text.get("moe_gate_act", "softmax") != "softmax":
            raise ValueError(f"{file}: field 'moe_gate_act' must be 'softmax', got {text['moe_gate_act']!r}")
        layers = _nested_moe_layers(text, file, num_layers) if nested else _flat_moe_layers(text, file, num_layers)
        norm_min = text.get("moe_norm_min", 1e-12)
        if isinstance(norm_min, bool) or not isinstance(norm_min, (int, float)) or norm_min < 0:
            raise ValueError(f"{file}: field 'moe_norm_min' must be a number >= 0, got {norm_min!r}")
        spatial = vision.get("spatial_merge_size", raw.get("spatial_conv_size", 2))
        temporal = vision.get("temporal_merge_size", vision.get("temporal_conv_size", raw.get("temporal_conv_size", 2)))
        return cls(tokens=_tokens(raw, nested, file), num_experts=experts, moe_intermediate_size=widths,
                   top_k=top_k, num_shared_experts=_int(text, "moe_num_shared_experts", file, default=2, minimum=0),
                   norm_min=float(norm_min), moe_layers=layers, mrope_section=_mrope(text, nested, file, head_dim),
                   spatial_merge_size=_int({"spatial_merge_size": spatial}, "spatial_merge_size", file),
                   temporal_merge_size=_int({"temporal_merge_size": temporal}, "temporal_merge_size", file))


def _int(fields: dict[str, Any], name: str, file: str, default: Any = None, minimum: int = 1) -> int:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{file}: field '{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def _pair(fields: dict[str, Any], name: str, file: str) -> tuple[int, int]:
    """An int (both sets) or [text, vision]."""
    value = fields.get(name)
    values = value if isinstance(value, list) else [value, value]
    if len(values) != 2:
        raise ValueError(f"{file}: field '{name}' must be an integer or [text, vision], got {value!r}")
    return _int({name: values[0]}, name, file), _int({name: values[1]}, name, file)


def _nested_moe_layers(text: dict[str, Any], file: str, num_layers: int) -> tuple[int, ...]:
    kinds = text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)  # transformers' default
    if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ValueError(f"{file}: field 'mlp_layer_types' must give 'dense' or 'sparse' for each of the "
                         f"{num_layers} layers, got {kinds!r}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "sparse")


def _flat_moe_layers(text: dict[str, Any], file: str, num_layers: int) -> tuple[int, ...]:
    """Layer i has experts of a modality when start <= i <= end (-1: the last layer) and
    (i + 1) % moe_layer_interval == 0; both modalities must agree (FastDeploy builds the layer when
    min(start) <= i <= max(end), so the sets are the same in Baidu's checkpoints)."""
    interval = _int(text, "moe_layer_interval", file, default=1)
    sets = []
    for modality in range(2):
        bounds = []
        for name, default in (("moe_layer_start_index", 1), ("moe_layer_end_index", -1)):
            value = text.get(name, default)
            value = value[modality] if isinstance(value, list) and len(value) == 2 else value
            bounds.append(_int({name: value}, name, file, minimum=-1))
        start, end = bounds[0], num_layers - 1 if bounds[1] == -1 else bounds[1]
        sets.append(tuple(i for i in range(num_layers) if start <= i <= end and (i + 1) % interval == 0))
    if sets[0] != sets[1]:
        raise NotImplementedError(f"{file}: text experts in layers {list(sets[0])} but vision experts in "
                                  f"{list(sets[1])}: layers with experts for one modality only are not supported")
    return sets[0]


def _mrope(text: dict[str, Any], nested: bool, file: str, head_dim: int) -> tuple[int, int, int]:
    if nested:
        params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        section = params.get("mrope_section", [22, 22, 20])  # transformers' default
    else:
        if text.get("rope_3d", True) is not True:
            raise ValueError(f"{file}: field 'rope_3d' must be true (1-D rotary VL models are not supported)")
        t = _int(text, "freq_allocation", file, default=20, minimum=0)
        section = [(head_dim // 2 - t) // 2, (head_dim // 2 - t) // 2, t]
    ok = (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) and s >= 0 for s in section)
          and section[0] == section[1] and sum(section) == head_dim // 2)
    if not ok:
        raise ValueError(f"{file}: the 3-D rotary split [h, w, t] must have h == w and h + w + t = head_dim / 2 "
                         f"= {head_dim // 2} frequencies, got {section!r}")
    return tuple(section)


def _tokens(raw: dict[str, Any], nested: bool, file: str) -> VLTokenIds:
    ids = dict(_DEFAULT_TOKENS)
    if not nested:
        ids["image_token_id"] = raw.get("im_patch_id", ids["image_token_id"])
        ids["video_token_id"] = raw.get("video_token_id", ids["image_token_id"])
    ids.update({k: raw[k] for k in _DEFAULT_TOKENS if raw.get(k) is not None})
    values = [_int(ids, k, file, minimum=0) for k in _DEFAULT_TOKENS]
    image, image_start, image_end, video_start, video_end, video = values
    if len({image, image_start, image_end, video_start, video_end}) != 5 or video in (image_start, image_end,
                                                                                       video_start, video_end):
        raise ValueError(f"{file}: the image/video placeholder, start and end token ids must differ, got {ids}")
    return VLTokenIds(image, image_start, image_end, video, video_start, video_end)
