"""The runner's sampling stage for one step: from the step's logits to its ModelRunnerOutput (the grammar
masks, logit bias, the sampler, forced tokens, logprobs), and the one rule deciding when the compiled step
may take the tokens inside its forward call instead.

The runner forwards the step and calls this once: `SamplingStage.__call__` with the logits, or, when
`sample_in_forward` allowed it, `SamplingStage.sampled_in_forward` with the tokens the compiled call took.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import paddle

from fastdeploy.sampling.sampler import Sampler, param_table
from fastdeploy.ops.token_bitmask import apply_token_bitmask_
from fastdeploy.sampling.logprobs import step_logprobs
from fastdeploy.step_types import ModelRunnerOutput, SchedulerOutput


def sampler_alone(step: SchedulerOutput) -> bool:
    """Nothing but the sampler reads the step's logits: every logit row samples (no prompt-logprob rows) and
    no row has a grammar mask, a logit bias or logprobs to report. Bans and penalties are the sampling
    rows' own business (SamplingBatch.untouched_logits); engine/step_builder.py's SteadyDecode keeps a decoding step for
    reuse only when this holds too."""
    return (len(step.forward.logit_rows) == step.num_samples and not len(step.guided_rows)
            and not len(step.bias_rows) and not len(step.logprob_rows))


class InForward(NamedTuple):
    """How the compiled step takes the tokens inside its forward call: with the sampling op's float64
    parameter table `params`, or (None) a bare argmax."""

    params: np.ndarray | None


_ARGMAX = InForward(None)  # made once: the one-stream greedy decode step allocates nothing here


def sample_in_forward(step: SchedulerOutput) -> InForward | None:
    """Whether (and how) the step's tokens may be taken inside the compiled forward call, while the logits
    are in cache: every row samples from its logits with its policy alone (nothing banned or penalised) and
    nothing else needs the logits (`sampler_alone`); None otherwise. Forced tokens are put in afterwards
    either way. Whether the compiled step runs the forward at all is the runner's (CompiledDecoder.covers)."""
    sampling = step.sampling
    if not step.num_samples or not sampler_alone(step) or not sampling.untouched_logits():
        return None
    if sampling.plain_greedy():
        return _ARGMAX
    return InForward(param_table(sampling, sampling.greedy_mask()))


def with_logit_bias(logits: paddle.Tensor, step: SchedulerOutput) -> paddle.Tensor | np.ndarray:
    """The sampler's input: logits plus each row's logit_bias (before penalties, as vLLM does); the raw
    logits stay untouched for logprobs."""
    if not len(step.bias_rows):
        return logits
    biased = np.array(logits.numpy(), copy=True)
    biased[step.bias_rows, step.bias_token_ids] += step.bias_values
    return biased


def with_forced_tokens(tokens: list[int], step: SchedulerOutput) -> list[int]:
    """The sampled tokens with the forced ones put in their rows."""
    if not len(step.forced_token_ids):
        return tokens
    return [f if f >= 0 else t for f, t in zip(step.forced_token_ids.tolist(), tokens)]


class SamplingStage:
    """Turns a forwarded step into its ModelRunnerOutput. Holds the sampler (the compiled op, or the numpy
    sampler without it) and the engine's logprobs_mode."""

    def __init__(self, logprobs_mode: str) -> None:
        self.logprobs_mode = logprobs_mode
        self.sampler = Sampler()

    @staticmethod
    def sampled_in_forward(step: SchedulerOutput, tokens: list[int], how: InForward) -> ModelRunnerOutput:
        """The output of a step whose `tokens` the compiled forward call took as `how` (sample_in_forward's
        answer) said; -1 marks a sampled row without a finite largest logit."""
        if how.params is not None and -1 in tokens:
            raise ValueError(f"logits of row {tokens.index(-1)} are all -inf or hold NaN/inf")
        return ModelRunnerOutput(with_forced_tokens(tokens, step))

    def __call__(self, step: SchedulerOutput, logits: paddle.Tensor | None,
                 wait_for_masks: Callable[[], object] | None = None) -> ModelRunnerOutput:
        """Sample the step from its logits [S + P, vocab] (None: no row needs them). `wait_for_masks`: returns
        once step.token_bitmask is filled (the engine computes the grammar masks while the forward runs)."""
        num_samples = step.num_samples
        tokens: list[int] = []
        if len(step.guided_rows):
            if wait_for_masks is not None:
                wait_for_masks()
            apply_token_bitmask_(logits, step.guided_rows, step.token_bitmask)
        sampled_from, thresholds = None, None
        if num_samples:
            sampled_from = with_logit_bias(logits[:num_samples], step)
            if self.logprobs_mode.startswith("processed") and len(step.logprob_rows):
                thresholds = np.empty(num_samples, dtype=np.float32)
            tokens = with_forced_tokens(self.sampler(sampled_from, step.sampling, thresholds).tolist(), step)
        output = ModelRunnerOutput(tokens)
        if len(step.logprob_rows) or len(step.prompt_logprob_k):
            output.logprobs, output.prompt_logprobs = step_logprobs(step, logits, sampled_from, thresholds, tokens,
                                                                    self.logprobs_mode)
        return output
