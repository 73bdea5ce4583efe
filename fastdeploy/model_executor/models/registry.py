"""Architecture name (config.json `architectures`) -> model class, imported on first use."""
from __future__ import annotations

import importlib

# architecture -> (module under fastdeploy.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),  # HF (-PT) spelling
    "Ernie4_5_ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),  # Paddle spelling, same model
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),  # both layouts' spelling
    # ERNIE-4.5-VL: transformers', Baidu's (-PT, -Paddle) and FastDeploy's name, and transformers' old alias
    "Ernie4_5_VLMoeForConditionalGeneration": ("ernie4_5_vl.model", "Ernie4_5_VLMoeForConditionalGeneration"),
    "Ernie4_5_VL_MoeForConditionalGeneration": ("ernie4_5_vl.model", "Ernie4_5_VLMoeForConditionalGeneration"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type:
    """The class of the first architecture in the list that is supported."""
    if isinstance(architectures, str) or not isinstance(architectures, (list, tuple)):
        raise TypeError(f"architectures must be a list of names, got {architectures!r}")
    for arch in architectures:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"fastdeploy.model_executor.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(f"unsupported architecture(s) {list(architectures)}; "
                     f"supported: {', '.join(supported_architectures())}")


class ModelRegistry:
    """FastDeploy's public registry object (`fastdeploy.ModelRegistry`), over the table above. Its
    lookups mirror FastDeploy's names; registering new model classes is not offered."""

    @classmethod
    def get_supported_archs(cls) -> list[str]:
        return supported_architectures()

    @classmethod
    def get_class(cls, name: str) -> type:
        """The model class of one architecture name (ValueError when unsupported)."""
        return get_model_class([name])

    @classmethod
    def resolve_model_cls(cls, architectures: str | list[str]) -> tuple[type, str]:
        """(model class, the architecture it was found by) for the first supported name."""
        names = [architectures] if isinstance(architectures, str) else architectures
        model_cls = get_model_class(list(names))
        return model_cls, next(arch for arch in names if arch in _MODELS)

    @classmethod
    def is_multimodal_model(cls, architectures: str | list[str]) -> bool:
        names = [architectures] if isinstance(architectures, str) else list(architectures)
        return any(arch in _MODELS and _MODELS[arch][0] == "ernie4_5_vl.model" for arch in names)
