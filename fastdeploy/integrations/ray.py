"""Data-parallel batch inference on Ray Data (the `ray` extra): independent replicas, each one `LLM`.

    import ray
    from fastdeploy.integrations.ray import LLMPredictor

    ds = ray.data.read_json("prompts.jsonl")                     # a "prompt" column: text or token ids
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs={"model": "path/to/model",
                        "sampling_params": {"temperature": 0, "max_tokens": 128}, "llm_kwargs": {"max_model_len": 4096}},
                        compute=ray.data.ActorPoolStrategy(size=4), batch_size=64, num_cpus=8)
    ds.write_json("outputs")

Ray makes the pool's actors (`concurrency=4` before Ray 2.51); each builds one `LLM` in its constructor and runs every batch it is given through
one `generate` call, so the batch's prompts share continuous batching. Each output row keeps the input row's columns
and adds `generated_text`, `generated_token_ids`, `error_code` (200 when fine) and `error_msg`; a prompt the engine
refuses (too long, say) fails its own row, not the batch. `num_cpus` reserves the actor's cores, and the replica's
compiled ops take that many threads, shared among its tensor-parallel ranks (`llm_kwargs={"tensor_parallel_size":
2}` runs two processes inside that one reservation). A replica
that dies is restarted by Ray and its batch runs again when map_batches's actor options allow it (`max_restarts=2,
max_task_retries=2`, say), so every row comes out once.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import ray

from fastdeploy import LLM, SamplingParams, ops

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "error_code", "error_msg")


class LLMPredictor:
    """A `map_batches` callable class: one replica of the model and its sampling parameters."""

    def __init__(self, model: str, sampling_params: Mapping[str, Any] | None = None,
                 llm_kwargs: Mapping[str, Any] | None = None, prompt_column: str = "prompt") -> None:
        if sampling_params is not None and not isinstance(sampling_params, Mapping):
            raise TypeError(f"sampling_params must be a dict of SamplingParams fields, got {type(sampling_params).__name__}")
        if llm_kwargs is not None and not isinstance(llm_kwargs, Mapping):
            raise TypeError(f"llm_kwargs must be a dict of LLM arguments, got {type(llm_kwargs).__name__}")
        self.params = SamplingParams(**dict(sampling_params or {}))
        if self.params.n != 1:
            raise ValueError(f"sampling_params n must be 1 (one output row per input row), got {self.params.n}")
        self.prompt_column = prompt_column
        cpus = assigned_cpus()
        ops.limit_cores(max(1, int(cpus)) if cpus else None)  # what Ray gave this actor, else the machine's
        self.llm = LLM(model=model, **dict(llm_kwargs or {}))

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self.prompt_column not in batch:
            raise ValueError(f"the batch has no {self.prompt_column!r} column (prompt_column); columns: {sorted(batch)}")
        clash = sorted(set(OUTPUT_COLUMNS) & set(batch))
        if clash:
            raise ValueError(f"the batch already has the output columns {clash}; rename them")
        prompts = [_prompt(p) for p in batch[self.prompt_column]]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        token_ids = np.empty(len(outputs), dtype=object)  # ragged: one int64 array per row
        token_ids[:] = [np.asarray(o.outputs.token_ids, np.int64) for o in outputs]
        return {**batch,
                "generated_text": np.array([o.outputs.text for o in outputs], dtype=object),
                "generated_token_ids": token_ids,
                "error_code": np.array([o.error_code for o in outputs], np.int64),
                "error_msg": np.array([o.error_msg or "" for o in outputs], dtype=object)}


def assigned_cpus() -> float | None:
    """The CPUs Ray reserved for this actor; None outside a Ray worker (a driver, or no Ray at all)."""
    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return ray.get_runtime_context().get_assigned_resources().get("CPU")


def _prompt(value: Any) -> str | dict[str, list[int]]:
    """A row's prompt: text, or token ids (a list or an integer array)."""
    if isinstance(value, str):
        return value
    ids = np.asarray(value)
    if ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
        return {"prompt_token_ids": ids.tolist()}
    raise TypeError(f"a prompt must be text or a list of token ids, got {type(value).__name__}")
