"""Can the Triton GDN prefill give the states at interior block boundaries, exactly?

The lighter cache cuts a prefill chunk at each boundary whose state it keeps, because a
recurrent state exists only at the end of a forward; on the 80B-shaped model every cut costs a
full engine step (docs/benchmarks.md). vLLM's Triton GDN prefill (FLA's chunked kernels)
already computes the state before every 64-token chunk of every row, ``h``, in the model dtype,
and throws it away. Writing boundary states from inside one forward (docs/internal_writes_survey.md)
rests on two claims this file checks against the reference that needs no trust in ``h``: the
final state of a run of the same row truncated at that boundary (what a cut produces today).

1. ``h[chunk_offsets[r] + j]`` is bitwise the truncated run's final state (float32) cast to the
   model dtype: enough for bf16 SSM caches.
2. Re-running vLLM's own recurrence kernel with a float32 ``h`` buffer gives the truncated run's
   float32 final state bitwise: what float32 SSM caches need.

GPU only (the FLA chain does not run under TRITON_INTERPRET, docs/internal_writes_survey.md §4).
"""

from __future__ import annotations

import pytest
import torch
from vllm.utils.math_utils import cdiv

from .conftest import requires_gpu

CHUNK = 64  # FLA_CHUNK_SIZE, checked below against vLLM's
HG, H, K, V = 2, 4, 128, 128  # Qwen3-Next's layout in miniature: grouped q/k heads, more v heads


def fla():
    """vLLM's FLA modules (an ImportError skips: vLLM builds without them)."""
    from vllm.third_party.flash_linear_attention.ops import chunk, chunk_delta_h, index, utils

    return chunk, chunk_delta_h, index, utils


def inputs(lengths: list[int], seed: int = 0):
    """One varlen batch as vLLM's GDN layer passes it (batch dim 1), plus nonzero initial states."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q, k = randn(1, total, HG, K), randn(1, total, HG, K)
    v = randn(1, total, H, V)
    # Slow decay (log gates near 0) so that every chunk's contribution stays visible.
    g = torch.nn.functional.logsigmoid(randn(1, total, H, dtype=torch.float32) + 6.0)
    beta = torch.sigmoid(randn(1, total, H))
    h0 = randn(len(lengths), H, V, K, dtype=torch.float32) * 0.1
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, device="cuda", dtype=torch.int32)
    return q, k, v, g, beta, h0, cu


def run(q, k, v, g, beta, h0, cu):
    """vLLM's chunked GDN prefill; returns (final states, what ``chunk_gated_delta_rule_fwd_h``
    got and returned) by wrapping the module global that ``chunk_gated_delta_rule_fwd`` calls."""
    chunk, *_ = fla()
    seen: dict = {}
    original = chunk.chunk_gated_delta_rule_fwd_h

    def recording(**kwargs):
        out = original(**kwargs)
        seen.update(kwargs=kwargs, h=out[0])
        return out

    chunk.chunk_gated_delta_rule_fwd_h = recording
    try:
        _, final = chunk.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=K**-0.5, initial_state=h0.clone(), output_final_state=True,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        )
    finally:
        chunk.chunk_gated_delta_rule_fwd_h = original
    return final, seen


def truncated_final(q, k, v, g, beta, h0, cu, row: int, tokens: int) -> torch.Tensor:
    """Row ``row`` alone, its first ``tokens`` tokens only: the state a chunk cut there leaves."""
    a = int(cu[row])
    sl = slice(a, a + tokens)
    final, _ = run(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0[row : row + 1],
                   torch.tensor([0, tokens], device="cuda", dtype=torch.int32))
    return final[0]


def fp32_states(seen: dict) -> torch.Tensor:
    """vLLM's recurrence kernel again on the recorded inputs, into a float32 ``h``."""
    _, chunk_delta_h, index, _ = fla()
    kw = seen["kwargs"]
    k, u, cu = kw["k"], kw["u"], kw["cu_seqlens"]
    offsets = kw.get("chunk_offsets")
    if offsets is None:
        offsets = index.prepare_chunk_offsets(cu, CHUNK)
    h32 = torch.empty(seen["h"].shape, device="cuda", dtype=torch.float32)
    n = cu.numel() - 1

    def grid(meta):
        return (cdiv(V, meta["BV"]), n * H)

    chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64[grid](
        k=k, v=u, w=kw["w"], v_new=None, g=kw["g"], gk=None, h=h32, h0=kw["initial_state"], ht=None,
        cu_seqlens=cu, chunk_offsets=offsets, T=k.shape[1], H=H, Hg=HG, K=K, V=V, BT=CHUNK,
        USE_EXP2=False,
    )
    return h32


LENGTHS = [576 * 2 + 100, 3 * CHUNK, 576 + CHUNK, 5]


@requires_gpu
def test_every_chunk_start_state_equals_a_truncated_runs_final_state():
    pytest.importorskip("vllm.third_party.flash_linear_attention.ops.chunk")
    _, _, index, utils = fla()
    assert utils.FLA_CHUNK_SIZE == CHUNK
    batch = inputs(LENGTHS)
    _, seen = run(*batch)
    h = seen["h"][0]  # [NT, H, V, K], model dtype
    assert h.dtype == torch.bfloat16
    h32 = fp32_states(seen)[0]
    cu = batch[-1]
    offsets = index.prepare_chunk_offsets(cu, CHUNK).tolist()
    checked = 0
    for row, n in enumerate(LENGTHS):
        for j in range(1, cdiv(n, CHUNK)):
            want = truncated_final(*batch, row=row, tokens=j * CHUNK)
            got_bf16, got_fp32 = h[offsets[row] + j], h32[offsets[row] + j]
            assert torch.equal(got_bf16, want.to(torch.bfloat16)), (row, j)
            assert torch.equal(got_fp32, want), (row, j, (got_fp32 - want).abs().max().item())
            # A state read one chunk early is not it (the test can see a wrong row).
            assert not torch.equal(h32[offsets[row] + j - 1], want), (row, j)
            checked += 1
    assert checked == sum(cdiv(n, CHUNK) - 1 for n in LENGTHS) > 20
