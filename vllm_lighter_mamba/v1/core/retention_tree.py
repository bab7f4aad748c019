"""The prefix tree of cached boundary states that the retention policy keeps per block pool.

One node per block hash (a prefix) on a chain that leads to a cached boundary state: its
parent, whether a complete state (a page in every Mamba group) is cached there, and how many
children lead to one ("live"). An attention block whose node is missing or not live is past
the deepest state on its chain: no hit can reach it. When the last attention copy of a prefix
is evicted, the states below it cannot be reached either.

The tree only keeps its own structure. What a change means for eviction (a state gone, a
prefix no hit can reach, a state that became a pass-through) it reports to a
:class:`TreeListener` (the eviction tiers, ``retention_tiers.py``) as it happens, so the
tiers see the changes in the same order as the tree makes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from vllm.v1.core.kv_cache_utils import BlockHash


class PrefixNode:
    """A cached prefix (one block hash) on a chain that leads to a cached state."""

    __slots__ = ("key", "parent", "children", "index", "state", "live_children", "resumable", "admitted",
                 "dropped", "branched", "provisional", "shared", "bet", "prompt_end",
                 "continuation")

    def __init__(self, key: BlockHash, parent: PrefixNode | None, index: int) -> None:
        self.key = key
        self.parent = parent
        self.children: set[PrefixNode] = set()
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
        # The prompt's last boundary of the request that cached it, and no continuation has
        # resumed past it yet: the deeper states below it are that request's own decode's,
        # which a repeat of the prompt cannot reach (a sequence end, not a pass-through).
        self.prompt_end = False
        # The boundary its request's decode ends on, kept for a next turn nobody has resumed
        # from yet: a bet on a continuation (settled like a checkpoint bet, on its own record).
        self.continuation = False

    @property
    def live(self) -> bool:
        return self.state or self.live_children > 0


class TreeListener(Protocol):
    """What the tree tells about its changes (implemented by ``retention_tiers.EvictionTiers``)."""

    def bet_lost(self, node: PrefixNode) -> None:
        """A checkpoint's or continuation's bet: its state is gone before anyone resumed from it."""

    def forget(self, key: BlockHash) -> None:
        """The state at ``key`` is gone: its entries among the released states are stale."""

    def unreachable(self, key: BlockHash) -> None:
        """The attention at ``key`` is past every cached state on its chain."""

    def pass_through(self, node: PrefixNode) -> None:
        """``node``'s state got its first deeper state on a path that never branched."""


class PrefixTree:
    """The nodes of one pool, by block hash (see the module docstring)."""

    def __init__(self, listener: TreeListener) -> None:
        self.listener = listener
        self.nodes: dict[BlockHash, PrefixNode] = {}

    def clear(self) -> None:
        self.nodes = {}

    def chain(self, block_hashes: Sequence[BlockHash], index: int) -> PrefixNode:
        """The node of ``block_hashes[index]``, creating the missing ones above it."""
        j = index
        while j >= 0 and block_hashes[j] not in self.nodes:
            j -= 1
        parent = self.nodes[block_hashes[j]] if j >= 0 else None
        node = parent
        for k in range(j + 1, index + 1):
            node = PrefixNode(block_hashes[k], parent, k)
            self.nodes[node.key] = node
            if parent is not None:
                parent.children.add(node)
                if len(parent.children) > 1:
                    parent.branched = True
            parent = node
        assert node is not None
        return node

    def set_state(self, node: PrefixNode, value: bool) -> None:
        """A complete state is now cached at ``node`` (``value``), or no longer."""
        if node.state == value:
            return
        was_live = node.live
        node.state = value
        if not value:
            if node.bet or node.continuation:
                self.listener.bet_lost(node)
            self.listener.forget(node.key)
        if node.live != was_live:
            self._liveness_changed(node)

    def _liveness_changed(self, node: PrefixNode) -> None:
        """Carry a node's change of liveness up its chain (stops where nothing changes)."""
        while True:
            if not node.live:
                self.listener.unreachable(node.key)
            parent = node.parent
            if parent is None:
                return
            was_live = parent.live
            parent.live_children += 1 if node.live else -1
            if node.live and parent.live_children == 1 and parent.state and not parent.branched:
                self.listener.pass_through(parent)  # its first deeper state
            if parent.live == was_live:
                return
            node = parent

    def remove_subtree(self, node: PrefixNode) -> list[BlockHash]:
        """The prefix's attention is gone: nothing below it can be reached by a hit. Removes
        ``node`` and everything below it; returns the keys of the states removed (orphans:
        first in line for eviction, after the attention below ``node``)."""
        orphaned = []
        stack = [node]
        while stack:
            current = stack.pop()
            if current.state:
                orphaned.append(current.key)
                if current.bet or current.continuation:
                    self.listener.bet_lost(current)
            stack.extend(current.children)
            del self.nodes[current.key]
            self.listener.forget(current.key)
            if current is not node:
                self.listener.unreachable(current.key)
        parent = node.parent
        if parent is not None:
            parent.children.discard(node)
            if node.live:  # the parent loses a live child
                node.state, node.live_children = False, 0
                self._liveness_changed(node)
        return orphaned


def chain_up(node: PrefixNode | None) -> Iterator[tuple[bool, int]]:
    """``(has_state, live_children)`` of ``node``, then of its parent, and so on to the root
    (the input of ``retention_policy.exclusive_attention_blocks``)."""
    while node is not None:
        yield node.state, node.live_children
        node = node.parent


def nearest_state_above(node: PrefixNode) -> PrefixNode | None:
    """The closest ancestor of ``node`` that holds a cached state (None if none does)."""
    ancestor = node.parent
    while ancestor is not None and not ancestor.state:
        ancestor = ancestor.parent
    return ancestor
