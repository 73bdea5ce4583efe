"""The messages between rank 0 and its tensor-parallel workers (pickled over the step channel)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.config import EngineConfig
from fastdeploy.step_types import ForwardBatch


# Rank 0 -> worker
@dataclass(slots=True)
class Init:
    """Join the collectives and load this rank's shard."""

    config: EngineConfig


@dataclass(slots=True)
class AllocateKV:
    num_blocks: int


@dataclass(slots=True)
class Step:
    """Run this forward (no reply: the collectives inside it keep the ranks in step)."""

    batch: ForwardBatch


@dataclass(slots=True)
class GetParameters:
    pass


@dataclass(slots=True)
class Stop:
    pass


# Worker -> rank 0
@dataclass(slots=True)
class Ready:
    pass


@dataclass(slots=True)
class Parameters:
    weights: dict[str, np.ndarray]


@dataclass(slots=True)
class Failed:
    traceback: str
