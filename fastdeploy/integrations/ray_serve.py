"""OpenAI-compatible server replicas on Ray Serve (the `ray` extra): R replicas of the API server on a Ray
cluster, behind Ray Serve's HTTP proxy, which sends each call to a replica with few calls in flight.

    from ray import serve
    from fastdeploy.integrations.ray_serve import build_openai_app

    serve.start(http_options={"host": "0.0.0.0", "port": 8180})
    serve.run(build_openai_app(["--model", "path/to/model", "--max-model-len", "4096"],
                               num_replicas=4, num_cpus=8), route_prefix="/")

or from a shell, `serve run fastdeploy.integrations.ray_serve:app_builder args="--model path/to/model"
num_replicas=4 num_cpus=8`. `server_args` are `fastdeploy serve`'s flags and mean what they mean there (API keys,
limits, media policy, tensor parallel inside a replica), except the ones the proxy owns (address, port), the metrics
port and --data-parallel-size (replicas are Serve's). Each replica runs one engine in its actor: built and stepped on
one thread of its own (one OpenMP team, engine_loop.py), its compiled ops taking the `num_cpus` Ray reserved for it
(tensor-parallel workers share them). Serve replaces a replica whose engine loop died (`check_health`) and drains
one it stops for up to --timeout-graceful-shutdown seconds.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ray import serve
from ray.serve import Application

from fastdeploy import ops
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.openai.api_server import Gatekeeper, ServerSettings, server_settings, serving_app
from fastdeploy.entrypoints.openai.cli_args import make_parser
from fastdeploy.entrypoints.openai.engine_loop import EngineLoop
from fastdeploy.integrations.ray import assigned_cpus

logger = logging.getLogger(__name__)

# Flags that are not a replica's to take, and what takes their place.
REFUSED_FLAGS = {
    "--host": "Ray Serve's proxy binds the address: serve.start(http_options={'host': ...})",
    "--port": "Ray Serve's proxy binds the port: serve.start(http_options={'port': ...})",
    "--metrics-port": "replicas share hosts, so none opens a port of its own; each answers /metrics on the API",
    "--data-parallel-size": "Ray Serve runs the replicas: build_openai_app(num_replicas=...)",
}
_STOP_WAIT_S = 60.0  # a stopping replica's engine thread finishes its step and closes its workers within this


def parse_server_args(server_args: Sequence[str]) -> argparse.Namespace:
    """`fastdeploy serve`'s flags for a replica (ValueError naming one it cannot take)."""
    if isinstance(server_args, str) or not all(isinstance(a, str) for a in server_args):
        raise TypeError("server_args must be a list of command-line flags, e.g. ['--model', 'path/to/model']")
    for arg in server_args:
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            raise ValueError(f"server_args: {flag} is not a replica's flag: {REFUSED_FLAGS[flag]}")
    try:
        return make_parser().parse_args(list(server_args))
    except SystemExit:  # argparse has printed what is wrong
        raise ValueError(f"server_args: not valid `fastdeploy serve` flags: {shlex.join(server_args)}") from None


@serve.deployment
@serve.ingress()
class OpenAIServer:
    """One replica: an engine stepped by a thread of its own, and the API server's app over it."""

    def __init__(self, server_args: Sequence[str]) -> None:
        args = parse_server_args(server_args)
        settings = server_settings(args)
        if settings.config.launch is not None:
            raise ValueError("a Ray Serve replica cannot join a paddle.distributed.launch group; run Ray outside it")
        cpus = assigned_cpus()
        ops.limit_cores(max(1, int(cpus)) if cpus else None)
        self._loop: EngineLoop | None = None
        self._gate: Gatekeeper | None = None
        self._error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(args, settings, built), name="fastdeploy-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if self._error is not None:
            raise self._error

    def _run(self, args: argparse.Namespace, settings: ServerSettings, built: threading.Event) -> None:
        """Build the engine and step it, on this thread only: the compiled ops' OpenMP team is this thread's."""
        try:
            engine = LLMEngine(settings.config)
            self._loop, self._gate, _ = serving_app(args, settings, engine, on_death=lambda: None)
        except BaseException as e:  # noqa: BLE001 - raised again by __init__, on the replica's own thread
            self._error = e
            return
        finally:
            built.set()
        try:
            self._loop.run()  # until __del__ closes it; if it dies, check_health reports it
        finally:
            engine.runner.close()

    def __serve_build_asgi_app__(self) -> Gatekeeper:
        return self._gate

    def check_health(self) -> None:
        """Serve's probe: raising makes it replace this replica."""
        if self._loop.failed:
            raise RuntimeError(self._loop.failed)
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop has stopped")

    def __del__(self) -> None:
        """Serve stops the replica after draining its calls: stop stepping and close the workers."""
        if self._gate is not None:
            self._gate.draining = True
            self._loop.close()
            self._thread.join(_STOP_WAIT_S)


def build_openai_app(server_args: Sequence[str], num_replicas: int = 1, num_cpus: float | None = None,
                     **deployment_options: Any) -> Application:
    """A Serve application of `num_replicas` API servers, each reserving `num_cpus` CPUs (Ray's default when None)
    and taking `fastdeploy serve`'s `server_args`; `deployment_options` go to the deployment as they are
    (`autoscaling_config`, `ray_actor_options`, ...). Calls a replica has not answered yet are capped by its
    --max-concurrency; more wait in Serve's queue."""
    args = parse_server_args(server_args)
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if num_cpus is not None and not (isinstance(num_cpus, (int, float)) and num_cpus > 0):
        raise ValueError(f"num_cpus must be a positive number of CPUs, got {num_cpus!r}")
    actor = dict(deployment_options.pop("ray_actor_options", {}))
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    options = {"num_replicas": num_replicas, "max_ongoing_requests": args.max_concurrency,
               "graceful_shutdown_timeout_s": args.timeout_graceful_shutdown, "ray_actor_options": actor,
               **deployment_options}
    if "autoscaling_config" in deployment_options:
        options.pop("num_replicas")  # Serve takes one or the other
    return OpenAIServer.options(**options).bind(list(server_args))


def app_builder(cli_args: Mapping[str, str]) -> Application:
    """For `serve run fastdeploy.integrations.ray_serve:app_builder args="--model PATH ..." num_replicas=R
    num_cpus=C`."""
    unknown = sorted(set(cli_args) - {"args", "num_replicas", "num_cpus"})
    if unknown:
        raise ValueError(f"unknown arguments {unknown}; allowed: args, num_replicas, num_cpus")
    if "args" not in cli_args:
        raise ValueError('args is required: args="--model path/to/model ..." (fastdeploy serve\'s flags)')
    try:
        replicas = int(cli_args.get("num_replicas", 1))
        cpus = float(cli_args["num_cpus"]) if "num_cpus" in cli_args else None
    except ValueError as e:
        raise ValueError(f"num_replicas must be an integer and num_cpus a number: {e}") from None
    return build_openai_app(shlex.split(cli_args["args"]), num_replicas=replicas, num_cpus=cpus)
