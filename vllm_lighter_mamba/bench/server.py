"""Start ``vllm serve`` as an operator would (a subprocess on a local port), wait until it
is ready, and stop it cleanly: one server (:func:`serve`) or several started at once
(:func:`serve_many`). Used by the demo, the server tests, the stress test and
``benchmarks/benchmark_serving.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_command() -> list[str]:
    """The ``vllm`` command of this environment (next to this Python, else on PATH), else
    vLLM's CLI module (hosts where vLLM is importable but its scripts are not installed)."""
    local = Path(sys.executable).with_name("vllm")
    if local.exists():
        return [str(local)]
    found = shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def cpu_serve_args() -> list[str]:
    """Arguments the CPU build needs for the tiny GDN model."""
    return ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32", "--enforce-eager"]


@contextlib.contextmanager
def serve(
    model: str,
    args: list[str] = (),
    lighter: bool = True,
    env: dict | None = None,
    log_path: str | None = None,
    ready_timeout: float = 600.0,
) -> Iterator[str]:
    """Yield the base URL of a running ``vllm serve MODEL``; stop it on exit."""
    with serve_many([ServerSpec(model, list(args), lighter, env, log_path)], ready_timeout) as urls:
        yield urls[0]


@dataclass
class ServerSpec:
    """One ``vllm serve MODEL ARGS`` of :func:`serve_many`."""

    model: str
    args: list[str] = field(default_factory=list)
    lighter: bool = True
    env: dict | None = None
    log_path: str | None = None


@contextlib.contextmanager
def serve_many(specs: list[ServerSpec], ready_timeout: float = 600.0) -> Iterator[list[str]]:
    """Yield the base URLs of servers that were all started at once (their start-ups overlap:
    several servers on one GPU cost the start-up time of about one); stop them all on exit."""
    started: list[tuple[subprocess.Popen, str, object]] = []
    ports: set[int] = set()
    try:
        for spec in specs:
            port = free_port()
            while port in ports:  # a port is only reserved once its server binds it
                port = free_port()
            ports.add(port)
            started.append(_launch(spec, port))
        for (process, base_url, _), spec in zip(started, specs, strict=True):
            _wait_ready(process, base_url, ready_timeout, spec.log_path)
        yield [base_url for _, base_url, _ in started]
    finally:
        for process, _, log in started:
            _stop(process)
            if log is not subprocess.DEVNULL:
                log.close()


def _launch(spec: ServerSpec, port: int) -> tuple[subprocess.Popen, str, object]:
    """Start one server in its own process session (stopped with its children); do not wait."""
    environment = dict(os.environ)
    environment["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1" if spec.lighter else "0"
    environment.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    environment.update(spec.env or {})
    command = vllm_command() + ["serve", spec.model, "--host", "127.0.0.1", "--port", str(port), *spec.args]
    log = open(spec.log_path, "w") if spec.log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return process, f"http://127.0.0.1:{port}", log


def _wait_ready(process: subprocess.Popen, base_url: str, timeout: float, log_path: str | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = Path(log_path).read_text()[-4000:] if log_path else ""
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def metrics(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus ``/metrics`` as {name{labels}: value} (counters, gauges)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return values


def metric_total(values: dict[str, float], name: str) -> float:
    """Sum of a metric over its label sets."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def wait_for_metric(
    base_url: str,
    name: str,
    at_least: float,
    timeout_s: float,
    poke: Callable[[], object] | None = None,
) -> dict[str, float]:
    """``/metrics`` once ``name`` reached ``at_least`` (or the last read at the timeout).

    The lighter counters reach the front end with a delay (the engine core publishes them,
    the front end reads them on a step or on its periodic stats log); ``poke`` (e.g. one
    small request) runs before each read when the caller wants steps to happen meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if poke is not None:
            poke()
        values = metrics(base_url)
        if metric_total(values, name) >= at_least or time.monotonic() > deadline:
            return values
        time.sleep(1.0)
