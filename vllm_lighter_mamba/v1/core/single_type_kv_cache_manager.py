"""The Mamba block manager of the lighter cache.

Layout of a request's Mamba block table (position-indexed, like attention's): the block at
position ``i`` holds the recurrent state after token ``(i + 1) * block_size``. Only a few
positions hold a real block at any time; every other one is vLLM's null block:

- the prefix-cache hit (the state at the hit boundary), until the first chunk has copied it;
- the running state at ``cdiv(num_tokens, block_size) - 1`` plus ``num_speculative_blocks``;
- the previous running block, which is this step's copy source: freed one step later, once
  the processed-token count (which excludes in-flight steps) has moved past it.

A block is hashed (cached) by vLLM's ``cache_full_blocks`` when its position fills, and it
then holds the exact boundary state, because the scheduler ends prefill chunks on block
boundaries and decode advances one token at a time. A block whose state was left mid-block
and then crossed by a longer step would hold the wrong state for its boundary: it is taken
out of its position before it can be hashed ("detached") and freed like a skipped block.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from vllm_lighter_mamba.v1.metrics.counters import COUNTERS, MAMBA_GROUP_IDS


def running_position(num_tokens: int, block_size: int) -> int:
    """Position of the block that holds the state after ``num_tokens`` tokens."""
    return max(cdiv(num_tokens, block_size) - 1, 0)


def new_positions(num_held: int, num_tokens: int, block_size: int, num_spec: int) -> range:
    """Positions that must get a block for a step ending at ``num_tokens`` tokens.

    ``num_held`` is the length of the request's block list before the step (hit blocks
    included). Positions below the running one are padded with null blocks.
    """
    first = running_position(num_tokens, block_size)
    return range(max(first, num_held), first + 1 + num_spec)


class LighterMambaManager(MambaManager):
    """Put in place of ``MambaManager`` for Mamba-type groups while the variable is on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert self.mamba_cache_mode != "align", "the lighter cache replaces align mode"
        # Position of the running block of each request (the last step's destination).
        self.running_pos: dict[str, int] = {}
        # Lowest position that may still hold a non-null block below the running one.
        self._scan_from: dict[str, int] = {}
        # Token count at the end of each request's last scheduled step.
        self._last_end: dict[str, int] = {}
        # Blocks taken out of their position but still read by an in-flight copy.
        self._detached: dict[str, list[tuple[int, KVCacheBlock]]] = {}
        MAMBA_GROUP_IDS.add(self.kv_cache_group_id)

    # --- hits and caching (vLLM's logic; counted for the metrics) ---------------------

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        super().add_local_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
        if any(not block.is_null for block in new_computed_blocks):
            COUNTERS.state_hits += 1
            COUNTERS.state_hit_tokens += num_local_computed_tokens

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval=retention_interval)
        after = self.num_cached_block.get(request.request_id, 0)
        blocks = self.req_to_blocks[request.request_id][before:after]
        COUNTERS.states_cached += sum(1 for b in blocks if not b.is_null and b.block_hash is not None)

    # --- allocation -------------------------------------------------------------------

    def _num_reusable_spec_blocks(self, request_id: str, first: int) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        return len(self._reusable_spec_positions(request_id, blocks, first))

    def _reusable_spec_positions(
        self, request_id: str, blocks: list[KVCacheBlock], first: int
    ) -> list[int]:
        """Last step's speculative blocks that this step would skip: moved, not freed."""
        previous = self.running_pos.get(request_id)
        if previous is None or self.num_speculative_blocks == 0:
            return []
        candidates = range(previous + 1, min(previous + 1 + self.num_speculative_blocks, first))
        return [i for i in candidates if i < len(blocks) and not blocks[i].is_null]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        if (
            len(new_computed_blocks) > 0
            and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step
        ):
            # vLLM's rule: a state cached by another request in this step is not written
            # yet; report "does not fit" so the request waits one step.
            return self.block_pool.num_gpu_blocks + 1
        # Draft models have no Mamba layers: lookahead tokens need no state block.
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        positions = new_positions(
            num_held, num_tokens_main_model, self.block_size, self.num_speculative_blocks
        )
        first = running_position(num_tokens_main_model, self.block_size)
        num_new = max(len(positions) - self._num_reusable_spec_blocks(request_id, first), 0)
        return num_new + self._get_num_evictable_blocks(new_computed_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        num_held = len(blocks)
        first = running_position(num_tokens_main_model, self.block_size)
        self._detach_inexact_source(request_id, blocks, first)
        self._last_end[request_id] = num_tokens_main_model
        positions = new_positions(
            num_held, num_tokens_main_model, self.block_size, self.num_speculative_blocks
        )
        self.running_pos[request_id] = first
        if len(positions) == 0:
            return []
        reusable = self._reusable_spec_positions(request_id, blocks, first)
        num_fresh = max(len(positions) - len(reusable), 0)
        fresh = self.block_pool.get_new_blocks(num_fresh) if num_fresh else []
        blocks.extend([self._null_block] * (positions.start - num_held))
        for _ in positions:
            if reusable:
                source = reusable.pop(0)
                blocks.append(blocks[source])
                blocks[source] = self._null_block
            else:
                blocks.append(fresh.pop(0))
        # The worker's block table is append-only: it receives every appended entry.
        return blocks[num_held:]

    def _detach_inexact_source(self, request_id: str, blocks: list[KVCacheBlock], first: int) -> None:
        """Keep a mid-block state from being cached as the state of its block's boundary.

        The previous running block holds the state after the previous step's last token.
        If that token was not its block's last one and this step runs past the block, the
        block would be hashed as "state at the boundary" while holding an earlier state.
        Prefill chunks are aligned and decode moves one token at a time, so this happens
        only for multi-token steps after an unaligned prompt end (e.g. drafted tokens).
        """
        previous = self.running_pos.get(request_id)
        last_end = self._last_end.get(request_id)
        if previous is None or last_end is None or previous >= first:
            return
        if last_end % self.block_size == 0 or previous >= len(blocks):
            return
        block = blocks[previous]
        if block.is_null:
            return
        blocks[previous] = self._null_block
        self._detached.setdefault(request_id, []).append((previous, block))

    # --- freeing ----------------------------------------------------------------------

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        if processed_computed_tokens <= 0 or request_id not in self.req_to_blocks:
            return
        keep_from = running_position(processed_computed_tokens, self.block_size)
        blocks = self.req_to_blocks[request_id]
        start = self._scan_from.get(request_id, 0)
        stop = min(keep_from, len(blocks))
        freed = []
        for i in range(start, stop):
            if not blocks[i].is_null:
                freed.append(blocks[i])
                blocks[i] = self._null_block
        detached = self._detached.get(request_id)
        if detached:
            freed.extend(block for pos, block in detached if pos < keep_from)
            self._detached[request_id] = [(p, b) for p, b in detached if p >= keep_from]
        if stop > start:
            self._scan_from[request_id] = stop
        if freed:
            # Tail first, as vLLM frees, so the oldest states are evicted first.
            self.block_pool.free_blocks(reversed(freed))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.running_pos.pop(request_id, None)
        self._scan_from.pop(request_id, None)
        self._last_end.pop(request_id, None)
        detached = [block for _, block in self._detached.pop(request_id, [])]
        return detached + super().pop_blocks_for_free(request_id)
