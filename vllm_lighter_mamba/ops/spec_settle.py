"""Speculative decoding: where a step's accepted states must land (pure rules).

With ``k`` draft tokens, a spec-decode row of ``q = 1 + k`` tokens starting after ``c``
computed tokens runs vLLM's kernels on the columns ``D .. D + k`` of its block table,
``D = (c + q - 1) // block_size`` (the gather's running position). Reading column 0 (the
runner passes ``num_accepted_tokens = 1``, because the running state was copied to ``D``
before the forward), the kernels leave:

- the temporal (SSM / recurrent) state after token ``t`` (``t = 0 .. q - 1``) in column
  ``t``, i.e. position ``D + t``;
- the conv state of column 0 (position ``D``) as a window over the step's inputs: read from
  token row ``t`` on, it is the conv state after token ``t``.

Once sampling knows ``a`` (1 .. q) accepted tokens, the lighter layout needs:

1. the state at a block boundary crossed strictly inside the accepted tokens in that
   boundary's block (it is hashed as that boundary's state), and
2. the state after ``c + a`` tokens at position ``(c + a - 1) // block_size``, token row 0:
   where the next step's copy (or kernel) reads it, as for every non-speculative step.

At most one boundary is crossed per step (``q <= block_size``). Rule 1 runs before rule 2:
rule 2 may overwrite the conv state rule 1 reads (an in-place shift within block ``D``).
"""

from __future__ import annotations

from typing import NamedTuple


class SettleMove(NamedTuple):
    """Copy the state of token ``t`` of the step into position ``dst``: temporal state from
    position ``D + t``, conv state from position ``D`` starting at token row ``t``."""

    running: int  # D
    token: int  # t
    dst: int


def settle_moves(seq_len: int, query_len: int, accepted: int, block_size: int) -> list[SettleMove]:
    """The moves of one spec-decode row after sampling, in order (boundary, then running)."""
    if seq_len <= 0 or query_len <= 0:
        return []
    computed = seq_len - query_len
    accepted = min(max(accepted, 1), query_len)
    running = (seq_len - 1) // block_size
    end = computed + accepted
    moves = []
    boundary = (computed // block_size + 1) * block_size
    if boundary < end:
        moves.append(SettleMove(running, boundary - computed - 1, boundary // block_size - 1))
    last = SettleMove(running, accepted - 1, (end - 1) // block_size)
    if (last.running + last.token, last.token) != (last.dst, 0):
        moves.append(last)
    return moves
