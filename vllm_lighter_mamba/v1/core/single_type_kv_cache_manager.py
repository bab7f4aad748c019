"""The Mamba block manager of the lighter cache.

Layout of a request's Mamba block table (position-indexed, like attention's): the block at
position ``i`` holds the recurrent state after token ``(i + 1) * block_size``. Only a few
positions hold a real block at any time; every other one is vLLM's null block:

- the prefix-cache hit (the state at the hit boundary), until the first chunk has copied it;
- the running state at ``cdiv(num_tokens, block_size) - 1`` plus ``num_speculative_blocks``;
- the previous running block, which is this step's copy source: freed once the
  processed-token count (which excludes in-flight steps) has moved past it;
- where the forward can write a state inside a chunk (the spec's
  ``prefill_checkpoint_alignment``), the last cache position of the chunk that reaches the
  prefill end (its internal checkpoint, ``policy.internal_checkpoint``): a fresh block instead
  of a null one, hashed when the chunk is scheduled like any filled position and freed as
  cached once the chunk is processed.

A block is hashed (cached) by vLLM's ``cache_full_blocks`` when its position fills, and it
then holds the exact boundary state, because the scheduler ends prefill chunks on block
boundaries and decode advances one token at a time. A block whose state was left mid-block
and then crossed by a longer step would hold the wrong state for its boundary: it is taken
out of its position before it can be hashed ("detached") and freed like a skipped block.
A decode step with draft tokens is the exception: after sampling the worker copies the
boundary state into that block (``ops/spec_settle.py``), so it stays and is hashed.

The primary Mamba group's manager (the lowest group id: one state is one page per group,
counted once; :func:`primary_group`) also tells the pool's retention bookkeeping
(``block_pool_retention``) which states it cached, which one a request resumed from, and when
a request let go of its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_lighter_mamba.v1.core.block_pool_retention import retention_of
from vllm_lighter_mamba.v1.core.retention_guard import with_retention
from vllm_lighter_mamba.v1.core.sched.policy import internal_checkpoint
from vllm_lighter_mamba.v1.metrics.counters import engine_counters

_PRIMARY = "_lighter_mamba_primary_group"


def claim_primary_group(block_pool: Any, group_id: int) -> None:
    """Every lighter Mamba group's manager registers its group on the engine's pool (shared by
    all of them); the lowest group id is the primary one: one state is a page in each Mamba
    group, so that group's manager alone counts states and tells the retention policy."""
    current = getattr(block_pool, _PRIMARY, None)
    if current is None or group_id < current:
        setattr(block_pool, _PRIMARY, group_id)


def primary_group(block_pool: Any) -> int | None:
    """The pool's primary Mamba group (None: no lighter Mamba manager uses this pool)."""
    return getattr(block_pool, _PRIMARY, None)


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


def worker_settles_step(
    num_computed: int, num_tokens: int, num_output_placeholders: int, step_end: int
) -> bool:
    """Whether a step of a request that ends at ``step_end`` tokens is a decode step with
    draft tokens: vLLM schedules drafts when the step runs past the request's known (and
    in-flight) tokens, and the runner treats the row as spec decode when the step starts at
    the last known token (1 + drafts tokens); the lighter runner then settles its accepted
    states, the state of a boundary crossed included, into their blocks."""
    known_end = num_tokens + num_output_placeholders
    return num_computed == known_end - 1 and step_end > known_end


@dataclass
class RequestState:
    """What the manager keeps per request, beyond vLLM's own block list."""

    # Position of the running block (the last step's destination).
    running_pos: int
    # Token count at the end of the request's last scheduled step.
    last_end: int
    # Lowest position that may still hold a non-null block below the running one.
    scan_from: int = 0
    # Blocks taken out of their position but still read by an in-flight copy.
    detached: list[tuple[int, KVCacheBlock]] = field(default_factory=list)
    # The previous running position when this step runs past it from a mid-block state:
    # detached before hashing unless the worker settles the step (decided in cache_blocks,
    # where vLLM passes the request, right after the allocation).
    crossed_mid_block: int | None = None
    # vLLM's Request (set when its blocks are first cached, or when it resumed from a state):
    # the retention policy reads its tokens and prompt when the request lets go of its blocks.
    request: Any = None


class LighterMambaManager(MambaManager):
    """Built by vLLM's ``KVCacheSpecRegistry`` for ``LighterMambaSpec`` groups."""

    # Hits are whole blocks: a state exists only at a block boundary (align's sub-block
    # hits need its partial-tail states). This also keeps vLLM's fine-grained lookup off.
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, **kwargs: Any) -> None:
        # vLLM 0.34's MambaManager.__init__ asserts that Mamba prefix caching runs in "align"
        # mode; our spec keeps "none" (vLLM's own Mamba cache off) and this class caches. The
        # parent is built without caching, which only that check reads, and gets the engine's
        # setting right after.
        enable_caching = kwargs.pop("enable_caching")
        super().__init__(kv_cache_spec, block_pool, enable_caching=False, **kwargs)
        self.enable_caching: bool = enable_caching
        assert self.mamba_cache_mode == "none", "the lighter cache replaces vLLM's Mamba cache modes"
        self.states: dict[str, RequestState] = {}
        # Prefix-cache hits not yet told to the retention policy: request id -> (hash, tokens).
        self._hits: dict[str, tuple[Any, int]] = {}
        # The position of the block the forward writes inside the step being allocated
        # (decided where vLLM passes the chunk's prefill end, used by the allocation after it).
        self._checkpoint_positions: dict[str, int] = {}
        claim_primary_group(self.block_pool, self.kv_cache_group_id)

    # --- lookup (vLLM's logic; the hit told to the retention policy) --------------------

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Any,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks, hit_length = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, *args, **kwargs
        )
        state = hit_blocks[0][-1] if hit_blocks and hit_blocks[0] else None
        if (
            state is not None
            and not state.is_null
            and state.block_hash is not None
            and primary_group(block_pool) in kv_cache_group_ids
        ):
            # A request waiting for blocks asks again every step: keep what it asks for.
            block_hash = get_block_hash(state.block_hash)
            with_retention(block_pool, "state_wanted", lambda policy: policy.state_wanted(block_hash), None)
        return hit_blocks, hit_length

    # --- caching (vLLM's logic; counted for the metrics) ------------------------------

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        state = self.states.get(request.request_id)
        if state is not None and state.crossed_mid_block is not None:
            settled = bool(request.spec_token_ids) and worker_settles_step(
                request.num_computed_tokens, request.num_tokens, request.num_output_placeholders,
                state.last_end,
            )
            self._resolve_crossed_block(state, self.req_to_blocks[request.request_id], keep=settled)
        before = self.num_cached_block.get(request.request_id, 0)
        # Dense (``None``): every boundary state a chunk end or a decode leaves is cached. vLLM
        # 0.32's default interval 0 would hash only the replay boundaries of Mamba groups (sparse
        # retention, ``MambaManager.reachable_block_mask``): a decode-crossed boundary, what a
        # next turn resumes from, would stay unhashed. What to evict under pressure is our
        # retention policy's decision (``block_pool_retention``); a user-set interval is a
        # start-up error (``config.align_option_conflicts``).
        del retention_interval
        super().cache_blocks(
            request, num_tokens, retention_interval=None, replay_boundaries=replay_boundaries
        )
        after = self.num_cached_block.get(request.request_id, 0)
        # One state per boundary, whatever the number of Mamba groups: the lowest counts.
        if after > before and primary_group(self.block_pool) == self.kv_cache_group_id:
            blocks = self.req_to_blocks[request.request_id]
            cached = [
                i for i in range(before, after) if not blocks[i].is_null and blocks[i].block_hash is not None
            ]
            counters = engine_counters(self.block_pool)
            counters.states_cached += len(cached)
            counters.states_held += len(cached)
            self._keep_request(request)
            drop = self.drop_eagle_checkpoint_block

            def tell_cached(policy: Any) -> None:
                for index in cached:
                    policy.state_cached(request, index, drop)

            with_retention(self.block_pool, "state_cached", tell_cached, None)
        hit = self._hits.pop(request.request_id, None) if self._hits else None
        if hit is not None:
            # The deepest hit this prompt allows (vLLM recomputes at least the last token).
            deepest = (request.num_tokens - 1) // self.block_size * self.block_size
            block_hash, repeat, request_id = hit[0], hit[1] >= deepest, request.request_id
            with_retention(
                self.block_pool, "state_hit",
                lambda policy: policy.state_hit(block_hash, repeat=repeat, request_id=request_id), None,
            )
            # Released through the policy too (even if it caches no state of its own): the
            # state it resumed from is ranked afresh then, and its record dropped.
            self._keep_request(request)

    def _keep_request(self, request: Any) -> None:
        """Keep vLLM's Request for the retention policy's ``request_released``."""
        state = self.states.get(request.request_id)
        if state is not None and state.request is None:
            state.request = request

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        super().add_local_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
        if new_computed_blocks and primary_group(self.block_pool) == self.kv_cache_group_id:
            hit = new_computed_blocks[-1]
            if retention_of(self.block_pool) is not None and not hit.is_null and hit.block_hash is not None:
                # Told to the policy with the request's length, known at its first caching.
                self._hits[request_id] = (get_block_hash(hit.block_hash), num_local_computed_tokens)

    # --- allocation -------------------------------------------------------------------

    def _reusable_spec_positions(
        self, request_id: str, blocks: list[KVCacheBlock], first: int
    ) -> list[int]:
        """Last step's speculative blocks that this step would skip: moved, not freed."""
        state = self.states.get(request_id)
        if state is None or self.num_speculative_blocks == 0:
            return []
        previous = state.running_pos
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
        prefill_end: int = 0,
    ) -> int:
        if (
            len(new_computed_blocks) > 0
            and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step
        ):
            # vLLM's rule: a state cached by another request in this step is not written
            # yet; report "does not fit" so the request waits one step.
            return self.block_pool.num_gpu_blocks + 1
        # Draft models have no Mamba layers: lookahead tokens need no state block.
        first = running_position(num_tokens_main_model, self.block_size)
        state = self.states.get(request_id)
        if state is not None and state.running_pos == first and not new_computed_blocks:
            if self._checkpoint_positions and not apply_admission_cap:
                self._checkpoint_positions.pop(request_id, None)
            return 0  # the common decode step: still inside the running block
        blocks = self.req_to_blocks.get(request_id, [])
        num_held = len(blocks) + len(new_computed_blocks)
        positions = new_positions(
            num_held, num_tokens_main_model, self.block_size, self.num_speculative_blocks
        )
        num_reusable = len(self._reusable_spec_positions(request_id, blocks, first))
        checkpoint = self._checkpoint_position(total_computed_tokens, num_tokens_main_model, prefill_end)
        if not apply_admission_cap:  # (that call sizes the whole request, not this step)
            self._checkpoint_positions[request_id] = checkpoint
        return (
            max(len(positions) - num_reusable, 0)
            + int(checkpoint >= 0)
            + self._get_num_evictable_blocks(new_computed_blocks)
        )

    def _checkpoint_position(self, start: int, end: int, prefill_end: int) -> int:
        """The position of the block the forward writes inside the chunk ``[start, end)``
        (``policy.internal_checkpoint``, the rule the scheduler and the worker ask), or -1."""
        boundary = internal_checkpoint(
            start, end, prefill_end, self.block_size, self.kv_cache_spec.prefill_checkpoint_alignment
        )
        return boundary // self.block_size - 1 if boundary else -1

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        first = running_position(num_tokens_main_model, self.block_size)
        state = self.states.get(request_id)
        if state is not None and state.running_pos == first:
            state.last_end = num_tokens_main_model
            return []  # the common decode step: its blocks were allocated with the running one
        blocks = self.req_to_blocks[request_id]
        num_held = len(blocks)
        if state is not None:
            self._resolve_crossed_block(state, blocks, keep=False)  # not cached since: detach
            state.crossed_mid_block = self._crossed_mid_block(state, blocks, first)
        # Read "last step's speculative blocks" before the running position moves on.
        reusable = self._reusable_spec_positions(request_id, blocks, first)
        if state is None:
            self.states[request_id] = RequestState(running_pos=first, last_end=num_tokens_main_model)
        else:
            state.running_pos, state.last_end = first, num_tokens_main_model
        positions = new_positions(
            num_held, num_tokens_main_model, self.block_size, self.num_speculative_blocks
        )
        if len(positions) == 0:
            return []
        checkpoint = self._checkpoint_positions.pop(request_id, -1)
        # The worker writes every checkpoint position whose entry is not null; every position
        # of this chunk is appended now (a chunk with a checkpoint starts on a block boundary
        # and has no speculative blocks), so a null entry can only be this step's padding.
        assert checkpoint < 0 or num_held <= checkpoint < positions.start, (checkpoint, num_held)
        num_fresh = max(len(positions) - len(reusable), 0) + int(checkpoint >= 0)
        fresh = self.block_pool.get_new_blocks(num_fresh) if num_fresh else []
        blocks.extend([self._null_block] * (positions.start - num_held))
        if checkpoint >= 0:
            blocks[checkpoint] = fresh.pop()
        for _ in positions:
            if reusable:
                source = reusable.pop(0)
                blocks.append(blocks[source])
                blocks[source] = self._null_block
            else:
                blocks.append(fresh.pop(0))
        # The worker's block table is append-only: it receives every appended entry.
        return blocks[num_held:]

    def _crossed_mid_block(self, state: RequestState, blocks: list[KVCacheBlock], first: int) -> int | None:
        """The previous running position if this step leaves it from a mid-block state.

        That block holds the state after the previous step's last token. If that token was
        not its block's last one and this step runs past the block, the block would be
        hashed as "state at the boundary" while holding an earlier state, unless the worker
        copies the boundary state in (speculative decoding). Prefill chunks are aligned and
        decode moves one token at a time, so this happens only for multi-token steps after
        an unaligned end: drafted tokens, or EAGLE's shortened last cacheable chunk.
        """
        previous = state.running_pos
        if previous >= first or state.last_end % self.block_size == 0 or previous >= len(blocks):
            return None
        return None if blocks[previous].is_null else previous

    def _resolve_crossed_block(self, state: RequestState, blocks: list[KVCacheBlock], keep: bool) -> None:
        """Keep the crossed block in its position (the worker settles its boundary state), or
        detach it: out of its position before it is hashed, freed once no copy reads it."""
        position, state.crossed_mid_block = state.crossed_mid_block, None
        if position is None or keep:
            return
        block = blocks[position]
        if not block.is_null:
            blocks[position] = self._null_block
            state.detached.append((position, block))

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
        state = self.states.get(request_id)
        start = state.scan_from if state is not None else 0
        blocks = self.req_to_blocks[request_id]
        stop = min(keep_from, len(blocks))
        if stop <= start and (state is None or not state.detached):
            return  # the common decode step: nothing below the running block to free
        freed = []
        for i in range(start, stop):
            if not blocks[i].is_null:
                freed.append(blocks[i])
                blocks[i] = self._null_block
        if state is not None:
            if state.detached:
                freed.extend(block for pos, block in state.detached if pos < keep_from)
                state.detached = [(p, b) for p, b in state.detached if p >= keep_from]
            state.scan_from = max(state.scan_from, stop)
        if freed:
            # Tail first, as vLLM frees, so the oldest states are evicted first.
            self.block_pool.free_blocks(reversed(freed))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._hits.pop(request_id, None)
        self._checkpoint_positions.pop(request_id, None)
        state = self.states.pop(request_id, None)
        primary = primary_group(self.block_pool) == self.kv_cache_group_id
        if state is not None and state.request is not None and primary:
            request, drop = state.request, self.drop_eagle_checkpoint_block
            with_retention(
                self.block_pool, "request_released", lambda p: p.request_released(request, drop), None
            )
        detached = [block for _, block in state.detached] if state is not None else []
        return detached + super().pop_blocks_for_free(request_id)
