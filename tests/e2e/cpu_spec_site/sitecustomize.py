"""Test scaffolding (put on PYTHONPATH by tests/e2e/test_cpu_speculative.py): lets vLLM 0.26's
CPU backend run speculative decoding for a GDN model in every process of a test engine.

- Upstream's CPU decode op rejects a state-index tensor whose last dimension has a stride
  other than 1, and the GDN builder passes column 0 of the ``1 + k`` state columns (stride
  ``1 + k``; ``.contiguous()`` keeps it for a single row): the indices are copied into a
  fresh tensor. Without this caching off itself fails on its first spec step.
- The lighter cache rejects speculative decoding on the CPU backend for users (because of
  the above); the line is dropped here so the test can run the lighter cache's CPU path.
"""

import functools
import os

if os.environ.get("LIGHTER_MAMBA_TEST_CPU_SPEC") == "1":
    import vllm._custom_ops as ops

    import vllm_lighter_mamba.config as lighter_config

    upstream_op = ops.fused_sigmoid_gating_delta_rule_update_cpu

    @functools.wraps(upstream_op)
    def decode_with_dense_indices(*args, **kwargs):
        indices = kwargs.get("initial_state_indices")
        if indices is not None and indices.dim() > 0 and indices.stride(-1) != 1:
            kwargs["initial_state_indices"] = indices.new_empty(indices.shape).copy_(indices)
        return upstream_op(*args, **kwargs)

    ops.fused_sigmoid_gating_delta_rule_update_cpu = decode_with_dense_indices

    checks = lighter_config.speculative_conflicts

    @functools.wraps(checks)
    def conflicts_without_the_cpu_line(vllm_config):
        return [line for line in checks(vllm_config) if "CPU backend" not in line]

    lighter_config.speculative_conflicts = conflicts_without_the_cpu_line

if os.environ.get("LIGHTER_MAMBA_TEST_OFF_STATE_FIX") == "1":
    # Caching off as the control for drafters that skip steps (ngram): vLLM 0.26's "none" mode
    # leaves the state after the last accepted token in column ``accepted - 1`` and a step
    # without drafts reads column 0 (vLLM #39273, fix proposed in #52942). Here, after
    # sampling, that state moves to column 0 (temporal: the block; conv: the window from
    # token row ``accepted - 1``), and the GDN kernels always read column 0.
    import torch
    from vllm.v1.attention.backends import gdn_attn
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker import gpu_model_runner

    builder = gdn_attn.GDNAttentionMetadataBuilder
    upstream_build = builder.build

    @functools.wraps(upstream_build)
    def build_reading_column_0(self, *args, num_accepted_tokens=None, **kwargs):
        if num_accepted_tokens is not None:
            num_accepted_tokens = torch.ones_like(num_accepted_tokens)
        return upstream_build(self, *args, num_accepted_tokens=num_accepted_tokens, **kwargs)

    builder.build = build_reading_column_0

    runner_cls = gpu_model_runner.GPUModelRunner
    upstream_update = runner_cls._update_states_after_model_execute

    def move_accepted_states_to_column_0(runner, num_reqs):
        accepted = runner.num_accepted_tokens.gpu[:num_reqs].tolist()
        drafts = runner.num_decode_draft_tokens.gpu[:num_reqs].tolist()
        context = runner.compilation_config.static_forward_context
        for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            if not isinstance(group.kv_cache_spec, MambaSpec):
                continue
            table = runner.input_batch.block_table[group_id].get_device_tensor(num_reqs).tolist()
            for name in group.layer_names:
                conv, temporal = context[name].kv_cache  # GDN: (conv, temporal)
                for r in range(num_reqs):
                    a = accepted[r]
                    if drafts[r] < 0 or a <= 1:
                        continue
                    first, last = table[r][0], table[r][a - 1]
                    temporal[first] = temporal[last].clone()
                    window = conv[first, a - 1 :].clone()
                    conv[first, : window.shape[0]] = window

    @functools.wraps(upstream_update)
    def update_then_move(self, output_token_ids, scheduler_output):
        result = upstream_update(self, output_token_ids, scheduler_output)
        if scheduler_output.scheduled_spec_decode_tokens:
            move_accepted_states_to_column_0(self, output_token_ids.size(0))
        return result

    runner_cls._update_states_after_model_execute = update_then_move
