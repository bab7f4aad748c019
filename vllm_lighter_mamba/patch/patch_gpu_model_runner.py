"""vllm.v1.worker.gpu_model_runner: the per-step state copy (GPU and CPU runners), the
accepted states of speculative decoding put in place after sampling, and the state-index
kernels compiled once the KV cache is set up (not in the first requests).
(What / Why / How: ``patch/__init__.py``.)
"""

from __future__ import annotations

import functools
from typing import Any

try:
    from vllm.v1.worker import gpu_model_runner as upstream
except ImportError:  # vLLM 0.34 has only Model Runner V2 (patch_mamba_hybrid)
    upstream = None

from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.worker.mamba_state_copy import COPIER_ATTR as COPIER
from vllm_lighter_mamba.v1.worker.mamba_state_copy import MambaStateCopier, lighter_groups


def _tables(runner: Any, copier: MambaStateCopier, num_reqs: int) -> list[Any]:
    block_tables = runner.input_batch.block_table
    return [block_tables[g].get_device_tensor(num_reqs) for g, _, _ in copier.groups]


def _wrap_prepare_inputs(prepare_inputs: Any) -> Any:
    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any, *args, **kwargs):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        copier = self.__dict__.get(COPIER)
        if copier is not None:
            num_reqs = self.input_batch.num_reqs
            if copier.num_spec:
                # The builders pass num_accepted_tokens to the kernels as "read the initial
                # state from column accepted - 1". The lighter layout keeps the running state
                # in column 0 (settle() put it there after the last step, the copy moves it
                # with the running position), so every row reads column 0. No wait.
                self.num_accepted_tokens.gpu.fill_(1)
            computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
            if copier.may_move(computed, num_scheduled_tokens[:num_reqs]):
                copier.copy(
                    _tables(self, copier, num_reqs),
                    self.seq_lens[:num_reqs],
                    self.num_scheduled_tokens.gpu[:num_reqs],
                )
        return result

    return _prepare_inputs


def _wrap_update_states_after_model_execute(update: Any) -> Any:
    @functools.wraps(update)
    def _update_states_after_model_execute(self: Any, output_token_ids: Any, scheduler_output: Any):
        result = update(self, output_token_ids, scheduler_output)
        copier = self.__dict__.get(COPIER)
        if copier is not None and copier.num_spec and scheduler_output.scheduled_spec_decode_tokens:
            n = output_token_ids.size(0)
            copier.settle(
                _tables(self, copier, n),
                self.seq_lens[:n],
                self.num_scheduled_tokens.gpu[:n],
                self.num_accepted_tokens.gpu[:n],
                self.num_decode_draft_tokens.gpu[:n],
            )
        return result

    return _update_states_after_model_execute


def _wrap_initialize_kv_cache(initialize_kv_cache: Any) -> Any:
    @functools.wraps(initialize_kv_cache)
    def initialize_kv_cache_and_copier(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any):
        result = initialize_kv_cache(self, kv_cache_config, *args, **kwargs)
        copier = None
        if lighter_groups(kv_cache_config):
            forward_context = self.compilation_config.static_forward_context
            copier = MambaStateCopier(forward_context, kv_cache_config, self.device, self.model)
            copier.warm_up(_tables(self, copier, 1), self.seq_lens.dtype)
        self.__dict__[COPIER] = copier
        return result

    return initialize_kv_cache_and_copier


def apply() -> None:
    if upstream is None:
        return
    runner = upstream.GPUModelRunner
    replace_attr(runner, "_prepare_inputs", _wrap_prepare_inputs(original(runner, "_prepare_inputs")))
    replace_attr(
        runner,
        "_update_states_after_model_execute",
        _wrap_update_states_after_model_execute(original(runner, "_update_states_after_model_execute")),
    )
    replace_attr(
        runner, "initialize_kv_cache", _wrap_initialize_kv_cache(original(runner, "initialize_kv_cache"))
    )
