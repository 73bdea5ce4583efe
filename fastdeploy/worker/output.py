"""Per-token log-probability records as FastDeploy's fastdeploy.worker.output names them."""
from __future__ import annotations

from typing import NamedTuple


class Logprob(NamedTuple):
    """One token's log-probability entry (a NamedTuple, as FastDeploy's: compact and immutable)."""

    logprob: float
    rank: int | None = None  # 1-based rank in the vocabulary
    decoded_token: str | None = None


# Per prompt position ({token_id: Logprob}, None for position 0), and per generated token.
PromptLogprobs = list[dict[int, Logprob] | None]
SampleLogprobs = list[dict[int, Logprob]]

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
