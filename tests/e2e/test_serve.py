"""`VLLM_USE_LIGHTER_MAMBA_CACHE=1 vllm serve` as an operator runs it: completions and chat
completions through the openai client, cached tokens in the usage, and the prefix-cache
counters on /metrics (vLLM's and ours)."""

from __future__ import annotations

import pytest

from vllm_lighter_mamba.bench.server import cpu_serve_args, metric_total, metrics, serve, wait_for_metric

from .helpers import shared_text

pytestmark = pytest.mark.engine

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
SYSTEM = shared_text(9, 900)
# Every usage this server returned, for the final comparison with our counters.
USAGES: list = []


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
    # vLLM logs (and we pull our counters) every VLLM_LOG_STATS_INTERVAL seconds.
    env = {"VLLM_LOG_STATS_INTERVAL": "1"}
    with serve(qwen3_next_dir, args, lighter=True, env=env, log_path=str(tmp / "server.log")) as url:
        yield url, qwen3_next_dir, tmp / "server.log"


def cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    return (details.cached_tokens if details else 0) or 0


def complete(client, model: str, prompt: str, max_tokens: int = 4):
    response = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    usage = response.usage
    USAGES.append(usage)
    return usage


def test_completions_first_follower_hits(server):
    from openai import OpenAI

    base_url, model, log = server
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    before = metrics(base_url)
    # The first prompt's unique tail (300 tokens) puts its last block boundary (1,152) past the
    # shared 900 tokens; its first chunk ends at 768 (the 1,024-token budget on the 384-token
    # block grid), and the state there serves the first follower (with or without cold-prompt
    # checkpoints: 768 is also the one 1 block before 1,152).
    prompts = [SYSTEM + " " + shared_text(3, 300)] + [SYSTEM + f" question {i}?" for i in (1, 2)]
    usages = [complete(client, model, p) for p in prompts]
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


def test_chat_completions_hit(server):
    from openai import OpenAI

    base_url, model, _ = server
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": SYSTEM + " (chat)"}]
    responses = [
        client.chat.completions.create(
            model=model, messages=messages + [{"role": "user", "content": q}], max_tokens=4, temperature=0.0
        )
        for q in ("one", "two")
    ]
    USAGES.extend(r.usage for r in responses)
    assert responses[0].choices[0].message.content is not None
    assert cached_tokens(responses[1].usage) > 0


def test_lighter_counters_on_metrics_equal_the_cached_tokens(server):
    """Our counters reach /metrics through vLLM's utility channel (no files), once per
    request whatever the number of Mamba groups: equal to the per-request cached tokens."""
    base_url, _, log = server
    expected_tokens = sum(cached_tokens(u) for u in USAGES)
    expected_hits = sum(cached_tokens(u) > 0 for u in USAGES)
    assert expected_hits >= 3
    values = wait_for_metric(base_url, "vllm:lighter_mamba_state_hit_tokens_total", expected_tokens, 30)
    assert metric_total(values, "vllm:lighter_mamba_state_hit_tokens_total") == expected_tokens
    assert metric_total(values, "vllm:lighter_mamba_state_hits_total") == expected_hits
    assert metric_total(values, "vllm:lighter_mamba_states_cached_total") > 0
    for name in ("states_evicted", "lost_hit_tokens", "states_dropped", "evicted_pages_ranked_state"):
        assert f'vllm:lighter_mamba_{name}_total{{engine="0"}}' in values, name
    # The retention policy's view: the states the hits used are still held, and were kept
    # for later requests (no pressure in this run, so nothing was evicted).
    assert 0 < metric_total(values, "vllm:lighter_mamba_states_held") <= metric_total(
        values, "vllm:lighter_mamba_states_cached_total"
    )
    assert metric_total(values, "vllm:lighter_mamba_states_admitted_total") > 0
    assert "lighter Mamba cache: states_cached=" in log.read_text()
