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
