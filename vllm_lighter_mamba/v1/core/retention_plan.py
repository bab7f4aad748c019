"""The per-request plan the scheduler decides and the retention bookkeeping reads.

At a request's first admission the scheduler decides where its prefill chunks stop (its
cold-prompt checkpoints, EAGLE's next-turn stop) and, as chunks are cut at those stops, which
of align's chunk ends they owe. The retention policy needs the same decisions to tell a
state's worth when it is cached (a checkpoint bet, an expected branch point, the request's
own prompt end or decode end). Both hold one :class:`RetentionPlans` (made by the scheduler,
handed to ``install_retention``): the scheduler sets a request's plan and drops it when the
request leaves the scheduler; the bookkeeping only reads it. Nothing is stored on vLLM's
``Request``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_lighter_mamba.v1.core.retention_policy import decode_end_boundary
from vllm_lighter_mamba.v1.core.sched.policy import resend_hit_boundary


@dataclass(frozen=True)
class RetentionPlan:
    """One request's chunk stops and the boundaries its own future resumes from (tokens)."""

    # Every chunk stop, in the order decided: the checkpoints, EAGLE's next-turn stop, then
    # the align chunk ends those stops pushed back (owed).
    stops: tuple[int, ...]
    # The cold-prompt checkpoints among them (empty unless the prompt found no cached prefix).
    checkpoints: tuple[int, ...]
    # Where the same prompt sent again resumes (``resend_hit_boundary`` of the prompt).
    last_prompt_boundary: int
    # Where a continuation resumes once decode stops at ``max_tokens`` (0: no limit known).
    decode_end: int
    # The prompt found no cached prefix at its first admission: all of it is new to the cache.
    cold: bool = False

    def with_owed(self, position: int) -> RetentionPlan:
        """The plan with align's chunk end ``position`` added to the stops."""
        return replace(self, stops=(*self.stops, position))


def plan_request(
    num_prompt_tokens: int,
    max_tokens: int | None,
    block_size: int,
    use_eagle: bool,
    stops: tuple[int, ...] = (),
    checkpoints: tuple[int, ...] = (),
    cold: bool = False,
) -> RetentionPlan:
    """The plan of a request of ``num_prompt_tokens`` (``stops``: the scheduler's chunk stops,
    ``checkpoints`` those among them that are cold-prompt checkpoints; ``cold``: the prompt
    found no cached prefix). With no stops it is what the bookkeeping assumes for a request
    the scheduler did not plan."""
    return RetentionPlan(
        stops=stops,
        checkpoints=checkpoints,
        last_prompt_boundary=resend_hit_boundary(num_prompt_tokens, block_size, use_eagle),
        decode_end=decode_end_boundary(num_prompt_tokens, max_tokens, block_size, use_eagle),
        cold=cold,
    )


class RetentionPlans:
    """The plans of one scheduler's requests, by request id."""

    def __init__(self) -> None:
        self._plans: dict[str, RetentionPlan] = {}

    def set(self, request_id: str, plan: RetentionPlan) -> None:
        self._plans[request_id] = plan

    def get(self, request_id: str) -> RetentionPlan | None:
        return self._plans.get(request_id)

    def pop(self, request_id: str) -> None:
        """The request left the scheduler (finished or aborted): nothing reads its plan again."""
        self._plans.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._plans)
