"""The pure chunk-alignment policy, case by case and as a property."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from vllm_lighter_mamba.v1.core.sched.policy import (
    align_chunk_end,
    block_aligned_chunk_len,
    checkpoint_positions,
    last_cache_position,
    next_turn_stops,
)

BS = 16
# The policy is tested with checkpoints (the setting's example; the engine's default is none).
CHECKPOINTS = (1, 2, 4)


def chunk(start, n, prompt, tokens=None, eagle=False, junction=0, cold=False):
    tokens = prompt if tokens is None else tokens
    last = last_cache_position(tokens, BS, eagle)
    stops = tuple(checkpoint_positions(last, BS, CHECKPOINTS)) if cold else ()
    return block_aligned_chunk_len(start, n, prompt, tokens, BS, eagle, junction, stops)[0]


def test_last_cache_position():
    assert last_cache_position(100, 16, False) == 96
    assert last_cache_position(96, 16, False) == 96
    assert last_cache_position(100, 16, True) == 80
    assert last_cache_position(10, 16, True) == 0


def test_chunk_before_last_position_is_floored_to_a_block():
    assert chunk(0, 40, 100) == 32
    assert chunk(32, 40, 100) == 32  # ends at 64


def test_chunk_crossing_last_position_ends_there():
    assert chunk(64, 40, 100) == 32  # would end at 104 > 96: ends at 96


def test_chunk_after_last_position_is_unchanged():
    assert chunk(96, 4, 100) == 4
    assert chunk(0, 10, 10) == 10  # shorter than a block: last position is 0


def test_decode_is_unchanged():
    assert chunk(100, 1, 100, tokens=101) == 1


def test_too_small_budget_floors_to_zero():
    assert chunk(0, 15, 100) == 0
    assert chunk(16, 10, 100) == 0


def test_exact_boundary_is_kept():
    assert chunk(0, 96, 100) == 96


def test_eagle_backs_off_one_block():
    assert chunk(64, 40, 100, eagle=True) == 16  # last position 80
    assert chunk(80, 20, 100, eagle=True) == 20


def test_eagle_prompts_also_stop_at_their_last_full_block():
    # A next turn under EAGLE/MTP hits its reply's deepest boundary less one block: after a
    # reply that crossed one boundary, the prompt's last full block (96 of 100).
    assert next_turn_stops(100, BS, True) == (96,)
    assert next_turn_stops(100, BS, False) == ()  # the last cache position already
    assert next_turn_stops(96, BS, True) == ()  # the prompt's end: no cut needed
    assert next_turn_stops(10, BS, True) == ()
    stops = next_turn_stops(100, BS, True)
    # Cut there, the chunk owes nothing: its end (the prompt's, 100) holds no cacheable state.
    assert block_aligned_chunk_len(80, 20, 100, 100, BS, True, 0, stops) == (16, None)


def test_resumed_request_uses_its_current_token_count():
    # 100 prompt tokens + 40 outputs being replayed after preemption: last position 128.
    assert chunk(96, 44, 100, tokens=140) == 32
    assert chunk(128, 12, 100, tokens=140) == 12


def test_junction_of_a_shared_prefix_is_a_stop():
    assert chunk(0, 96, 100, junction=40) == 32  # floored junction 32
    assert chunk(32, 64, 100, junction=40) == 64  # already past it


def test_checkpoint_positions_count_back_from_the_last_position():
    assert checkpoint_positions(192, 16, CHECKPOINTS) == [176, 160, 128]
    assert checkpoint_positions(32, 16, CHECKPOINTS) == [16]  # none at or below 0


def test_cold_prompt_stops_at_checkpoints_and_owes_align_its_end():
    # 300 tokens: last position 288, checkpoints 272, 256, 224.
    stops = (272, 256, 224)
    assert block_aligned_chunk_len(0, 300, 300, 300, BS, stops=stops) == (224, 288)
    assert block_aligned_chunk_len(0, 100, 300, 300, BS, stops=stops) == (96, None)  # align's own end
    assert block_aligned_chunk_len(224, 76, 300, 300, BS, stops=stops) == (32, 288)
    assert block_aligned_chunk_len(288, 12, 300, 300, BS, stops=stops) == (12, None)
    # A prompt that had a hit has no stops: one chunk to the last position.
    assert chunk(32, 268, 300) == 256


def trajectory(
    prompt: int, budgets: list[int], block_size: int, stops: tuple[int, ...], eagle: bool = False
) -> list[int]:
    """Chunk ends of one prompt, step by step as the scheduler mixin drives the policy."""
    ends, start, step = [], 0, 0
    while start < prompt:
        budget = min(budgets[step % len(budgets)], prompt - start)
        n, owed = block_aligned_chunk_len(start, budget, prompt, prompt, block_size, eagle, stops=stops)
        if owed is not None:
            stops = (*stops, owed)
        start += n
        if n:
            ends.append(start)
        step += 1
        assert step < 10_000
    return ends


# One prompt chunked under one token budget, at realistic block sizes (544, 1056: Qwen3-Next).
PROMPT_BUDGET_CASES = {
    "prompt": st.integers(1, 3000),
    "budget": st.integers(1, 3000),
    "block_size": st.sampled_from([16, 64, 256, 544, 1056]),
    "cold": st.booleans(),
}


def test_issue8_first_follower_scenario_leaves_a_state_at_the_junction():
    # 900 shared + 300 unique tokens at block 128, budget 1024: align ends chunks at 1024
    # and 1152, past the shared prefix; the checkpoint two blocks before (896) is the
    # junction a follower needs, and align's ends stay ends.
    prompt, bs = 1201, 128
    stops = tuple(checkpoint_positions(last_cache_position(prompt, bs, False), bs, CHECKPOINTS))
    ends = trajectory(prompt, [1024], bs, stops)
    assert 896 in ends and {1024, 1152} <= set(ends) and ends[-1] == prompt
    assert trajectory(prompt, [1024], bs, ()) == [1024, 1152, 1201]


@given(**PROMPT_BUDGET_CASES)
def test_property_every_align_chunk_end_is_kept(prompt, budget, block_size, cold):
    """Issue 13: under the same budget, checkpoints add chunk ends and never drop align's."""
    budget = max(budget, block_size)  # start-up rejects budgets below a block
    last = last_cache_position(prompt, block_size, False)
    stops = tuple(checkpoint_positions(last, block_size, CHECKPOINTS)) if cold else ()
    align = trajectory(prompt, [budget], block_size, ())
    ours = trajectory(prompt, [budget], block_size, stops)
    assert set(align) <= set(ours)
    assert set(ours) - set(align) <= set(stops)
    assert len(ours) <= len(align) + len(stops)


@given(**PROMPT_BUDGET_CASES)
def test_property_eagle_keeps_every_align_state(prompt, budget, block_size, cold):
    """With EAGLE/MTP: every block boundary align ends a chunk on is a chunk end here too, and
    the others are the request's stops (checkpoints, the next-turn stop). (Past the last cache
    position chunk ends off the block grid hold no cacheable state and may move.)"""
    budget = max(budget, block_size)
    last = last_cache_position(prompt, block_size, True)
    stops = (tuple(checkpoint_positions(last, block_size, CHECKPOINTS)) if cold else ()) + next_turn_stops(
        prompt, block_size, True
    )
    align = {e for e in trajectory(prompt, [budget], block_size, (), eagle=True) if e % block_size == 0}
    ours = {e for e in trajectory(prompt, [budget], block_size, stops, eagle=True) if e % block_size == 0}
    assert align <= ours
    assert ours - align <= set(stops)


@given(
    prompt=st.integers(1, 600),
    extra=st.integers(0, 50),
    start_blocks=st.integers(0, 40),
    n=st.integers(0, 700),
    block_size=st.sampled_from([1, 4, 16, 64, 256]),
    eagle=st.booleans(),
    junction=st.integers(0, 700),
    cold=st.booleans(),
)
# A resumed request (2 outputs) whose token count is a block multiple: since vLLM 0.32 align's
# last cache position is a block below it (16, not 32), and a chunk may end at the prefill
# end (31) mid-block.
@example(prompt=30, extra=2, start_blocks=1, n=15, block_size=16, eagle=False, junction=0, cold=False)
def test_property_chunk_ends_are_cacheable(prompt, extra, start_blocks, n, block_size, eagle, junction, cold):
    tokens = prompt + extra
    start = min(start_blocks * block_size, tokens - 1)
    n = min(n, tokens - start)  # the scheduler never asks for more than remains
    last = last_cache_position(tokens, block_size, eagle)
    stops = tuple(checkpoint_positions(last, block_size, CHECKPOINTS)) if cold else ()
    got, owed = block_aligned_chunk_len(start, n, prompt, tokens, block_size, eagle, junction, stops)
    assert 0 <= got <= max(n, 0)
    end = start + got
    in_prefill = start < max(prompt, tokens - 1)
    # Align's last cache position (vLLM's), where its chunks stop.
    last = get_mamba_prefill_checkpoint_position(tokens, block_size, eagle)
    if got > 0 and in_prefill and start < last:
        # Before the last cache position a chunk ends on a block boundary or exactly there.
        assert end % block_size == 0 or end == last
        assert end <= last
    if not in_prefill:
        assert got == n and owed is None
    if in_prefill and n > 0:
        # Align's end, or the first stop inside align's chunk, which then owes align's end.
        align_end = align_chunk_end(start, n, prompt, tokens, block_size, eagle, junction)
        inside = [c for c in stops if start < c < align_end]
        assert end == (min(inside) if inside else align_end)
        assert owed == (align_end if inside else None)
