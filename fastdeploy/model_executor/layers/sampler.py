"""The sampler layer: one token per row of a step's logits (vLLM V1 / FastDeploy order: bans,
penalties, greedy argmax or temperature / top-k / top-p / min-p and a draw at each row's uniform).

The compiled op runs the whole batch (fastdeploy.ops.sampling.sample_batch); the numpy sampler
beside it (fastdeploy.ops.sampling_reference) is its reference and the fallback. Both give the same
tokens except where a float rounding difference decides a cut or a draw (tests/test_sampling_op.py).
"""
from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.ops.logits_filters import Scratch
from fastdeploy.ops.sampling import sample_batch
from fastdeploy.ops.sampling_reference import SamplingBatch, sample_numpy


def _as_array(logits: paddle.Tensor | np.ndarray) -> np.ndarray:
    """A float32 [B, V] array over the logits, zero-copy where possible. Never written to: the
    caller's logits stay as they were (the runner may still want their raw values)."""
    if isinstance(logits, np.ndarray):
        x = np.asarray(logits, dtype=np.float32)
    elif isinstance(logits, paddle.Tensor):
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        try:
            x = np.from_dlpack(logits)  # shares the tensor's CPU memory
        except (BufferError, RuntimeError, TypeError, ValueError):
            x = logits.numpy()  # e.g. a GPU tensor: copy to host
    else:
        raise TypeError(f"logits must be a paddle.Tensor or numpy array, got {type(logits).__name__}")
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must have shape [batch, vocab], got {list(x.shape)}")
    return x


class Sampler:
    """Samples a SamplingBatch (values trusted: validated when the requests were made) from logits."""

    def __init__(self, use_compiled: bool = True) -> None:
        self.use_compiled = use_compiled
        self._scratch = Scratch()

    def __call__(self, logits: paddle.Tensor | np.ndarray, batch: SamplingBatch) -> np.ndarray:
        view = _as_array(logits)
        if len(batch) != view.shape[0]:
            raise ValueError(f"the batch has {len(batch)} rows (temperature, top_p, ...) but the logits have "
                             f"{view.shape[0]}")
        if self.use_compiled:
            # A float32 paddle tensor goes to the op as it is: wrapping the numpy view again costs time.
            as_is = isinstance(logits, paddle.Tensor) and logits.dtype == paddle.float32
            return sample_batch(logits if as_is else view, batch)
        return sample_numpy(view, batch, batch.greedy_mask(), batch.uniforms, self._scratch)
