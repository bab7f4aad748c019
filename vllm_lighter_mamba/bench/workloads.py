"""Token-level workloads for the prefix-caching benchmark (engine and ``--simulate``).

A workload is a list of waves; each wave is a list of requests issued together after the
previous wave finished. Prompts are token ids (no tokenizer involved), so the engine and the
simulation see exactly the same requests. ``multi-turn`` prompts extend the previous turn's
prompt and output, so its waves are built one at a time from the outputs.

Two workloads have open arrivals (:class:`OpenSource`): ``multi-prefix`` (many system prompts
with Zipf popularity, Poisson arrivals) and ``multi-turn-sessions`` (chat sessions that start
at Poisson times and send their next turn a think time after the previous one finished). The
simulation honours their arrival steps; the engine runs them as waves (all first requests,
then each round of next turns), arrival steps ignored.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

WORKLOADS = (
    "repeat",
    "shared-prefix",
    "divergent",
    "multi-turn",
    "few-shot",
    "multi-prefix",
    "multi-turn-sessions",
)
OPEN_WORKLOADS = ("multi-prefix", "multi-turn-sessions")


@dataclass
class WorkloadSpec:
    num_prompts: int = 16
    repeat_count: int = 2
    prefix_len: int = 1024
    input_length_range: tuple[int, int] = (64, 256)
    output_len: int = 16
    seed: int = 0
    vocab: int = 250
    num_turns: int = 3
    # Open workloads: system prompts (lengths prefix_len x 0.5..1.5), their Zipf exponent,
    # requests per scheduler step (Poisson), and the think time between a session's turns.
    num_prefixes: int = 48
    zipf_s: float = 1.0
    arrival_rate: float = 1.0
    think_steps: tuple[int, int] = (0, 50)


@dataclass
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Open workloads (--simulate): the scheduler step it arrives at; for a follow-up, the
    # steps after the previous turn finished.
    arrival: int = 0


Wave = list[BenchRequest]
# Given the outputs so far ({request_id: token ids}), the next wave, or None when done.
WaveSource = Callable[[dict[str, list[int]]], Wave | None]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _length(rng: random.Random, spec: WorkloadSpec) -> int:
    low, high = spec.input_length_range
    return rng.randint(low, high)


def workload_rng(name: str, spec: WorkloadSpec) -> random.Random:
    """Each workload draws its own tokens: with one shared seed, workloads run one after the
    other in the same engine would share their prefix and start warm."""
    return random.Random(f"{name}:{spec.seed}")


def static_waves(name: str, spec: WorkloadSpec) -> list[Wave]:
    rng = workload_rng(name, spec)
    n, out = spec.num_prompts, spec.output_len
    if name == "repeat":
        prompts = [_tokens(rng, spec.prefix_len + _length(rng, spec), spec.vocab) for _ in range(n)]
        return [
            [BenchRequest(f"r{k}-{i}", p, out) for i, p in enumerate(prompts)]
            for k in range(spec.repeat_count)
        ]
    if name in ("shared-prefix", "few-shot", "divergent"):
        prefix_len = spec.prefix_len
        if name == "divergent":
            # Ends mid-block for any power-of-two block size up to 64 (upstream vLLM #45238).
            prefix_len += 37
        prefix = _tokens(rng, prefix_len, spec.vocab)

        def suffix_len() -> int:
            if name == "few-shot":
                return max(4, _length(rng, spec) // 8)
            if name == "divergent":
                return _length(rng, spec) * 4
            return _length(rng, spec)

        prompts = [prefix + _tokens(rng, suffix_len(), spec.vocab) for _ in range(n)]
        # The first request computes the prefix; the rest follow together.
        waves = [[BenchRequest("p0", prompts[0], out)], [
            BenchRequest(f"p{i}", p, out) for i, p in enumerate(prompts[1:], start=1)
        ]]
        for k in range(1, spec.repeat_count):
            waves.append([BenchRequest(f"p{i}-again{k}", p, out) for i, p in enumerate(prompts)])
        return waves
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


def from_list(waves: list[Wave]) -> WaveSource:
    remaining = iter(waves)
    return lambda outputs: next(remaining, None)


class OpenSource:
    """An open-arrival workload: first requests with arrival steps, and follow-ups (a session's
    next turn) made when a request finishes, from its output.

    Called as a :data:`WaveSource` (engine mode) it returns the first requests as one wave,
    then the follow-ups of the previous wave as the next one.
    """

    def __init__(
        self, initial: list[BenchRequest], follow_up: Callable[[str, list[int]], BenchRequest | None]
    ) -> None:
        self.initial = initial
        self.follow_up = follow_up
        self._last: Wave | None = None

    def __call__(self, outputs: dict[str, list[int]]) -> Wave | None:
        if self._last is None:
            wave = list(self.initial)
        else:
            wave = [f for r in self._last if (f := self.follow_up(r.request_id, outputs[r.request_id]))]
        self._last = wave
        return wave or None


def _zipf_choice(rng: random.Random, n: int, s: float) -> int:
    """An index in [0, n) with P(i) proportional to 1 / (i + 1) ** s."""
    return rng.choices(range(n), weights=[1.0 / (i + 1) ** s for i in range(n)])[0]


def _system_prompts(rng: random.Random, spec: WorkloadSpec) -> list[list[int]]:
    lengths = [max(1, round(spec.prefix_len * rng.uniform(0.5, 1.5))) for _ in range(spec.num_prefixes)]
    return [_tokens(rng, n, spec.vocab) for n in lengths]


def _poisson_steps(rng: random.Random, n: int, rate: float) -> list[int]:
    """Arrival steps of ``n`` events of a Poisson process with ``rate`` events per step."""
    t, steps = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        steps.append(int(t))
    return steps


def multi_prefix(name: str, spec: WorkloadSpec) -> OpenSource:
    """``num_prompts`` requests, each a Zipf-chosen system prompt plus its own question."""
    rng = workload_rng(name, spec)
    systems = _system_prompts(rng, spec)
    requests = []
    for i, step in enumerate(_poisson_steps(rng, spec.num_prompts, spec.arrival_rate)):
        system = systems[_zipf_choice(rng, len(systems), spec.zipf_s)]
        prompt = system + _tokens(rng, _length(rng, spec), spec.vocab)
        requests.append(BenchRequest(f"m{i}", prompt, spec.output_len, arrival=step))
    return OpenSource(requests, lambda request_id, output: None)


def multi_turn_sessions(name: str, spec: WorkloadSpec) -> OpenSource:
    """``num_prompts`` chat sessions of ``num_turns`` turns: a Zipf-chosen system prompt and a
    first message; each next turn is the previous prompt, its reply and a new message, sent a
    think time (``think_steps``) after the reply. Sessions start at Poisson times (rate
    ``arrival_rate / num_turns``, so about ``arrival_rate`` requests per step in all)."""
    rng = workload_rng(name, spec)
    systems = _system_prompts(rng, spec)
    rate = spec.arrival_rate / max(spec.num_turns, 1)
    prompts: dict[int, list[int]] = {}
    session_rngs: dict[int, random.Random] = {}
    initial = []
    for c, step in enumerate(_poisson_steps(rng, spec.num_prompts, rate)):
        # Each session draws its own messages, so follow-ups do not depend on finishing order.
        session_rngs[c] = random.Random(f"{name}:{spec.seed}:{c}")
        prompts[c] = systems[_zipf_choice(rng, len(systems), spec.zipf_s)] + _tokens(
            session_rngs[c], _length(session_rngs[c], spec), spec.vocab
        )
        initial.append(BenchRequest(f"s{c}-t0", list(prompts[c]), spec.output_len, arrival=step))

    def follow_up(request_id: str, output: list[int]) -> BenchRequest | None:
        session, turn = (int(x) for x in request_id[1:].split("-t"))
        if turn + 1 >= spec.num_turns:
            return None
        session_rng = session_rngs[session]
        message = _tokens(session_rng, _length(session_rng, spec), spec.vocab)
        prompts[session] = prompts[session] + list(output) + message
        think = session_rng.randint(*spec.think_steps)
        return BenchRequest(f"s{session}-t{turn + 1}", list(prompts[session]), spec.output_len, arrival=think)

    return OpenSource(initial, follow_up)


def wave_source(name: str, spec: WorkloadSpec) -> WaveSource:
    """Waves for any workload; multi-turn builds each turn from the previous outputs."""
    if name == "multi-prefix":
        return multi_prefix(name, spec)
    if name == "multi-turn-sessions":
        return multi_turn_sessions(name, spec)
    if name != "multi-turn":
        return from_list(static_waves(name, spec))
    rng = workload_rng(name, spec)
    conversations = [
        _tokens(rng, spec.prefix_len // 4 + _length(rng, spec), spec.vocab) for _ in range(spec.num_prompts)
    ]
    turn = 0

    def next_wave(outputs: dict[str, list[int]]) -> Wave | None:
        nonlocal turn
        if turn >= spec.num_turns:
            return None
        if turn > 0:
            for c, prompt in enumerate(conversations):
                reply = outputs[f"c{c}-t{turn - 1}"]
                conversations[c] = prompt + reply + _tokens(rng, _length(rng, spec) // 2, spec.vocab)
        wave = [BenchRequest(f"c{c}-t{turn}", list(p), spec.output_len) for c, p in enumerate(conversations)]
        turn += 1
        return wave

    return next_wave


def trace_waves(path: str) -> list[Wave]:
    """Replay a user's log: JSONL lines with ``arrival`` (a step or wave number; lines with
    the same arrival form one wave), ``prompt_token_ids`` and ``output_len``."""
    by_arrival: dict[float, Wave] = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            item = json.loads(line)
            request = BenchRequest(
                str(item.get("request_id", f"t{i}")), list(item["prompt_token_ids"]), int(item["output_len"])
            )
            by_arrival.setdefault(float(item.get("arrival", i)), []).append(request)
    return [by_arrival[k] for k in sorted(by_arrival)]


def random_trace(rng: random.Random, one_at_a_time: bool = False, max_model_len: int = 8192):
    """A random scheduler trace for ``bench.sim.replay``: (requests, scheduler kwargs, replay kwargs).

    Shared prefixes (small vocabularies make prompts collide often), arrivals, aborts, small
    pools (waiting and preemption), ``reset_prefix_cache`` with running requests, sync and
    async scheduling with real overlap, block sizes from 16 to 1056 (as vLLM picks for
    hybrid models). ``one_at_a_time``: one running request and a pool nothing is evicted from.
    """
    from vllm_lighter_mamba.bench.sim import SimRequest

    block_size = rng.choice([16, 32, 64, 256, 544, 1056])
    max_blocks = min(6, (max_model_len - 128) // block_size - 1)
    vocab = rng.choice([3, 300])

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefixes = [tokens(rng.randrange(0, max_blocks * block_size)) for _ in range(rng.randrange(1, 4))]
    requests = []
    for i in range(rng.randrange(1, 8)):
        prompt = (rng.choice(prefixes) + tokens(rng.randrange(1, 3 * block_size)))[: max_model_len - 80]
        abort = rng.randrange(0, 40) if rng.random() < 0.15 and not one_at_a_time else None
        requests.append(SimRequest(f"q{i}", prompt, rng.randrange(1, 40), rng.randrange(0, 30), abort))
    budget = block_size * rng.randrange(1, 6) + rng.randrange(0, block_size)
    async_scheduling = rng.random() < 0.5
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    # Small pools: one long request fits (the engine checks that at start-up), several wait
    # or get preempted.
    min_blocks = 2 * (longest // block_size + 4) + 8
    scheduler_kwargs = {
        "block_size": block_size,
        "max_num_batched_tokens": budget,
        "max_num_seqs": 1 if one_at_a_time else rng.choice([1, 2, 4, 8]),
        "num_blocks": 1000 if one_at_a_time else rng.choice([min_blocks, 2 * min_blocks, 400]),
        "max_model_len": max_model_len,
        "async_scheduling": async_scheduling,
    }
    resets = []
    if rng.random() < 0.2 and not one_at_a_time:
        resets = sorted(rng.sample(range(1, 60), rng.randrange(1, 3)))
    return requests, scheduler_kwargs, {"overlap": async_scheduling, "resets": resets}


def history_trace(seed: int) -> tuple[list, dict, list[int]]:
    """System prompts shared by questions, exact repeats and multi-turn continuations (an
    earlier prompt, its reply and a new message), with random arrivals; and pool sizes from
    the smallest that runs every request to one that never evicts. Small blocks (4-16 tokens)
    and pools of a few dozen blocks: the retention property test's traces
    (``tests/v1/core/test_retention_property.py``, ``benchmarks/benchmark_pressure_traces.py``)."""
    from vllm_lighter_mamba.bench.sim import SimRequest, continuation

    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    systems = [
        [rng.randrange(1, 300) for _ in range(rng.randrange(bs, 6 * bs))] for _ in range(rng.randrange(1, 4))
    ]
    reqs: list = []
    for i in range(rng.randrange(3, 10)):
        kind = rng.random()
        arrival = rng.randrange(0, 12 * (i + 1))
        max_tokens = rng.randrange(1, 3 * bs)
        if reqs and kind < 0.2:  # the same prompt again
            prompt = list(rng.choice(reqs).prompt_token_ids)
        elif reqs and kind < 0.45:  # the next turn of an earlier conversation
            earlier = rng.choice(reqs)
            reply = continuation(earlier.prompt_token_ids, earlier.max_tokens)
            message = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 2 * bs))]
            prompt = earlier.prompt_token_ids + reply + message
            arrival = max(arrival, earlier.arrival_step + 2 * earlier.max_tokens)
        else:
            prompt = rng.choice(systems) + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 3 * bs))]
        reqs.append(SimRequest(f"q{i}", prompt, max_tokens, arrival))
    groups = rng.choice([1, 3])
    need = max(-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) for r in reqs) + 3 * groups + 2
    kwargs = {
        "block_size": bs,
        "max_num_batched_tokens": bs * rng.randrange(2, 6),
        "max_num_seqs": rng.choice([2, 4, 8]),
        "num_mamba_groups": groups,
        "max_model_len": 4096,
    }
    return reqs, kwargs, sorted({need, need + 2, need + 5, 3 * need // 2, 2 * need, 4 * need, 1000})
