"""vLLM's scheduler with block-aligned prefill chunks for hybrid models.

vLLM 0.26's ``Scheduler.schedule`` already calls a chunk-splitting hook on both the
running and the waiting path (after the token budget and encoder inputs, and skipping
requests whose KV is being loaded asynchronously). We turn that hook on for every model
with Mamba-type layers and give it our policy; upstream's align-mode body never runs.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from vllm.v1.request import Request

from vllm_lighter_mamba.v1.core.sched.policy import block_aligned_chunk_len
from vllm_lighter_mamba.v1.metrics.counters import COUNTERS, publish


class LighterMambaSchedulerMixin:
    """Mixed in front of vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Models without Mamba-type layers are scheduled exactly as upstream does.
        self.lighter_mamba_active: bool = bool(self.has_mamba_layers)
        if self.lighter_mamba_active:
            self.need_mamba_block_aligned_split = True
            # Sub-block (fine-grained) hits are align mode's; we hit whole blocks only.
            self.mamba_partial_cache_hit = False

    def schedule(self, *args: Any, **kwargs: Any):
        output = super().schedule(*args, **kwargs)
        if self.lighter_mamba_active:
            publish(self.vllm_config.parallel_config.data_parallel_rank)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        if self.lighter_mamba_active and not self.has_unfinished_requests():
            # Going idle: publish the final counts now (``schedule`` publishes at most once a
            # second, and an idle engine core does not call it again).
            publish(self.vllm_config.parallel_config.data_parallel_rank, force=True)
        return outputs

    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        first_admission = request.num_computed_tokens == 0 and request.num_preemptions == 0
        if first_admission:
            # First admission: vLLM reports where the attention groups' hit ran past the
            # Mamba state hit; those tokens are recomputed ("lost hits").
            COUNTERS.lost_hit_tokens += max(request.shared_prefix_boundary - start, 0)
        return block_aligned_chunk_len(
            start=start,
            num_new_tokens=num_new_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_tokens=request.num_tokens,
            block_size=self.cache_config.block_size,
            use_eagle=self.use_eagle,
            shared_prefix_boundary=request.shared_prefix_boundary,
            cold_prompt=is_cold_prompt(request, start, first_admission),
        )


def is_cold_prompt(request: Request, start: int, first_admission: bool) -> bool:
    """Whether the request found no prefix-cache hit when it was first admitted.

    vLLM's own record of the hit (``prefill_stats``) exists only with stats logging on,
    so the answer is kept on the request, decided at its first admission.
    """
    if first_admission or not hasattr(request, "lighter_mamba_cold_prompt"):
        request.lighter_mamba_cold_prompt = start == 0
    return request.lighter_mamba_cold_prompt


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
