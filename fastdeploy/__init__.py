"""Offline LLM inference on PaddlePaddle with FastDeploy's API."""
import logging
import warnings

with warnings.catch_warnings():  # paddle warns about ccache on import, which concerns only op builds
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle  # noqa: F401

from fastdeploy.fatal_signals import restore_default_fatal_signals

restore_default_fatal_signals()  # Paddle's import installed crash handlers that can hang the process

from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.entrypoints.llm import LLM
from fastdeploy.model_executor.models.registry import ModelRegistry
from fastdeploy.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from fastdeploy.utils import current_package_version, version

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "ModelRegistry",
           "version"]
__version__ = current_package_version()
