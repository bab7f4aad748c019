"""How far a better eviction order could take the lighter cache on the retention property suite:
the suite's pressure cases (``benchmark_pressure_traces.py``) replayed with an eviction order
that knows the future, against align (vLLM's LRU).

The oracle replaces the retention policy's pick (``StateRetention._pick``) with Belady's rule
on pages: every cached free page (state or attention) gets its next use, the earliest arrival
(or now, for a request already waiting) of a request that has not started yet, or was
preempted, and whose prompt can hit that page's prefix (the prompt's whole blocks before its
last token); the pages used farthest ahead (never: first) are evicted first, ties in vLLM's
LRU order. It knows every request's prompt and arrival step, which no server does. It is not
a proven optimum (a page's next use counts even where a deeper state would serve that
request instead, and evicting one attention block can strand a whole chain), so it answers
"is there room above the policy on these traces", not "what is the best possible".

    python benchmarks/benchmark_oracle_eviction.py [--num-traces 200] [--model DIR] [--list-below]
    python benchmarks/benchmark_oracle_eviction.py -- <benchmark_prefix_caching.py --simulate args>

The first form is ``benchmark_pressure_traces.py --modes lighter:inside,oracle``.
The second form runs a retention sweep of ``benchmark_prefix_caching.py`` with the oracle's
order in its ``lighter:inside`` replays (workloads without follow-ups: multi-prefix, repeat).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling scripts


class Future:
    """What the oracle knows: each request's arrival and the prefixes its prompt can hit,
    and (from the replay's observer) which requests have started."""

    def __init__(self, requests: Sequence[Any], block_size: int) -> None:
        from vllm_lighter_mamba.bench.sim import make_request

        self.arrivals: dict[str, int] = {}
        self.users: dict[bytes, list[str]] = {}
        for sim_request in requests:
            request = make_request(sim_request, block_size)
            self.arrivals[sim_request.request_id] = sim_request.arrival_step
            hittable = (len(sim_request.prompt_token_ids) - 1) // block_size
            for block_hash in request.block_hashes[:hittable]:
                self.users.setdefault(bytes(block_hash), []).append(sim_request.request_id)
        self.now = 0
        self.live: dict[str, Any] = {}

    def observe(self, output: Any, live: dict[str, Any]) -> None:
        self.live = live

    def waiting_for_a_hit(self, request_id: str) -> bool:
        from vllm.v1.request import RequestStatus

        request = self.live.get(request_id)
        if request is None:
            return True  # not arrived yet
        return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def next_use(self, block_hash: bytes) -> float:
        uses = [max(self.arrivals[rid], self.now) for rid in self.users.get(block_hash, ())
                if self.waiting_for_a_hit(rid)]
        return min(uses, default=math.inf)


def oracle_pick(future: Future):
    from vllm.v1.core.kv_cache_utils import get_block_hash

    def pick(retention: Any, count: int) -> list[Any]:
        queue = retention.pool.free_block_queue
        candidates = []
        block = queue.fake_free_list_head.next_free_block
        order = 0
        while block is not queue.fake_free_list_tail:
            if block.block_hash is not None:
                candidates.append((-future.next_use(bytes(get_block_hash(block.block_hash))), order, block))
                order += 1
            block = block.next_free_block
        candidates.sort(key=lambda c: (c[0], c[1]))
        victims = [block for _, _, block in candidates[:count]]
        for block in victims:
            retention.pending[block.block_id] = "ranked_state"  # a known reason, for the counters
        return victims

    return pick


@contextlib.contextmanager
def oracle_order(requests: Sequence[Any], block_size: int) -> Iterator[dict[str, Any]]:
    """The oracle's pick in place of the policy's for the replays inside (of ``requests``);
    yields the hooks a replay needs (``sim.replay``'s ``check`` and ``observers``)."""
    from unittest import mock

    from vllm_lighter_mamba.v1.core.block_pool_retention import StateRetention

    future = Future(requests, block_size)

    def clock(scheduler: Any, output: Any, step: int) -> None:
        future.now = step + 1  # the next schedule() runs at step + 1

    with mock.patch.object(StateRetention, "_pick", oracle_pick(future)):
        yield {"check": clock, "observers": [future.observe]}


def replay_with_oracle(requests: Sequence[Any], model: str, num_blocks: int,
                       observers: Sequence[Callable] = (), scheduler: Any = None, **kwargs: Any) -> Any:
    """``requests`` replayed by the lighter cache (``lighter:inside``) with the oracle's pick;
    ``observers`` and ``scheduler`` as ``sim.replay`` takes them."""
    from vllm_lighter_mamba.bench.sim import replay

    with oracle_order(requests, kwargs["block_size"]) as hooks:
        return replay("lighter:inside", requests, model, num_blocks=num_blocks, max_steps=20_000,
                      check=hooks["check"], observers=[*hooks["observers"], *observers],
                      scheduler=scheduler, **kwargs)


def sweep(bench_argv: list[str]) -> None:
    """``benchmark_prefix_caching.py --simulate`` with ``bench_argv``, its ``lighter:inside``
    replays with the oracle's order. Workloads whose requests come only when others finish
    (multi-turn follow-ups) are refused: the oracle would not know them."""
    import benchmark_prefix_caching

    from vllm_lighter_mamba.bench import sim

    upstream = sim.replay

    def replay(mode: str, requests: Sequence[Any], model_dir: str, **kwargs: Any) -> Any:
        if mode != "lighter:inside":
            return upstream(mode, requests, model_dir, **kwargs)
        on_finish = kwargs.pop("on_finish", None)

        def no_follow_ups(request: Any, step: int) -> list:
            if on_finish is not None and on_finish(request, step):
                raise SystemExit("benchmark_oracle_eviction: this workload sends requests when others "
                                 "finish (follow-ups); the oracle cannot know them")
            return []

        with oracle_order(requests, kwargs["block_size"]) as hooks:
            return upstream(mode, requests, model_dir, on_finish=no_follow_ups, **hooks, **kwargs)

    sim.replay = replay
    try:
        benchmark_prefix_caching.main(bench_argv)
    finally:
        sim.replay = upstream


def shortfall_kind(align: Any, ours: Any) -> str:
    """Why ``ours`` (a replay below align in hit tokens) is below: align's extra hits went to
    requests it preempted afterwards (their hit was computed again), or ours computes no more
    tokens than align all the same, or a real loss (ours computes more)."""
    short = align.cached_tokens - ours.cached_tokens
    preempted_hits = sum(hit for rid, hit in align.cached_per_request.items()
                         if align.requests[rid].num_preemptions and hit > ours.cached_per_request.get(rid, 0))
    if preempted_hits >= short:
        return "align's extra hits went to requests it preempted later"
    if ours.computed_tokens <= align.computed_tokens:
        return "computes no more tokens than align"
    return "computes more tokens than align"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        sweep(argv[argv.index("--") + 1:])
        return
    import benchmark_pressure_traces

    benchmark_pressure_traces.main(["--modes", "lighter:inside,oracle", *argv])


if __name__ == "__main__":
    main()
