"""Which cached boundary states to keep, and what to evict first: the lighter cache's
retention policy, as pure functions. The bookkeeping that applies it: the prefix tree of
cached states (``retention_tree.py``), the eviction tiers (``retention_tiers.py``), the
scheduler's per-request plans (``retention_plan.py``) and the adapter to vLLM's block pool
(``block_pool_retention.py``); its settings (``alpha``, ``checkpoint_share``) are parsed in
``vllm_lighter_mamba/config.py``.

A cached boundary state is expensive: one page in *every* Mamba KV-cache group (Qwen3-Next-80B:
3 pages, against one page of attention KV for the same block of tokens), and it is useful only
together with the attention KV of every block before it. vLLM's single LRU free queue evicts
states and attention blocks independently, so under memory pressure it keeps states whose
attention prefix is gone and attention blocks that no cached state can resume past.

The policy (applied only when the pool must evict, so nothing changes without pressure):

1. Admission. When the request that cached a state has moved on, the state is *admitted*
   (ranked with the rest) if a later request can resume from it: where a resend of the prompt
   resumes, a junction with another cached prefix, a cold-prompt checkpoint (and the align
   chunk ends those owe), the boundary where the request's decode will end (a multi-turn
   continuation resumes there), or a state some request already resumed from. Any other
   state (a chunk end the token budget made, a boundary decode crossed on the way) is
   *dropped*: still cached, but first in line for eviction.
2. Coordinated eviction. First the pages that cannot serve any hit: free second copies of a
   prefix another block still holds (a request recomputed cached tokens), states whose attention
   prefix is gone (or that lost one group's page), then attention blocks past the deepest
   state cached on their chain (a hit can never reach them); then dropped states; then the
   admitted states in order of :func:`eviction_score`: recency plus ``alpha`` times the
   prefill work a hit saves per page its eviction would free (Marconi's utility, MLSys 2025).
   ``alpha`` was chosen by a measured sweep (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from vllm_lighter_mamba.v1.core.sched.policy import last_cache_position

# Why a page was evicted, in the order victims are taken. "duplicate_copy": a free page whose
# prefix another block still holds (a request recomputed tokens that were cached), so evicting
# it loses no hit. "lru": the pool evicted a cached page the policy did not pick (nothing of the
# policy's tiers was left).
EVICTION_REASONS = (
    "duplicate_copy",
    "orphan_state",
    "attention_past_state",
    "dropped_state",
    "unproven_checkpoint",
    "unproven_continuation",
    "ranked_state",
    "lru",
)


# Weight kept by the record of checkpoint bets at each new outcome: the record spans about the
# last 256 settled bets, so it follows a change of workload.
BET_RECORD_DECAY = 1.0 - 1.0 / 256


def settle_bet(won: float, lost: float, outcome_won: bool) -> tuple[float, float]:
    """The decayed record of checkpoint bets after one more is settled: won (a follower
    resumed from the checkpoint) or lost (evicted before anyone did)."""
    won, lost = won * BET_RECORD_DECAY, lost * BET_RECORD_DECAY
    return (won + 1.0, lost) if outcome_won else (won, lost + 1.0)


def checkpoint_budget(pool_states: float, fraction: float, won: float, lost: float) -> float:
    """How many unresumed cold-prompt checkpoints may stay cached before the oldest go first:
    ``fraction`` of the pool (in states), scaled by the share of recent bets that won. A
    workload whose checkpoints never serve a follower (every prompt distinct, exact repeats)
    keeps none of them under pressure; one whose checkpoints do (system prompts) keeps up to
    the share. Before any bet is settled the record is trusted in full."""
    settled = won + lost
    win_rate = won / settled if settled else 1.0
    return fraction * pool_states * win_rate


def decode_end_boundary(
    num_prompt_tokens: int, max_tokens: int | None, block_size: int, use_eagle: bool = False
) -> int:
    """The boundary a continuation of the conversation resumes from when the request stops
    at ``max_tokens``.

    At the end ``num_prompt_tokens + max_tokens - 1`` tokens are computed (the last sampled
    token is not): the deepest boundary among them, or with EAGLE/MTP one block earlier
    (full attention drops its last matched block), as :func:`last_cache_position` has it.
    """
    if not max_tokens:
        return 0
    return last_cache_position(num_prompt_tokens + max_tokens - 1, block_size, use_eagle)


def expected_by_others(position: int, *, block_size: int, shared_prefix_boundary: int,
                       stops: Iterable[int]) -> bool:
    """The state after ``position`` tokens is where *other* requests are expected to resume:
    the block-floored junction vLLM reported with another cached prefix (its siblings), or one
    of the request's own chunk stops (cold-prompt checkpoints and the align ends they owe: an
    expected branch point, the first follower's)."""
    junction = shared_prefix_boundary - shared_prefix_boundary % block_size
    return (junction > 0 and position == junction) or position in stops


def expected_by_itself(position: int, *, last_prompt_boundary: int, decode_end: int) -> bool:
    """The state is where *this* request's own future resumes: the boundary a resend of its
    prompt hits (the same prompt again; ``policy.resend_hit_boundary``) or the boundary its
    decode ends on (the next turn)."""
    return position in (last_prompt_boundary, decode_end)


def is_checkpoint_bet(position: int, stops: tuple[int, ...], checkpoints: tuple[int, ...]) -> bool:
    """A cold-prompt checkpoint that align would not have cached: a bet on a branch point.

    ``stops`` are the request's chunk stops: its ``checkpoints`` (decided at its first
    admission), then the align chunk ends they pushed back (owed), which align does cache.
    """
    if not checkpoints or stops[: len(checkpoints)] != checkpoints:
        return False  # not a cold prompt
    return position in checkpoints and position not in stops[len(checkpoints):]


def prefill_work(start_tokens: int, end_tokens: int) -> float:
    """Prefill work (in token-equivalents) of computing tokens ``[start, end)``.

    Linear in tokens: in the hybrids this cache serves most layers are linear-time (GDN,
    Mamba) and the attention layers' quadratic term stays below the per-token weight FLOPs
    up to contexts of tens of thousands of tokens (Qwen3-Next-80B: about 30k). Only ratios
    between states matter for ranking.
    """
    return float(max(end_tokens - start_tokens, 0))


def state_utility(position: int, ancestor_position: int, pages_freed: int) -> float:
    """Prefill work a hit on this state saves per page it holds (Marconi's FLOP efficiency).

    Evicting the state loses only the work past the nearest cached state before it on the
    chain (``ancestor_position``, 0 if none): a later request resumes there instead. The
    pages it holds are those its eviction would free: its own (one per Mamba group) and the
    attention blocks no other cached state needs (see :func:`exclusive_attention_blocks`).
    """
    return prefill_work(ancestor_position, position) / max(pages_freed, 1)


def exclusive_attention_blocks(chain_up: Iterable[tuple[bool, int]]) -> int:
    """How many attention blocks only this state needs, walking up its chain from its own
    block: ``chain_up`` yields ``(has_state, live_children)`` for the state's node, then its
    parent, and so on. None if cached states hang below it (they need its whole chain);
    otherwise the blocks up to the first ancestor that holds a state or leads to another one.
    """
    count = 0
    for depth, (has_state, live_children) in enumerate(chain_up):
        if depth == 0:
            if live_children > 0:
                return 0
        elif has_state or live_children > 1:
            break
        count += 1
    return count


def eviction_score(recency: int, utility: float, alpha: float, max_bonus: float = float("inf")) -> float:
    """Lower is evicted first.

    ``recency`` is the pool's clock when the state was last released (it advances by one per
    cached page released), so ``alpha * utility`` reads as "pages of extra lifetime": with
    alpha 1, a state saving 200 tokens of prefill per page outlives one saving 50 by about
    150 released pages. Alpha 0 is LRU among admitted states.

    The extra lifetime is bounded by ``max_bonus`` pages (:func:`utility_bonus_cap`): once a
    state has gone that long without a hit, a newer state outranks it whatever either would
    save. Uncapped, utility outlives a change of workload: long system prompts nobody sends
    any more kept their states for many turnovers of the pool while a chat's fresh states,
    worth less per page, were evicted before their next turn came (H100, 2026-12-05:
    multi-turn hit rate 0.12-0.26 against align's 0.60 after two system-prompt workloads).
    The bound is approached, not clipped (``max_bonus * (1 - exp(-alpha * utility /
    max_bonus))``, close to ``alpha * utility`` well below it): a clipped bonus is the same
    for every state past the cap, so in small pools, where most states are, utility stopped
    ranking at all and the order fell back to recency (the property suite's pressure cases
    below align: 16.6% clipped, 15.9% approached; CPU replays, 2026-12-07).
    """
    if max_bonus <= 0:
        return float(recency)
    bonus = alpha * utility
    if max_bonus < float("inf"):
        bonus = max_bonus * -math.expm1(-bonus / max_bonus)
    return recency + bonus


def utility_bonus_cap(pool_pages: int, turnovers: float) -> float:
    """The most extra lifetime utility can buy, in released pages: ``turnovers`` times the
    pool's page count (the clock advances by one per cached page released, so one pool's
    worth of releases is about the time every unreferenced page takes to be reused once)."""
    return turnovers * pool_pages
