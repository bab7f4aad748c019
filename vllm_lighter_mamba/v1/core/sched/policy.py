"""Where a prefill chunk may end when Mamba-type states are cached at block boundaries.

A recurrent state exists only at the end of a chunk, and the block manager can cache a
state only if the chunk ended exactly on a block boundary. This module holds the one
policy, as a pure function, that both scheduler paths (waiting and running) apply after
the token budget and encoder inputs have shaped ``num_new_tokens``.
"""

from __future__ import annotations

# A prompt that found nothing in the cache ("cold") also leaves states this many blocks
# before its last cache position. Its last state covers its own unique tail too, so a
# later prompt that shares only the head (a system prompt followed by a different
# question) cannot use it; vLLM then reports the junction and the *first* such follower
# recomputes the prefix (upstream align does the same: issue 8's "first follower gets 0").
# Checkpoints close to the end serve the common case (a long shared head, a short unique
# tail) for the price of a few extra chunk ends on cold prompts only.
COLD_PROMPT_CHECKPOINTS_IN_BLOCKS = (1, 2, 4)


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


def checkpoint_positions(
    last_position: int, block_size: int, distances: tuple[int, ...] = COLD_PROMPT_CHECKPOINTS_IN_BLOCKS
) -> list[int]:
    """Block boundaries before ``last_position`` where a cold prompt's chunks also end."""
    return [last_position - d * block_size for d in distances if last_position - d * block_size > 0]


def block_aligned_chunk_len(
    start: int,
    num_new_tokens: int,
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    use_eagle: bool = False,
    shared_prefix_boundary: int = 0,
    cold_prompt: bool = False,
) -> int:
    """Clip a chunk ``[start, start + num_new_tokens)`` so its end is cacheable.

    - decode, or a chunk that starts at/after the last cache position: unchanged;
    - a chunk that crosses the last cache position: ends exactly there;
    - a chunk that ends before it: floored to a block boundary (possibly to 0 tokens,
      in which case the request is not scheduled this step and keeps its place);
    - a chunk that crosses the block-floored ``shared_prefix_boundary`` (where this prompt
      stops sharing a cached prefix with another request's, as vLLM's KV-cache manager
      reports it) also ends there, so the state at that junction is cached for siblings;
    - on a cold prompt (no cache hit at admission), a chunk that crosses one of
      ``checkpoint_positions`` ends at the first one it crosses.
    """
    if num_new_tokens <= 0:
        return num_new_tokens
    # Outside prefill (decode, or the replayed outputs of a resumed request are done).
    if start >= max(num_prompt_tokens, num_tokens - 1):
        return num_new_tokens
    last_position = last_cache_position(num_tokens, block_size, use_eagle)
    if start >= last_position:
        return num_new_tokens
    end = start + num_new_tokens
    if end > last_position:
        end = last_position
    elif end < last_position:
        end = end // block_size * block_size
    stops = [shared_prefix_boundary // block_size * block_size]
    if cold_prompt:
        stops += checkpoint_positions(last_position, block_size)
    end = min([end] + [stop for stop in stops if start < stop < end])
    return max(end - start, 0)
