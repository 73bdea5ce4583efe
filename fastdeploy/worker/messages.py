"""The messages between rank 0 and its tensor-parallel workers: pickled over the step channel to the workers it
started on this host; Step, MtpStep, Stop and Noop also broadcast, in step_codec.py's binary form, to ranks on
other hosts."""
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
class MtpLayerStep:
    """One run of the MTP layer, as every tensor-parallel rank runs it: its rows' tokens, positions, lengths and
    context ends, the block table, where its input hidden states are (`from_main`: rows of the main model's hidden
    states of the step, else rows of the previous run's outputs), and the rows whose outputs and logits it keeps."""

    ids: list[int]
    positions: list[int]
    lens: list[int]
    ends: list[int]
    table: np.ndarray
    from_main: bool
    sources: list[int]
    out_rows: list[int]


@dataclass(slots=True)
class MtpStep:
    """Run the MTP layer so (no reply, as Step)."""

    step: MtpLayerStep


@dataclass(slots=True)
class GetParameters:
    pass


@dataclass(slots=True)
class Stop:
    pass


@dataclass(slots=True)
class Noop:
    """Nothing to do: rank 0 is idle (ranks on other hosts must hear from it within the ring's timeout)."""


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
