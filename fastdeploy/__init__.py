"""Offline LLM inference on PaddlePaddle with FastDeploy's API."""
import logging
import warnings

with warnings.catch_warnings():  # paddle warns about ccache on import, which concerns only op builds
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle  # noqa: F401

from fastdeploy.engine.request import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.entrypoints.llm import LLM

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob"]
__version__ = "0.1.0"
