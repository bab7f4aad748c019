"""The state retention policy: its pure rules, its bookkeeping on vLLM's real BlockPool
(which cached pages an allocation evicts, and in which order), and its decisions and counters
through vLLM's real scheduler. Align and prefix caching off stay vLLM's own behaviour."""

from __future__ import annotations

import types

import pytest
from prometheus_client import REGISTRY
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

from vllm_lighter_mamba.bench.sim import (
    SimRequest,
    cached_block_tracker,
    install_patches,
    make_request,
    make_scheduler,
    replay,
)
from vllm_lighter_mamba.bench.workloads import history_trace
from vllm_lighter_mamba.config import RetentionSettings, parse_settings
from vllm_lighter_mamba.envs import LighterMambaConfigError
from vllm_lighter_mamba.patch._util import original
from vllm_lighter_mamba.v1.core import block_pool_retention
from vllm_lighter_mamba.v1.core.block_pool_retention import install_retention, retention_of
from vllm_lighter_mamba.v1.core.retention_plan import RetentionPlan, RetentionPlans, plan_request
from vllm_lighter_mamba.v1.core.retention_policy import (
    checkpoint_budget,
    decode_end_boundary,
    eviction_score,
    exclusive_attention_blocks,
    expected_by_itself,
    expected_by_others,
    is_checkpoint_bet,
    settle_bet,
    state_utility,
    utility_bonus_cap,
)
from vllm_lighter_mamba.v1.core.sched.policy import checkpoint_positions
from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import claim_primary_group
from vllm_lighter_mamba.v1.metrics.counters import engine_counters
from vllm_lighter_mamba.v1.metrics.prometheus import LighterMambaMetrics

from .invariants import check_all_returned, check_pool

# The replays run the policy with cold-prompt checkpoints (1, 2 and 4 blocks: a setting, none
# by default), so that its checkpoint bets are exercised too; ``OFF``: vLLM's LRU order, the same
# chunks.
ON = "lighter:ckpt=1/2/4"
OFF = "lighter:off,ckpt=1/2/4"

BS = 4
ATTENTION, MAMBA = [0], [1, 2, 3]


# --- pure rules ------------------------------------------------------------------------------


def test_admission_rules():
    others = {"block_size": 16, "shared_prefix_boundary": 70, "stops": (80,)}
    itself = {"last_prompt_boundary": 96, "decode_end": 128}
    assert expected_by_itself(96, **itself)  # the prompt's last cacheable boundary
    assert expected_by_others(64, **others)  # the junction, floored to a block
    assert expected_by_others(80, **others)  # a cold-prompt checkpoint
    assert expected_by_itself(128, **itself)  # where decode ends: a continuation resumes there
    for position in (32, 112):  # a chunk end the budget made; a boundary decode crossed
        assert not expected_by_others(position, **others) and not expected_by_itself(position, **itself)
    assert not expected_by_itself(64, **itself) and not expected_by_others(96, **others)
    assert not expected_by_others(0, block_size=16, shared_prefix_boundary=0, stops=())
    # 100 prompt tokens and 40 to generate: 139 computed at the end, last boundary 128.
    assert decode_end_boundary(100, 40, 16) == 128
    assert decode_end_boundary(100, 1, 16) == 96
    assert decode_end_boundary(100, None, 16) == 0
    # With EAGLE/MTP the next turn resumes a block earlier (attention drops its last block).
    assert decode_end_boundary(100, 40, 16, use_eagle=True) == 112


def test_utility_counts_the_work_lost_per_page_freed():
    # A state 2048 tokens deep with nothing cached before it, whose eviction frees its 3
    # state pages and 8 attention blocks only it needs, against a leaf one block past it.
    junction = state_utility(2048, 0, 3 + 8)
    leaf = state_utility(2304, 2048, 3 + 1)
    assert junction == pytest.approx(2048 / 11) and leaf == pytest.approx(256 / 4)
    # Cached states below a state need its whole chain: its eviction frees only its pages.
    assert exclusive_attention_blocks([(True, 2), (False, 1)]) == 0
    # A leaf frees its own block and its ancestors up to one that holds or leads to a state.
    assert exclusive_attention_blocks([(True, 0), (False, 1), (False, 1), (True, 1)]) == 3
    assert exclusive_attention_blocks([(True, 0), (False, 1), (False, 2), (False, 3)]) == 2
    assert exclusive_attention_blocks([(True, 0), (False, 1)]) == 2  # up to the root
    # Lower scores go first; alpha 0 is recency alone.
    assert eviction_score(10, leaf, 0.0) < eviction_score(11, junction, 0.0)
    assert eviction_score(11, leaf, 1.0) < eviction_score(10, junction, 1.0)


def test_utility_buys_at_most_the_cap_of_extra_lifetime():
    junction, leaf = state_utility(2048, 0, 3 + 8), state_utility(2304, 2048, 3 + 1)
    assert utility_bonus_cap(455, 1.0) == 455 and utility_bonus_cap(455, 0.5) == 227.5
    # Below the cap utility still ranks: the junction outlives a slightly newer leaf.
    assert eviction_score(11, leaf, 1.0, max_bonus=455) < eviction_score(10, junction, 1.0, max_bonus=455)
    # Past it a state released a cap's worth of pages later outranks an older one whatever
    # each saves (a workload nobody sends any more leaves); uncapped the old junction
    # outlives a leaf released 1,900 pages later.
    old_junction = eviction_score(10, junction, 16.0, max_bonus=455)
    assert old_junction < eviction_score(10 + 455, leaf, 16.0, max_bonus=455)
    assert old_junction <= 10 + 455
    assert eviction_score(1910, leaf, 16.0) < eviction_score(10, junction, 16.0)
    # Near and past the cap utility still ranks states released together (a clipped bonus
    # made both 455: recency alone, wherever alpha * utility exceeds a small pool's cap).
    assert eviction_score(10, leaf, 16.0, max_bonus=455) < eviction_score(10, junction, 16.0, max_bonus=455)
    # (a 13-block pool's cap; utilities of the property suite's seed-1 states)
    assert eviction_score(10, 2.0, 16.0, max_bonus=13) < eviction_score(10, 8.0, 16.0, max_bonus=13)
    # A cap of 0 leaves recency alone.
    assert eviction_score(10, junction, 16.0, max_bonus=0) == 10
    assert eviction_score(10, leaf, 16.0, max_bonus=0) == 10


def test_checkpoint_bets():
    # A cold prompt's checkpoints (last boundary 160, block 16), then the align end a
    # checkpoint pushed back (128): align caches that one, so it is no bet.
    stops, checkpoints = (144, 128, 96, 128), (144, 128, 96)
    assert is_checkpoint_bet(96, stops, checkpoints) and is_checkpoint_bet(144, stops, checkpoints)
    assert not is_checkpoint_bet(128, stops, checkpoints)
    assert not is_checkpoint_bet(160, stops, checkpoints)
    assert not is_checkpoint_bet(96, (), checkpoints)  # not a cold prompt: no checkpoints


def test_settings():
    assert parse_settings(None) == RetentionSettings()
    assert parse_settings("off") is None
    assert parse_settings({"alpha": 2}) == RetentionSettings(alpha=2.0)
    assert parse_settings({"checkpoint_share": 0}) == RetentionSettings(checkpoint_share=0.0)
    assert parse_settings({"utility_cap": 2}) == RetentionSettings(utility_cap=2.0)
    for bad in ("on", {"alpha": -1}, {"beta": 1}, {"alpha": True}, 3, {"checkpoint_share": "x"}):
        with pytest.raises(LighterMambaConfigError, match="lighter_mamba_retention"):
            parse_settings(bad)


# --- the bookkeeping on vLLM's BlockPool ------------------------------------------------------


class Pool:
    """vLLM's BlockPool (patched as in a lighter engine) with the policy installed: one
    attention group and three Mamba groups, chains cached by hand."""

    def __init__(self, num_blocks: int = 64, alpha: float = 1.0, checkpoint_share: float = 1.0,
                 utility_cap: float = 1.0) -> None:
        install_patches()
        self.pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BS)
        claim_primary_group(self.pool, MAMBA[0])
        self.counters = engine_counters(self.pool)
        settings = RetentionSettings(alpha, checkpoint_share, utility_cap)
        self.plans = RetentionPlans()
        retention = install_retention(self.pool, BS, ATTENTION, MAMBA, settings, self.counters, self.plans)
        assert retention is not None
        self.retention = retention
        self.held: list = []

    def chain(self, rid: str, num_blocks: int, states: list[int], first_token: int = 1, cold: bool = False):
        """A request of ``num_blocks`` full blocks plus one token, its attention cached, and a
        state cached after each block index in ``states``; everything released (attention
        first, as vLLM's coordinator frees a finished request). The last block's state is the
        prompt's last boundary (admitted); others are budget chunk ends (dropped)."""
        tokens = list(range(first_token, first_token + num_blocks * BS + 1))
        request = make_request(SimRequest(rid, tokens, 1), BS)
        if cold:  # as the scheduler plans a prompt that found nothing cached
            checkpoints = tuple(checkpoint_positions(num_blocks * BS, BS, (1, 2, 4)))
            plan = plan_request(len(tokens), 1, BS, False, stops=checkpoints, checkpoints=checkpoints)
            self.plans.set(rid, plan)
        attention = self.pool.get_new_blocks(num_blocks)
        self.pool.cache_full_blocks(request, attention, 0, num_blocks, BS, ATTENTION[0])
        state_pages = {}
        for index in states:
            pages = []
            for group in MAMBA:
                block = self.pool.get_new_blocks(1)[0]
                row = [self.pool.null_block] * index + [block]
                self.pool.cache_full_blocks(request, row, index, index + 1, BS, group)
                pages.append(block)
            self.retention.state_cached(request, index, use_eagle=False)
            state_pages[index] = pages
        self.pool.free_blocks(reversed(attention))
        for index in states:
            self.pool.free_blocks(state_pages[index])
        return attention, state_pages

    def drain_free(self) -> None:
        """Take every never-cached free block, so that the next allocation must evict."""
        queue = self.pool.free_block_queue
        while queue.num_free_blocks and queue.fake_free_list_head.next_free_block.block_hash is None:
            self.held += self.pool.get_new_blocks(1)

    def evicted(self) -> dict[str, int]:
        return {k.removeprefix("evicted_pages_"): v for k, v in self.counters.as_dict().items()
                if k.startswith("evicted_pages_") and v}


def cached(blocks) -> bool:
    return all(b.block_hash is not None for b in blocks)


def test_without_pressure_the_free_queue_is_not_touched():
    p = Pool(num_blocks=64)
    p.chain("a", 6, [5])
    queue = p.pool.free_block_queue
    before = [b.block_id for b in queue.get_all_free_blocks()]
    got = p.pool.get_new_blocks(10)  # never-cached blocks are at the front: no eviction
    assert [b.block_id for b in got] == before[:10]
    assert p.evicted() == {} and p.counters.states_evicted == 0


def test_a_second_copy_of_a_cached_prefix_goes_first():
    """A request that recomputed a cached prefix (no state to resume from, e.g. it arrived
    before the junction state was cached) holds a second copy of the prefix's attention
    blocks, and vLLM's lookup finds the first copy, the free one. Evicting that copy loses no
    hit (the held copy serves it, and then a follower shares the held blocks instead of taking
    free ones): it goes before any state. Of two free copies only one goes."""
    p = Pool(num_blocks=48)
    a_attention, a_states = p.chain("a", 4, [3])
    resend = make_request(SimRequest("resend", list(range(1, 4 * BS + 2)), 1), BS)  # a's tokens
    held = p.pool.get_new_blocks(4)
    p.pool.cache_full_blocks(resend, held, 0, 4, BS, ATTENTION[0])
    p.drain_free()
    p.pool.get_new_blocks(4)
    assert p.evicted() == {"duplicate_copy": 4}
    assert not cached(a_attention) and cached(held) and cached(a_states[3])
    keys = [get_block_hash(b.block_hash) for b in held]
    assert [p.pool.get_cached_block(k, ATTENTION)[0].block_id for k in keys] == [b.block_id for b in held]

    # Both copies free: one of each goes, the prefix stays cached.
    p = Pool(num_blocks=48)
    p.chain("a", 4, [3])
    copies = p.pool.get_new_blocks(4)
    p.pool.cache_full_blocks(resend, copies, 0, 4, BS, ATTENTION[0])
    p.pool.free_blocks(reversed(copies))
    p.drain_free()
    p.pool.get_new_blocks(5)
    assert p.evicted()["duplicate_copy"] == 4
    assert all(p.pool.get_cached_block(k, ATTENTION) is not None for k in keys)


def test_victims_in_order_dropped_state_then_ranked_then_attention_past_state():
    p = Pool(num_blocks=48)
    a_attention, a_states = p.chain("a", 8, [3, 7])  # 3: a budget chunk end (dropped); 7: kept
    b_attention, b_states = p.chain("b", 4, [3], first_token=500)
    p.drain_free()
    node_a3 = p.retention.tree.nodes[a_states[3][0].block_hash[:-4]]
    assert not node_a3.resumable and p.counters.states_dropped == 1 and p.counters.states_admitted == 2
    # 1. The dropped state goes first, all three of its pages, although it is more recent
    #    than the older chain's attention.
    p.pool.get_new_blocks(3)
    assert not any(b.block_hash for b in a_states[3]) and cached(a_states[7]) and cached(a_attention)
    assert p.evicted() == {"dropped_state": 3}
    # 2. Then the admitted state with the lowest score (a's: older, and below the pages it
    #    frees b's is no better); its attention chain is now past any cached state.
    p.pool.get_new_blocks(3)
    assert not any(b.block_hash for b in a_states[7]) and cached(b_states[3])
    assert p.evicted() == {"dropped_state": 3, "ranked_state": 3}
    # 3. a's attention goes before b's state: no hit can use it any more.
    p.pool.get_new_blocks(8)
    assert not any(b.block_hash for b in a_attention)
    assert cached(b_states[3]) and cached(b_attention)
    assert p.evicted() == {"dropped_state": 3, "ranked_state": 3, "attention_past_state": 8}
    assert p.counters.states_evicted == 2 and not p.retention.pending


def test_a_state_a_waiting_request_asks_for_stays():
    """A lookup that finds a released state (a request asking for it; one that must wait for
    blocks asks again every step) ranks it as just released: the states released since go
    first. Without the lookup the older one goes first (part 2 above)."""
    p = Pool(num_blocks=48)
    a_attention, a_states = p.chain("a", 8, [7])
    b_attention, b_states = p.chain("b", 4, [3], first_token=500)
    p.drain_free()
    p.retention.state_wanted(a_states[7][0].block_hash[:-4])
    p.pool.get_new_blocks(3)
    assert cached(a_states[7]) and not any(b.block_hash for b in b_states[3])
    assert p.evicted() == {"ranked_state": 3}


def test_the_state_a_request_resumed_from_is_as_recent_as_that_request():
    """vLLM's LRU touches a hit block when the request holding it lets go; ours releases the
    state as soon as the request has read it. When that request is released, the state it
    resumed from is ranked afresh: the states released meanwhile go first. Without it the
    older one goes first (part 2 of the victims' order above)."""
    p = Pool(num_blocks=48)
    a_attention, a_states = p.chain("a", 8, [7])
    b_attention, b_states = p.chain("b", 4, [3], first_token=500)
    p.drain_free()
    a_state = a_states[7][0].block_hash[:-4]
    # r resumed from a's state and went on with tokens of its own.
    tokens = list(range(1, 8 * BS + 1)) + list(range(900, 900 + 4 * BS + 1))
    r = make_request(SimRequest("r", tokens, 1), BS)
    r.num_computed_tokens = len(tokens)
    p.retention.state_hit(a_state, repeat=False, request_id="r")
    p.retention.request_released(r, use_eagle=False)
    assert not p.retention.resumed_from
    p.pool.get_new_blocks(3)
    assert cached(a_states[7]) and not any(b.block_hash for b in b_states[3])
    assert p.evicted() == {"ranked_state": 3}


def test_every_request_that_resumed_from_a_state_is_released_through_the_policy(qwen3_next_dir):
    """The policy keeps the state each running request resumed from until that request lets
    go. A request that hits and then caches no state of its own (a repeat whose decode
    crosses no boundary: q4 of this trace) is released through the policy as well, so no
    record is left behind (the pool is unbounded here: nothing is evicted)."""
    requests, kwargs, pools = history_trace(0)
    result = replay(ON, requests, qwen3_next_dir, num_blocks=pools[-1], max_steps=20_000, **kwargs)
    assert result.cached_per_request["q4"] > 0
    assert retention_of(result.scheduler.kv_cache_manager.block_pool).resumed_from == {}


def test_a_lookup_through_the_manager_tells_the_policy(qwen3_next_dir, monkeypatch):
    """vLLM's prefix-cache lookup reaches the policy through our Mamba manager, once per
    lookup that finds a state (the primary group's call), with that state's hash."""
    wanted = []
    upstream = block_pool_retention.StateRetention.state_wanted

    def record(self, block_hash):
        wanted.append(block_hash)
        return upstream(self, block_hash)

    monkeypatch.setattr(block_pool_retention.StateRetention, "state_wanted", record)
    result = replay(ON, pressure_trace(), qwen3_next_dir, **PRESSURE)
    hits = [n for n in result.cached_per_request.values() if n > 0]
    assert hits and len(wanted) >= len(hits)
    assert engine_counters(result.scheduler.kv_cache_manager.block_pool).retention_failures == 0


def test_state_goes_with_its_attention_prefix():
    p = Pool(num_blocks=48)
    a_attention, a_states = p.chain("a", 8, [7])
    b_attention, b_states = p.chain("b", 4, [3], first_token=500)
    p.drain_free()
    # Something else (here vLLM's own API, as a KV connector would) evicts one block in the
    # middle of a's chain: a's state can no longer be reached, nor its deeper attention.
    p.pool.evict_blocks({a_attention[2].block_id})
    assert p.retention.tree.nodes.get(a_states[7][0].block_hash[:-4]) is None
    p.pool.get_new_blocks(3)
    assert not any(b.block_hash for b in a_states[7])
    assert p.evicted() == {"lru": 1, "orphan_state": 3}  # (the connector's eviction: lru)
    p.pool.get_new_blocks(5)  # then a's attention past the gap
    assert not any(b.block_hash for b in a_attention[3:]) and cached(b_states[3]) and cached(b_attention)


def test_blocks_in_use_are_never_victims():
    p = Pool(num_blocks=48)
    _, a_states = p.chain("a", 4, [1, 3])  # 1: dropped
    p.drain_free()
    p.pool.touch(a_states[1])  # a hit on the dropped state: in use, out of the free queue
    got = p.pool.get_new_blocks(3)
    assert cached(a_states[1]) and not any(b.block_hash for b in a_states[3])
    assert {b.block_id for b in got} == {b.block_id for b in a_states[3]}
    p.pool.free_blocks(a_states[1])  # released by a request that resumed from it: now kept
    assert p.retention.tree.nodes[a_states[1][0].block_hash[:-4]].resumable is False  # (hits mark it
    p.retention.state_hit(a_states[1][0].block_hash[:-4], repeat=False)  # through the manager; see below)
    assert p.retention.tree.nodes[a_states[1][0].block_hash[:-4]].resumable


def test_checkpoint_bets_beyond_their_share_go_before_ranked_states():
    """A cold prompt's checkpoints are bets align would not make: beyond their share of the
    pool (here 0.1 x 60 pages = 2 states of 3 pages), the oldest go before any ranked state,
    even an older one; a checkpoint someone resumed from is no bet any more."""
    p = Pool(num_blocks=60, checkpoint_share=0.1)
    _, old = p.chain("old", 4, [3], first_token=500)  # ranked, released first
    _, cold = p.chain("cold", 6, [1, 3, 4, 5], cold=True)  # checkpoints 2, 4, 5 blocks; last 6
    nodes = {i: p.retention.tree.nodes[cold[i][0].block_hash[:-4]] for i in cold}
    assert [nodes[i].bet for i in (1, 3, 4, 5)] == [True, True, True, False]
    assert len(p.retention.tiers.checkpoint_bets.queue) == 3
    p.drain_free()
    p.pool.get_new_blocks(3)  # one checkpoint bet too many: the oldest goes
    assert not any(b.block_hash for b in cold[1]) and cached(cold[3]) and cached(old[3])
    assert p.evicted() == {"unproven_checkpoint": 3}
    p.retention.state_hit(cold[4][0].block_hash[:-4], repeat=False)  # a follower resumed there
    assert not nodes[4].bet and len(p.retention.tiers.checkpoint_bets.queue) == 1
    p.pool.get_new_blocks(3)  # within their share: ranking as usual (the oldest state)
    assert cached(cold[3]) and not any(b.block_hash for b in old[3])
    assert p.evicted() == {"unproven_checkpoint": 3, "ranked_state": 3}


def test_checkpoints_that_serve_no_follower_lose_their_share():
    """The share is scaled by how the checkpoint bets went lately: a checkpoint lost before
    anyone resumed from it (every prompt distinct, exact repeats) shrinks it, so under
    pressure the other checkpoints go before any ranked state even within the share."""
    p = Pool(num_blocks=60, checkpoint_share=1.0)  # share: all 20 states of the pool
    _, old = p.chain("old", 4, [3], first_token=500)
    _, cold = p.chain("cold", 6, [1, 3, 4, 5], cold=True)  # checkpoints after blocks 1, 3, 4
    p.drain_free()
    p.pool.evict_blocks({cold[1][0].block_id})  # lost (as a connector would evict it)
    assert (p.retention.tiers.checkpoint_bets.won, p.retention.tiers.checkpoint_bets.lost) == (0.0, 1.0)
    # The lost state's other two pages first, then of the 2 checkpoints left (share: 20 x 0
    # won) the oldest, before the older ranked state.
    p.pool.get_new_blocks(5)
    assert not any(b.block_hash for b in cold[3]) and cached(cold[4]) and cached(old[3])
    assert p.evicted() == {"lru": 1, "orphan_state": 2, "unproven_checkpoint": 3}
    p.retention.state_hit(cold[4][0].block_hash[:-4], repeat=False)  # won: no bet any more
    assert p.retention.tiers.checkpoint_bets.won == 1.0 and not p.retention.tiers.checkpoint_bets.queue


def test_bet_record_and_share():
    assert checkpoint_budget(100, 0.5, won=0, lost=0) == 50  # nothing settled: trusted
    assert checkpoint_budget(100, 0.5, won=1, lost=3) == 12.5
    assert checkpoint_budget(100, 0.5, won=0, lost=2) == 0
    won, lost = 0.0, 0.0
    for _ in range(2000):  # a long run of lost bets, then one won: the record follows
        won, lost = settle_bet(won, lost, outcome_won=False)
    won, lost = settle_bet(won, lost, outcome_won=True)
    assert won == 1.0 and 250 < lost < 256


def test_a_prompt_end_outranks_its_own_decode_end_until_a_continuation_passes_it():
    """A request's prompt end (16 tokens) with its own decode end below it (24): the prompt
    end is where a repeat of the prompt resumes (the decode end is past the prompt), so it is
    a sequence end, not a pass-through, and the decode end goes first. Once a continuation
    resumed from the decode end, the prompt end is a pass-through (recency alone) and goes
    first. (Marconi: states at branch points and sequence ends.)"""
    def run(continued: bool):
        p = Pool(num_blocks=48)
        tokens = list(range(1, 6 * BS + 2))
        plan = RetentionPlan(stops=(), checkpoints=(), last_prompt_boundary=4 * BS, decode_end=6 * BS)
        p.plans.set("a", plan)
        _, states = p.chain("a", 6, [3, 5])
        request = make_request(SimRequest("a", tokens, 1), BS)
        request.num_computed_tokens = len(tokens)
        p.retention.request_released(request, use_eagle=False)  # both ranked afresh, same recency
        prompt_end = p.retention.tree.nodes[states[3][0].block_hash[:-4]]
        assert prompt_end.prompt_end and prompt_end.resumable and not prompt_end.provisional
        if continued:
            p.retention.state_hit(states[5][0].block_hash[:-4], repeat=False)
            assert not prompt_end.prompt_end
        p.drain_free()
        p.pool.get_new_blocks(3)
        return cached(states[3]), cached(states[5])

    assert run(continued=False) == (True, False)
    assert run(continued=True) == (False, True)


def test_a_cold_prompts_end_is_ranked_with_its_worth_while_its_request_runs():
    """A document sent for the first time (RAG): its prompt's last boundary is released as soon
    as it is cached, while the request still decodes. The next request with that document
    resumes there, so it keeps its worth (alpha x utility) from the start, and an older state
    worth as much goes first. A prompt that hit a cached prefix gets recency alone until its
    request lets go: its state covers only its own tail. (CPU replay of the serving RAG
    workload, 120 blocks: with recency alone for both, 0.462 / 0.283 hits against align's
    0.531 / 0.362.)"""
    def run(cold: bool):
        p = Pool(num_blocks=64, alpha=4.0)
        _, old = p.chain("old", 8, [7])
        request = make_request(SimRequest("old", list(range(1, 8 * BS + 2)), 1), BS)
        request.num_computed_tokens = 8 * BS + 1
        p.retention.request_released(request, use_eagle=False)  # ranked with its utility
        p.plans.set("new", plan_request(8 * BS + 1, 1, BS, False, cold=cold))
        _, new = p.chain("new", 8, [7], first_token=500)  # its request still runs
        node = p.retention.tree.nodes[new[7][0].block_hash[:-4]]
        assert node.prompt_end and node.provisional == (not cold)
        p.drain_free()
        p.pool.get_new_blocks(3)
        assert p.evicted() == {"ranked_state": 3}
        return cached(old[7]), cached(new[7])

    assert run(cold=True) == (False, True)
    assert run(cold=False) == (True, False)


def test_an_old_state_worth_more_goes_before_a_newer_one_once_both_pass_the_cap():
    """A change of workload: an old prompt's state that saves much per page (8 blocks of
    prefix) and a newer one that saves little (1 block). With a bonus far beyond the pool
    (alpha 1,000: thousands of pages of extra lifetime against a pool of 64), capped at one
    turnover of the pool the older goes first, as LRU; uncapped the newer would."""
    def run(utility_cap: float):
        p = Pool(num_blocks=64, alpha=1000.0, utility_cap=utility_cap)
        states = {}
        for rid, num_blocks, first in (("old", 8, 1), ("new", 1, 500)):
            _, pages = p.chain(rid, num_blocks, [num_blocks - 1], first_token=first)
            request = make_request(SimRequest(rid, list(range(first, first + num_blocks * BS + 1)), 1), BS)
            request.num_computed_tokens = num_blocks * BS + 1
            p.retention.request_released(request, use_eagle=False)  # ranked, no longer provisional
            states[rid] = pages[num_blocks - 1]
        p.drain_free()
        p.pool.get_new_blocks(3)
        assert p.evicted() == {"ranked_state": 3}
        return cached(states["old"]), cached(states["new"])

    assert run(utility_cap=1.0) == (False, True)
    assert run(utility_cap=float("inf")) == (True, False)


def test_decode_ends_beyond_their_share_go_before_ranked_states():
    """A decode end kept for a next turn nobody has resumed from yet is a bet on a
    continuation: beyond its share of the pool (here none) it goes before any ranked state,
    even an older one (every prompt distinct, exact repeats: no next turn ever comes). Once a
    next turn resumed from it, it is an ordinary ranked state."""
    def run(continued: bool):
        p = Pool(num_blocks=48, checkpoint_share=0.0)
        _, old = p.chain("old", 4, [3], first_token=500)  # ranked, released first
        plan = RetentionPlan(stops=(), checkpoints=(), last_prompt_boundary=4 * BS, decode_end=6 * BS)
        p.plans.set("a", plan)
        tokens = list(range(1, 6 * BS + 2))
        _, states = p.chain("a", 6, [3, 5])
        request = make_request(SimRequest("a", tokens, 1), BS)
        request.num_computed_tokens = len(tokens)
        p.retention.request_released(request, use_eagle=False)
        decode_end = p.retention.tree.nodes[states[5][0].block_hash[:-4]]
        assert decode_end.continuation and len(p.retention.tiers.continuation_bets.queue) == 1
        if continued:
            p.retention.state_hit(decode_end.key, repeat=False)
            assert not decode_end.continuation and not p.retention.tiers.continuation_bets.queue
        p.drain_free()
        p.pool.get_new_blocks(3)
        return cached(old[3]), cached(states[5]), p.evicted()

    assert run(continued=False) == (True, False, {"unproven_continuation": 3})
    assert run(continued=True) == (False, True, {"ranked_state": 3})


def test_a_partial_state_goes_first():
    """One state is a page in each Mamba group; when an allocation evicts only some of them,
    the rest can serve no hit and go next."""
    p = Pool(num_blocks=40)
    _, a_states = p.chain("a", 4, [3])
    _, b_states = p.chain("b", 4, [3], first_token=500)
    p.drain_free()
    p.pool.get_new_blocks(1)
    assert sum(b.block_hash is None for b in a_states[3]) == 1
    p.pool.get_new_blocks(2)
    assert not any(b.block_hash for b in a_states[3]) and cached(b_states[3])
    assert p.evicted() == {"ranked_state": 1, "orphan_state": 2}


class LruForAllPool(BlockPool):
    """A block pool whose ``free_blocks`` appends every freed block to the back of the queue,
    cached or not (a plain LRU queue): what the policy's move to the front cannot work with."""

    def free_blocks(self, ordered_blocks, **kwargs) -> None:
        freed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                freed.append(block)
        self.free_block_queue.append_n(freed)


def test_free_queue_order_is_checked_before_the_policy_is_installed(monkeypatch):
    """The move to the front evicts exactly the victims only while vLLM's free queue keeps
    never-cached blocks first: the installed vLLM passes the check; a pool that does not keep
    them first gets no policy, and one log line says so."""
    install_patches()
    assert block_pool_retention.free_queue_order_holds(BlockPool)  # (checked once per process)
    warnings = []
    monkeypatch.setattr(block_pool_retention.logger, "warning", lambda *args: warnings.append(args))
    assert not block_pool_retention.free_queue_order_holds(LruForAllPool)
    pool = LruForAllPool(64, enable_caching=True, hash_block_size=BS)
    claim_primary_group(pool, MAMBA[0])
    settings = RetentionSettings()
    plans = RetentionPlans()
    assert install_retention(pool, BS, ATTENTION, MAMBA, settings, engine_counters(pool), plans) is None
    assert retention_of(pool) is None and len(warnings) == 1 and "retention policy off" in warnings[0][0]


def test_policy_stays_off_where_the_free_queue_order_does_not_hold(qwen3_next_dir, monkeypatch):
    """Through the scheduler: the check failing leaves vLLM's LRU order (as the policy off)."""
    monkeypatch.setattr(block_pool_retention, "free_queue_order_holds", lambda pool_cls: False)
    unchecked = replay(ON, pressure_trace(), qwen3_next_dir, **PRESSURE)
    pool = unchecked.scheduler.kv_cache_manager.block_pool
    assert retention_of(pool) is None and engine_counters(pool).retention_failures == 0
    off = replay(OFF, pressure_trace(), qwen3_next_dir, **PRESSURE)
    assert unchecked.chunks == off.chunks and unchecked.outputs == off.outputs
    assert unchecked.scheduler.lighter_counters.as_dict() == off.scheduler.lighter_counters.as_dict()


# --- through vLLM's scheduler ------------------------------------------------------------------


def node_at(scheduler, request, position):
    retention = retention_of(scheduler.kv_cache_manager.block_pool)
    return retention.tree.nodes.get(request.block_hashes[position // 16 - 1])


def test_admission_decisions_in_a_replay(qwen3_next_dir):
    # 161 prompt tokens (last boundary 160, a cold prompt: checkpoints 144, 128, 96), a
    # 64-token budget (chunk ends 64, then 96, 128, 144, 160); 40 tokens to generate: decode
    # crosses 176 and 192, and ends at 200 computed tokens (state at 192).
    request = SimRequest("a", list(range(1, 162)), max_tokens=40)
    result = replay(ON, [request], qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    scheduler, vllm_request = result.scheduler, result.requests["a"]
    positions = (64, 96, 128, 144, 160, 176, 192)
    decisions = {pos: node_at(scheduler, vllm_request, pos).resumable for pos in positions}
    assert decisions == {64: False, 96: True, 128: True, 144: True, 160: True, 176: False, 192: True}
    # Checkpoints 96 and 144 are bets; 128 is also align's chunk end (owed): not a bet.
    bets = {pos: node_at(scheduler, vllm_request, pos).bet for pos in (96, 128, 144, 160)}
    assert bets == {96: True, 128: False, 144: True, 160: False}
    counters = scheduler.lighter_counters
    assert (counters.states_admitted, counters.states_dropped) == (5, 2)
    assert counters.states_held == counters.states_cached == 7


@pytest.mark.parametrize("length", [96, 97, 111])
def test_a_prompts_end_is_where_vllm_lets_a_resend_of_it_hit(qwen3_next_dir, length):
    """The state kept as a prompt's end (admitted, for a repeat of the prompt) is the one a
    resend resumes from. Reference: vLLM's scheduler, the hit of the second of two identical
    prompts. One token is always recomputed, so a prompt of exactly 6 blocks (96 tokens) is
    resent from 80, not 96: kept as "the prompt's end", 96 would be admitted and 80 dropped,
    first in line for eviction (the property suite's worst case, seed 1, was such a prompt)."""
    tokens = list(range(1, length + 1))
    first = SimRequest("a", tokens, max_tokens=40)
    again = SimRequest("b", tokens, max_tokens=1, arrival_step=80)
    result = replay("lighter", [first, again], qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    hit = result.cached_per_request["b"]
    assert hit == plan_request(length, 40, 16, False).last_prompt_boundary > 0
    ends = {pos: node_at(result.scheduler, result.requests["a"], pos) for pos in (hit, hit + 16)}
    assert ends[hit].prompt_end and ends[hit].resumable
    assert not ends[hit + 16].prompt_end


def test_only_a_cold_prompts_end_is_ranked_with_its_worth_while_its_request_runs(qwen3_next_dir):
    """Through the scheduler: ``a`` found nothing cached, so its prompt end (160) is ranked with
    its worth while it decodes; ``b`` resends a's first 160 tokens and more, hits them, and its
    own prompt end (192, its tail) is provisional (recency alone) until it lets go."""
    a = SimRequest("a", list(range(1, 162)), max_tokens=8)
    b = SimRequest("b", list(range(1, 161)) + list(range(500, 533)), max_tokens=8, arrival_step=60)
    seen: dict[str, set[bool]] = {"a": set(), "b": set()}

    def check(scheduler, output, step):
        for rid, position in (("a", 160), ("b", 192)):
            request = scheduler.requests.get(rid)
            node = node_at(scheduler, request, position) if request is not None else None
            if node is not None and node.state and not request.is_finished():
                seen[rid].add(node.provisional)

    # The default (no cold-prompt checkpoints, whose owed stops would make 160 a shared stop).
    result = replay("lighter", [a, b], qwen3_next_dir, block_size=16, max_num_batched_tokens=64, check=check)
    assert result.cached_per_request["b"] == 160
    assert seen == {"a": {False}, "b": {True}}


def test_a_request_that_stops_early_keeps_its_deepest_state(qwen3_next_dir):
    """Decode was expected to run to 200 tokens; aborted after about 180, its deepest state
    (176) was dropped when decode crossed it, and is kept once the request lets go."""
    request = SimRequest("a", list(range(1, 162)), max_tokens=40, abort_at_step=25)
    result = replay(ON, [request], qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    vllm_request = result.requests["a"]
    assert 176 < vllm_request.num_computed_tokens < 192
    assert node_at(result.scheduler, vllm_request, 176).resumable
    check_all_returned(result.scheduler)


def test_counters_add_up_under_pressure(qwen3_next_dir):
    reqs = [SimRequest(f"e{i}", [i % 3 + 1] * 100 + [i + 7] * 60, max_tokens=20, arrival_step=4 * i)
            for i in range(16)]
    result = replay(ON, reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64, num_blocks=80,
                    num_mamba_groups=3, check=lambda s, o, step: check_pool(s))
    counters = result.scheduler.lighter_counters
    tracker = cached_block_tracker(result.scheduler)
    evicted = sum(v for k, v in counters.as_dict().items() if k.startswith("evicted_pages_"))
    assert evicted == tracker.evicted_state_blocks + tracker.evicted_attn_blocks > 0
    assert counters.evicted_pages_lru == 0  # the policy picked every victim
    pool = result.scheduler.kv_cache_manager.block_pool
    held = sum(1 for b in pool.blocks if b.block_hash is not None and get_group_id(b.block_hash) == 1)
    assert counters.states_held == held == counters.states_cached - counters.states_evicted
    assert counters.states_admitted > 0 and counters.evicted_pages_ranked_state > 0
    check_all_returned(result.scheduler)


def test_gauge_and_counters_reach_prometheus():
    metrics = LighterMambaMetrics()
    values = {"states_held": 7, "states_admitted": 5, "evicted_pages_ranked_state": 3}
    metrics.export(91, values)
    sample = REGISTRY.get_sample_value
    assert sample("vllm:lighter_mamba_states_held", {"engine": "91"}) == 7
    assert sample("vllm:lighter_mamba_states_admitted_total", {"engine": "91"}) == 5
    assert sample("vllm:lighter_mamba_evicted_pages_ranked_state_total", {"engine": "91"}) == 3
    metrics.export(91, {**values, "states_held": 2, "states_admitted": 6})
    assert sample("vllm:lighter_mamba_states_held", {"engine": "91"}) == 2  # a gauge goes down
    assert sample("vllm:lighter_mamba_states_admitted_total", {"engine": "91"}) == 6


def pressure_trace() -> list[SimRequest]:
    return [SimRequest(f"r{i}", [i % 4 + 1] * 90 + [i + 11] * (20 + 7 * (i % 5)), max_tokens=12 + i % 9,
                       arrival_step=3 * i) for i in range(18)]


def test_align_under_pressure_is_vllms_own(qwen3_next_dir):
    """With our patches installed in the process, an align engine's pool runs upstream's
    code: the same replay with upstream's methods bound on its pool makes the same decisions."""
    install_patches()
    assert BlockPool.free_blocks is not original(BlockPool, "free_blocks")  # ours wraps it
    kwargs = {"block_size": 16, "max_num_batched_tokens": 64, "num_blocks": 70, "num_mamba_groups": 3}
    patched = replay("align", pressure_trace(), qwen3_next_dir, **kwargs)
    assert retention_of(patched.scheduler.kv_cache_manager.block_pool) is None
    scheduler = make_scheduler("align", qwen3_next_dir, **kwargs)
    pool = scheduler.kv_cache_manager.block_pool
    for name in ("get_new_blocks", "free_blocks", "_maybe_evict_cached_block", "reset_prefix_cache"):
        setattr(pool, name, types.MethodType(original(BlockPool, name), pool))
    stock = replay("align", pressure_trace(), qwen3_next_dir, scheduler=scheduler)
    assert patched.evicted_state_blocks + patched.evicted_attn_blocks > 0
    assert stock.chunks == patched.chunks and stock.cached_per_request == patched.cached_per_request
    assert (stock.evicted_state_blocks, stock.evicted_attn_blocks) == (
        patched.evicted_state_blocks, patched.evicted_attn_blocks)

    def pool_state(result):
        pool = result.scheduler.kv_cache_manager.block_pool
        queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        return queue, sorted((b.block_id, b.block_hash) for b in pool.blocks if b.block_hash is not None)

    assert pool_state(stock) == pool_state(patched)  # the same LRU order, the same cached blocks


def test_policy_off_leaves_lrus_order(qwen3_next_dir):
    off = replay(OFF, pressure_trace(), qwen3_next_dir, **PRESSURE)
    assert retention_of(off.scheduler.kv_cache_manager.block_pool) is None
    assert off.scheduler.lighter_counters.evicted_pages_lru > 0
    on = replay(ON, pressure_trace(), qwen3_next_dir, **PRESSURE)
    assert on.outputs == off.outputs and on.chunks != off.chunks  # other victims, same tokens


PRESSURE = {"block_size": 16, "max_num_batched_tokens": 64, "num_blocks": 70, "num_mamba_groups": 3}
ENTRY_POINTS = (
    "before_allocation", "after_free", "after_evict", "state_cached", "state_hit", "state_wanted",
    "request_released",
)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_failure_at_any_entry_point_turns_the_policy_off(qwen3_next_dir, monkeypatch, entry):
    """Issue 29: a bookkeeping bug at any of the policy's entry points (pool side and manager
    side) stops nothing: every request finishes with its tokens, every block is back in the
    pool, the policy is off for that engine, one log line and the retention_failures counter
    say so. (Outside strict mode, the suite's default.)"""
    monkeypatch.setenv("LIGHTER_MAMBA_RETENTION_STRICT", "0")
    calls = []
    upstream = getattr(block_pool_retention.StateRetention, entry)

    def broken(self, *args, **kwargs):
        calls.append(entry)
        if len(calls) == 3:  # mid-run, once the policy has state to lose
            raise RuntimeError("bookkeeping bug")
        return upstream(self, *args, **kwargs)

    monkeypatch.setattr(block_pool_retention.StateRetention, entry, broken)
    failed = replay(ON, pressure_trace(), qwen3_next_dir, **PRESSURE)
    assert len(calls) == 3  # it raised once, and was not called after
    pool = failed.scheduler.kv_cache_manager.block_pool
    assert retention_of(pool) is None
    assert engine_counters(pool).retention_failures == 1
    reference = replay(OFF, pressure_trace(), qwen3_next_dir, **PRESSURE)
    assert failed.outputs == reference.outputs  # (the simulator's model is a function of tokens)
    check_all_returned(failed.scheduler)


def test_strict_mode_raises_the_bookkeeping_error(qwen3_next_dir, monkeypatch):
    monkeypatch.setenv("LIGHTER_MAMBA_RETENTION_STRICT", "1")

    def broken(self, blocks):
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(block_pool_retention.StateRetention, "after_free", broken)
    with pytest.raises(RuntimeError, match="bookkeeping bug"):
        replay(ON, pressure_trace(), qwen3_next_dir, **PRESSURE)


def test_a_bad_victim_leaves_the_free_queue_as_it_was(qwen3_next_dir, monkeypatch):
    """before_allocation moves victims all or nothing: a pick that is not a free-queue member
    (here a block in use, added to real victims) raises before the queue is touched."""
    monkeypatch.setenv("LIGHTER_MAMBA_RETENTION_STRICT", "0")
    upstream_pick = block_pool_retention.StateRetention._pick
    upstream_before = block_pool_retention.StateRetention.before_allocation
    raised = []

    def bad_pick(self, count):
        victims = upstream_pick(self, count)
        in_use = next((b for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null), None)
        return victims + [in_use] if victims and in_use is not None else victims

    def snapshot(pool):
        queue = pool.free_block_queue
        return [b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks

    def checked_before_allocation(self, num_blocks):
        before = snapshot(self.pool)
        try:
            upstream_before(self, num_blocks)
        except RuntimeError:
            raised.append(snapshot(self.pool) == before)  # the queue exactly as it was
            raise

    monkeypatch.setattr(block_pool_retention.StateRetention, "_pick", bad_pick)
    monkeypatch.setattr(block_pool_retention.StateRetention, "before_allocation", checked_before_allocation)
    failed = replay(ON, pressure_trace(), qwen3_next_dir, **PRESSURE)
    assert raised == [True]
    pool = failed.scheduler.kv_cache_manager.block_pool
    assert retention_of(pool) is None and engine_counters(pool).retention_failures == 1
    check_all_returned(failed.scheduler)
