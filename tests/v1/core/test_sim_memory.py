"""The simulation charges memory as the engine does: one page per Mamba group for every
cached state, and its per-kind counts of cached pages are exact at every step."""

from __future__ import annotations

import random

from vllm.v1.core.kv_cache_utils import get_group_id

from vllm_lighter_mamba.bench.sim import SimRequest, cached_block_tracker, model_mamba_groups, replay

from .invariants import check_pool


def brute_force_cached(scheduler) -> tuple[int, int]:
    """(state pages, attention pages) that are cached and free, by looking at every block."""
    groups = scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
    mamba = {i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__.endswith("MambaSpec")}
    state = attn = 0
    for block in scheduler.kv_cache_manager.block_pool.blocks:
        if block.is_null or block.ref_cnt or block.block_hash is None:
            continue
        if get_group_id(block.block_hash) in mamba:
            state += 1
        else:
            attn += 1
    return state, attn


def trace(seed: int, n: int = 14) -> list[SimRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 300) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))]
        arrival = rng.randrange(0, 60)
        reqs.append(SimRequest(f"r{i}", prompt, max_tokens=rng.randrange(1, 40), arrival_step=arrival))
    return reqs


def test_model_config_gives_vllms_group_count(qwen3_next_dir):
    # The tiny Qwen3-Next has 3 GDN layers and 1 attention layer: vLLM makes 3 Mamba groups
    # of one layer each (as for Qwen3-Next-80B's 36 GDN and 12 attention layers).
    assert model_mamba_groups(qwen3_next_dir) == 3


def test_tracker_counts_are_exact_at_every_step_under_pressure(qwen3_next_dir):
    checked = []

    def check(scheduler, output, step):
        check_pool(scheduler)
        tracker = cached_block_tracker(scheduler)
        # After schedule() the tracker already saw every free, touch and eviction.
        assert (tracker.state_blocks, tracker.attn_blocks) == brute_force_cached(scheduler)
        checked.append(step)

    for mode in ("align", "lighter"):
        result = replay(mode, trace(1), qwen3_next_dir, check=check, block_size=16,
                        max_num_batched_tokens=64, num_blocks=60, num_mamba_groups=3)
        assert checked and result.evicted_state_blocks > 0 and result.evicted_attn_blocks > 0
        tracker = cached_block_tracker(result.scheduler)
        assert (tracker.state_blocks, tracker.attn_blocks) == brute_force_cached(result.scheduler)
        assert result.cached_state_peak > 0 and result.cached_attn_peak > 0


def test_a_cached_state_costs_one_page_per_mamba_group(qwen3_next_dir):
    """Without pressure the same states are cached whatever the group count; each costs
    as many pages as there are Mamba groups, attention KV is unchanged."""
    results = {
        groups: replay("lighter", trace(2), qwen3_next_dir, block_size=16, max_num_batched_tokens=64,
                       num_blocks=2000, num_mamba_groups=groups)
        for groups in (1, 3)
    }
    one, three = results[1], results[3]
    assert three.cached_per_request == one.cached_per_request
    state_one, attn_one = brute_force_cached(one.scheduler)
    state_three, attn_three = brute_force_cached(three.scheduler)
    assert state_one > 0 and state_three == 3 * state_one
    assert attn_three == attn_one
    assert three.cached_state_peak == 3 * one.cached_state_peak
