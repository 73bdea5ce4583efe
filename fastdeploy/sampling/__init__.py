"""Sampling: from a step's logits to its tokens and logprobs, and the per-row policy arrays it reads.

    sampler.py    Sampler: the whole batch in one call of the compiled op fd_sample (numpy fallback)
    filters.py    penalties and top-k / top-p / min-p thresholds over numpy logits
    reference.py  the numpy sampler (the compiled op's reference and fallback)
    logprobs.py   log-softmax, top-k entries, logprobs_mode and FastDeploy's logprob transforms
    stage.py      the runner's sampling stage for a step, and when the compiled step samples inside its forward
    rows.py       a step's SamplingBatch and logprob transforms from plain per-request values

A layer over ops (the compiled kernels) and fastdeploy.step_types, under the worker that calls it; it never
sees a Request, and ops never import it.
"""
