"""The worker's plan of internal checkpoints (``model_executor/layers/mamba/checkpoint.py``)
against a restatement written from the rule's definition: per prefill row that starts on a
block boundary, the deepest block boundary a resend can hit (one token recomputed) when it lies
at least a block past the row's start, strictly inside the chunk and on the 64-token grid from
the row's start; its row of FLA's ``h`` counts the 64-token chunks of the prefill rows before it."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import (
    FLA_CHUNK,
    CheckpointPlan,
    plan_checkpoints,
)


def expected(query_lens, seq_lens, num_decodes, block_size, alignment):
    rows, cols, offsets, starts, h_rows = [], [], [], [], []
    token, chunk = 0, 0
    for row, (q, end) in enumerate(zip(query_lens, seq_lens, strict=True)):
        start = end - q
        if row >= num_decodes:
            last = (end - 1) // block_size * block_size
            on_grid = start % block_size == 0 and (last - start) % alignment == 0
            if on_grid and start + block_size <= last < end:
                rows.append(row)
                cols.append(last // block_size - 1)
                offsets.append(last - start)
                starts.append(token)
                h_rows.append(chunk + (last - start) // FLA_CHUNK)
            chunk += -(-q // FLA_CHUNK)
        token += q
    return rows, cols, offsets, starts, h_rows


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([64, 128, 576]))
def test_plan_matches_the_rule(seed, block_size):
    rng = random.Random(seed)
    num_decodes, num_prefills = rng.randrange(0, 4), rng.randrange(0, 6)
    query_lens = [1] * num_decodes
    seq_lens = [rng.randrange(2, 5000) for _ in range(num_decodes)]
    for _ in range(num_prefills):
        start = rng.choice([0, block_size * rng.randrange(0, 8), rng.randrange(0, 4000)])
        q = rng.randrange(2, 3 * block_size)
        query_lens.append(q)
        seq_lens.append(start + q)
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    plan = plan_checkpoints(query_start_loc, seq_lens, num_decodes, num_prefills, block_size, 64)
    want = expected(query_lens, seq_lens, num_decodes, block_size, 64)
    assert (plan.rows, plan.cols, plan.offsets, plan.token_starts, plan.h_rows) == want


def test_a_chat_turn_has_one_checkpoint_and_a_decode_none():
    # A decode row, then a turn that resumes from a hit at 1,152 and ends at 2,000 (block 576).
    plan = plan_checkpoints([0, 1, 849], [700, 2000], 1, 1, 576, 64)
    assert plan.rows == [1] and plan.offsets == [1728 - 1152] and plan.cols == [2]
    assert plan.token_starts == [1] and plan.h_rows == [(1728 - 1152) // 64]


def test_device_plan_gathers_this_groups_blocks_and_regathers_another_groups():
    plan = plan_checkpoints([0, 300, 500], [300, 328], 0, 2, 128, 64)
    assert plan.rows == [0, 1] and plan.cols == [1, 1]
    table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    device = CheckpointPlan.build(plan, table)
    assert device.checkpoint.state_indices.tolist() == [1, 9]
    assert device.checkpoint.checkpoint_offsets.tolist() == [256, 128]
    assert device.token_starts.tolist() == [0, 300] and device.h_rows.tolist() == [4, 5 + 2]
    other = device.regather(table + 100)
    assert other.checkpoint.state_indices.tolist() == [101, 109]
    assert CheckpointPlan.build(plan_checkpoints([0, 5], [5], 0, 1, 128, 64), table) is None


def test_the_grid_is_vllms_fla_chunk():
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    assert FLA_CHUNK == FLA_CHUNK_SIZE
