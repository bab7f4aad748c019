"""The internal-checkpoint export through vLLM's real FLA prefill (GPU only): a step's plan
(``plan_checkpoints``: decode rows first, then prefill rows, as the GDN builder orders them),
the patched ``chunk_gated_delta_rule_fwd_h`` and vLLM's ``MambaPrefillCheckpointExporter`` leave
in each checkpoint's block the state a chunk cut at that boundary would leave (the truncated
run's final state in bf16, bitwise) and the conv window of the three raw tokens before it; a
row whose checkpoint column holds the null block, and every other block, stay untouched.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import requires_gpu
from .test_gdn_boundary_states import H, K, V, fla, inputs, truncated_final

BLOCK = 128
# Prefill rows (computed tokens before the step, query length): a checkpoint at 256 (offset 256),
# one at 256 from a hit at 128 (offset 128), none (the last cache position is the start), one at
# 128 whose block-table entry is null (the manager kept none), one at 128 (offset 128).
PREFILLS = [(0, 300), (128, 200), (256, 100), (0, 192), (0, 129)]
NUM_DECODES = 2
CONV_DIM, STATE_LEN = 24, 3


@requires_gpu
def test_checkpoints_hold_the_truncated_runs_state_and_conv_window(monkeypatch):
    pytest.importorskip("vllm.third_party.flash_linear_attention.ops.chunk")
    chunk, *_ = fla()
    from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import (
        FLA_CHUNK,
        PENDING,
        CheckpointPlan,
        PendingExport,
        plan_checkpoints,
    )
    from vllm_lighter_mamba.patch import patch_fla_chunk

    monkeypatch.setattr(chunk, patch_fla_chunk.NAME, getattr(chunk, patch_fla_chunk.NAME))
    patch_fla_chunk.apply()  # undone by monkeypatch at the end
    assert FLA_CHUNK == fla()[3].FLA_CHUNK_SIZE

    lengths = [q for _, q in PREFILLS]
    q, k, v, g, beta, h0, cu = inputs(lengths, seed=1)
    # The whole step: 2 decode rows (1 token each) in front of the prefill rows.
    query_start_loc = [0, 1, 2]
    for n in lengths:
        query_start_loc.append(query_start_loc[-1] + n)
    seq_lens = [50, 77] + [c + n for c, n in PREFILLS]
    plan = plan_checkpoints(query_start_loc, seq_lens, NUM_DECODES, len(PREFILLS), BLOCK, 64)
    assert plan.rows == [2, 3, 5, 6] and plan.offsets == [256, 128, 128, 128]

    num_blocks = 40
    table = torch.zeros(len(seq_lens), 8, dtype=torch.int32, device="cuda")
    checkpoint_blocks = {2: 11, 3: 12, 6: 14}  # row -> block; row 5's column stays null (0)
    for row, col in zip(plan.rows, plan.cols, strict=True):
        table[row, col] = checkpoint_blocks.get(row, 0)
    device_plan = CheckpointPlan.build(plan, table)
    raw = torch.randn(query_start_loc[-1], CONV_DIM, device="cuda", dtype=torch.bfloat16)
    conv_state = torch.full((num_blocks, CONV_DIM, STATE_LEN), -7.0, device="cuda", dtype=torch.bfloat16)
    ssm_state = torch.full((num_blocks, H, V, K), -7.0, device="cuda", dtype=torch.bfloat16)
    pending = PendingExport(device_plan, raw, conv_state, ssm_state, STATE_LEN)

    has_state = torch.tensor([c > 0 for c, _ in PREFILLS], device="cuda")
    initial = torch.where(has_state[:, None, None, None], h0, torch.zeros_like(h0))
    token = PENDING.set(pending)
    try:
        chunk.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=K**-0.5, initial_state=initial.clone(), output_final_state=True,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        )
    finally:
        PENDING.reset(token)
    assert pending.done

    batch = (q, k, v, g, beta, initial, cu)
    touched = set()
    for row, offset in zip(plan.rows, plan.offsets, strict=True):
        block = checkpoint_blocks.get(row)
        if block is None:
            continue
        touched.add(block)
        want = truncated_final(*batch, row=row - NUM_DECODES, tokens=offset).to(torch.bfloat16)
        assert torch.equal(ssm_state[block], want), (row, offset)
        end = query_start_loc[row] + offset
        assert torch.equal(conv_state[block], raw[end - STATE_LEN : end].T), (row, offset)
        # Not vacuous: the state one FLA chunk earlier differs.
        earlier = truncated_final(*batch, row=row - NUM_DECODES, tokens=offset - FLA_CHUNK)
        assert not torch.equal(ssm_state[block], earlier.to(torch.bfloat16))
    untouched = [b for b in range(num_blocks) if b not in touched]
    assert bool((ssm_state[untouched] == -7.0).all()) and bool((conv_state[untouched] == -7.0).all())
