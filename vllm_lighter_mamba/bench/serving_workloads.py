"""Serving workloads as ``vllm bench serve`` custom datasets (JSONL, one request per line).

What people run on a long-context hybrid model, and what a prefix cache is for:

- ``system``: a few long shared system prompts (8k-32k tokens), each followed by a short question;
- ``multi_turn``: chats in which every turn resends the whole history, turn by turn across chats;
- ``rag``: documents picked with Zipf popularity, each followed by a question;
- ``decode``: distinct short prompts and long answers (no reuse: per-step cost only).

Prompts are lowercase ASCII words. Under the byte-level tokenizer of
:mod:`vllm_lighter_mamba.bench.tiny_models` one character is one token, so prompt lengths are
exact. The history of a chat holds a written reply per turn, not the model's own answer (a
static dataset cannot know it): a turn hits at most the previous turn's prompt, never the
previous answer, in every caching mode alike.

Requests are written in the order they are meant to be sent; ``vllm bench serve`` keeps that
order with ``--disable-shuffle``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Workload:
    """One workload's requests and how they are sent: Poisson arrivals at ``request_rate`` per
    second (``None``: all at once), at most ``max_concurrency`` in flight (``None``: no cap)."""

    name: str
    requests: list[dict]
    request_rate: float | None
    max_concurrency: int | None = None

    def write(self, path: str | Path) -> Path:
        """The requests as a JSONL file for ``--dataset-name custom``."""
        path = Path(path)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.requests))
        return path


def words(rng: random.Random, length: int) -> str:
    """``length`` characters of lowercase words separated by spaces."""
    out: list[str] = []
    size = 0
    while size < length:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 9))) + " "
        out.append(word)
        size += len(word)
    return "".join(out)[:length]


def _question(rng: random.Random, length_range: tuple[int, int]) -> str:
    return "\n" + words(rng, rng.randint(*length_range) - 2) + "?"


def system_prompt(seed: int, prompt_len: int, num_prompts: int, num_systems: int = 4,
                  question_len: tuple[int, int] = (32, 128), output_len: int = 128,
                  request_rate: float | None = 1.0) -> Workload:
    """``num_systems`` system prompts of ``prompt_len`` tokens; each request one of them
    (uniformly) plus a short question."""
    rng = random.Random(f"system-{seed}-{prompt_len}")
    systems = [words(rng, prompt_len) for _ in range(num_systems)]
    requests = [{"prompt": rng.choice(systems) + _question(rng, question_len), "output_tokens": output_len}
                for _ in range(num_prompts)]
    return Workload(f"system{prompt_len // 1024}k", requests, request_rate)


def multi_turn(seed: int, num_chats: int = 16, num_turns: int = 6, first_len: int = 2048,
               user_len: tuple[int, int] = (128, 512), reply_len: int = 128, output_len: int = 128,
               request_rate: float | None = 3.0) -> Workload:
    """``num_chats`` chats of ``num_turns`` turns. Turn ``t``'s prompt is turn ``t - 1``'s
    prompt, a written reply of ``reply_len`` tokens and a new user message. Sent turn by turn:
    every chat's first turn, then every chat's second turn, ..."""
    rng = random.Random(f"multi-turn-{seed}")
    chats = []
    for _ in range(num_chats):
        history = "user: " + words(rng, first_len - 6)
        turns = [history]
        for _ in range(num_turns - 1):
            reply, question = words(rng, reply_len), words(rng, rng.randint(*user_len))
            history += "\nassistant: " + reply + "\nuser: " + question
            turns.append(history)
        chats.append(turns)
    requests = [{"prompt": chat[turn], "output_tokens": output_len}
                for turn in range(num_turns) for chat in chats]
    return Workload("multi_turn", requests, request_rate)


def zipf_index(rng: random.Random, n: int, s: float) -> int:
    """An index in ``range(n)`` with probability proportional to ``1 / (index + 1) ** s``."""
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def rag(seed: int, num_prompts: int = 64, num_docs: int = 32, doc_len: int = 4096, zipf_s: float = 1.1,
        question_len: tuple[int, int] = (32, 128), output_len: int = 128,
        request_rate: float | None = 2.0) -> Workload:
    """Document reuse: each request one of ``num_docs`` documents of ``doc_len`` tokens, drawn
    with Zipf popularity (exponent ``zipf_s``), plus a question."""
    rng = random.Random(f"rag-{seed}")
    docs = [words(rng, doc_len) for _ in range(num_docs)]
    requests = [{"prompt": docs[zipf_index(rng, num_docs, zipf_s)] + _question(rng, question_len),
                 "output_tokens": output_len} for _ in range(num_prompts)]
    return Workload("rag", requests, request_rate)


def decode(seed: int, num_prompts: int = 64, input_len: int = 512, output_len: int = 1024,
           max_concurrency: int | None = 32) -> Workload:
    """Distinct prompts, long answers, a fixed number in flight."""
    rng = random.Random(f"decode-{seed}")
    requests = [{"prompt": words(rng, input_len), "output_tokens": output_len} for _ in range(num_prompts)]
    return Workload("decode", requests, None, max_concurrency)


def warm_up_count(num_requests: int, fraction: float, minimum: int = 4) -> int:
    """How many requests a warm-up pass of a workload of ``num_requests`` sends."""
    return max(minimum, int(num_requests * fraction))


def warm_up_of(workload: Workload, fraction: float = 0.25) -> Workload:
    """The workload's first requests (its own shapes and order), for a server's warm-up pass.
    Run with another seed than the measured pass, so that it leaves no prefix the measured
    pass could hit."""
    count = warm_up_count(len(workload.requests), fraction)
    return Workload(workload.name + "-warmup", workload.requests[:count], workload.request_rate,
                    workload.max_concurrency)
