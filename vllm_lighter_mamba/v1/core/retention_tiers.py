"""The eviction order of the retention policy: released cached blocks sorted into tiers.

Per block pool, the released (cached, unreferenced) blocks the policy knows about, by tier,
in the order victims are taken (``retention_policy.EVICTION_REASONS``):

0. duplicate copies: free pages of a prefix another block also holds (a request recomputed
   cached tokens), oldest first: while the other copy is cached, evicting one loses no hit;
1. orphans: state pages that can serve no hit (their attention prefix is gone, or the state
   lost a page in another Mamba group), oldest first;
2. attention past the deepest state cached on its chain (a hit can never reach it);
3. dropped states (not admitted: no later request is expected to resume there);
4. checkpoint bets beyond their share of the pool (``retention_policy.checkpoint_budget``),
   oldest first; then, the same way on their own record, continuation bets (decode ends no
   next turn has resumed from yet);
5. admitted states in a heap by ``retention_policy.eviction_score``.

Entries are invalidated lazily: each is checked when taken (a block touched by a hit since,
a state gone or back, a state released again with a newer heap entry), so the pool needs no
hook besides the ones ``block_pool_retention`` wires. These tiers never read vLLM's pool:
which pages of a prefix are free comes from a :class:`FreePages` (the pool adapter).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock

from vllm_lighter_mamba.v1.core.retention_policy import (
    checkpoint_budget,
    eviction_score,
    exclusive_attention_blocks,
    settle_bet,
    state_utility,
    utility_bonus_cap,
)
from vllm_lighter_mamba.v1.core.retention_tree import PrefixNode, chain_up, nearest_state_above


class FreePages(Protocol):
    """The cached, unreferenced blocks (free-queue members) of a prefix, read from the pool."""

    def state_pages(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        """The state's pages, in every Mamba group."""

    def attention_pages(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        """The prefix's attention blocks, in every attention group."""

    def state_released(self, block_hash: BlockHash) -> bool:
        """Whether the state's page in the primary Mamba group is free (no request holds it)."""

    def redundant(self, block: KVCacheBlock, excluded: set[int]) -> bool:
        """Whether ``block`` is a free-queue member whose prefix (hash and group) another cached
        block, not among the ``excluded`` block ids, also holds."""


class BetBook:
    """One kind of bet (a state align would not have cached, kept for a request that may come):
    its released states, oldest first, and the decayed record of how such bets went lately
    (``retention_policy.settle_bet``). Beyond their share of the pool
    (``retention_policy.checkpoint_budget``, scaled by that record) the oldest go before any
    ranked state."""

    def __init__(self) -> None:
        self.queue: OrderedDict[BlockHash, None] = OrderedDict()
        self.won = 0.0
        self.lost = 0.0

    def settle(self, key: BlockHash, won: bool) -> None:
        self.won, self.lost = settle_bet(self.won, self.lost, won)
        self.queue.pop(key, None)

    def released(self, key: BlockHash) -> None:
        self.queue.pop(key, None)
        self.queue[key] = None  # most recent last

    def budget(self, pool_states: float, share: float) -> float:
        return checkpoint_budget(pool_states, share, self.won, self.lost)


class EvictionTiers:
    """The tiers of one pool (see the module docstring); also the prefix tree's listener."""

    def __init__(
        self,
        block_size: int,
        num_mamba_groups: int,
        num_attention_groups: int,
        alpha: float,
        checkpoint_share: float,
        counters: Any,
        pool_pages: int,
        utility_cap: float,
    ) -> None:
        self.block_size = block_size
        self.num_mamba_groups = num_mamba_groups
        self.num_attention_groups = num_attention_groups
        self.alpha = alpha
        self.max_bonus = utility_bonus_cap(pool_pages, utility_cap)
        self.checkpoint_share = checkpoint_share
        self.counters = counters
        self.clear()

    def clear(self) -> None:
        # Free pages with another copy of their prefix cached, by block id, oldest first.
        self.duplicates: OrderedDict[int, KVCacheBlock] = OrderedDict()
        # Released cached blocks by tier (keys: block hashes without group), oldest first.
        self.orphans: OrderedDict[BlockHash, None] = OrderedDict()
        self.dead_attention: OrderedDict[BlockHash, None] = OrderedDict()
        self.dropped: OrderedDict[BlockHash, None] = OrderedDict()
        # Cold-prompt checkpoints nobody resumed from yet (a follower may), and decode ends
        # no next turn resumed from yet, each on its own record; their states are also ranked.
        self.checkpoint_bets = BetBook()
        self.continuation_bets = BetBook()
        # (score, seq, block hash, clock when released); only the latest seq of a hash counts.
        self.ranked: list[tuple[float, int, BlockHash, int]] = []
        self.ranked_seq: dict[BlockHash, int] = {}
        self.released: dict[BlockHash, int] = {}  # clock when a ranked state was released
        self.seq = 0
        # Advances by one per cached page released: the recency of eviction_score.
        self.clock = 0

    # --- the prefix tree's listener -----------------------------------------------------

    def bet_lost(self, node: PrefixNode) -> None:
        self.settle(node, won=False)

    def forget(self, key: BlockHash) -> None:
        self.ranked_seq.pop(key, None)
        self.released.pop(key, None)
        self.dropped.pop(key, None)
        self.checkpoint_bets.queue.pop(key, None)
        self.continuation_bets.queue.pop(key, None)

    def unreachable(self, key: BlockHash) -> None:
        self.dead_attention[key] = None

    def pass_through(self, node: PrefixNode) -> None:
        """A released, ranked state whose utility just dropped: its entry is replaced (the
        heap only re-scores upwards when it pops an entry)."""
        released = self.released.get(node.key)
        if released is not None and node.key in self.ranked_seq:
            self.rank(node, released)

    # --- state changes told by the pool adapter ------------------------------------------

    def settle(self, node: PrefixNode, won: bool) -> None:
        """A checkpoint's or continuation's bet is over: it is an ordinary state from now on
        (or gone)."""
        if node.bet:
            self.checkpoint_bets.settle(node.key, won)
            node.bet = False
        if node.continuation:
            self.continuation_bets.settle(node.key, won)
            node.continuation = False

    def tick(self) -> None:
        """A cached page was released."""
        self.clock += 1

    def state_released(self, block_hash: BlockHash, node: PrefixNode | None) -> None:
        """The state's primary page became cached-and-free: sort it into its tier."""
        if node is None or not node.state:
            self.orphans[block_hash] = None
        elif node.resumable:
            self.rank(node)
            if node.bet:
                self.checkpoint_bets.released(block_hash)
            if node.continuation:
                self.continuation_bets.released(block_hash)
        else:
            self.dropped.pop(block_hash, None)
            self.dropped[block_hash] = None  # most recent last
            if not node.dropped:
                node.dropped = True
                self.counters.states_dropped += 1

    def duplicate(self, block: KVCacheBlock) -> None:
        """A free page whose prefix another block also holds: first in line (checked again when
        taken)."""
        self.duplicates.pop(block.block_id, None)
        self.duplicates[block.block_id] = block

    def attention_released(self, block_hash: BlockHash, node: PrefixNode | None) -> None:
        if node is None or not node.live:
            self.dead_attention[block_hash] = None

    def readmit(self, node: PrefixNode, released: bool) -> None:
        """A dropped (or provisional) state is admitted after all; ``released``: its pages
        are free already, so it is ranked now (else when they are released)."""
        self.dropped.pop(node.key, None)
        if released:
            self.rank(node)

    def orphaned(self, keys: list[BlockHash]) -> None:
        """States whose attention prefix is gone: first in line."""
        for key in keys:
            self.orphans[key] = None

    def state_evicted(self, block_hash: BlockHash, pages_left: bool) -> None:
        """A page of the state was evicted; ``pages_left``: other Mamba groups still hold one."""
        if pages_left:
            self.orphans[block_hash] = None  # the state's pages left in other groups
        else:
            self.orphans.pop(block_hash, None)

    def attention_evicted(self, block_hash: BlockHash, copies_left: bool) -> None:
        """The prefix's attention was evicted; ``copies_left``: other attention groups' copies."""
        if copies_left:
            self.dead_attention[block_hash] = None
        else:
            self.dead_attention.pop(block_hash, None)

    # --- ranking ----------------------------------------------------------------------

    def utility(self, node: PrefixNode) -> float:
        """The state's utility now (it changes as states around it come and go)."""
        if node.provisional:
            return 0.0  # its request still runs: recency alone until it lets go
        if node.live_children > 0 and not node.branched and not node.shared and not node.prompt_end:
            # Kept for its own request's continuation, and that continuation has since
            # cached a deeper state on a path that never branched: only a request diverging
            # between the two would resume here (Marconi keeps states at branch points and
            # sequence ends only). A conversation's earlier turns are the common case.
            # Ranked by recency alone. (Checkpoints and junction stops are expected branch
            # points and keep their utility; so does a prompt's last boundary until a
            # continuation resumes past it: the states below are its own decode's, which a
            # repeat of the prompt cannot use.)
            return 0.0
        ancestor = nearest_state_above(node)
        bs = self.block_size
        attention = exclusive_attention_blocks(chain_up(node))
        return state_utility(
            (node.index + 1) * bs,
            (ancestor.index + 1) * bs if ancestor is not None else 0,
            self.num_mamba_groups + attention * self.num_attention_groups,
        )

    def rank(self, node: PrefixNode, released: int | None = None) -> None:
        if not node.admitted:
            node.admitted = True
            self.counters.states_admitted += 1
        released = self.clock if released is None else released
        self.seq += 1
        self.ranked_seq[node.key] = self.seq
        self.released[node.key] = released
        score = eviction_score(released, self.utility(node), self.alpha, self.max_bonus)
        heapq.heappush(self.ranked, (score, self.seq, node.key, released))
        if len(self.ranked) > 2 * len(self.ranked_seq) + 64:
            # Drop superseded entries (a state released again, or gone).
            self.ranked = [e for e in self.ranked if self.ranked_seq.get(e[2]) == e[1]]
            heapq.heapify(self.ranked)

    # --- victims ----------------------------------------------------------------------

    def pick(
        self, count: int, nodes: Mapping[BlockHash, PrefixNode], pages: FreePages, pool_states: float
    ) -> list[tuple[KVCacheBlock, str]]:
        """Up to ``count`` victims, each with the reason it was picked: useless pages,
        dropped states, unproven checkpoints beyond their share of the ``pool_states``
        states the pool holds, then the lowest scores."""
        victims: list[tuple[KVCacheBlock, str]] = []
        chosen: set[int] = set()

        def take(blocks: list[KVCacheBlock], reason: str) -> bool:
            """Add a unit's blocks; False if the unit did not fit whole (caller keeps it)."""
            for block in blocks:
                if len(victims) == count:
                    return False
                if block.block_id not in chosen:
                    chosen.add(block.block_id)
                    victims.append((block, reason))
            return True

        def drain(queue: OrderedDict, reason: str, free: Callable[[BlockHash], list[KVCacheBlock]],
                  stale: Callable[[PrefixNode | None], bool], whole_state: bool, floor: float = 0) -> None:
            """Take ``queue``'s oldest entries (skipping those ``stale`` says are no victims any
            more) while blocks are missing and more than ``floor`` entries are left.
            ``whole_state``: only a state none of whose pages is in use again."""
            while len(victims) < count and len(queue) > floor:
                block_hash, _ = queue.popitem(last=False)
                if stale(nodes.get(block_hash)):
                    continue
                if whole_state and not pages.state_released(block_hash):
                    continue  # in use again: sorted again when it is released
                if not take(free(block_hash), reason):
                    queue[block_hash] = None
                    queue.move_to_end(block_hash, last=False)

        while len(victims) < count and self.duplicates:
            _, block = self.duplicates.popitem(last=False)
            if pages.redundant(block, chosen):
                take([block], "duplicate_copy")
        # A node whose state is back (its prefix was recomputed) is no orphan; attention
        # below which a state was cached since is needed again.
        drain(self.orphans, "orphan_state", pages.state_pages,
              lambda node: node is not None and node.state, whole_state=False)
        drain(self.dead_attention, "attention_past_state", pages.attention_pages,
              lambda node: node is not None and node.live, whole_state=False)
        drain(self.dropped, "dropped_state", pages.state_pages,
              lambda node: node is None or not node.state or node.resumable, whole_state=True)
        drain(self.checkpoint_bets.queue, "unproven_checkpoint", pages.state_pages,
              lambda node: node is None or not node.state or not node.bet, whole_state=True,
              floor=self.checkpoint_bets.budget(pool_states, self.checkpoint_share))
        drain(self.continuation_bets.queue, "unproven_continuation", pages.state_pages,
              lambda node: node is None or not node.state or not node.continuation, whole_state=True,
              floor=self.continuation_bets.budget(pool_states, self.checkpoint_share))
        while len(victims) < count and self.ranked:
            entry = heapq.heappop(self.ranked)
            score, seq, block_hash, released = entry
            if self.ranked_seq.get(block_hash) != seq:
                continue  # superseded by a later release
            node = nodes.get(block_hash)
            if node is None or not node.state or not pages.state_released(block_hash):
                self.ranked_seq.pop(block_hash, None)
                self.released.pop(block_hash, None)
                continue
            current = eviction_score(released, self.utility(node), self.alpha, self.max_bonus)
            if current > score:
                # Worth more now (a state below it or before it is gone): back in line.
                # Scores only grow here, so each entry comes back at most once per call.
                heapq.heappush(self.ranked, (current, seq, block_hash, released))
                continue
            if not take(pages.state_pages(block_hash), "ranked_state"):
                heapq.heappush(self.ranked, entry)
        return victims
