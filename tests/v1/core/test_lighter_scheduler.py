"""vLLM's real Scheduler + KVCacheManager over a hybrid KV-cache config, mocked model."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from vllm_lighter_mamba.bench.sim import SimRequest, replay
from vllm_lighter_mamba.v1.core.sched.policy import last_cache_position
from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import LighterMambaManager

from .invariants import check_all_returned, check_pool
from .shadow import replay_with_shadow


def aligned_chunk_checker(block_size, budget, use_eagle=False):
    def check(scheduler, output, step):
        assert output.total_num_scheduled_tokens <= budget
        for rid, n in output.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            start = request.num_computed_tokens - n
            end = start + n
            last = last_cache_position(request.num_tokens, block_size, use_eagle)
            if start < max(request.num_prompt_tokens, request.num_tokens - 1) and start < last:
                assert end % block_size == 0 or end == last, (rid, start, end, last)
                assert end <= last
        check_pool(scheduler)

    return check


def workload(seed, n=10, block_size=16, prefix_len=70, max_extra=90, spread=3):
    rng = random.Random(seed)
    prefix = [rng.randrange(900) for _ in range(prefix_len)]
    return [
        SimRequest(
            f"r{i}",
            prefix + [rng.randrange(900) for _ in range(rng.randrange(1, max_extra))],
            max_tokens=rng.randrange(1, 30),
            arrival_step=rng.randrange(0, spread * n),
        )
        for i in range(n)
    ]


def test_chunks_aligned_budget_respected_all_finish(qwen3_next_dir):
    reqs = workload(0)
    result = replay_with_shadow(
        reqs,
        qwen3_next_dir,
        check=aligned_chunk_checker(16, 64),
        block_size=16,
        max_num_batched_tokens=64,
    )
    assert all(len(result.outputs[r.request_id]) == r.max_tokens for r in reqs)
    assert result.cached_tokens > 0
    check_all_returned(result.scheduler)


def test_patches_are_inert_without_the_decision(qwen3_next_dir):
    """With the patches installed in this process, a config without the lighter-cache
    decision gets vLLM's own scheduler behaviour and manager, and the same trace twice."""
    reqs = workload(1)
    lighter = replay("lighter", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert type(lighter.scheduler.kv_cache_manager.coordinator.single_type_managers[1]) is (
        LighterMambaManager
    )
    assert lighter.scheduler.lighter_mamba_active
    align = replay("align", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    manager = align.scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert type(manager) is MambaManager
    assert not align.scheduler.lighter_mamba_active
    assert align.scheduler.lighter_counters is None
    again = replay("align", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert again.chunks == align.chunks and again.outputs == align.outputs


def test_upstream_align_split_never_runs(qwen3_next_dir, monkeypatch):
    calls = []
    upstream = Scheduler._mamba_block_aligned_split

    def spy(self, *args, **kwargs):
        calls.append(1)
        return upstream(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", spy)
    replay("lighter", workload(2), qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert calls == []
    replay("align", workload(2), qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert calls  # the spy works: align mode does call it


def test_queue_of_unaligned_requests_never_starves(qwen3_next_dir):
    # Budget just above one block: most steps cannot fit a second aligned chunk.
    reqs = [SimRequest(f"r{i}", [i] * 200 + [7] * (i + 1), max_tokens=5) for i in range(12)]
    result = replay(
        "lighter",
        reqs,
        qwen3_next_dir,
        check=aligned_chunk_checker(16, 20),
        block_size=16,
        max_num_batched_tokens=20,
        max_num_seqs=4,
        max_steps=5000,
    )
    assert all(len(result.outputs[r.request_id]) == 5 for r in reqs)
    check_all_returned(result.scheduler)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([4, 8, 16, 32]),
    budget_blocks=st.integers(1, 8),
    extra_budget=st.integers(0, 15),
    use_eagle=st.booleans(),
    num_blocks=st.sampled_from([40, 80, 400]),
    async_scheduling=st.booleans(),
)
def test_property_random_traces(
    qwen3_next_dir, seed, block_size, budget_blocks, extra_budget, use_eagle, num_blocks, async_scheduling
):
    budget = block_size * budget_blocks + extra_budget
    reqs = workload(seed, n=8, prefix_len=3 * block_size + seed % block_size, max_extra=4 * block_size)
    result = replay_with_shadow(
        reqs,
        qwen3_next_dir,
        check=aligned_chunk_checker(block_size, budget, use_eagle),
        overlap=async_scheduling,
        block_size=block_size,
        max_num_batched_tokens=budget,
        num_blocks=num_blocks,  # small pools force preemption
        use_eagle=use_eagle,
        async_scheduling=async_scheduling,
        max_steps=20_000,
    )
    assert all(len(result.outputs[r.request_id]) == r.max_tokens for r in reqs)
    check_all_returned(result.scheduler)


@pytest.mark.parametrize("seed", range(3))
def test_hits_at_least_upstream_align(qwen3_next_dir, seed):
    reqs = workload(seed, n=12)
    align = replay("align", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    ours = replay("lighter", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert ours.cached_tokens >= align.cached_tokens
    assert ours.outputs == align.outputs


def test_eagle_prompt_states_at_its_last_full_block(qwen3_next_dir):
    """With EAGLE/MTP a prompt's chunks end at its last full block as well as one block
    before it (align's last cache position): the state a next turn resumes from after a
    reply that crossed one boundary (full attention drops the last matched block)."""
    bs, prompt_len = 16, 16 * 5 + 7
    ends: set[int] = set()

    def record(scheduler, output, step):
        for rid in output.num_scheduled_tokens:
            ends.add(scheduler.requests[rid].num_computed_tokens)

    reqs = [SimRequest("r0", list(range(1, prompt_len + 1)), max_tokens=4)]
    result = replay("lighter", reqs, qwen3_next_dir, check=record, block_size=bs, max_num_batched_tokens=256,
                    use_eagle=True)
    check_all_returned(result.scheduler)
    assert {64, 80} <= ends


def _chunk_ends(mode, reqs, qwen3_next_dir, bs):
    ends: dict[str, list[int]] = {}

    def record(scheduler, output, step):
        for rid in output.num_scheduled_tokens:
            ends.setdefault(rid, []).append(scheduler.requests[rid].num_computed_tokens)

    result = replay(mode, reqs, qwen3_next_dir, check=record, block_size=bs, max_num_batched_tokens=256)
    check_all_returned(result.scheduler)
    return ends, result


@pytest.mark.parametrize(("mode", "checkpoints"), [
    ("lighter:ckpt=1/2/4", (128 - 16, 128 - 32, 128 - 64)),
    ("lighter:ckpt=3", (128 - 48,)),
    ("lighter:ckpt=none", ()),
    ("lighter", ()),  # none by default
])
def test_cold_prompt_checkpoints_follow_the_setting(qwen3_next_dir, mode, checkpoints):
    """A cold prompt's chunks end at its checkpoints (``lighter_mamba_cold_checkpoints``
    blocks before its last cache position), and nowhere else below it but where align ends
    them; the first follower that diverges after a checkpoint hits there, with none it hits
    nothing (the junction is reported only when the follower arrives)."""
    bs = 16
    shared = list(range(1, 100))  # 6 full blocks and 3 tokens shared; the cold prompt: 8 blocks + 5
    cold = SimRequest("cold", shared + list(range(500, 533)), max_tokens=2)
    follower = SimRequest("follower", shared + list(range(700, 740)), max_tokens=2, arrival_step=40)
    ends, result = _chunk_ends(mode, [cold, follower], qwen3_next_dir, bs)
    prompt_ends = [e for e in ends["cold"] if e <= 128]
    assert sorted(set(prompt_ends)) == sorted({*checkpoints, 128})
    # The follower shares 6 blocks (96 tokens): its best cached state is the deepest checkpoint
    # at or below 96, or none.
    expected_hit = max((c for c in checkpoints if c <= 96), default=0)
    assert result.cached_per_request["follower"] == expected_hit
