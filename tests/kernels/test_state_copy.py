"""The per-step state copy: the fused Triton plan-and-copy (GPU path) and the numba-planned
copy (CPU path) move exactly the bytes the reference plan says, in every state tensor of
every group, and nothing else (the whole KV buffer is compared, padding included).

On the CPU the Triton kernel runs under TRITON_INTERPRET=1; on a GPU for real."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_lighter_mamba.ops.state_copy_triton import copy_states_triton, word_dtype
from vllm_lighter_mamba.ops.state_indices import state_indices_torch
from vllm_lighter_mamba.v1.worker.mamba_state_copy import MambaStateCopier, any_moves, state_tensor_table

from .conftest import device, requires_triton


def kv_buffer(gen, num_blocks: int, page: int, layouts, dev: str):
    """A raw KV buffer and, per layout (dtype, inner shape, byte offset in the page), a
    state tensor viewing it the way vLLM lays Mamba states out (dim 0 = block, page stride)."""
    raw = torch.randint(0, 256, (num_blocks * page,), generator=gen, dtype=torch.uint8).to(dev)
    tensors = []
    for dtype, shape, offset in layouts:
        size = torch.tensor([], dtype=dtype).element_size()
        view = raw.view(dtype)
        strides = [page // size]
        inner = 1
        for dim in reversed(shape):
            strides.insert(1, inner)
            inner *= dim
        tensors.append(torch.as_strided(view, (num_blocks, *shape), tuple(strides), offset // size))
    return raw, tensors


def reference(raw, groups, tables, seq_lens, query_lens):
    """The plan of ``state_indices_torch`` applied with indexed copies, on a copy of ``raw``."""
    expected = raw.clone()
    for (spec, tensors), table in zip(groups, tables, strict=True):
        plan = state_indices_torch(table.cpu().long(), seq_lens.cpu(), spec.block_size, 0, query_lens.cpu())
        moving = plan.copy_src >= 0
        for tensor in tensors:
            mirror = torch.as_strided(
                expected.view(tensor.dtype), tensor.shape, tensor.stride(), tensor.storage_offset()
            )
            src, dst = plan.copy_src[moving].long(), plan.copy_dst[moving].long()
            mirror.index_copy_(0, dst.to(raw.device), mirror.index_select(0, src.to(raw.device)))
    return expected


def random_step(gen, num_reqs: int, max_blocks: int, num_blocks: int, block_size: int, dev: str):
    """A step's inputs. Block ids are distinct across the table, as the manager guarantees
    for the blocks a step writes (copies into a shared block would race in any order)."""
    rows = num_reqs + 3
    assert num_blocks > rows * max_blocks
    ids = torch.randperm(num_blocks - 1, generator=gen)[: rows * max_blocks] + 1
    table = ids.reshape(rows, max_blocks).to(torch.int32)
    seq_lens = torch.randint(0, max_blocks * block_size + 1, (num_reqs,), generator=gen, dtype=torch.int32)
    query_lens = torch.minimum(
        torch.randint(0, 3 * block_size, (num_reqs,), generator=gen, dtype=torch.int32), seq_lens
    )
    return table.to(dev), seq_lens.to(dev), query_lens.to(dev)


LAYOUTS = {
    # GDN-like: bf16 conv state and fp32 SSM state in one padded page.
    "gdn": ([(torch.bfloat16, (24, 3), 0), (torch.float32, (2, 8, 8), 256)], 1024),
    # Odd byte sizes force the byte-wide copy.
    "odd": ([(torch.uint8, (7, 3), 0), (torch.float16, (5,), 34)], 96),
}


@requires_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_reqs", [1, 5, 64])
def test_fused_copy_matches_reference(layout, num_reqs):
    dev = device()
    gen = torch.Generator().manual_seed(num_reqs)
    layouts, page = LAYOUTS[layout]
    block_size, max_blocks = 16, 6
    num_blocks = (num_reqs + 3) * max_blocks + 1
    raw, tensors = kv_buffer(gen, num_blocks, page, layouts, dev)
    # Two groups: the same layers' tensors split over two block tables, as vLLM groups them.
    spec = SimpleNamespace(block_size=block_size, num_speculative_blocks=0)
    groups = [(spec, tensors[:1]), (spec, tensors[1:])]
    steps = [random_step(gen, num_reqs, max_blocks, num_blocks, block_size, dev) for _ in range(2)]
    tables = [steps[0][0], steps[1][0]]
    seq_lens, query_lens = steps[0][1], steps[0][2]
    expected = reference(raw, groups, tables, seq_lens, query_lens)
    entries, word = state_tensor_table([(g, s, t) for g, (s, t) in enumerate(groups)], tables)
    assert word == (torch.int32 if layout == "gdn" else torch.uint8)
    copy_states_triton(entries, word, seq_lens, query_lens)
    assert torch.equal(raw, expected)


@requires_triton
def test_fused_copy_moves_nothing_without_moves():
    """Decode inside a block, fresh prefills and padding rows: not one byte changes."""
    dev = device()
    gen = torch.Generator().manual_seed(1)
    layouts, page = LAYOUTS["gdn"]
    raw, tensors = kv_buffer(gen, 20, page, layouts, dev)
    spec = SimpleNamespace(block_size=16, num_speculative_blocks=0)
    table = torch.arange(1, 17, dtype=torch.int32).reshape(4, 4).to(dev)
    seq_lens = torch.tensor([20, 16, 0, 7], dtype=torch.int32, device=dev)
    query_lens = torch.tensor([1, 16, 0, 7], dtype=torch.int32, device=dev)
    before = raw.clone()
    entries, word = state_tensor_table([(1, spec, tensors)], [table])
    copy_states_triton(entries, word, seq_lens, query_lens)
    assert torch.equal(raw, before)


def test_word_is_the_widest_common_divisor():
    assert word_dtype([4096, 1024, 8]) == torch.int32
    assert word_dtype([4096, 1026, 8]) == torch.int16
    assert word_dtype([4096, 1024, 33]) == torch.uint8


def copier_for(spec, tensors, on_gpu: bool) -> MambaStateCopier:
    copier = MambaStateCopier.__new__(MambaStateCopier)
    copier.groups, copier.on_gpu, copier.block_sizes = [(1, spec, tensors)], on_gpu, [spec.block_size]
    copier.num_moves, copier.recent_moves = 0, deque()
    copier._table_key, copier._entries, copier._word = None, None, torch.uint8
    copier.num_spec, copier.conv_tensors = 0, frozenset()
    return copier


def test_host_move_check_agrees_with_the_plan():
    gen = torch.Generator().manual_seed(3)
    for num_reqs in (1, 4, 64):
        for _ in range(50):
            table, seq_lens, query_lens = random_step(gen, num_reqs, 6, (num_reqs + 3) * 6 + 1, 16, "cpu")
            plan = state_indices_torch(table.long(), seq_lens, 16, 0, query_lens)
            computed = (seq_lens - query_lens).numpy()
            assert any_moves(computed, query_lens.numpy(), [16]) == bool((plan.copy_src >= 0).any())


@requires_triton
@pytest.mark.parametrize("moves", [True, False])
def test_gpu_path_skips_the_launch_only_when_nothing_moves(moves, monkeypatch):
    """The runner's GPU path (run here on whatever device Triton has): with the host counts,
    a step without moves launches nothing; with moves, the fused copy runs and is exact."""
    import vllm_lighter_mamba.ops.state_copy_triton as triton_copy

    dev = device()
    gen = torch.Generator().manual_seed(11)
    layouts, page = LAYOUTS["gdn"]
    raw, tensors = kv_buffer(gen, 200, page, layouts, dev)
    table, seq_lens, query_lens = random_step(gen, 16, 6, 200, 16, dev)
    if not moves:  # decode inside the running block for every request
        seq_lens = torch.full_like(seq_lens, 20)
        query_lens = torch.ones_like(query_lens)
    spec = SimpleNamespace(block_size=16, num_speculative_blocks=0)
    expected = reference(raw, [(spec, tensors)], [table], seq_lens, query_lens)
    before = raw.clone()
    launches = []
    upstream = triton_copy.copy_states_triton
    monkeypatch.setattr(triton_copy, "copy_states_triton", lambda *a: launches.append(1) or upstream(*a))
    copier = copier_for(spec, tensors, on_gpu=True)
    if copier.may_move((seq_lens - query_lens).cpu().numpy(), query_lens.cpu().numpy()):
        copier.copy([table], seq_lens, query_lens)
    assert torch.equal(raw, expected)
    assert launches == ([1] if moves else [])
    assert torch.equal(raw, before) != moves  # the random step really moved states


def test_cpu_copier_matches_reference():
    """The CPU runner's path: numba plan from the runner's buffers, indexed copies."""
    gen = torch.Generator().manual_seed(7)
    layouts, page = LAYOUTS["gdn"]
    raw, tensors = kv_buffer(gen, 300, page, layouts, "cpu")
    table, seq_lens, query_lens = random_step(gen, 32, 6, 300, 16, "cpu")
    spec = SimpleNamespace(block_size=16, num_speculative_blocks=0)
    expected = reference(raw, [(spec, tensors)], [table], seq_lens, query_lens)
    copier = copier_for(spec, tensors, on_gpu=False)
    copier.copy([table], seq_lens, query_lens)
    assert torch.equal(raw, expected)
    assert copier.num_moves == len(copier.recent_moves) > 0


# --- speculative decoding: the accepted states after sampling (ops/spec_settle.py) ---------


def settle_reference(raw, tensors, conv, table, seq_lens, query_lens, accepted, drafts, block_size):
    """``settle_moves`` applied row by row with the CPU path's tensor copies, on a copy of ``raw``."""
    from vllm_lighter_mamba.ops.spec_settle import settle_moves
    from vllm_lighter_mamba.v1.worker.mamba_state_copy import apply_settle_move

    expected = raw.clone()
    mirrors = [
        torch.as_strided(expected.view(t.dtype), t.shape, t.stride(), t.storage_offset()) for t in tensors
    ]
    conv_ids = frozenset(id(mirrors[i]) for i in conv)
    for r in range(seq_lens.shape[0]):
        if int(drafts[r]) < 0:
            continue
        for move in settle_moves(int(seq_lens[r]), int(query_lens[r]), int(accepted[r]), block_size):
            apply_settle_move(mirrors, conv_ids, table[r].tolist(), move)
    return expected


@requires_triton
@pytest.mark.parametrize("num_spec", [1, 2, 3])
def test_settle_matches_the_rules(num_spec):
    """Random spec-decode rows (every start offset, acceptance and boundary crossing), plus
    non-spec rows that must not move: the fused launch equals the rules applied in order,
    including the in-place shift of a conv window inside its own block."""
    dev = device()
    block_size = 8
    gen = torch.Generator().manual_seed(num_spec)
    # conv: (rows = 3 + num_spec, dim 4) bf16; temporal: (2, 4, 4) fp32.
    layouts = [(torch.bfloat16, (3 + num_spec, 4), 0), (torch.float32, (2, 4, 4), 64)]
    num_reqs, max_blocks = 48, 8
    num_blocks = (num_reqs + 3) * max_blocks + 1
    raw, tensors = kv_buffer(gen, num_blocks, 256, layouts, dev)
    ids = torch.randperm(num_blocks - 1, generator=gen)[: num_reqs * max_blocks] + 1
    table = ids.reshape(num_reqs, max_blocks).to(torch.int32)
    computed = torch.randint(1, (max_blocks - num_spec - 1) * block_size, (num_reqs,), generator=gen)
    drafts = torch.randint(0, num_spec + 1, (num_reqs,), generator=gen)
    drafts[::5] = -1  # prefill / plain decode rows: untouched
    query_lens = torch.where(drafts >= 0, drafts + 1, torch.randint(1, 9, (num_reqs,), generator=gen))
    seq_lens = computed + query_lens
    accepted = torch.minimum(torch.randint(1, num_spec + 2, (num_reqs,), generator=gen), query_lens)
    spec = SimpleNamespace(block_size=block_size, num_speculative_blocks=num_spec)
    expected = settle_reference(raw, tensors, {0}, table, seq_lens, query_lens, accepted, drafts, block_size)
    # The entries hold the table's address: the device copy must outlive the launch (a
    # temporary here was freed and its memory reused by the counts below on a GPU).
    table_dev = table.to(dev)
    entries, word = state_tensor_table([(1, spec, tensors)], [table_dev], frozenset({id(tensors[0])}))
    from vllm_lighter_mamba.ops.state_copy_triton import settle_states_triton

    as_dev = [x.to(torch.int32).to(dev) for x in (seq_lens, query_lens, accepted, drafts)]
    before = raw.clone()
    settle_states_triton(entries, word, *as_dev)
    assert torch.equal(raw, expected)
    assert not torch.equal(raw, before)


def test_settle_rules_by_hand():
    """Block 4, a step of 3 tokens after 5 computed (tokens 6, 7, 8; the running position
    is 1): all accepted ends on the boundary (state of token 8 to position 1); one accepted
    leaves the state of token 6 at position 1; a step from 3 computed (tokens 4, 5, 6,
    running position 1) crossing the boundary at token 4 copies it to position 0 first."""
    from vllm_lighter_mamba.ops.spec_settle import SettleMove, settle_moves

    assert settle_moves(8, 3, 3, 4) == [SettleMove(1, 2, 1)]
    assert settle_moves(8, 3, 1, 4) == []  # token 6's state is already in column 0 = position 1
    assert settle_moves(6, 3, 3, 4) == [SettleMove(1, 0, 0), SettleMove(1, 2, 1)]
    assert settle_moves(6, 3, 1, 4) == [SettleMove(1, 0, 0)]  # only token 4: it is the boundary


@requires_triton
def test_spec_decode_steps_always_plan_on_the_device():
    """With speculative blocks the copier launches without the host check: the host's counts
    assume every draft accepted under async scheduling. (Reading column 0 is the runner
    adapters' job: they fill the accepted counts with 1.)"""
    dev = device()
    gen = torch.Generator().manual_seed(5)
    layouts, page = LAYOUTS["gdn"]
    raw, tensors = kv_buffer(gen, 200, page, layouts, dev)
    table, seq_lens, query_lens = random_step(gen, 16, 6, 200, 16, dev)
    spec = SimpleNamespace(block_size=16, num_speculative_blocks=2)
    expected = reference(raw, [(spec, tensors)], [table], seq_lens, query_lens)
    assert not torch.equal(raw, expected)  # the step moves states
    copier = copier_for(spec, tensors, on_gpu=True)
    copier.num_spec = 2
    # Host counts that say "nothing moves" (as optimistic async counts can): still planned.
    assert copier.may_move(np.full(16, 20), np.ones(16, dtype=np.int32))
    copier.copy([table], seq_lens, query_lens)
    assert torch.equal(raw, expected)
