"""vLLM's scheduler with block-aligned prefill chunks for hybrid models.

vLLM's ``Scheduler.schedule`` already calls a chunk-splitting hook,
``_mamba_block_aligned_split``, on both the running and the waiting path (after the token
budget, before encoder inputs, and skipping requests whose KV is being loaded
asynchronously). While the engine's config says the lighter cache is active we turn that
hook on and give it our policy; upstream's align-mode body never runs. Otherwise the mixin
changes nothing.

The chunk stops decided for a request (``request_stops``) are its :class:`RetentionPlan`, kept
in the scheduler's :class:`RetentionPlans` (by request id, dropped when the request leaves the
scheduler); the pool's retention bookkeeping holds the same object and reads them from there.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.request import Request, RequestStatus

from vllm_lighter_mamba.config import check_block_size, cold_checkpoints, is_active, retention_settings
from vllm_lighter_mamba.v1.core.block_pool_retention import install_retention
from vllm_lighter_mamba.v1.core.retention_plan import RetentionPlans, plan_request
from vllm_lighter_mamba.v1.core.sched.policy import (
    block_aligned_chunk_len,
    checkpoint_positions,
    in_prefill,
    last_cache_position,
    next_turn_stops,
)
from vllm_lighter_mamba.v1.metrics.counters import LighterMambaCounters, engine_counters

logger = init_logger("vllm.lighter_mamba")


class LighterMambaSchedulerMixin:
    """Mixed in front of vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lighter_mamba_active: bool = is_active(self.vllm_config) and bool(self.has_mamba_layers)
        self.lighter_counters: LighterMambaCounters | None = None
        # Per-request chunk stops, shared with the pool's retention bookkeeping.
        self.lighter_plans = RetentionPlans()
        # vLLM's async scheduler already hashes after every output (cache_accepted_boundaries).
        self.lighter_hash_after_output = self.lighter_mamba_active and not isinstance(self, AsyncScheduler)
        if self.lighter_mamba_active:
            self.need_mamba_block_aligned_split = True
            # Sub-block (fine-grained) hits are align mode's; we hit whole blocks only.
            self.mamba_partial_cache_hit = False
            self.lighter_block_size: int = self._lighter_block_size()
            self.lighter_checkpoint_alignment: int | None = self._lighter_checkpoint_alignment()
            self.lighter_cold_checkpoints: tuple[int, ...] = cold_checkpoints(self.vllm_config)
            # The block size is final only here (the KV-cache groups' page alignment can raise
            # it past what the workers' platform hook saw): check the budgets against it.
            check_block_size(self.vllm_config, self.lighter_block_size)
            logger.info("lighter Mamba cache: block size %d tokens", self.lighter_block_size)
            logger.info(
                "lighter Mamba cache: last boundary state of a prefill %s",
                "written inside the forward (internal checkpoint)"
                if self.lighter_checkpoint_alignment else "left by a chunk end",
            )
            self.lighter_counters = engine_counters(self.kv_cache_manager.block_pool)
            self._install_retention()

    def _lighter_block_size(self) -> int:
        """The block size of our Mamba groups: where states live, so where chunks must end.

        Not ``cache_config.block_size``: the engine core's copy can lag the finalized one
        (vLLM 0.32 on the CPU: 128, the platform default, while every KV-cache group's block,
        hence every state, is 384 tokens); chunk stops on its grid end off the state grid."""
        from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

        sizes = {
            g.kv_cache_spec.block_size
            for g in self.kv_cache_config.kv_cache_groups
            if isinstance(g.kv_cache_spec, LighterMambaSpec)
        }
        return sizes.pop() if len(sizes) == 1 else self.block_size

    def _lighter_checkpoint_alignment(self) -> int | None:
        """The grid on which the forward can write a boundary state inside a chunk, if every
        Mamba group's layers can (the workers decide it per layer: ``LighterMambaSpec``'s
        ``prefill_checkpoint_alignment``); None keeps a chunk end at every state we keep."""
        from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

        alignments = {
            g.kv_cache_spec.prefill_checkpoint_alignment
            for g in self.kv_cache_config.kv_cache_groups
            if isinstance(g.kv_cache_spec, LighterMambaSpec)
        }
        return alignments.pop() if len(alignments) == 1 else None

    def _install_retention(self) -> None:
        """The state retention policy on this engine's block pool (``block_pool_retention``),
        for the layouts it knows: full-attention groups plus our Mamba groups."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

        settings = retention_settings(self.vllm_config)
        if settings is None or not self.cache_config.enable_prefix_caching:
            return
        groups = self.kv_cache_config.kv_cache_groups
        attention = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, LighterMambaSpec)]
        if not attention or not mamba or len(attention) + len(mamba) != len(groups):
            logger.info("lighter Mamba cache: state retention policy off (KV-cache groups of other types)")
            return
        install_retention(
            self.kv_cache_manager.block_pool,
            self.lighter_block_size,
            attention,
            mamba,
            settings,
            self.lighter_counters,
            self.lighter_plans,
        )

    def schedule(self, *args: Any, **kwargs: Any):
        output = super().schedule(*args, **kwargs)
        if self.lighter_counters is not None and output.scheduled_new_reqs:
            self._count_admissions(output.scheduled_new_reqs)
        return output

    def _count_admissions(self, new_requests: list) -> None:
        """Hits are counted once per request, when it is first scheduled (a request that
        found a hit but had to wait is looked up again; vLLM's own prefix-cache counter
        counts every lookup, its per-request ``num_cached_tokens`` only the admission)."""
        try:
            for new in new_requests:
                request = self.requests.get(new.req_id)
                if request is not None and request.num_preemptions == 0:
                    self.lighter_counters.record_admission(
                        new.num_computed_tokens, request.shared_prefix_boundary
                    )
        except Exception:  # observability must never stop the engine
            logger.exception("lighter Mamba cache: counting admissions failed; counts may be low")

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int], is_stale: bool = False
    ) -> tuple[list[int], bool]:
        update = super()._update_request_with_output
        if not self.lighter_hash_after_output:
            return update(request, new_token_ids, is_stale=is_stale)
        return update_and_cache_accepted(
            update, self.kv_cache_manager, request, new_token_ids, is_stale=is_stale
        )

    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if not self.lighter_mamba_active:  # align mode, or no Mamba layers: upstream's policy
            return super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
            )
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        # Decode (every running request, every step): nothing to clip.
        if not in_prefill(start, request.num_prompt_tokens, request.num_tokens):
            return num_new_tokens
        # As upstream's split: the hit drops a block only where EAGLE's block drop is on.
        use_eagle = self.use_eagle_block_drop
        stops = request_stops(self.lighter_plans, request, start, self.lighter_block_size, use_eagle,
                              self.lighter_cold_checkpoints)
        num_tokens, owed = block_aligned_chunk_len(
            start=start,
            num_new_tokens=num_new_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_tokens=request.num_tokens,
            block_size=self.lighter_block_size,
            use_eagle=use_eagle,
            shared_prefix_boundary=request.shared_prefix_boundary,
            stops=stops,
            checkpoint_alignment=self.lighter_checkpoint_alignment,
        )
        if owed is not None:  # (only a stop cuts a chunk short: the request has a plan)
            plan = self.lighter_plans.get(request.request_id)
            assert plan is not None
            self.lighter_plans.set(request.request_id, plan.with_owed(owed))
        return num_tokens

    def _free_blocks(self, request: Request) -> None:
        # vLLM's one exit of a finished request (after its KV-cache blocks are released, which
        # reads the plan); a preempted request stays and keeps its plan.
        super()._free_blocks(request)
        self.lighter_plans.pop(request.request_id)


def update_and_cache_accepted(
    update: Any,
    kv_cache_manager: Any,
    request: Request,
    new_token_ids: list[int],
    is_stale: bool = False,
) -> tuple[list[int], bool]:
    """A scheduler's ``_update_request_with_output`` (``update``), then, for a request that
    was running, :func:`cache_accepted_boundaries` (what vLLM's async scheduler does after
    every output). A stale output (its step ran before the request was preempted, vLLM's
    ``is_stale``) computed into blocks the preemption freed: nothing of it to hash."""
    running = request.status == RequestStatus.RUNNING
    new_token_ids, stopped = update(request, new_token_ids, is_stale=is_stale)
    if running and not is_stale:
        cache_accepted_boundaries(kv_cache_manager, request, len(new_token_ids))
    return new_token_ids, stopped


def cache_accepted_boundaries(kv_cache_manager: Any, request: Request, num_new_tokens: int) -> None:
    """Hash the blocks a step's accepted drafts completed, once the step's output is in.

    vLLM hashes a block when a step is scheduled, up to the request's known tokens, so a
    boundary crossed inside accepted drafts is known only after the step. vLLM's async
    scheduler hashes after every output; the synchronous one waits for the next schedule,
    whose ``remove_skipped_blocks`` runs first and would free the lighter layout's block of
    that boundary unhashed (and a request that finishes in that step never gets there).
    ``num_new_tokens``: the tokens appended by this output (after a stop trimmed them). A
    step that accepted drafts computed past the tokens known before it (even past a stop)."""
    if request.num_computed_tokens > request.num_tokens - num_new_tokens:
        kv_cache_manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))


def request_stops(
    plans: RetentionPlans,
    request: Request,
    start: int,
    block_size: int,
    use_eagle: bool,
    checkpoint_distances: tuple[int, ...],
) -> tuple[int, ...]:
    """The request's own chunk stops, decided at its first admission and kept in its plan.

    A prompt that found no prefix-cache hit ("cold") stops at its cold-prompt checkpoints
    (``checkpoint_distances`` blocks before its last cache position);
    vLLM's own record of the hit (``prefill_stats``) exists only with stats logging on, so
    the answer is kept in the request's plan (a request resumed after a preemption keeps it).
    With EAGLE/MTP every prompt also stops at its last full block (``next_turn_stops``).
    Chunks cut at a stop add align's end they skipped (``block_aligned_chunk_len``).
    """
    if request.num_computed_tokens == 0 and request.num_preemptions == 0:
        # Decided again on every attempt to admit the request (one may fail for room, and
        # the hit can differ at the next).
        last = last_cache_position(request.num_tokens, block_size, use_eagle)
        checkpoints = (
            tuple(checkpoint_positions(last, block_size, checkpoint_distances)) if start == 0 else ()
        )
        stops = checkpoints + next_turn_stops(request.num_tokens, block_size, use_eagle)
        plans.set(request.request_id, plan_request(
            request.num_prompt_tokens, request.max_tokens, block_size, use_eagle, stops, checkpoints,
            cold=start == 0,
        ))
    plan = plans.get(request.request_id)
    return plan.stops if plan is not None else ()


@cache
def with_lighter_mamba(scheduler_cls: type) -> type:
    """The scheduler class vLLM would use, with block-aligned chunks in front."""
    if issubclass(scheduler_cls, LighterMambaSchedulerMixin):
        return scheduler_cls
    return type(
        f"LighterMamba{scheduler_cls.__name__}",
        (LighterMambaSchedulerMixin, scheduler_cls),
        {"__module__": __name__},
    )
