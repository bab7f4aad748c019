"""The serving workloads: exact lengths, the reuse each one claims, and vLLM's own custom-dataset
loader reading them in order with their answer lengths."""

from __future__ import annotations

import collections

import pytest

from vllm_lighter_mamba.bench import serving_workloads as sw
from vllm_lighter_mamba.bench.tiny_models import build_tokenizer


def _shared_prefix(a: str, b: str) -> int:
    import os

    return len(os.path.commonprefix([a, b]))


def test_words_have_the_asked_length_and_are_lowercase_ascii():
    import random

    text = sw.words(random.Random(0), 1000)
    assert len(text) == 1000
    assert set(text) <= set(sw.LETTERS + " ")


def test_system_prompts_share_one_of_few_long_prefixes_and_differ_after_it():
    w = sw.system_prompt(seed=0, prompt_len=2048, num_prompts=40, num_systems=3)
    prefixes = collections.Counter(r["prompt"][:2048] for r in w.requests)
    assert len(prefixes) == 3
    assert all(32 <= len(r["prompt"]) - 2048 <= 128 for r in w.requests)
    assert len({r["prompt"] for r in w.requests}) == 40
    assert w.name == "system2k" and w.request_rate == 1.0


def test_seeds_give_unrelated_prompts_and_a_seed_gives_the_same_ones():
    a, b = sw.system_prompt(0, 4096, 8), sw.system_prompt(1, 4096, 8)
    assert a == sw.system_prompt(0, 4096, 8)
    assert max(_shared_prefix(x["prompt"], y["prompt"]) for x in a.requests for y in b.requests) < 64


def test_every_turn_resends_the_previous_turn_and_turns_go_out_turn_by_turn_across_chats():
    w = sw.multi_turn(seed=0, num_chats=3, num_turns=4, first_len=500, reply_len=50)
    prompts = [r["prompt"] for r in w.requests]
    assert len(prompts) == 12
    assert all(len(p) == 500 for p in prompts[:3])
    for turn in range(1, 4):
        for chat in range(3):
            previous, current = prompts[(turn - 1) * 3 + chat], prompts[turn * 3 + chat]
            assert current.startswith(previous)
            assert 50 + 128 <= len(current) - len(previous) <= 50 + 512 + 20
    assert _shared_prefix(prompts[0], prompts[1]) < 64


def test_rag_documents_follow_zipf_popularity():
    w = sw.rag(seed=0, num_prompts=400, num_docs=8, doc_len=256, zipf_s=1.1)
    counts = collections.Counter(r["prompt"][:256] for r in w.requests)
    ranked = [c for _, c in counts.most_common()]
    assert len(counts) <= 8
    assert ranked[0] > 2.5 * ranked[-1]
    uniform = sw.rag(seed=0, num_prompts=400, num_docs=8, doc_len=256, zipf_s=0.0)
    assert max(collections.Counter(r["prompt"][:256] for r in uniform.requests).values()) < ranked[0]


def test_decode_prompts_are_distinct_with_long_answers_and_a_concurrency_cap():
    w = sw.decode(seed=0, num_prompts=16, input_len=300, output_len=700, max_concurrency=4)
    assert len({r["prompt"] for r in w.requests}) == 16
    assert all(len(r["prompt"]) == 300 and r["output_tokens"] == 700 for r in w.requests)
    assert w.request_rate is None and w.max_concurrency == 4


def test_warm_up_takes_the_first_requests_with_the_same_pacing():
    w = sw.rag(seed=0, num_prompts=40)
    warm = sw.warm_up_of(w, 0.25)
    assert warm.requests == w.requests[:10] and warm.request_rate == w.request_rate
    assert len(sw.warm_up_of(w, 0.01).requests) == 4


def test_vllm_custom_dataset_reads_them_in_order_with_exact_lengths(tmp_path):
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets import CustomDataset

    tokenizer_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    w = sw.multi_turn(seed=0, num_chats=2, num_turns=3, first_len=300, reply_len=40, output_len=17)
    path = w.write(tmp_path / "w.jsonl")
    dataset = CustomDataset(dataset_path=str(path), disable_shuffle=True, random_seed=0)
    sampled = dataset.sample(tokenizer=tokenizer, num_requests=len(w.requests), output_len=-1,
                             skip_chat_template=True)
    assert [s.prompt for s in sampled] == [r["prompt"] for r in w.requests]
    assert [s.prompt_len for s in sampled] == [len(r["prompt"]) for r in w.requests]
    assert {s.expected_output_len for s in sampled} == {17}
