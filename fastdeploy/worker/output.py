"""FastDeploy's import path of the per-token log-probability records (they live in fastdeploy/outputs.py)."""
from fastdeploy.outputs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
