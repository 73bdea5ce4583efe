"""Sampling: from a step's logits to its tokens and logprobs, and the per-row policy arrays it reads.

    policy.py     a step's SamplingBatch from plain per-request values, the op's view of it, and the one rule
                  for when the compiled forward takes the tokens itself (sample_in_forward)
    sampler.py    Sampler: the whole batch in one call of the compiled op fd_sample (numpy fallback), and
                  the runner's SamplingStage around it (masks, bias, forced tokens, logprobs)
    filters.py    penalties and top-k / top-p / min-p thresholds over numpy logits
    reference.py  the numpy sampler (the compiled op's reference and fallback)
    logprobs.py   log-softmax, top-k entries, logprobs_mode and FastDeploy's logprob transforms

A layer over ops (the compiled kernels) and fastdeploy.step_types, under the worker that calls it; it never
sees a Request, and ops never import it.
"""
