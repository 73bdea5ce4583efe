"""EngineArgs: the LLM(...) parameters as a dataclass, as FastDeploy users import it.

Its fields are generated from EngineConfig's (fastdeploy/config.py, the one declaration with each
parameter's default, help and validation), so the two cannot drift; the server's flags come from them too."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from fastdeploy.config import EngineConfig

ENGINE_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.init]


def _create_engine_config(self: Any) -> EngineConfig:
    """The validated EngineConfig of these arguments (the errors LLM(...) would raise)."""
    return EngineConfig(**{f.name: getattr(self, f.name) for f in ENGINE_FIELDS})


def _from_cli_args(cls: type, args: argparse.Namespace) -> Any:
    """The EngineArgs of parsed server flags (see fastdeploy/entrypoints/openai/cli_args.py)."""
    return cls(**{f.name: getattr(args, f.name) for f in ENGINE_FIELDS})


def _field_spec(f: dataclasses.Field) -> tuple[str, Any, dataclasses.Field]:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        copy = dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    elif f.default is dataclasses.MISSING:
        copy = dataclasses.field(metadata=f.metadata)
    else:
        copy = dataclasses.field(default=f.default, metadata=f.metadata)
    return f.name, f.type, copy


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [_field_spec(f) for f in ENGINE_FIELDS],
    namespace={"create_engine_config": _create_engine_config, "from_cli_args": classmethod(_from_cli_args),
               "__doc__": "The LLM(...) parameters (see docs/offline_inference.md); "
                          "EngineArgs(model=...).create_engine_config() validates them."})
EngineArgs.__module__ = __name__  # make_dataclass takes `module=` only from Python 3.12
