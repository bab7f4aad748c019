"""Run the e2e runner in a fresh process per mode (the variable must be set before vLLM
loads its plugins, and each mode needs its own engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_ENGINE = {
    "max_model_len": 4096,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "mamba_ssm_cache_dtype": "float32",
}


def run_mode(
    mode: str,
    model: str,
    waves: list[list[str]],
    engine: dict,
    max_tokens: int = 12,
    env: dict | None = None,
    **spec_extra,
) -> dict:
    """One engine in a fresh process; ``spec_extra``: ``metrics=True`` (vLLM's own metrics at
    the end), ``ranks=True`` (each worker's state-copier record)."""
    env = {**os.environ, **(env or {})}
    env["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1" if mode == "lighter" else "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        spec = {"mode": mode, "model": model, "engine": engine, "waves": waves, "max_tokens": max_tokens,
                **spec_extra}
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.runner", spec_path, out_path],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            raise AssertionError(f"{mode} engine failed:\n{proc.stderr[-6000:]}")
        with open(out_path) as f:
            return json.load(f)


def flat_requests(result: dict) -> list[dict]:
    """A run's requests in order, all waves together."""
    return [r for wave in result["waves"] for r in wave["requests"]]


def shared_text(seed: int, length: int) -> str:
    """Deterministic text; the byte-level tokenizer makes one token per character."""
    # seed * 5 is distinct modulo 26 for seeds 0..25: different seeds share no prefix.
    return "".join(chr(97 + (i * 7 + seed * 5 + (i // 5)) % 26) for i in range(length))
