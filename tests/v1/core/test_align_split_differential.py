"""``policy.align_chunk_end`` (our restatement of align's chunk split) against vLLM's own
``Scheduler._mamba_block_aligned_split`` of the installed vLLM, on random prefill chunks: a
request's start (computed tokens), the tokens asked for, its prompt and token counts, EAGLE's
block drop and a shared-prefix junction, in the settings the lighter cache allows (no sub-block
hits, no exact junction checkpoints, a budget of at least one block), with and without internal
checkpoints (their alignment; the lighter cache takes them without EAGLE only)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import example, given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_lighter_mamba.v1.core.sched.policy import align_chunk_end


def upstream_end(start, n, prompt, tokens, block_size, eagle, junction, budget, alignment=None) -> int:
    scheduler = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size),
        block_size=block_size,
        hash_block_size=block_size,
        mamba_partial_cache_hit=False,
        mamba_has_prefill_checkpoint_blocks=alignment is not None,
        mamba_prefill_checkpoint_alignment=alignment or block_size,
        mamba_shared_prefix_checkpoint=False,
        num_hash_lookahead_tokens=0,
        use_eagle_block_drop=eagle,
        max_num_scheduled_tokens=budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
    )
    request = SimpleNamespace(
        num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=tokens,
        shared_prefix_boundary=junction,
    )
    return start + Scheduler._mamba_block_aligned_split(scheduler, request, n)


@settings(max_examples=3000, deadline=None)
@given(
    prompt=st.integers(1, 2000),
    extra=st.integers(0, 40),
    start=st.integers(0, 2100),
    n=st.integers(1, 2100),
    block_size=st.sampled_from([1, 4, 16, 64, 256, 384]),
    eagle=st.booleans(),
    junction=st.integers(0, 2100),
    budget_blocks=st.integers(1, 8),
)
@example(prompt=30, extra=2, start=16, n=15, block_size=16, eagle=False, junction=0, budget_blocks=1)
@example(prompt=768, extra=0, start=384, n=384, block_size=384, eagle=False, junction=0, budget_blocks=1)
def test_align_chunk_end_is_vllms_split(prompt, extra, start, n, block_size, eagle, junction, budget_blocks):
    tokens = prompt + extra
    start = min(start, tokens - 1)
    n = min(n, tokens - start)  # the scheduler never asks for more than remains
    budget = max(budget_blocks * block_size, n)
    ours = align_chunk_end(start, n, prompt, tokens, block_size, eagle, junction)
    assert ours == upstream_end(start, n, prompt, tokens, block_size, eagle, junction, budget)


@settings(max_examples=3000, deadline=None)
@given(
    prompt=st.integers(1, 2000),
    extra=st.integers(0, 40),
    start_blocks=st.integers(0, 40),
    start_offset=st.sampled_from([0, 0, 0, 1, 7]),
    n=st.integers(1, 2100),
    block_size=st.sampled_from([16, 64, 128, 256, 384, 576]),
    alignment=st.sampled_from([16, 64]),
    junction=st.integers(0, 2100),
    budget_blocks=st.integers(1, 8),
)
@example(prompt=1000, extra=0, start_blocks=1, start_offset=0, n=999, block_size=64, alignment=64,
         junction=0, budget_blocks=16)
@example(prompt=1025, extra=1, start_blocks=0, start_offset=0, n=1026, block_size=64, alignment=64,
         junction=0, budget_blocks=17)
def test_align_chunk_end_with_internal_checkpoints_is_vllms_split(
    prompt, extra, start_blocks, start_offset, n, block_size, alignment, junction, budget_blocks
):
    """A chunk that reaches the prefill end runs past the last cache position when that state is
    written inside it, as in vLLM's split with align's internal checkpoint."""
    tokens = prompt + extra
    start = min(start_blocks * block_size + start_offset, tokens - 1)
    n = min(n, tokens - start)
    budget = max(budget_blocks * block_size, n)
    ours = align_chunk_end(start, n, prompt, tokens, block_size, False, junction, alignment)
    assert ours == upstream_end(start, n, prompt, tokens, block_size, False, junction, budget, alignment)
