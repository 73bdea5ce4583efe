"""Compatibility re-export: the step's boundary types live in fastdeploy/step_types.py. To be removed once
engine/ and output/ import fastdeploy.step_types (engine.py, scheduler.py, output_processor.py still import
this path)."""
from fastdeploy.step_types import (ForwardBatch, ModelRunnerOutput, SamplingBatch,  # noqa: F401
                                   SchedulerOutput, TopLogprobs, VisionSlice)
