"""The oracle drafter of the GPU speculative-decoding test, checked where it can run: on the
CPU backend with an attention-only tiny model (vLLM 0.26's CPU build cannot run GDN with
drafting). With its drafts, greedy outputs equal the run without drafting exactly while a
share of drafts is accepted and a share rejected: the method can judge a cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .helpers import flat_requests, run_mode, shared_text
from .oracle_proposer import ORACLE_FILE, oracle_drafts

WAVES = [[shared_text(5, 300) + " a", shared_text(6, 200) + " b"]]
ENGINE = {"max_model_len": 2048, "max_num_batched_tokens": 512, "max_num_seqs": 4, "enforce_eager": True}


def accepted(drafts: list[int], truth: list[int]) -> int:
    """How many leading drafts a greedy rejection sampler accepts."""
    count = 0
    while count < len(drafts) and drafts[count] == truth[count]:
        count += 1
    return count


def test_drafts_follow_the_reference_up_to_a_cut():
    """A greedy decode walking the reference with these drafts: each step accepts the drafts
    before the cut and rejects the rest, and the walk keeps both accepting and rejecting
    (a step that accepts everything advances by k + 1 tokens: the cut must not repeat)."""
    prompt, output = [1, 2, 3], [(7 * i) % 200 + 4 for i in range(200)]
    references = [(prompt, output)]
    done, counts = 1, []
    while done + 3 < len(output):
        truth = output[done : done + 3]
        drafts = oracle_drafts(prompt + output[:done], references, 3)
        n = accepted(drafts, truth)
        assert len(drafts) == 3 and all(d != t for d, t in zip(drafts[n:], truth[n:], strict=True))
        counts.append(n)
        done += n + 1
    tail = counts[-15:]
    assert len(tail) == 15 and 0 < sum(tail) < 3 * len(tail) and len(set(tail)) > 1
    assert oracle_drafts(prompt + [output[0], 0], references, 3) == [0, 0, 0]  # left the reference
    assert oracle_drafts([9, 9], references, 3) == [0, 0, 0]


def test_a_next_turn_follows_its_own_reference():
    """A next turn's context starts with the first turn's prompt too: the longest matching
    prompt is the one it continues."""
    first = ([1, 2, 3], [4, 5, 6, 7])
    follow = ([1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25])
    for references in ([first, follow], [follow, first]):
        drafts = oracle_drafts([*follow[0], 20], references, 3)
        # Its reference's next tokens, each kept or (from the cut on) replaced by token + 1.
        assert all(d in (t, t + 1) for d, t in zip(drafts, [21, 22, 23], strict=True)), drafts


def tiny_llama(out: Path) -> str:
    from transformers import LlamaConfig

    from vllm_lighter_mamba.bench.tiny_models import TOKEN_IDS, VOCAB_SIZE, save_random_model

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, **TOKEN_IDS,
    )
    return str(save_random_model(config, out))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's check; the GPU runs the real test")
def test_oracle_drafting_is_lossless_on_an_attention_model(tmp_path):
    model = tiny_llama(tmp_path / "llama")
    plain = run_mode("none", model, WAVES, ENGINE, max_tokens=40)
    reference = flat_requests(plain)
    oracle = tmp_path / "references.json"
    oracle.write_text(json.dumps([[r["prompt_token_ids"], r["token_ids"]] for r in reference]))
    spec = {"method": "custom_class", "model": "tests.e2e.oracle_proposer.OracleProposer",
            "num_speculative_tokens": 3}
    engine = {**ENGINE, "speculative_config": spec, "disable_log_stats": False}
    env = {ORACLE_FILE: str(oracle)}
    result = run_mode("none", model, WAVES, engine, max_tokens=40, metrics=True, env=env)
    drafted = flat_requests(result)
    assert [r["token_ids"] for r in drafted] == [r["token_ids"] for r in reference]
    counts = result["spec_decode"]
    assert 0 < counts["accepted"] < counts["draft"]
