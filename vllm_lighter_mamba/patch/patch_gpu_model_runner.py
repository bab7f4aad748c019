"""vllm.v1.worker.gpu_model_runner: the per-step state copy (GPU and CPU runners), and the
state-index kernels compiled once the KV cache is set up (not in the first requests)."""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.worker import gpu_model_runner as upstream

from vllm_lighter_mamba.config import lighter_layout_active
from vllm_lighter_mamba.ops.state_indices import warm_up_state_indices
from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.worker.mamba_state_copy import copy_running_states, mamba_groups


def _wrap_prepare_inputs(prepare_inputs: Any) -> Any:
    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any, *a, **kw):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens, *a, **kw)
        if lighter_layout_active(self.cache_config):
            copy_running_states(self, num_scheduled_tokens)
        return result

    return _prepare_inputs


def _wrap_initialize_kv_cache(initialize_kv_cache: Any) -> Any:
    @functools.wraps(initialize_kv_cache)
    def initialize_kv_cache_and_warm_up(self: Any, kv_cache_config: Any, *a, **kw):
        result = initialize_kv_cache(self, kv_cache_config, *a, **kw)
        if lighter_layout_active(self.cache_config):
            specs = {spec.num_speculative_blocks for _, spec, _ in mamba_groups(kv_cache_config)}
            for num_spec in sorted(specs):
                warm_up_state_indices(self.device, num_spec)
        return result

    return initialize_kv_cache_and_warm_up


def apply() -> None:
    runner = upstream.GPUModelRunner
    replace_attr(runner, "_prepare_inputs", _wrap_prepare_inputs(original(runner, "_prepare_inputs")))
    replace_attr(
        runner, "initialize_kv_cache", _wrap_initialize_kv_cache(original(runner, "initialize_kv_cache"))
    )
