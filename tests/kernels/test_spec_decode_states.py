"""Speculative decoding through vLLM's own GDN and Mamba2 kernels and the lighter layout: a
request decodes in spec-decode steps (1 + k tokens, a random number accepted, rejected drafts fed
as different inputs) with every rule the runner applies: the gather's columns, the copy
before the forward, one accepted token passed to the kernels, and the settle after sampling.
After every step the state after the accepted tokens sits at its running position, and
every block boundary crossed holds that boundary's exact state, for the recurrent (SSM)
state and the conv window, compared with the same kernels run one real token at a time.

On the CPU the Triton kernels run under TRITON_INTERPRET=1; on a GPU for real."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_lighter_mamba.ops.state_copy_triton import settle_states_triton
from vllm_lighter_mamba.ops.state_indices import state_indices_torch
from vllm_lighter_mamba.v1.worker.mamba_state_copy import state_tensor_table

from .conftest import device, requires_triton

HEADS, DIM_K, DIM_V, CONV_DIM, WIDTH = 2, 16, 16, 8, 4
HEAD_DIM, GROUPS, D_STATE = 8, 1, 16  # Mamba2


_TRITON_MODULES: dict[str, object] = {}


def vllm_module(name: str):
    """One of vLLM's kernel modules bound to the real Triton: what a GPU runs. Without a GPU
    vLLM swaps Triton for placeholders at import (``vllm.triton_utils``), and vLLM 0.32 also
    rebinds some entry points to its CPU ops (``causal_conv1d_update``, which ignores
    ``num_accepted_tokens``); under TRITON_INTERPRET=1 the real Triton runs on the CPU, so the
    module is reloaded once against it with the platform's CPU switch off."""
    import importlib

    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils
    from vllm.platforms import current_platform

    if name in _TRITON_MODULES:
        return _TRITON_MODULES[name]
    if triton_utils.triton is not triton:
        import triton.language.extra.libdevice as tldevice

        triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
        triton_utils.HAS_TRITON = True
    module = importlib.import_module(name)
    if current_platform.is_cpu():
        current_platform.is_cpu = lambda: False  # an instance attribute over the class's
        try:
            module = importlib.reload(module)
        finally:
            del current_platform.is_cpu
    elif module.triton is not triton:
        module = importlib.reload(module)
    _TRITON_MODULES[name] = module
    return module


class Layer:
    """One layer's kernels on fixed random weights; inputs per token. The conv window is
    vLLM's ``causal_conv1d_update`` for every model kind; the recurrent kernel is the
    subclass's."""

    ssm_shape: tuple[int, ...]

    def __init__(self, gen: torch.Generator, dev: str) -> None:
        self.dev = dev
        self.conv_weight = (torch.randn(CONV_DIM, WIDTH, generator=gen) * 0.5).to(dev)

    def inputs(self, gen: torch.Generator, num: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num, CONV_DIM, generator=gen)}

    def recurrent(self, ssm, tokens: dict, indices: torch.Tensor, accepted: torch.Tensor | None) -> None:
        raise NotImplementedError

    def conv(self, conv_sd, tokens: dict, column0: torch.Tensor, accepted, max_query_len: int) -> None:
        module = vllm_module("vllm.model_executor.layers.mamba.ops.causal_conv1d")
        n = tokens["x"].shape[0]
        d = self.dev
        module.causal_conv1d_update(
            tokens["x"].to(d), conv_sd.transpose(-1, -2), self.conv_weight, None, "silu",
            conv_state_indices=column0.to(d), num_accepted_tokens=accepted,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=d),
            max_query_len=max_query_len,
        )


class GDNLayer(Layer):
    """Qwen3-Next's GatedDeltaNet: ``fused_sigmoid_gating_delta_rule_update`` (what vLLM's
    GDN layer runs for spec-decode rows)."""

    ssm_shape = (HEADS, DIM_V, DIM_K)

    def __init__(self, gen: torch.Generator, dev: str) -> None:
        self.A_log = torch.randn(HEADS, generator=gen).to(dev)
        self.dt_bias = torch.randn(HEADS, generator=gen).to(dev)
        super().__init__(gen, dev)

    def inputs(self, gen: torch.Generator, num: int) -> dict[str, torch.Tensor]:
        return {
            "q": torch.randn(num, HEADS, DIM_K, generator=gen),
            "k": torch.randn(num, HEADS, DIM_K, generator=gen),
            "v": torch.randn(num, HEADS, DIM_V, generator=gen),
            "a": torch.randn(num, HEADS, generator=gen),
            "b": torch.randn(num, HEADS, generator=gen),
            **super().inputs(gen, num),
        }

    def recurrent(self, ssm, tokens: dict, indices: torch.Tensor, accepted: torch.Tensor | None) -> None:
        module = vllm_module("vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating")
        n = tokens["q"].shape[0]
        d = self.dev
        module.fused_sigmoid_gating_delta_rule_update(
            A_log=self.A_log, a=tokens["a"].to(d), b=tokens["b"].to(d), dt_bias=self.dt_bias,
            q=tokens["q"].unsqueeze(0).to(d), k=tokens["k"].unsqueeze(0).to(d),
            v=tokens["v"].unsqueeze(0).to(d), initial_state=ssm, inplace_final_state=True,
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=d),
            ssm_state_indices=indices.to(d), num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True,
        )


class Mamba2Layer(Layer):
    """Mamba2 (NemotronH, whose ``nemotron_h_mtp`` vLLM serves): ``selective_state_update``
    with the per-head tied dt/A that ``MambaMixer2`` passes for decode rows."""

    ssm_shape = (HEADS, HEAD_DIM, D_STATE)

    def __init__(self, gen: torch.Generator, dev: str) -> None:
        self.A = (-torch.rand(HEADS, generator=gen) - 0.5).to(dev)
        self.D = torch.randn(HEADS, generator=gen).to(dev)
        self.dt_bias = torch.randn(HEADS, generator=gen).to(dev)
        super().__init__(gen, dev)

    def inputs(self, gen: torch.Generator, num: int) -> dict[str, torch.Tensor]:
        return {
            "u": torch.randn(num, HEADS, HEAD_DIM, generator=gen),
            "dt": torch.randn(num, HEADS, generator=gen),
            "B": torch.randn(num, GROUPS, D_STATE, generator=gen),
            "C": torch.randn(num, GROUPS, D_STATE, generator=gen),
            **super().inputs(gen, num),
        }

    def recurrent(self, ssm, tokens: dict, indices: torch.Tensor, accepted: torch.Tensor | None) -> None:
        module = vllm_module("vllm.model_executor.layers.mamba.ops.mamba_ssm")
        n = tokens["u"].shape[0]
        d = self.dev
        u = tokens["u"].to(d)
        spec = {} if accepted is None else {
            "num_accepted_tokens": accepted,
            "cu_seqlens": torch.tensor([0, n], dtype=torch.int32, device=d),
        }
        module.selective_state_update(
            ssm, u, tokens["dt"].to(d)[:, :, None].expand(-1, -1, HEAD_DIM),
            self.A[:, None, None].expand(-1, HEAD_DIM, D_STATE), tokens["B"].to(d), tokens["C"].to(d),
            self.D[:, None].expand(-1, HEAD_DIM), self.dt_bias[:, None].expand(-1, HEAD_DIM),
            dt_softplus=True, state_batch_indices=indices.to(d), dst_state_batch_indices=indices.to(d),
            out=torch.empty_like(u), **spec,
        )


LAYERS = {"gdn": GDNLayer, "mamba2": Mamba2Layer}


def reference_states(layer: Layer, tokens: dict, num_blocks: int, num_spec: int, dev: str):
    """The SSM state after each prefix, the kernel run one token at a time (non-spec)."""
    ssm = torch.zeros(num_blocks, *layer.ssm_shape, device=dev)
    states = [ssm[1].clone()]
    one = torch.tensor([1], dtype=torch.int32)
    for i in range(tokens["x"].shape[0]):
        layer.recurrent(ssm, {key: value[i : i + 1] for key, value in tokens.items()}, one, None)
        states.append(ssm[1].clone())
    return states


@requires_triton
@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("num_spec", [1, 2, 3])
def test_spec_steps_keep_exact_running_and_boundary_states(kind, num_spec):
    dev = device()
    gen = torch.Generator().manual_seed(num_spec)
    rng = random.Random(num_spec)
    block_size, max_blocks = 4, 24
    prompt, total = 5, 60
    layer = LAYERS[kind](gen, dev)
    real = layer.inputs(gen, total + 8)
    ref_ssm = reference_states(layer, real, 4, num_spec, dev)
    # The request's block table: every position its own block (block 0 is vLLM's null block).
    table = torch.arange(1, max_blocks + 1, dtype=torch.int32).reshape(1, max_blocks)
    num_blocks = max_blocks + 1
    ssm = torch.zeros(num_blocks, *layer.ssm_shape, device=dev)
    conv_sd = torch.zeros(num_blocks, WIDTH - 1 + num_spec, CONV_DIM, device=dev)
    spec = type("Spec", (), {"block_size": block_size, "num_speculative_blocks": num_spec})()
    table_dev = table.to(dev)  # outlives every launch: the entries hold its address
    entries, word = state_tensor_table([(1, spec, [conv_sd, ssm])], [table_dev], frozenset({id(conv_sd)}))
    one = torch.ones(1, dtype=torch.int32, device=dev)

    def step(computed: int, tokens: dict, spec_row: bool):
        n = tokens["x"].shape[0]
        seq, query = torch.tensor([computed + n]), torch.tensor([n])
        plan = state_indices_torch(table.long(), seq, block_size, num_spec, query)
        if int(plan.copy_src[0]) >= 0:  # the runner's copy before the forward
            src, dst = int(plan.copy_src[0]), int(plan.copy_dst[0])
            ssm[dst], conv_sd[dst] = ssm[src].clone(), conv_sd[src].clone()
        columns = plan.state_indices.to(torch.int32)
        if spec_row:
            layer.recurrent(ssm, tokens, columns, one)
            layer.conv(conv_sd, tokens, columns[:, 0], one, 1 + num_spec)
        else:  # a prefill chunk: initial and final state in column 0 (the recurrent kernel
            # takes one token per call without spec indices; the chunk kernel is not under test)
            for i in range(n):
                token = {key: value[i : i + 1] for key, value in tokens.items()}
                layer.recurrent(ssm, token, columns[:, 0], None)
            conv_prefill(conv_sd, tokens, int(columns[0, 0]), computed)

    def check(length: int, where: str):
        pos = (length - 1) // block_size
        block = int(table[0, pos])
        torch.testing.assert_close(ssm[block], ref_ssm[length], rtol=1e-4, atol=1e-4, msg=where)
        window = real["x"][max(length - WIDTH + 1, 0) : length].to(dev)
        expect = torch.zeros(WIDTH - 1, CONV_DIM, device=dev)
        expect[WIDTH - 1 - window.shape[0] :] = window
        torch.testing.assert_close(conv_sd[block, : WIDTH - 1], expect, msg=where)

    # The prompt: one non-spec step (the prompt ends mid-block).
    step(0, {key: value[:prompt] for key, value in real.items()}, spec_row=False)
    check(prompt, "prompt")
    computed, boundaries = prompt, 0
    while computed < total:
        drafts = rng.randint(0, num_spec)
        accepted = rng.randint(1, drafts + 1)
        tokens = {key: value[computed : computed + 1 + drafts].clone() for key, value in real.items()}
        rejected = layer.inputs(gen, 1 + drafts)  # what a rejected draft feeds instead
        for key in tokens:
            tokens[key][accepted:] = rejected[key][accepted:]
        step(computed, tokens, spec_row=True)
        n = 1 + drafts
        settle_states_triton(
            entries, word, *(torch.tensor([v], dtype=torch.int32, device=dev)
                             for v in (computed + n, n, accepted, drafts)),
        )
        end = computed + accepted
        for boundary in range(block_size * (computed // block_size + 1), end + 1, block_size):
            check(boundary, f"boundary {boundary} after {computed}+{accepted}/{n}")
            boundaries += 1
        check(end, f"running state after {computed}+{accepted}/{n}")
        computed = end
    assert boundaries >= (total - prompt) // block_size - 1


def conv_prefill(conv_sd, tokens: dict, block: int, computed: int) -> None:
    """A prefill chunk from an empty state: vLLM's prefill kernel leaves the last
    ``WIDTH - 1`` inputs in the window's first rows (token row 0 is the oldest)."""
    assert computed == 0
    x = tokens["x"].to(conv_sd.device)
    window = x[-(WIDTH - 1) :]
    conv_sd[block].zero_()
    conv_sd[block, WIDTH - 1 - window.shape[0] : WIDTH - 1] = window
