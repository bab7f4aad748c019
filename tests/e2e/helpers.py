"""Run the e2e runner in a fresh process per mode (the variable must be set before vLLM
loads its plugins, and each mode needs its own engine)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_ENGINE = {
    "max_model_len": 4096,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "mamba_ssm_cache_dtype": "float32",
}


# The test site (cpu_spec_site/sitecustomize.py) and the flags that switch its parts on.
SPEC_SITE = Path(__file__).parent / "cpu_spec_site"
CPU_SPEC = {"LIGHTER_MAMBA_TEST_CPU_SPEC": "1"}  # drafting for GDN on the CPU backend
OFF_STATE_FIX = {"LIGHTER_MAMBA_TEST_OFF_STATE_FIX": "1"}  # caching off without vLLM #39273
# The per-worker record (``ranks=True``) is read with collective_rpc(function), which vLLM
# sends pickled only when allowed (test engines on this machine).
RPC_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
# Model Runner V2 on the CPU (its Triton kernels interpreted): see the site's docstring.
MODEL_RUNNER_V2 = {
    "LIGHTER_MAMBA_TEST_TRITON_CPU": "1",
    "TRITON_INTERPRET": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
}


def spec_site_env(env: dict) -> dict:
    """``env`` with the test site first on the engine's PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(SPEC_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path}


# LIGHTER_MAMBA_E2E_RUNS_DIR=DIR keeps every engine run's result there under a digest of all
# that determines it, so a test longer than one device call (the GPU graphs case: five
# compiled engines) finishes over several calls. Unset (CI): every run is fresh.
RUNS_DIR = "LIGHTER_MAMBA_E2E_RUNS_DIR"


def run_digest(spec: dict, extra_env: dict) -> str:
    """The run's spec, the variables it adds (a file they name by its content) and the code."""
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    for name, value in sorted(extra_env.items()):
        digest.update(name.encode())
        digest.update(Path(value).read_bytes() if os.path.isfile(value) else value.encode())
    root = Path(REPO_ROOT)
    for path in sorted([*root.glob("vllm_lighter_mamba/**/*.py"), *root.glob("tests/e2e/**/*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def run_in_fresh_process(module: str, mode: str, spec: dict, env: dict, out_name: str,
                         load: Callable[[str], Any]) -> Any:
    """``python -m module SPEC OUT`` in a fresh process with the mode's variable set (it must
    be set before vLLM loads its plugins); ``load(OUT)``, read before the temporary folder
    goes."""
    env = {**os.environ, **env, "VLLM_USE_LIGHTER_MAMBA_CACHE": "1" if mode == "lighter" else "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, out_name)
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.run(
            [sys.executable, "-m", module, spec_path, out_path],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            raise AssertionError(f"{mode} engine failed:\n{proc.stderr[-6000:]}")
        return load(out_path)


def fresh_process_main(run: Callable[[dict], Any], save: Callable[[Any, str], None] | None = None) -> None:
    """The ``__main__`` of a module that :func:`run_in_fresh_process` runs (``python -m module
    SPEC OUT``): ``run(spec)`` saved to OUT, as JSON unless ``save`` says otherwise."""
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        result = run(json.load(f))
    if save is not None:
        save(result, out_path)
        return
    with open(out_path, "w") as f:
        json.dump(result, f)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


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
    spec = {"mode": mode, "model": model, "engine": engine, "waves": waves, "max_tokens": max_tokens,
            **spec_extra}
    kept = None
    if os.environ.get(RUNS_DIR):
        kept = Path(os.environ[RUNS_DIR]) / f"{run_digest(spec, env or {})}.json"
        if kept.exists():
            return json.loads(kept.read_text())
    result = run_in_fresh_process("tests.e2e.runner", mode, spec, env or {}, "out.json", read_json)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(result))
    return result


def flat_requests(result: dict) -> list[dict]:
    """A run's requests in order, all waves together."""
    return [r for wave in result["waves"] for r in wave["requests"]]


def shared_text(seed: int, length: int) -> str:
    """Deterministic text; the byte-level tokenizer makes one token per character."""
    # seed * 5 is distinct modulo 26 for seeds 0..25: different seeds share no prefix.
    return "".join(chr(97 + (i * 7 + seed * 5 + (i // 5)) % 26) for i in range(length))


# Two bf16 steps of a log-probability: a greedy pick this close can flip with the rounding of a
# different (equally right) computation order. Measured: the CPU test's next turn left caching
# off at a token whose top-2 log-probabilities were equal in caching off (0.0625 apart in ours).
NEAR_TIE = 0.125


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def parts_only_at_a_near_tie(ours: dict, theirs: dict) -> bool:
    """Greedy outputs equal, or first different where ``theirs`` picked between two tokens
    at most :data:`NEAR_TIE` apart (requests run with ``top2``)."""
    first = first_difference(ours["token_ids"], theirs["token_ids"])
    if first is None:
        return True
    best, second = theirs["top2"][first]
    return best - second <= NEAR_TIE


def top1_drift(ours: dict, theirs: dict) -> float:
    """The largest difference of the best log-probability while two greedy runs agree and at
    the token where they part (requests run with ``top2``): how far apart the states behind
    them are. The parting token counts: at a true near tie both runs' best log-probabilities
    are close, while a wrong state that parts at once (a flat random model often has a near
    tie there) shows only in it."""
    first = first_difference(ours["token_ids"], theirs["token_ids"])
    compared = len(ours["token_ids"]) if first is None else first + 1
    compared = min(compared, len(ours["top2"]), len(theirs["top2"]))
    pairs = zip(ours["top2"][:compared], theirs["top2"][:compared], strict=True)
    return max((abs(a[0] - b[0]) for a, b in pairs), default=0.0)


def agreement(ours: list[dict], reference: list[dict]) -> list[dict]:
    """Per request (run with ``top2``): where it first parts from ``reference``, whether only
    at a near tie, and the drift (:func:`top1_drift`)."""
    return [
        {
            "first_difference": first_difference(o["token_ids"], r["token_ids"]),
            "near_tie": parts_only_at_a_near_tie(o, r),
            "drift": top1_drift(o, r),
        }
        for o, r in zip(ours, reference, strict=True)
    ]


def disagreements(ours: list[dict], theirs: list[dict], max_drift: float) -> list[dict]:
    """The requests whose greedy outputs part from ``theirs`` other than at a near tie, or
    whose drift (:func:`top1_drift`) is ``max_drift`` or more."""
    return [
        {"request": index, **a}
        for index, a in enumerate(agreement(ours, theirs))
        if not a["near_tie"] or a["drift"] >= max_drift
    ]


def exact_differences(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """The requests (run with ``top2``) whose greedy tokens or whose two best log-probabilities
    at any token differ from ``theirs`` at all: for runs equal by construction (one request at
    a time, the same chunk ends, float32 states)."""
    return [
        {"request": index, "first_difference": first_difference(o["token_ids"], t["token_ids"]),
         "log_prob_difference": max((abs(a - b) for x, y in zip(o["top2"], t["top2"], strict=False)
                                     for a, b in zip(x, y, strict=True)), default=0.0)}
        for index, (o, t) in enumerate(zip(ours, theirs, strict=True))
        if o["token_ids"] != t["token_ids"] or o["top2"] != t["top2"]
    ]
