"""GPU end to end (skipped without CUDA): speculative decoding with the lighter cache is lossless.

Tiny Qwen3-Next (GDN) with an MTP layer (and the tiny NemotronH, Mamba2, with one), eager unless
the case says graphs, float32 states, greedy, one request at a time
(a spec-decode row makes vLLM run other decodes of its batch through the prefill kernel, which
changes their rounding), vLLM's defaults otherwise. Drafts come from

- the oracle drafter (``oracle_proposer.py``): the continuation of a run without drafting, with
  the drafts from a length-dependent cut on replaced, so steps accept 0 to all of them;
- the model's MTP layer (``mtp``, i.e. ``qwen3_next_mtp``; random weights accept few drafts),
  also for the tiny NemotronH (Mamba2, vLLM's ``nemotron_h_mtp``);
- ngram (model-free; random weights rarely repeat, so it drafts little), judged against caching
  off with vLLM #39273's stale state fixed (ngram skips steps; see test_cpu_speculative);
- the oracle that drafts nothing on about one step in three (``oracle_skip``): ngram's pattern,
  a plain decode after a step that accepted drafts, with many drafts accepted; judged like ngram
  (an expected failure for now: see ``ORACLE_SKIP_FAILED``).

The judge is caching off with the same drafting. Measured on the H200 (2026-12-02): with
drafting every mode's greedy outputs part from a run without drafting within 4-28 tokens, at
times not at a near tie, because a drafting step computes the same tokens in another order in
bf16 and this random model's logits are flat; caching off, align and lighter with the same
drafting part from each other only at near ties, the picked tokens' log-probabilities up to
0.093 apart until then. So the lighter cache's outputs may part from caching off's only where
caching off's pick was a near tie, within :data:`DRIFT` until then; with the settle removed
(the state after the last accepted token left where the kernel wrote it) all 7 requests
parted at tokens 4-6, none at a near tie. The next turn is judged against caching off with
drafting on the same prompt (the lighter cache's first turn may part from caching off's at a
near tie, and the next turn's prompt with it). It must also serve the second wave from the
cache, (oracle) accept drafts, and serve the first request's next turn from the deepest
boundary it crossed while decoding with drafts. Every run's agreement with the run without
drafting is recorded.

On the device: ``python -m pytest tests/e2e/test_gpu_speculative.py`` (``scripts/device_speculative.sh``);
``LIGHTER_MAMBA_GPU_E2E_JSON=PATH`` also writes every run's outputs and agreements there;
``LIGHTER_MAMBA_GPU_SPEC_FLOAT32=1`` runs the model in float32 with Triton attention, which
takes bf16's reordering out of the comparison with the run without drafting.
``LIGHTER_MAMBA_GPU_KV_BYTES=N`` gives every engine a pool of N bytes instead of profiling, so
that cases can run side by side on one GPU (``scripts/device_speculative.sh`` with ``PARALLEL``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from .helpers import (
    OFF_STATE_FIX,
    agreement,
    flat_requests,
    run_mode,
    shared_text,
    spec_site_env,
)
from .oracle_proposer import ORACLE_FILE
from .test_gpu_models import engine_args, record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PREFIX = shared_text(5, 1500)
WAVES = [
    [PREFIX + " first?"],
    [PREFIX + " second?", PREFIX + " third, longer?", shared_text(6, 600) + " b"],
    [shared_text(6, 600) + " b", shared_text(7, 900) + " z"],
    # The first request's next turn: its hit is a boundary crossed while decoding with drafts.
    [{"follow": 0, "text": " and then?"}],
]
NUM_SPEC = 3
METHODS = {
    "oracle": {"method": "custom_class", "model": "tests.e2e.oracle_proposer.OracleProposer"},
    "oracle_skip": {"method": "custom_class", "model": "tests.e2e.oracle_proposer.SkippingOracleProposer"},
    "mtp": {"method": "mtp"},
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}
# Methods that draft nothing on some steps: vLLM 0.26's caching off then reads a stale state
# after a step that accepted drafts (vLLM #39273), so their control has that fixed
# (tests/e2e/cpu_spec_site).
SKIPS_STEPS = ("ngram", "oracle_skip")
MAX_TOKENS = 96
# The largest difference of a picked token's log-probability allowed while two runs with the
# same drafting agree. Caching off, align and lighter with oracle or ngram drafts: up to 0.093
# apart (H200). A state two tokens short of its boundary moved it by 0.40 on the CPU
# (test_cpu_speculative).
DRIFT = 0.15
FLOAT32 = os.environ.get("LIGHTER_MAMBA_GPU_SPEC_FLOAT32") == "1"


# The tiny models with an MTP layer: (engine_args' arch, vLLM's architecture).
MODELS = {"qwen3_next_mtp": ("qwen3_next", "Qwen3NextForCausalLM"),
          "nemotron_h_mtp": ("nemotron_h", "NemotronHForCausalLM")}


def model_args(model: str, eager: bool) -> dict:
    """The engine without drafting: one request at a time; float32 weights on request."""
    args = {**engine_args(MODELS[model][0], eager=eager), "max_num_seqs": 1}
    args.setdefault("additional_config", {})
    if FLOAT32:
        args.update(dtype="float32", attention_backend="TRITON_ATTN")
    return args


# Failed once on the H200 (2026-12-02): one request of seven parted from the fixed caching off
# at a token where caching off's pick led by 1.25 nats, no mechanism found (docs/design.md,
# "fourth run"); the float32 variant would tell a wrong state from bf16 noise. Not strict: a
# pass is reported (XPASS), not hidden.
ORACLE_SKIP_FAILED = pytest.mark.xfail(
    reason="H200 2026-12-02: 1 of 7 requests parted from caching off beyond a near tie, unexplained",
    strict=False,
)


def cases() -> list:
    eager = [("qwen3_next_mtp", method, True) for method in METHODS]
    return [
        pytest.param(*case, marks=ORACLE_SKIP_FAILED) if case[1] == "oracle_skip" else case
        for case in eager + [("qwen3_next_mtp", "mtp", False), ("nemotron_h_mtp", "mtp", True)]
    ]


@pytest.mark.parametrize(
    ("model_name", "method", "eager"),
    cases(),
    ids=lambda value: value if isinstance(value, str) else ("eager" if value else "graphs"),
)
def test_lighter_drafting_agrees_with_caching_off(model_name, method, eager, tmp_path):
    from tests.conftest import tiny_model
    from vllm_lighter_mamba.config import SPECULATIVE_SHOWN

    model = tiny_model(model_name)
    base = model_args(model_name, eager)
    reference = flat_requests(run_mode("none", model, WAVES, base, max_tokens=MAX_TOKENS, top2=True))
    oracle = tmp_path / "references.json"
    oracle.write_text(json.dumps([[r["prompt_token_ids"], r["token_ids"]] for r in reference]))
    engine = {
        **base,
        "disable_log_stats": False,
        "speculative_config": {**METHODS[method], "num_speculative_tokens": NUM_SPEC},
    }
    # A method not shown lossless for Qwen3-Next runs only when asked for.
    if MODELS[model_name][1] not in SPECULATIVE_SHOWN.get(METHODS[method]["method"], ()):
        opt_in = {"lighter_mamba_speculative": "experimental"}
        engine["additional_config"] = {**engine["additional_config"], **opt_in}
    env = {ORACLE_FILE: str(oracle)}
    control_env = spec_site_env({**env, **OFF_STATE_FIX}) if method in SKIPS_STEPS else env
    modes = ("none", "align", "lighter")
    envs = {"none": control_env, "align": env, "lighter": env}
    results = {
        mode: run_mode(mode, model, WAVES, engine, max_tokens=MAX_TOKENS, metrics=True, env=e, top2=True)
        for mode, e in envs.items()
    }
    # Caching off with the same drafting on the lighter cache's next-turn prompt.
    next_turn = flat_requests(results["lighter"])[-1]["prompt_token_ids"]
    results["none_next_turn"] = run_mode(
        "none", model, [[{"prompt_token_ids": next_turn}]], engine, max_tokens=MAX_TOKENS, env=control_env,
        top2=True,
    )
    control = flat_requests(results["none"])[:-1] + flat_requests(results["none_next_turn"])
    agreements = {
        **{f"{m}~reference": agreement(flat_requests(results[m]), reference) for m in modes},
        # (align's next turn has align's own prompt: first turns only)
        "align~none": agreement(flat_requests(results["align"])[:-1], control[:-1]),
        "lighter~none": agreement(flat_requests(results["lighter"]), control),
    }
    name = f"{model_name}-{method}{'-float32' if FLOAT32 else ''}"
    record(name, eager, {"reference": reference, **results, "agreement": agreements})
    lighter = flat_requests(results["lighter"])
    assert all(a["near_tie"] for a in agreements["lighter~none"]), agreements["lighter~none"]
    assert max(a["drift"] for a in agreements["lighter~none"]) < DRIFT, agreements["lighter~none"]
    assert lighter[1]["cached_tokens"] > 0 and lighter[4]["cached_tokens"] > 0
    if method.startswith("oracle"):
        assert results["lighter"]["spec_decode"]["accepted"] > 0
    # The next turn resumes from the deepest boundary the first request computed while
    # decoding with drafts (a block less with MTP: vLLM drops an EAGLE-style drafter's last
    # matched block).
    block = results["lighter"]["block_size"]
    deepest = (lighter[0]["prompt_tokens"] + MAX_TOKENS - 1) // block * block
    assert lighter[-1]["cached_tokens"] >= deepest - (block if method == "mtp" else 0)
