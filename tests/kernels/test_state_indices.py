"""The three implementations of the state-index gather agree, on random and edge cases.

On the CPU the Triton kernel runs under TRITON_INTERPRET=1 (``make test`` sets it for this
directory only); on a GPU the same tests run it for real."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lighter_mamba.ops.state_indices import mamba_state_indices

from .conftest import requires_gpu, requires_triton

BACKENDS = ["torch", "numba", pytest.param("triton", marks=requires_triton)]


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def random_case(gen, num_reqs, max_blocks, block_size, dtype):
    table = torch.randint(1, 10_000, (num_reqs + 2, max_blocks), generator=gen, dtype=dtype)
    seq_lens = torch.randint(0, max_blocks * block_size + 1, (num_reqs,), generator=gen, dtype=torch.int32)
    query_lens = torch.minimum(
        torch.randint(0, 3 * block_size, (num_reqs,), generator=gen, dtype=torch.int32), seq_lens
    )
    return table, seq_lens, query_lens


def run(backend, table, seq_lens, block_size, num_spec, query_lens):
    device = device_for(backend)
    result = mamba_state_indices(
        table.to(device),
        seq_lens.to(device),
        block_size,
        num_spec,
        None if query_lens is None else query_lens.to(device),
        backend=backend,
    )
    return [None if t is None else t.cpu() for t in result]


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_reqs", [1, 7, 300, 4096])
@pytest.mark.parametrize("num_spec", [0, 2])
def test_matches_reference(backend, dtype, num_reqs, num_spec):
    gen = torch.Generator().manual_seed(num_reqs * 10 + num_spec)
    table, seq_lens, query_lens = random_case(gen, num_reqs, 12, 16, dtype)
    expected = run("torch", table, seq_lens, 16, num_spec, query_lens)
    assert_same(run(backend, table, seq_lens, 16, num_spec, query_lens), expected)
    indices_only = run(backend, table, seq_lens, 16, num_spec, None)
    assert indices_only[1] is None and torch.equal(indices_only[0], expected[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_cases(backend):
    table = torch.tensor(
        [
            [0, 0, 7, 8, 9],  # 48-token hit in block 2 (nulls before), next chunk ends at 64
            [0, 0, 0, 0, 0],  # zero-length padding row of a CUDA-graph batch
            [5, 6, 0, 0, 0],  # decode inside block 1
            [5, 6, 0, 0, 0],  # decode crossing into block 1
            [3, 4, 5, 6, 7],  # spec blocks run past the table end
            [11, 12, 13, 14, 15],  # fresh prefill (nothing computed): no copy
        ],
        dtype=torch.int32,
    )
    seq_lens = torch.tensor([64, 0, 20, 17, 80, 40], dtype=torch.int32)
    query_lens = torch.tensor([16, 0, 1, 1, 1, 40], dtype=torch.int32)
    state, src, dst = run(backend, table, seq_lens, 16, 1, query_lens)
    assert state.tolist() == [[8, 9], [0, 0], [6, 0], [6, 0], [7, -1], [13, 14]]
    assert src.tolist() == [7, -1, -1, 5, -1, -1]
    assert dst.tolist() == [8, -1, -1, 6, -1, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    table = torch.zeros((4, 3), dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    state, src, dst = run(backend, table, empty, 16, 0, empty)
    assert state.shape == (0, 1) and src.shape == (0,) and dst.shape == (0,)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_reqs=st.integers(1, 64),
    max_blocks=st.integers(1, 20),
    block_size=st.sampled_from([1, 16, 64, 256]),
    num_spec=st.integers(0, 3),
)
def test_property_numba_equals_reference(seed, num_reqs, max_blocks, block_size, num_spec):
    gen = torch.Generator().manual_seed(seed)
    table, seq_lens, query_lens = random_case(gen, num_reqs, max_blocks, block_size, torch.int32)
    assert_same(
        run("numba", table, seq_lens, block_size, num_spec, query_lens),
        run("torch", table, seq_lens, block_size, num_spec, query_lens),
    )


@requires_gpu
def test_gpu_default_backend_is_triton_and_matches():
    gen = torch.Generator().manual_seed(0)
    table, seq_lens, query_lens = random_case(gen, 1024, 64, 16, torch.int32)
    result = mamba_state_indices(table.cuda(), seq_lens.cuda(), 16, 1, query_lens.cuda())
    assert result.state_indices.is_cuda
    expected = run("torch", table, seq_lens, 16, 1, query_lens)
    assert_same([t.cpu() for t in result], expected)


def test_warm_up_compiles_the_signatures_a_step_uses():
    from vllm_lighter_mamba.ops import state_indices_numba
    from vllm_lighter_mamba.ops.state_indices import warm_up_state_indices

    warm_up_state_indices("cpu")
    # (block table, seq lens, query lens) dtypes of every compiled variant.
    compiled = {tuple(str(arg.dtype) for arg in sig[:3]) for sig in state_indices_numba._gather.signatures}
    assert {("int32", "int32", "int32"), ("int32", "int64", "int64")} <= compiled
