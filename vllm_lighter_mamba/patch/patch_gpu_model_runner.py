"""vllm.v1.worker.gpu_model_runner: the per-step state copy (GPU and CPU runners)."""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.worker import gpu_model_runner as upstream

from vllm_lighter_mamba.config import lighter_layout_active
from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.worker.mamba_state_copy import copy_running_states


def _wrap_prepare_inputs(prepare_inputs: Any) -> Any:
    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any, *a, **kw):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens, *a, **kw)
        if lighter_layout_active(self.cache_config):
            copy_running_states(self, num_scheduled_tokens)
        return result

    return _prepare_inputs


def apply() -> None:
    runner = upstream.GPUModelRunner
    replace_attr(runner, "_prepare_inputs", _wrap_prepare_inputs(original(runner, "_prepare_inputs")))
