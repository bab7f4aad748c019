"""The retention policy (``retention_policy.py``) applied to vLLM's ``BlockPool``.

vLLM keeps every cached, unreferenced block in one LRU free queue and evicts from its front
when it allocates. We leave the pool, its queue and its eviction code alone and only change
*which* cached blocks are at the front when an allocation is about to evict: right before
``get_new_blocks`` pops, :meth:`StateRetention.before_allocation` moves the victims the policy
picks to the front of the queue (``FreeKVCacheBlockQueue.remove`` / ``prepend_n``), and vLLM
then evicts them as usual. An allocation that evicts nothing (free, never-cached blocks are
at the front) is untouched, so without memory pressure the pool behaves exactly as vLLM's.

To pick victims we keep, per pool:

- a tree of the cached chains that lead to a cached boundary state: one node per block hash
  (a prefix), with its parent, whether a complete state (a page in every Mamba group) is
  cached there, and how many children lead to one ("live"). An attention block whose node is
  missing or not live is past the deepest state on its chain: no hit can reach it. When the
  last attention copy of a prefix is evicted, the states below it cannot be reached either.
- the released blocks, sorted into tiers: pages that can serve no hit (orphaned or partial
  states, attention past the deepest state), dropped states (not admitted), admitted states
  in a heap by :func:`eviction_score`.

Entries are checked when taken (a block touched by a hit since then is skipped), so the pool
needs no other hook. Work happens when a state is cached (per block boundary a request
crosses, not per step), when blocks are released, and when an allocation evicts.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)

from vllm_lighter_mamba.config import RetentionSettings
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
)
from vllm_lighter_mamba.v1.core.sched.policy import checkpoint_positions, last_cache_position

_ATTR = "_lighter_mamba_retention"


class _Node:
    """A cached prefix (one block hash) on a chain that leads to a cached state."""

    __slots__ = ("key", "parent", "children", "index", "state", "live_children", "resumable", "admitted",
                 "dropped", "branched", "provisional", "shared", "bet")

    def __init__(self, key: BlockHash, parent: _Node | None, index: int) -> None:
        self.key = key
        self.parent = parent
        self.children: set[_Node] = set()
        self.index = index  # block position: the state here is the one after (index + 1) blocks
        self.state = False  # a complete boundary state is cached at this prefix
        self.live_children = 0  # children whose subtree holds a cached state
        self.resumable = False  # admitted (or resumed from): ranked, not dropped
        self.admitted = False  # counted once in states_admitted
        self.dropped = False  # counted once in states_dropped
        self.branched = False  # two different continuations were cached below it (ever)
        # Kept only for its own request's future (its prompt's last boundary, its decode
        # end) while that request still runs: nobody else is known to need it yet.
        self.provisional = False
        # Kept for other requests: a junction stop or a cold-prompt checkpoint (an expected
        # branch point, even before anything branched there).
        self.shared = False
        # A cold-prompt checkpoint nobody resumed from yet: a bet on a branch point, and a
        # state align would not have cached.
        self.bet = False

    @property
    def live(self) -> bool:
        return self.state or self.live_children > 0


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
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.attention_groups = sorted(attention_groups)
        self.mamba_groups = sorted(mamba_groups)
        self.primary = self.mamba_groups[0]  # one state = one page per Mamba group: count it once
        self.mamba_set = frozenset(self.mamba_groups)
        self.attention_set = frozenset(self.attention_groups)
        self.alpha = settings.alpha
        self.checkpoint_share = settings.checkpoint_share
        self.counters = counters
        self.clear()

    def clear(self) -> None:
        self.nodes: dict[BlockHash, _Node] = {}
        # Released cached blocks by tier (keys: block hashes without group), oldest first.
        self.orphans: OrderedDict[BlockHash, None] = OrderedDict()
        self.dead_attention: OrderedDict[BlockHash, None] = OrderedDict()
        self.dropped: OrderedDict[BlockHash, None] = OrderedDict()
        # Released checkpoint bets (also ranked), oldest first: beyond their share, the
        # oldest go before any ranked state.
        self.bets: OrderedDict[BlockHash, None] = OrderedDict()
        # (score, seq, block hash, clock when released); only the latest seq of a hash counts.
        self.ranked: list[tuple[float, int, BlockHash, int]] = []
        self.ranked_seq: dict[BlockHash, int] = {}
        self.released: dict[BlockHash, int] = {}  # clock when a ranked state was released
        self.seq = 0
        self.clock = 0
        # Checkpoint bets settled lately (decayed): a follower resumed there, or it was lost.
        self.bets_won = 0.0
        self.bets_lost = 0.0
        # Victims moved to the front of the free queue: why, by block id (for the counters).
        self.pending: dict[int, str] = {}

    # --- the tree -----------------------------------------------------------------------

    def _chain(self, block_hashes: Any, index: int) -> _Node:
        """The node of ``block_hashes[index]``, creating the missing ones above it."""
        j = index
        while j >= 0 and block_hashes[j] not in self.nodes:
            j -= 1
        parent = self.nodes[block_hashes[j]] if j >= 0 else None
        node = parent
        for k in range(j + 1, index + 1):
            node = _Node(block_hashes[k], parent, k)
            self.nodes[node.key] = node
            if parent is not None:
                parent.children.add(node)
                if len(parent.children) > 1:
                    parent.branched = True
            parent = node
        assert node is not None
        return node

    def _set_state(self, node: _Node, value: bool) -> None:
        if node.state == value:
            return
        was_live = node.live
        node.state = value
        if not value:
            if node.bet:
                self._settle(node, won=False)
            self._untier(node.key)
        if node.live != was_live:
            self._liveness_changed(node)

    def _untier(self, key: BlockHash) -> None:
        """The state at ``key`` is gone: forget its entries among the released states."""
        self.ranked_seq.pop(key, None)
        self.released.pop(key, None)
        self.dropped.pop(key, None)
        self.bets.pop(key, None)

    def _liveness_changed(self, node: _Node) -> None:
        """Carry a node's change of liveness up its chain (stops where nothing changes)."""
        while True:
            if not node.live:
                self.dead_attention[node.key] = None
            parent = node.parent
            if parent is None:
                return
            was_live = parent.live
            parent.live_children += 1 if node.live else -1
            if node.live and parent.live_children == 1 and parent.state and not parent.branched:
                self._rank_again(parent)  # its first deeper state: now a pass-through
            if parent.live == was_live:
                return
            node = parent

    def _remove_subtree(self, node: _Node) -> None:
        """The prefix's attention is gone: nothing below it can be reached by a hit, so its
        states and attention blocks are first in line."""
        orphaned = []
        stack = [node]
        while stack:
            current = stack.pop()
            if current.state:
                orphaned.append(current.key)
                if current.bet:
                    self._settle(current, won=False)
            stack.extend(current.children)
            del self.nodes[current.key]
            self._untier(current.key)
            if current is not node:
                self.dead_attention[current.key] = None
        parent = node.parent
        if parent is not None:
            parent.children.discard(node)
            if node.live:  # the parent loses a live child
                node.state, node.live_children = False, 0
                self._liveness_changed(node)
        for key in orphaned:
            self.orphans[key] = None

    # --- called by the Mamba manager ------------------------------------------------------

    def state_cached(self, request: Any, index: int, use_eagle: bool) -> None:
        """The primary Mamba group hashed the state after ``(index + 1)`` blocks of ``request``."""
        hashes = resolve_block_hashes(request.block_hashes, self.pool.hash_block_size, self.block_size)
        node = self._chain(hashes, index)
        self._set_state(node, True)
        if not node.resumable:
            bs = self.block_size
            position = (index + 1) * bs
            stops = tuple(getattr(request, "lighter_mamba_stops", ()))
            last = last_cache_position(request.num_prompt_tokens, bs, use_eagle)
            shared = expected_by_others(
                position, block_size=bs, shared_prefix_boundary=request.shared_prefix_boundary, stops=stops
            )
            own = expected_by_itself(
                position,
                last_prompt_boundary=last,
                decode_end=decode_end_boundary(request.num_prompt_tokens, request.max_tokens, bs, use_eagle),
            )
            node.resumable = shared or own
            node.provisional = own and not shared
            node.shared = shared
            # The checkpoints as the scheduler chose them at the request's first admission.
            junction = request.shared_prefix_boundary - request.shared_prefix_boundary % bs
            node.bet = (
                not own
                and position != junction
                and is_checkpoint_bet(position, stops, tuple(checkpoint_positions(last, bs)))
            )

    def _settle(self, node: _Node, won: bool) -> None:
        """A checkpoint bet is over: it is an ordinary state from now on (or gone)."""
        self.bets_won, self.bets_lost = settle_bet(self.bets_won, self.bets_lost, won)
        node.bet = False
        self.bets.pop(node.key, None)

    def state_hit(self, block_hash: BlockHash, repeat: bool) -> None:
        """A request resumed from this state: a later one may too. ``repeat``: it was the
        deepest hit the request's prompt allows (the same prompt again, or a sibling that
        branches right there), not a continuation that goes on past it."""
        node = self.nodes.get(block_hash)
        if node is not None:
            node.resumable = True
            node.provisional = False
            if node.bet:
                self._settle(node, won=True)
            node.shared = node.shared or repeat

    def request_released(self, request: Any, use_eagle: bool) -> None:
        """The request finished or was preempted: its deepest state is where a continuation
        (or its own resumption) starts, and its prompt's last boundary where a repeat of the
        prompt does (each a block earlier with EAGLE/MTP: ``last_cache_position``). Either one
        that was dropped, or ranked by recency alone while the request ran, is admitted and
        ranked afresh."""
        bs = self.block_size
        deepest = last_cache_position(request.num_computed_tokens, bs, use_eagle) // bs - 1
        last = last_cache_position(request.num_prompt_tokens, bs, use_eagle) // bs - 1
        hashes = resolve_block_hashes(request.block_hashes, self.pool.hash_block_size, bs)
        for index in {deepest, last}:
            if not 0 <= index < len(hashes):
                continue
            node = self.nodes.get(hashes[index])
            if node is None or not node.state or (node.resumable and not node.provisional):
                continue
            node.resumable, node.provisional = True, False
            self.dropped.pop(node.key, None)
            if self._free_blocks(node.key, (self.primary,)):  # already released: rank it now
                self._rank(node)

    # --- called by the block pool ---------------------------------------------------------

    def after_free(self, blocks: list[KVCacheBlock]) -> None:
        """Sort the blocks that just became cached-and-free into their tiers."""
        for block in blocks:
            key = block.block_hash
            if key is None or block.ref_cnt != 0 or block.is_null:
                continue
            self.clock += 1
            group = get_group_id(key)
            block_hash = get_block_hash(key)
            if group in self.mamba_set:
                if group != self.primary:
                    continue  # a state's other pages go with its primary page
                node = self.nodes.get(block_hash)
                if node is None or not node.state:
                    self.orphans[block_hash] = None
                elif node.resumable:
                    self._rank(node)
                    if node.bet:
                        self.bets.pop(block_hash, None)
                        self.bets[block_hash] = None  # most recent last
                else:
                    self.dropped.pop(block_hash, None)
                    self.dropped[block_hash] = None  # most recent last
                    if not node.dropped:
                        node.dropped = True
                        self.counters.states_dropped += 1
            elif group in self.attention_set:
                node = self.nodes.get(block_hash)
                if node is None or not node.live:
                    self.dead_attention[block_hash] = None

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
                node = self.nodes.get(block_hash)
                if node is not None:
                    self._set_state(node, False)
                if self._any_cached(block_hash, self.mamba_groups):
                    self.orphans[block_hash] = None  # the state's pages left in other groups
                else:
                    self.orphans.pop(block_hash, None)
        elif group in self.attention_set:
            if self.pool.get_cached_block(block_hash, self.attention_groups) is None:
                node = self.nodes.get(block_hash)
                if node is not None:
                    self._remove_subtree(node)
                if self._any_cached(block_hash, self.attention_groups):
                    self.dead_attention[block_hash] = None  # other attention groups' copies
                else:
                    self.dead_attention.pop(block_hash, None)
        return reason

    def _any_cached(self, block_hash: BlockHash, groups: Iterable[int]) -> bool:
        cache = self.pool.cached_block_hash_to_block
        return any(cache.get_one_block(make_block_hash_with_group_id(block_hash, g)) for g in groups)

    # --- victims ----------------------------------------------------------------------------

    def _rank_again(self, node: _Node) -> None:
        """A released, ranked state whose utility just dropped: its entry is replaced (the
        heap only re-scores upwards when it pops an entry)."""
        released = self.released.get(node.key)
        if released is not None and node.key in self.ranked_seq:
            self._rank(node, released)

    def _utility(self, node: _Node) -> float:
        """The state's utility now (it changes as states around it come and go)."""
        if node.provisional:
            return 0.0  # its request still runs: recency alone until it lets go
        if node.live_children > 0 and not node.branched and not node.shared:
            # Kept for its own request's continuation, and that continuation has since
            # cached a deeper state on a path that never branched: only a request diverging
            # between the two would resume here (Marconi keeps states at branch points and
            # sequence ends only). A conversation's earlier turns are the common case.
            # Ranked by recency alone. (Checkpoints and junction stops are expected branch
            # points and keep their utility.)
            return 0.0
        ancestor = node.parent
        while ancestor is not None and not ancestor.state:
            ancestor = ancestor.parent
        bs = self.block_size
        attention = exclusive_attention_blocks(self._up(node))
        return state_utility(
            (node.index + 1) * bs,
            (ancestor.index + 1) * bs if ancestor is not None else 0,
            len(self.mamba_groups) + attention * len(self.attention_groups),
        )

    @staticmethod
    def _up(node: _Node | None):
        while node is not None:
            yield node.state, node.live_children
            node = node.parent

    def _rank(self, node: _Node, released: int | None = None) -> None:
        if not node.admitted:
            node.admitted = True
            self.counters.states_admitted += 1
        released = self.clock if released is None else released
        self.seq += 1
        self.ranked_seq[node.key] = self.seq
        self.released[node.key] = released
        score = eviction_score(released, self._utility(node), self.alpha)
        heapq.heappush(self.ranked, (score, self.seq, node.key, released))
        if len(self.ranked) > 2 * len(self.ranked_seq) + 64:
            # Drop superseded entries (a state released again, or gone).
            self.ranked = [e for e in self.ranked if self.ranked_seq.get(e[2]) == e[1]]
            heapq.heapify(self.ranked)

    def _free_blocks(self, block_hash: BlockHash, groups: Iterable[int]) -> list[KVCacheBlock]:
        """The cached, unreferenced blocks of ``block_hash`` in ``groups`` (free-queue members)."""
        found = []
        cache = self.pool.cached_block_hash_to_block
        for group in groups:
            key = make_block_hash_with_group_id(block_hash, group)
            blocks = blocks_cached_under(cache, key)
            found.extend(b for b in blocks if b.ref_cnt == 0 and b.prev_free_block is not None)
        return found

    def _pick(self, count: int) -> list[KVCacheBlock]:
        """Up to ``count`` victims: useless pages, dropped states, then the lowest scores."""
        victims: list[KVCacheBlock] = []
        chosen: set[int] = set()

        def take(blocks: list[KVCacheBlock], reason: str) -> bool:
            """Add a unit's blocks; False if the unit did not fit whole (caller keeps it)."""
            for block in blocks:
                if len(victims) == count:
                    return False
                if block.block_id not in chosen:
                    chosen.add(block.block_id)
                    victims.append(block)
                    self.pending[block.block_id] = reason
            return True

        def drain(queue: OrderedDict, reason: str, groups: Sequence[int], stale: Callable[[Any], bool],
                  whole_state: bool, floor: float = 0) -> None:
            """Take ``queue``'s oldest entries (skipping those ``stale`` says are no victims any
            more) while blocks are missing and more than ``floor`` entries are left.
            ``whole_state``: only a state none of whose pages is in use again."""
            while len(victims) < count and len(queue) > floor:
                block_hash, _ = queue.popitem(last=False)
                if stale(self.nodes.get(block_hash)):
                    continue
                if whole_state and not self._free_blocks(block_hash, (self.primary,)):
                    continue  # in use again: sorted again when it is released
                if not take(self._free_blocks(block_hash, groups), reason):
                    queue[block_hash] = None
                    queue.move_to_end(block_hash, last=False)

        # A node whose state is back (its prefix was recomputed) is no orphan; attention
        # below which a state was cached since is needed again.
        drain(self.orphans, "orphan_state", self.mamba_groups,
              lambda node: node is not None and node.state, whole_state=False)
        drain(self.dead_attention, "attention_past_state", self.attention_groups,
              lambda node: node is not None and node.live, whole_state=False)
        drain(self.dropped, "dropped_state", self.mamba_groups,
              lambda node: node is None or not node.state or node.resumable, whole_state=True)
        budget = checkpoint_budget(
            self.pool.num_gpu_blocks / len(self.mamba_groups), self.checkpoint_share, self.bets_won,
            self.bets_lost,
        )
        drain(self.bets, "unproven_checkpoint", self.mamba_groups,
              lambda node: node is None or not node.state or not node.bet, whole_state=True,
              floor=budget)
        while len(victims) < count and self.ranked:
            entry = heapq.heappop(self.ranked)
            score, seq, block_hash, released = entry
            if self.ranked_seq.get(block_hash) != seq:
                continue  # superseded by a later release
            node = self.nodes.get(block_hash)
            if node is None or not node.state or not self._free_blocks(block_hash, (self.primary,)):
                self.ranked_seq.pop(block_hash, None)
                self.released.pop(block_hash, None)
                continue
            current = eviction_score(released, self._utility(node), self.alpha)
            if current > score:
                # Worth more now (a state below it or before it is gone): back in line.
                # Scores only grow here, so each entry comes back at most once per call.
                heapq.heappush(self.ranked, (current, seq, block_hash, released))
                continue
            if not take(self._free_blocks(block_hash, self.mamba_groups), "ranked_state"):
                heapq.heappush(self.ranked, entry)
        return victims


def retention_of(pool: Any) -> StateRetention | None:
    return getattr(pool, _ATTR, None)


def install_retention(
    pool: Any,
    block_size: int,
    attention_groups: list[int],
    mamba_groups: list[int],
    settings: RetentionSettings,
    counters: Any,
) -> StateRetention:
    retention = StateRetention(pool, block_size, attention_groups, mamba_groups, settings, counters)
    setattr(pool, _ATTR, retention)
    return retention


def remove_retention(pool: Any) -> None:
    if getattr(pool, _ATTR, None) is not None:
        setattr(pool, _ATTR, None)


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
