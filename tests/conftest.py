from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples every run (a failure is a finding, not a flake); explore with
# HYPOTHESIS_PROFILE=explore (random examples) or LIGHTER_MAMBA_TRACES=10000 (trace suite).
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# vLLM's CPU backend reserves most of the machine's RAM for KV cache by default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A retention bookkeeping bug fails the test that hits it (outside tests it switches the
# policy off: v1/core/retention_guard.py). The failure-injection tests turn this off.
os.environ.setdefault("LIGHTER_MAMBA_RETENTION_STRICT", "1")

MODEL_CACHE = Path(os.environ.get("LIGHTER_MAMBA_MODEL_CACHE", Path(__file__).parent.parent / ".tiny_models"))


def tiny_model(arch: str) -> str:
    """Build (once per checkout and version of the model builder) and return the path of a
    tiny random-weight model."""
    import hashlib

    from vllm_lighter_mamba.bench import tiny_models
    from vllm_lighter_mamba.bench.tiny_models import build_tiny_model

    # A changed builder (a model's shape) gets a fresh model instead of a stale cached one.
    version = hashlib.sha256(Path(tiny_models.__file__).read_bytes()).hexdigest()[:8]
    out = MODEL_CACHE / f"{arch}-{version}"

    def complete(path: Path) -> bool:
        return (path / "config.json").exists() and (path / "tokenizer.json").exists()

    if not complete(out):
        # `make test` runs two pytest workers: each builds into its own folder and renames it
        # into place, so neither reads a half-written model (the loser's copy is dropped).
        staging = out.with_name(f"{out.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_model(arch, staging, seed=0)
        try:
            os.rename(staging, out)
        except OSError:  # a folder is there: another worker's model, or a half-done old build
            if not complete(out):
                shutil.rmtree(out)
                os.rename(staging, out)
            shutil.rmtree(staging, ignore_errors=True)
    return str(out)


@pytest.fixture(scope="session")
def qwen3_next_dir() -> str:
    return tiny_model("qwen3_next")


@pytest.fixture(autouse=True)
def _no_leaked_variable():
    """Tests set the variable through helpers; none may leak it into the next test."""
    before = os.environ.get("VLLM_USE_LIGHTER_MAMBA_CACHE")
    yield
    after = os.environ.get("VLLM_USE_LIGHTER_MAMBA_CACHE")
    if after != before:
        if before is None:
            os.environ.pop("VLLM_USE_LIGHTER_MAMBA_CACHE", None)
        else:
            os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = before
        pytest.fail("test leaked VLLM_USE_LIGHTER_MAMBA_CACHE")
