"""Building a model and filling it from a checkpoint, for both checkpoint layouts.

- HF layout (`-PT` repos): decoder tensors under `model.`, linear weights [out, in], q/k/v and
  gate/up separate.
- Paddle layout (`-Paddle` repos): decoder tensors under the model's `paddle_prefix` (`ernie.`),
  linear weights [in, out], q/k/v and gate/up fused (`qkv_proj`, `up_gate_proj`) or separate, bf16
  sometimes stored as raw U16.
The layout is read from the tensor names and shapes. No float32 model is ever built: the model's
linear weights and embedding are `PackedParameter`s with no storage until the checkpoint's dtypes
have chosen their formats and the memory plan says they fit; then each tensor goes from the
memory-mapped file straight into its packed form (only this tensor-parallel rank's slice is read),
in file order, its pages read ahead before and released after.
A model may list `ignored_checkpoint_patterns` (regexes of tensors it does not use, e.g. ERNIE's
multi-token-prediction head) and mark parameters `optional_in_checkpoint` (kept at their initial
value when the checkpoint lacks them, as transformers does). A model with a part that has its own
loader (ERNIE-4.5-VL's vision encoder) names that part's tensors with `separately_loaded(name)`; they
are left out of the plan, and `load_separately(checkpoint, precision, available_bytes)` loads them
once the rest is filled.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from paddle import nn
from tqdm import tqdm

from fastdeploy.distributed.parallel_state import SINGLE, TPGroup, building_for
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.checkpoint import (  # noqa: F401 - re-exported
    Checkpoint, LazyArray, TensorInfo, bf16_bits_to_float32, read_safetensors_header)
from fastdeploy.model_executor.layers.packed import Precision, WeightSlot, named_slots, packed_parameters
from fastdeploy.model_executor.memory_plan import check_fits
from fastdeploy.model_executor.models.ernie4_5_mtp import attach_mtp, is_mtp_tensor, mtp_layer_is_moe
from fastdeploy.model_executor.models.registry import get_model_class
from fastdeploy.model_executor.quantization import QuantConfig, parse_quantization

logger = logging.getLogger(__name__)

_PROGRESS_BYTES = 1 << 30  # show a progress bar for checkpoints larger than this


@dataclass(slots=True)
class _Target:
    checkpoint_name: str
    param_name: str
    shard: str | None  # part of a fused parameter, None for the whole parameter


def loadable(model: nn.Layer) -> dict[str, Any]:
    """Everything a checkpoint tensor can fill, by name: float32 parameters and packed weight slots."""
    out: dict[str, Any] = dict(model.named_parameters())
    out.update(named_slots(model))
    return out


def _plan(model: nn.Layer, params: dict[str, Any], names: list[str], prefix: str) -> tuple[list[_Target], list[str]]:
    """Map checkpoint tensor names onto the model's parameters; returns (targets, unexpected names)."""
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    lm_head = getattr(model, "lm_head", None)
    tied = bool(getattr(lm_head, "tied", False))
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_patterns", ())]
    # Tensor parallel: sublayers that exist only on other ranks (e.g. their experts) are not read here.
    elsewhere = tuple(f"{layer_name}.{child}." for layer_name, layer in model.named_sublayers()
                      for child in getattr(layer, "other_rank_children", ()))
    targets, unexpected, skipped = [], [], []
    num_elsewhere = 0
    for ckpt_name in names:
        name = "model." + ckpt_name[len(prefix):] if ckpt_name.startswith(prefix) else ckpt_name
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # recomputed / tied to the embedding (transformers ignores a stored copy too)
        if any(p.search(ckpt_name) for p in ignored):
            skipped.append(ckpt_name)
            continue
        parts = name.split(".")
        shard = None
        if len(parts) >= 2 and parts[-2] in packed:
            fused, shard = packed[parts[-2]]
            name = ".".join(parts[:-2] + [fused, parts[-1]])
        if name not in params:
            if elsewhere and name.startswith(elsewhere):
                num_elsewhere += 1
            else:
                unexpected.append(ckpt_name)
            continue
        targets.append(_Target(ckpt_name, name, shard))
    if skipped:
        logger.info("skipped %d checkpoint tensors the model does not use (e.g. %s)", len(skipped), skipped[0])
    if num_elsewhere:
        logger.debug("left %d checkpoint tensors to the other tensor-parallel ranks", num_elsewhere)
    return targets, unexpected


def _stored_in_out(params: dict[str, Any], checkpoint: Checkpoint, targets: list[_Target], paddle_named: bool) -> bool:
    """Whether linear weights are stored [in, out] (Paddle) rather than [out, in] (HF), from their shapes.

    Only non-square tensors tell; a checkpoint without any (or a mixed one) falls back to / is checked
    against the naming."""
    votes: dict[bool, str] = {}
    for t in targets:
        param = params[t.param_name]
        if not getattr(param, "linear_in_out", False):
            continue
        shape = checkpoint.tensors[t.checkpoint_name].shape
        expected = list(param.global_shape)  # the unsharded shape
        if t.shard is not None:
            expected[-1] = param.part_sizes[t.shard]
        if len(shape) == 2 and expected[0] != expected[1]:
            if list(shape) == expected:
                votes.setdefault(True, t.checkpoint_name)
            elif list(shape) == expected[::-1]:
                votes.setdefault(False, t.checkpoint_name)
    if len(votes) == 2:
        raise ValueError(f"checkpoint mixes weight orientations: {votes[True]} is stored [in, out] "
                         f"but {votes[False]} is stored [out, in]")
    return next(iter(votes)) if votes else paddle_named


@dataclass(slots=True)
class LoadPlan:
    targets: list[_Target]  # in file order
    params: dict[str, Any]
    layout: str  # "hf" or "paddle"
    in_out: bool  # linear weights stored [in, out]


def plan_loading(model: nn.Layer, checkpoint: Checkpoint) -> LoadPlan:
    """Match the checkpoint to the model (raising on unexpected or missing tensors) and record how the
    tensors filling each packed weight are stored, which decides its format."""
    separately = getattr(model, "separately_loaded", None)
    names = [n for n in checkpoint.tensors if separately is None or not separately(n)]
    params = loadable(model)
    paddle_prefix = getattr(model, "paddle_prefix", None)
    paddle_named = bool(paddle_prefix) and any(n.startswith(paddle_prefix) for n in names)
    targets, unexpected = _plan(model, params, names, paddle_prefix if paddle_named else "model.")
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint {checkpoint.model_dir} "
                         f"({len(unexpected)}): {', '.join(sorted(unexpected)[:20])}")
    in_out = _stored_in_out(params, checkpoint, targets, paddle_named)
    layout = "paddle" if paddle_named or in_out else "hf"

    filled: dict[str, dict[str | None, str]] = {}  # parameter -> part (None: whole) -> checkpoint tensor
    for t in targets:
        parts = filled.setdefault(t.param_name, {})
        clash = (parts.get(t.shard) or parts.get(None)) if t.shard else next(iter(parts.values()), None)
        if clash:
            raise ValueError(f"checkpoint tensors {clash} and {t.checkpoint_name} both fill {t.param_name}")
        parts[t.shard] = t.checkpoint_name
    missing = _missing(model, params, filled, layout, paddle_prefix)
    if missing:
        raise ValueError(f"checkpoint {checkpoint.model_dir} ({layout} layout) is missing tensors "
                         f"({len(missing)}): {', '.join(missing[:20])}")
    for t in targets:
        param = params[t.param_name]
        if isinstance(param, WeightSlot):
            param.target.stored_kinds.add(checkpoint.kind(t.checkpoint_name))
    where = {t.checkpoint_name: checkpoint.tensors[t.checkpoint_name] for t in targets}
    targets.sort(key=lambda t: (where[t.checkpoint_name].file, where[t.checkpoint_name].offset))
    return LoadPlan(targets, params, layout, in_out)


def fill_weights(plan: LoadPlan, checkpoint: Checkpoint, progress: bool = True) -> None:
    """Read every planned tensor into its parameter or packed weight, in file order."""
    total = sum(checkpoint.nbytes(t.checkpoint_name) for t in plan.targets)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights",
               disable=not progress or total < _PROGRESS_BYTES)
    with bar:
        for i, t in enumerate(plan.targets):
            if i + 1 < len(plan.targets):
                checkpoint.prefetch(plan.targets[i + 1].checkpoint_name)
            param = plan.params[t.param_name]
            array = checkpoint.lazy(t.checkpoint_name)  # the loader reads only the slice its rank keeps
            if getattr(param, "linear_in_out", False) and not plan.in_out:
                array = array.T  # still lazy
            try:
                param.weight_loader(param, array, t.shard)
            except ValueError as e:
                stored = list(checkpoint.tensors[t.checkpoint_name].shape)
                raise ValueError(f"tensor {t.checkpoint_name} (stored shape {stored}, {plan.layout} layout): "
                                 f"{e}") from e
            del array
            checkpoint.release(t.checkpoint_name)
            bar.update(checkpoint.nbytes(t.checkpoint_name))


def load_weights(model: nn.Layer, checkpoint: Checkpoint, precision: Precision = Precision(),
                 available_bytes: int | None = None, tp_size: int = 1, progress: bool = True) -> str:
    """Plan, check the memory, allocate the packed weights and fill them; returns the layout ("hf" or
    "paddle"). `available_bytes` (default: what the host has available) is what the weights of all
    `tp_size` ranks may take."""
    plan = plan_loading(model, checkpoint)
    weights = packed_parameters(model)
    check_fits(weights, precision, tp_size, available_bytes)
    for weight in weights:
        weight.allocate(precision.format_for(weight))
    fill_weights(plan, checkpoint, progress)
    if hasattr(model, "load_separately"):
        model.load_separately(checkpoint, precision, available_bytes)
    return plan.layout


def _missing(model: nn.Layer, params: dict[str, Any], filled: dict[str, dict[str | None, str]],
             layout: str, paddle_prefix: str | None) -> list[str]:
    """Names (as this layout would spell them) of the parameters or parts no tensor fills."""
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    by_fused: dict[str, list[tuple[str, str]]] = {}
    for module, (fused, part) in packed.items():
        by_fused.setdefault(fused, []).append((module, part))

    def spell(name: str) -> str:
        return paddle_prefix + name[len("model."):] if layout == "paddle" and name.startswith("model.") else name

    missing = []
    for name in params:
        parts_filled = filled.get(name, {})
        if None in parts_filled:
            continue
        if not parts_filled and getattr(params[name], "optional_in_checkpoint", False):
            logger.warning("checkpoint has no %s: keeping its initial value", spell(name))
            continue
        parts = name.split(".")
        module_parts = by_fused.get(parts[-2], []) if len(parts) >= 2 else []
        if not module_parts:
            missing.append(spell(name))
            continue
        absent = [(m, p) for m, p in module_parts if p not in parts_filled]
        if len(absent) == len(module_parts) and layout == "paddle":
            missing.append(spell(name))  # Paddle checkpoints usually store the fused tensor
        else:
            missing.extend(spell(".".join(parts[:-2] + [m, parts[-1]])) for m, _ in absent)
    return missing


def load_model(config: ModelConfig, tp: TPGroup = SINGLE, quantization: QuantConfig | str | None = None,
               available_bytes: int | None = None, dtype: str = "auto", lm_head_fp32: bool = False,
               mtp_weights: str | None = None) -> nn.Layer:
    """Build the model for `config.architectures` (this rank's shard of it when `tp` has several
    ranks) with its weights packed as `quantization` (None, "wint8", "wint4" or a QuantConfig's weight
    formats), `dtype` and `lm_head_fp32` say (layers/packed.py's Precision; validated by EngineConfig), with
    ERNIE-4.5's MTP layer, from the MTP tensors of directory `mtp_weights`, when given (models/ernie4_5_mtp.py),
    fill it from the checkpoint, and put it in eval mode. Raises ValueError before anything large is
    allocated when the weights would not fit in `available_bytes` (default: the host's available memory)."""
    model_class = get_model_class(config.architectures)
    start = time.perf_counter()
    with building_for(tp):
        model = model_class(config)  # small float32 parameters only; packed weights come later
    # U16 holds raw 16-bit floats: which kind is only written in the config.
    u16 = "float16" if config.dtype == "float16" else "bfloat16"
    with Checkpoint(config.model_path, u16_dtype=u16) as checkpoint:
        if mtp_weights is not None:
            if os.path.realpath(mtp_weights) != os.path.realpath(config.model_path):
                checkpoint.overlay(mtp_weights, is_mtp_tensor)
            with building_for(tp):
                attach_mtp(model, mtp_layer_is_moe(list(checkpoint.tensors)))
        quant = quantization if isinstance(quantization, QuantConfig) else parse_quantization(quantization)
        precision = Precision(quant.dense, dtype, lm_head_fp32, quant.moe)
        layout = load_weights(model, checkpoint, precision, available_bytes, tp.size, progress=tp.rank == 0)
    model.eval()
    logger.info("loaded %s (%s layout, %d tensors) from %s in %.2f s", model_class.__name__, layout,
                len(checkpoint.tensors), config.model_path, time.perf_counter() - start)
    return model
