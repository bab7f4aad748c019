"""`VLLM_USE_LIGHTER_MAMBA_CACHE=1 vllm serve` as an operator runs it: completions and chat
completions through the openai client, cached tokens in the usage, and vLLM's prefix-cache
counters on /metrics."""

from __future__ import annotations

import pytest

from vllm_lighter_mamba.testing.server import cpu_serve_args, metric_total, metrics, serve, wait_for_metric

from .helpers import shared_text

pytestmark = pytest.mark.engine

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
SYSTEM = shared_text(9, 900)


@pytest.fixture(scope="module")
def server(qwen3_next_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = cpu_serve_args() + [
        "--enable-prompt-tokens-details",
        "--max-num-batched-tokens", "1024",
        "--max-model-len", "4096",
        "--chat-template", str(template),
    ]
    with serve(qwen3_next_dir, args, lighter=True, log_path=str(tmp / "server.log")) as base_url:
        yield base_url, qwen3_next_dir, tmp / "server.log"


def cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    return (details.cached_tokens if details else 0) or 0


def test_completions_first_follower_hits(server):
    from openai import OpenAI

    base_url, model, log = server
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    before = metrics(base_url)
    # The first prompt's unique tail (300 tokens) puts its last block boundary past the
    # shared 900 tokens, the case where upstream align serves the first follower nothing
    # (issue 8): only a state left at a cold-prompt checkpoint can serve it.
    prompts = [SYSTEM + " " + shared_text(3, 300)] + [SYSTEM + f" question {i}?" for i in (1, 2)]
    usages = [
        client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0.0).usage
        for p in prompts
    ]
    assert cached_tokens(usages[0]) == 0
    # The first follower of the request that computed the prefix is served from the cache.
    assert cached_tokens(usages[1]) > 0 and cached_tokens(usages[2]) > 0
    after = metrics(base_url)
    def rise(name: str) -> float:
        return metric_total(after, name) - metric_total(before, name)

    hits, queries = rise("vllm:prefix_cache_hits_total"), rise("vllm:prefix_cache_queries_total")
    assert queries >= sum(u.prompt_tokens for u in usages)
    assert hits >= cached_tokens(usages[1]) + cached_tokens(usages[2])
    assert "lighter Mamba cache on" in log.read_text()


def test_lighter_counters_on_metrics(server):
    """The engine core publishes about once a second; the front end reads it on the next step."""
    from openai import OpenAI

    base_url, model, _ = server
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    values = wait_for_metric(
        base_url, "vllm:lighter_mamba_state_hits_total", at_least=1, timeout_s=30,
        poke=lambda: client.completions.create(model=model, prompt=SYSTEM + " metrics?", max_tokens=2,
                                               temperature=0.0),
    )
    assert metric_total(values, "vllm:lighter_mamba_state_hits_total") > 0
    assert metric_total(values, "vllm:lighter_mamba_state_hit_tokens_total") > 0
    assert metric_total(values, "vllm:lighter_mamba_states_cached_total") > 0
    for name in ("states_evicted", "lost_hit_tokens"):
        assert any(k.startswith(f"vllm:lighter_mamba_{name}_total") for k in values), name


def test_chat_completions_hit(server):
    from openai import OpenAI

    base_url, model, _ = server
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": SYSTEM + " (chat)"}]
    first = client.chat.completions.create(
        model=model, messages=messages + [{"role": "user", "content": "one"}], max_tokens=4, temperature=0.0
    )
    second = client.chat.completions.create(
        model=model, messages=messages + [{"role": "user", "content": "two"}], max_tokens=4, temperature=0.0
    )
    assert first.choices[0].message.content is not None
    assert cached_tokens(second.usage) > 0
