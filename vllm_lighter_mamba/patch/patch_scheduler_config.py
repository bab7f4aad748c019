"""vllm.config.scheduler: put block-aligned chunking in front of vLLM's scheduler class."""

from __future__ import annotations

from typing import Any

from vllm.config import scheduler as upstream

from vllm_lighter_mamba.patch._util import original, replace_attr


def _get_scheduler_cls(self: Any) -> type:
    from vllm_lighter_mamba.v1.core.sched.scheduler import with_lighter_mamba

    # The mixin is inert unless the engine's config says the lighter cache is active.
    return with_lighter_mamba(original(upstream.SchedulerConfig, "get_scheduler_cls")(self))


def apply() -> None:
    replace_attr(upstream.SchedulerConfig, "get_scheduler_cls", _get_scheduler_cls)
