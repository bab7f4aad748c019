"""The retention policy's adapter to vLLM's ``BlockPool``: the only code that edits the
pool's free queue or reads its private structures.

vLLM keeps every cached, unreferenced block in one LRU free queue and evicts from its front
when it allocates. We leave the pool, its queue and its eviction code alone and only change
*which* cached blocks are at the front when an allocation is about to evict: right before
``get_new_blocks`` pops, :meth:`StateRetention.before_allocation` moves the victims the policy
picks to the front of the queue (``FreeKVCacheBlockQueue.remove`` / ``prepend_n``), and vLLM
then evicts them as usual. An allocation that evicts nothing (free, never-cached blocks are
at the front) is untouched, so without memory pressure the pool behaves exactly as vLLM's.

That move evicts exactly the victims only because vLLM keeps never-cached free blocks ahead
of cached ones in the queue (``free_blocks`` prepends the first, appends the second): the
blocks popped after the victims are then never-cached ones. Otherwise the allocation would
also evict cached blocks from the front, more than vLLM's own order evicts, so
:func:`install_retention` checks that on the running vLLM first (:func:`free_queue_order_holds`)
and leaves the policy off if it does not hold.

Per pool, :class:`StateRetention` ties together the prefix tree of cached states
(``retention_tree.py``), the eviction tiers (``retention_tiers.py``) and the scheduler's
per-request plans (``retention_plan.py``); the policy's rules are pure functions in
``retention_policy.py``. Work happens when a state is cached (per block boundary a request
crosses, not per step), when blocks are hashed or released (one lookup per block: does another
copy of its prefix exist), and when an allocation evicts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)

from vllm_lighter_mamba.config import RetentionSettings
from vllm_lighter_mamba.v1.core.retention_plan import RetentionPlan, RetentionPlans, plan_request
from vllm_lighter_mamba.v1.core.retention_policy import (
    expected_by_itself,
    expected_by_others,
    is_checkpoint_bet,
)
from vllm_lighter_mamba.v1.core.retention_tiers import EvictionTiers
from vllm_lighter_mamba.v1.core.retention_tree import PrefixNode, PrefixTree, nearest_state_above
from vllm_lighter_mamba.v1.core.sched.policy import last_cache_position

_ATTR = "_lighter_mamba_retention"
logger = init_logger("vllm.lighter_mamba")


class StateRetention:
    """Per-pool bookkeeping of the retention policy (see the module docstring)."""

    def __init__(
        self,
        pool: Any,
        block_size: int,
        attention_groups: Iterable[int],
        mamba_groups: Iterable[int],
        settings: RetentionSettings,
        counters: Any,
        plans: RetentionPlans,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.attention_groups = sorted(attention_groups)
        self.mamba_groups = sorted(mamba_groups)
        self.primary = self.mamba_groups[0]  # one state = one page per Mamba group: count it once
        self.attention_set = frozenset(self.attention_groups)
        self.mamba_set = frozenset(self.mamba_groups)
        self.counters = counters
        self.plans = plans
        self.tiers = EvictionTiers(
            block_size, len(self.mamba_groups), len(self.attention_groups), settings.alpha,
            settings.checkpoint_share, counters, pool.num_gpu_blocks, settings.utility_cap,
        )
        self.tree = PrefixTree(self.tiers)
        # Victims moved to the front of the free queue: why, by block id (for the counters).
        self.pending: dict[int, str] = {}
        # The state each running request resumed from, by request id.
        self.resumed_from: dict[str, BlockHash] = {}

    def clear(self) -> None:
        """vLLM dropped every cached block (``reset_prefix_cache``)."""
        self.tree.clear()
        self.tiers.clear()
        self.pending = {}
        self.resumed_from = {}

    def _plan(self, request: Any, use_eagle: bool) -> RetentionPlan:
        """The scheduler's plan for ``request`` (one without stops if it made none)."""
        plan = self.plans.get(request.request_id)
        if plan is None:
            plan = plan_request(request.num_prompt_tokens, request.max_tokens, self.block_size, use_eagle)
        return plan

    # --- called by the Mamba manager ------------------------------------------------------

    def state_cached(self, request: Any, index: int, use_eagle: bool) -> None:
        """The primary Mamba group hashed the state after ``(index + 1)`` blocks of ``request``."""
        hashes = resolve_block_hashes(request.block_hashes, self.pool.hash_block_size, self.block_size)
        node = self.tree.chain(hashes, index)
        self.tree.set_state(node, True)
        if not node.resumable:
            bs = self.block_size
            position = (index + 1) * bs
            plan = self._plan(request, use_eagle)
            shared = expected_by_others(
                position, block_size=bs, shared_prefix_boundary=request.shared_prefix_boundary,
                stops=plan.stops,
            )
            own = expected_by_itself(
                position, last_prompt_boundary=plan.last_prompt_boundary, decode_end=plan.decode_end
            )
            node.resumable = shared or own
            node.shared = shared
            node.prompt_end = own and position == plan.last_prompt_boundary
            # Ranked by recency alone while its request runs, unless it is the end of a prompt
            # that found nothing cached: the one way into a prefix new to the cache (a
            # document, a first turn), which the next request sending it resumes from. A
            # prompt that hit adds only its own tail (a question after a shared prefix),
            # whose state is worth little until some request proves otherwise.
            node.provisional = own and not shared and not (node.prompt_end and plan.cold)
            # Its decode end (past the prompt): a bet on a next turn, as a checkpoint is on a
            # follower; beyond their share the unproven ones go first (``EvictionTiers.pick``).
            node.continuation = own and not shared and position == plan.decode_end and not node.prompt_end
            # The checkpoints as the scheduler chose them at the request's first admission.
            junction = request.shared_prefix_boundary - request.shared_prefix_boundary % bs
            node.bet = (
                not own and position != junction and is_checkpoint_bet(position, plan.stops, plan.checkpoints)
            )

    def state_hit(self, block_hash: BlockHash, repeat: bool, request_id: str | None = None) -> None:
        """A request resumed from this state: a later one may too. ``repeat``: it was the
        deepest hit the request's prompt allows (the same prompt again, or a sibling that
        branches right there), not a continuation that goes on past it."""
        if request_id is not None:
            self.resumed_from[request_id] = block_hash  # ranked afresh when it is released
        node = self.tree.nodes.get(block_hash)
        if node is not None:
            self._demand_seen(node)
            node.shared = node.shared or repeat
            if not repeat:
                # A continuation resumed here and goes on: this state, and the prompt end
                # above it whose decode led here, are pass-throughs once deeper states hang
                # below them (``EvictionTiers.utility``).
                node.prompt_end = False
                above = nearest_state_above(node)
                if above is not None and above.prompt_end:
                    above.prompt_end = False
                    self.tiers.pass_through(above)

    def state_wanted(self, block_hash: BlockHash) -> None:
        """A prefix-cache lookup found this state. A request that must wait for blocks is
        looked up again every step, while the allocations of the requests ahead of it evict:
        without this, the state it waits for (a next turn's, where its previous turn's decode
        ended) could be the one they take. A state a request asks for is demand seen, not a
        bet: it is admitted, a bet on it counts as won, and it is ranked as if just released."""
        node = self.tree.nodes.get(block_hash)
        if node is None or not node.state or not self.state_released(block_hash):
            return  # a state in use is ranked afresh when it is released
        self._demand_seen(node)
        self.tiers.readmit(node, released=True)

    def _demand_seen(self, node: PrefixNode) -> None:
        """A request resumed from the state, or asked for it: admitted for good, a bet on it won."""
        node.resumable, node.provisional = True, False
        if node.bet or node.continuation:
            self.tiers.settle(node, won=True)

    def request_released(self, request: Any, use_eagle: bool) -> None:
        """The request finished or was preempted: its deepest state is where a continuation
        (or its own resumption) starts (a block earlier with EAGLE/MTP: ``last_cache_position``),
        and its plan's ``last_prompt_boundary`` where a repeat of the prompt does. Either one
        that was dropped, or ranked by recency alone while the request ran, is admitted and
        ranked afresh. The state it resumed from is ranked afresh too: vLLM's LRU touches a
        hit block when the request that holds it lets go, while ours was released as soon as
        the request had read it, so by recency it would go before the states of requests
        that started after it (a sibling branching there later finds it gone)."""
        bs = self.block_size
        deepest = last_cache_position(request.num_computed_tokens, bs, use_eagle) // bs - 1
        last = self._plan(request, use_eagle).last_prompt_boundary // bs - 1
        hashes = resolve_block_hashes(request.block_hashes, self.pool.hash_block_size, bs)
        resumed_from = self.resumed_from.pop(request.request_id, None)
        node = self.tree.nodes.get(resumed_from) if resumed_from is not None else None
        if node is not None and node.state and node.resumable and self.state_released(node.key):
            self.tiers.rank(node)
        for index in {deepest, last}:
            if not 0 <= index < len(hashes):
                continue
            node = self.tree.nodes.get(hashes[index])
            if node is None or not node.state or (node.resumable and not node.provisional):
                continue
            node.resumable, node.provisional = True, False
            self.tiers.readmit(node, released=self.state_released(node.key))

    # --- called by the block pool ---------------------------------------------------------

    def after_cache(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks just hashed: where one repeats a prefix cached before (its request
        recomputed it), the free copies of that prefix are duplicates."""
        for block in blocks:
            key = block.block_hash
            if key is None or block.is_null:
                continue
            copies = self._copies(key)
            if len(copies) > 1:
                for copy in copies:
                    if in_free_queue(copy):
                        self.tiers.duplicate(copy)

    def after_free(self, blocks: list[KVCacheBlock]) -> None:
        """Sort the blocks that just became cached-and-free into their tiers."""
        for block in blocks:
            key = block.block_hash
            if key is None or block.ref_cnt != 0 or block.is_null:
                continue
            self.tiers.tick()
            if len(self._copies(key)) > 1:
                self.tiers.duplicate(block)
            group = get_group_id(key)
            block_hash = get_block_hash(key)
            # A state's pages in the other Mamba groups go with its primary page.
            if group == self.primary:
                self.tiers.state_released(block_hash, self.tree.nodes.get(block_hash))
            elif group in self.attention_set:
                self.tiers.attention_released(block_hash, self.tree.nodes.get(block_hash))

    def before_allocation(self, num_blocks: int) -> None:
        """If taking ``num_blocks`` from the front would evict cached blocks, put the
        policy's victims there instead (as many as would be evicted)."""
        queue = self.pool.free_block_queue
        if num_blocks <= 0 or num_blocks > queue.num_free_blocks:
            return  # vLLM raises or has nothing to do
        block = queue.fake_free_list_head.next_free_block
        to_evict = 0
        for _ in range(num_blocks):
            if block.block_hash is not None:
                to_evict += 1
            block = block.next_free_block
        if to_evict == 0:
            return
        victims = self._pick(to_evict)
        if not victims:
            return
        # All or nothing: every victim is checked before the queue is touched, so a bad pick
        # raises (and the guard turns the policy off) with vLLM's free queue as it was.
        seen: set[int] = set()
        for block in victims:
            if (block.ref_cnt != 0 or block.block_id in seen
                    or block.prev_free_block is None or block.next_free_block is None):
                raise RuntimeError(f"retention picked block {block.block_id}, not a free-queue member")
            seen.add(block.block_id)
        for block in victims:
            queue.remove(block)
        queue.prepend_n(victims)

    def after_evict(self, block: KVCacheBlock, key: Any) -> str:
        """vLLM evicted ``block`` (its hash was ``key``); returns the reason counted."""
        reason = self.pending.pop(block.block_id, "lru")
        group = get_group_id(key)
        block_hash = get_block_hash(key)
        if group in self.mamba_set:
            if self.pool.get_cached_block(block_hash, self.mamba_groups) is None:
                node = self.tree.nodes.get(block_hash)
                if node is not None:
                    self.tree.set_state(node, False)
                pages_left = self._any_cached(block_hash, self.mamba_groups)
                self.tiers.state_evicted(block_hash, pages_left=pages_left)
        elif group in self.attention_set:
            if self.pool.get_cached_block(block_hash, self.attention_groups) is None:
                node = self.tree.nodes.get(block_hash)
                if node is not None:
                    self.tiers.orphaned(self.tree.remove_subtree(node))
                self.tiers.attention_evicted(
                    block_hash, copies_left=self._any_cached(block_hash, self.attention_groups)
                )
        return reason

    # --- victims ----------------------------------------------------------------------------

    def _pick(self, count: int) -> list[KVCacheBlock]:
        """Up to ``count`` victims, in the tiers' order; each one's reason kept for the counters."""
        pool_states = self.pool.num_gpu_blocks / len(self.mamba_groups)
        picked = self.tiers.pick(count, self.tree.nodes, self, pool_states)
        for block, reason in picked:
            self.pending[block.block_id] = reason
        return [block for block, _ in picked]

    # --- the pool's cached blocks (``retention_tiers.FreePages``) ---------------------------

    def state_pages(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        return self._free_blocks(block_hash, self.mamba_groups)

    def attention_pages(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        return self._free_blocks(block_hash, self.attention_groups)

    def state_released(self, block_hash: BlockHash) -> bool:
        return bool(self._free_blocks(block_hash, (self.primary,)))

    def redundant(self, block: KVCacheBlock, excluded: set[int]) -> bool:
        key = block.block_hash
        if key is None or not in_free_queue(block):
            return False
        return any(c.block_id != block.block_id and c.block_id not in excluded for c in self._copies(key))

    def _copies(self, key: Any) -> list[KVCacheBlock]:
        """Every block cached under ``key`` (a block hash with its group), in use or free."""
        return blocks_cached_under(self.pool.cached_block_hash_to_block, key)

    def _free_blocks(self, block_hash: BlockHash, groups: Iterable[int]) -> list[KVCacheBlock]:
        """The cached, unreferenced blocks of ``block_hash`` in ``groups`` (free-queue members)."""
        found = []
        for group in groups:
            key = make_block_hash_with_group_id(block_hash, group)
            found.extend(block for block in self._copies(key) if in_free_queue(block))
        return found

    def _any_cached(self, block_hash: BlockHash, groups: Iterable[int]) -> bool:
        cache = self.pool.cached_block_hash_to_block
        return any(cache.get_one_block(make_block_hash_with_group_id(block_hash, g)) for g in groups)


def retention_of(pool: Any) -> StateRetention | None:
    return getattr(pool, _ATTR, None)


def install_retention(
    pool: Any,
    block_size: int,
    attention_groups: list[int],
    mamba_groups: list[int],
    settings: RetentionSettings,
    counters: Any,
    plans: RetentionPlans,
) -> StateRetention | None:
    """The policy on ``pool``; None (policy off, one log line) if vLLM's free queue does not
    keep never-cached blocks first (see the module docstring)."""
    if not free_queue_order_holds(type(pool)):
        logger.warning(
            "lighter Mamba cache: this vLLM's block pool does not keep never-cached free blocks "
            "ahead of cached ones; state retention policy off (vLLM's LRU eviction order)"
        )
        return None
    retention = StateRetention(pool, block_size, attention_groups, mamba_groups, settings, counters, plans)
    setattr(pool, _ATTR, retention)
    return retention


def remove_retention(pool: Any) -> None:
    if getattr(pool, _ATTR, None) is not None:
        setattr(pool, _ATTR, None)


@functools.cache
def free_queue_order_holds(pool_cls: type) -> bool:
    """Whether ``pool_cls`` (vLLM's ``BlockPool``) behaves as :meth:`StateRetention.before_allocation`
    needs, tried once per process on a throwaway pool of five blocks: ``free_blocks`` puts
    never-cached blocks ahead of cached ones, whatever order they are freed in, and after
    one cached block is moved to the front (``remove`` / ``prepend_n``), an allocation of
    three blocks evicts that block and no other cached one."""
    try:
        pool = pool_cls(6, enable_caching=True, hash_block_size=1)  # block 0 is the null block
        blocks = pool.get_new_blocks(5)
        cached = blocks[:3]
        for i, block in enumerate(cached):
            key = make_block_hash_with_group_id(BlockHash(f"free-queue probe {i}".encode()), 0)
            block.set_block_hash(key)
            pool.cached_block_hash_to_block.insert(key, block)
        pool.free_blocks([cached[0], blocks[3], cached[1], blocks[4], cached[2]])
        order = [block.block_hash is None for block in pool.free_block_queue.get_all_free_blocks()]
        if order != [True, True, False, False, False]:
            return False
        queue = pool.free_block_queue
        queue.remove(cached[2])
        queue.prepend_n([cached[2]])
        taken = {block.block_id for block in pool.get_new_blocks(3)}
        expected = {cached[2].block_id, blocks[3].block_id, blocks[4].block_id}
        evicted = [block.block_hash is None for block in cached]
        return taken == expected and evicted == [False, False, True]
    except Exception:  # a pool that cannot even run the probe cannot run the policy either
        logger.exception("lighter Mamba cache: the block pool's free-queue probe failed")
        return False


def in_free_queue(block: KVCacheBlock) -> bool:
    """An unreferenced block in vLLM's free queue (a cached one there is evictable)."""
    return block.ref_cnt == 0 and block.prev_free_block is not None


def blocks_cached_under(cache: Any, key: Any) -> list[KVCacheBlock]:
    """Every block vLLM's ``BlockHashToBlockMap`` holds under ``key`` (it has no public call
    for all of them). vLLM 0.32: ``_cache`` maps a key to a block, or to ``{block_id: block}``
    for copies; vLLM 0.34: to one block id, the copies' ids in ``_dup_ids``, the blocks in
    ``_blocks``."""
    entry = cache._cache.get(key)
    if entry is None:
        return []
    if isinstance(entry, KVCacheBlock):
        return [entry]
    if isinstance(entry, dict):
        return list(entry.values())
    return [cache._blocks[block_id] for block_id in (cache._dup_ids.get(key) or (entry,))]
