"""Where a prefill chunk may end when Mamba-type states are cached at block boundaries.

A recurrent state exists only at the end of a chunk, and the block manager can cache a
state only if the chunk ended exactly on a block boundary. This module holds the one
policy, as pure functions, that both scheduler paths (waiting and running) apply after
the token budget has shaped ``num_new_tokens``.

The policy is vLLM's own (0.32's ``Scheduler._mamba_block_aligned_split``, align mode),
mirrored in :func:`align_chunk_end` without the stops that need align's own cache (the lighter
cache hits whole blocks only), plus one addition, per-request stops (the cold-prompt
checkpoints). A chunk cut at a stop owes align's end to a later chunk, so every chunk end
align makes is also a chunk end here: under the same token budgets the lighter cache caches
a superset of align's states.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)

# A prompt that found nothing in the cache ("cold") may also leave states a few blocks
# before its last cache position (its checkpoints). Its last state covers its own unique tail
# too, so a later prompt that shares only the head (a system prompt followed by a different
# question) cannot use it; vLLM then reports the junction and the *first* such follower
# recomputes the prefix (upstream align does the same: issue 8's "first follower gets 0").
# Checkpoints close to the end serve the common case (a long shared head, a short unique
# tail) for the price of one more chunk end each, on cold prompts only. The distances come
# from ``config.cold_checkpoints`` (``additional_config``; none by default).


def last_cache_position(num_tokens: int, block_size: int, use_eagle: bool) -> int:
    """The last block boundary (in tokens) whose state is worth materializing.

    ``num_tokens`` is the prompt length, or for a resumed request replaying its outputs,
    its current token count. With EAGLE/MTP drafting the full-attention groups drop the
    last matched block on a hit, so the state one block earlier is the one a hit can use.
    """
    position = num_tokens - num_tokens % block_size
    if use_eagle:
        position = max(position - block_size, 0)
    return position


def resend_hit_boundary(num_tokens: int, block_size: int, use_eagle: bool) -> int:
    """The deepest boundary a resend of the same ``num_tokens`` tokens can hit: vLLM's rule
    (``get_mamba_prefill_checkpoint_position``: one token is always recomputed, EAGLE/MTP drop
    one more block). For a prompt of exactly k blocks it is k - 1 blocks, one block short of
    :func:`last_cache_position` (the state after the whole prompt, which only a longer prompt,
    a next turn, can hit)."""
    return get_mamba_prefill_checkpoint_position(num_tokens, block_size, use_eagle)


def next_turn_stops(num_tokens: int, block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """With EAGLE/MTP, the prompt's last full block boundary as well (one block past
    :func:`last_cache_position`), where align leaves no state.

    A next turn (this prompt, the reply, new text) hits the deepest block boundary the reply
    reached, less the block that full attention drops: when the reply crosses one boundary,
    that is this one. Without EAGLE it is the last cache position already.
    """
    position = num_tokens - num_tokens % block_size
    return (position,) if use_eagle and 0 < position < num_tokens else ()


def checkpoint_positions(last_position: int, block_size: int, distances: tuple[int, ...]) -> list[int]:
    """Block boundaries before ``last_position`` where a cold prompt's chunks also end."""
    return [last_position - d * block_size for d in distances if last_position - d * block_size > 0]


def internal_checkpoint(
    start: int, end: int, prefill_end: int, block_size: int, alignment: int | None
) -> int:
    """The block boundary whose state the forward writes *inside* the chunk ``[start, end)``
    (an internal prefill checkpoint), or 0 for none.

    Where the model's prefill kernel can export the state at an interior point on a grid of
    ``alignment`` tokens from each row's start (``prefill_checkpoint_alignment`` on the Mamba
    groups' spec; None where it cannot), the chunk that reaches the prefill end does not have to
    stop at the last cache position: the forward writes that state into its block. The point is
    vLLM's (``get_mamba_prefill_checkpoint_position`` of the chunk's end, the deepest boundary a
    resend of the same tokens can hit) and so is the validity rule
    (``is_mamba_prefill_checkpoint_valid``, with the whole block as the hash grid: we hit whole
    blocks only). The block manager and the worker each ask this one rule, with the same chunk,
    so a block reserved for a checkpoint is always the one the forward writes; the scheduler
    drops its stop at the last cache position by vLLM's split's own test (:func:`align_chunk_end`),
    which holds only where this one does.
    """
    if alignment is None or end < prefill_end:
        return 0
    position = get_mamba_prefill_checkpoint_position(end, block_size, False)
    valid = is_mamba_prefill_checkpoint_valid(start, end, position, block_size, block_size, alignment)
    return position if valid else 0


def in_prefill(start: int, num_prompt_tokens: int, num_tokens: int) -> bool:
    """Whether a chunk starting at ``start`` still computes the prompt (or, for a resumed
    request, replays its outputs); decode steps are never clipped."""
    return start < max(num_prompt_tokens, num_tokens - 1)


def align_chunk_end(
    start: int,
    num_new_tokens: int,
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    use_eagle: bool = False,
    shared_prefix_boundary: int = 0,
    checkpoint_alignment: int | None = None,
) -> int:
    """Where vLLM's align mode ends a prefill chunk ``[start, start + num_new_tokens)``.

    Mirrors ``Scheduler._mamba_block_aligned_split`` of vLLM 0.32 for a request in prefill,
    without what needs align's own cache (sub-block hits' partial-tail stop, the internal
    prefill checkpoint, the exact shared-prefix junction) and with a token budget of at least
    one block (the plugin's start-up check):

    - a chunk that ends before the prefill end (the prompt's, or for a resumed request its
      last token's) is floored to a block boundary (possibly to ``start``: the request is then
      not scheduled this step and keeps its place);
    - a start off the block grid first re-aligns to the next boundary;
    - the chunk never runs past align's last cache position mid-chunk: vLLM's
      ``get_mamba_prefill_checkpoint_position``, the deepest boundary a resend of the same
      tokens can hit (one token is always recomputed; EAGLE/MTP drop one more block);
    - it stops at the block-floored ``shared_prefix_boundary`` (where this prompt stops
      sharing a cached prefix with another request's, as vLLM's KV-cache manager reports it);
    - except that a chunk reaching the prefill end does not stop at the last cache position
      when the forward writes that state inside (:func:`internal_checkpoint`, with the
      model's ``checkpoint_alignment``), as align's own split does for its internal checkpoint.
    """
    end = start + num_new_tokens
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if end < prefill_end:
        end = end // block_size * block_size
    next_boundary = (start // block_size + 1) * block_size
    last_position = get_mamba_prefill_checkpoint_position(num_tokens, block_size, use_eagle)
    if checkpoint_alignment is not None and end >= prefill_end and is_mamba_prefill_checkpoint_valid(
        start, end, get_mamba_prefill_checkpoint_position(prefill_end, block_size, use_eagle),
        block_size, block_size, checkpoint_alignment,
    ):
        # vLLM's own test (its split with align's internal checkpoint). The state the chunk
        # then writes inside is at :func:`internal_checkpoint` (of the chunk's end, as the
        # worker places it); it differs only for a resumed request whose chunk runs one token
        # past a block-aligned prefill end, and is then that end, this stop.
        last_position = 0
    stops = (
        next_boundary if start % block_size != 0 else 0,
        last_position,
        start + (shared_prefix_boundary - start) // block_size * block_size
        if start < shared_prefix_boundary < end
        else 0,
    )
    # (A chunk floored below a mid-block start is empty, as upstream's max(end - start, 0).)
    return max(min((s for s in stops if start < s < end), default=end), start)


def block_aligned_chunk_len(
    start: int,
    num_new_tokens: int,
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    use_eagle: bool = False,
    shared_prefix_boundary: int = 0,
    stops: tuple[int, ...] = (),
    checkpoint_alignment: int | None = None,
) -> tuple[int, int | None]:
    """A chunk starting at ``start``, clipped so its end is cacheable: (tokens, owed end).

    The end is align's (:func:`align_chunk_end`), or the first of the request's own
    ``stops`` inside that chunk (its cold-prompt checkpoints, EAGLE's next-turn stop). A chunk
    cut short of align's end returns that end as *owed* if it is a block boundary: the caller
    adds it to the request's stops, so a later chunk still ends there. Every chunk end align
    would make at a block boundary is thus also one here; under the same token budgets the
    lighter cache's cacheable chunk ends are align's plus the stops.
    """
    if num_new_tokens <= 0 or not in_prefill(start, num_prompt_tokens, num_tokens):
        return num_new_tokens, None
    align_end = align_chunk_end(
        start, num_new_tokens, num_prompt_tokens, num_tokens, block_size, use_eagle, shared_prefix_boundary,
        checkpoint_alignment,
    )
    end = min((s for s in stops if start < s < align_end), default=align_end)
    # Only a block boundary is owed: past the last cache position align's end is wherever the
    # prompt or the budget ends (EAGLE's next-turn stop cuts such chunks), no state to keep.
    owed = align_end if end < align_end and align_end % block_size == 0 else None
    return max(end - start, 0), owed
