"""benchmarks/benchmark_prefill_steps.py: its prefill step and chunk counting, by hand and on
a tiny replay through vLLM's scheduler whose chunks are worked out below."""

from __future__ import annotations

import pytest

from vllm_lighter_mamba.bench.sim import SimRequest, replay

from . import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("benchmark_prefill_steps")


def test_prefill_stats_counts_prompt_chunks_only(bench):
    chunks = [
        ("a", 0, 512, 0), ("b", 256, 100, 0),  # b hit 256 tokens
        ("a", 512, 300, 1), ("b", 356, 1, 1),   # a's last chunk carries 2 drafts past its 810
        ("a", 812, 3, 2), ("b", 357, 1, 2),     # decode steps: not prefill
    ]
    stats = {s.request_id: s for s in bench.prefill_stats(chunks, {"a": 810, "b": 356}, {"b": 256})}
    assert stats["a"].chunks == [512, 298] and stats["a"].steps == 2 and stats["a"].hit_tokens == 0
    assert stats["b"].chunks == [100] and stats["b"].steps == 1 and stats["b"].hit_rate == 256 / 356


# One 900-token prompt, block 256, budget 512, then the same prompt again. Its last block
# boundary is 768.
# - none: 0-512, 512-900 (2 steps); the repeat hits nothing: 2 steps again.
# - align, vLLM's CUDA defaults: 0-512, then 512-900 in one chunk: its internal checkpoint
#   writes the state at 768 without a cut (2 steps); the repeat hits 768: one 132-token chunk.
# - align:triton (no internal checkpoints): 0-512, 512-768 (cut at the last boundary), 768-900.
# - lighter (no cold-prompt checkpoints, the default): align:triton's chunks.
# - lighter:ckpt=1/2/4: a cold prompt also stops 1 and 2 blocks before 768 (512, 256; 4 blocks
#   before is below 0): 0-256, 256-512, 512-768, 768-900 (4 steps); the repeat hits 768.
# - align:pmu=64 (--prefix-match-unit 64, fine-grained hits): align's chunks, and the prompt's
#   tail is hashed and its state kept on the 64-token grid, so the repeat hits 896 (the deepest
#   multiple of 64 that leaves a token to compute) and computes 4 tokens. The replay hashes the
#   request as the engine core does, on the scheduler's hash block size (64 here, not 256).
EXPECTED = {
    "none": ([512, 388], 0, [512, 388]),
    "align": ([512, 388], 768, [132]),
    "align:triton": ([512, 256, 132], 768, [132]),
    "align:pmu=64": ([512, 388], 896, [4]),
    "lighter": ([512, 256, 132], 768, [132]),
    "lighter:ckpt=1/2/4": ([256, 256, 256, 132], 768, [132]),
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_prefill_steps_of_a_tiny_replay(bench, qwen3_next_dir, mode):
    base, options = bench.parse_mode(mode)
    prompt = [(7 * i) % 250 + 1 for i in range(900)]
    kwargs = dict(block_size=256, max_num_batched_tokens=512, max_model_len=2048, num_blocks=200,
                  num_mamba_groups=3, **options)
    first = replay(base, [SimRequest("r0", prompt, 4)], qwen3_next_dir, **kwargs)
    again = replay(base, [SimRequest("r1", prompt, 4)], qwen3_next_dir,
                   scheduler=first.scheduler)
    (cold,) = bench.prefill_stats(first.chunks, {"r0": 900}, first.cached_per_request)
    (warm,) = bench.prefill_stats(again.chunks, {"r1": 900}, again.cached_per_request)
    cold_chunks, hit, warm_chunks = EXPECTED[mode]
    assert cold.chunks == cold_chunks and cold.steps == len(cold_chunks) and cold.hit_tokens == 0
    assert (warm.hit_tokens, warm.chunks) == (hit, warm_chunks)
    # Prefill steps plus the 3 decode steps of 4 output tokens (the last prefill step samples
    # the first).
    assert first.steps == len(cold_chunks) + 3


def test_table_has_a_row_per_mode(bench):
    rows = [bench.Row("w", 512, mode, 256, [bench.PrefillStats("r", 900, 768, [132])], 4)
            for mode in ("none", "lighter")]
    table = bench.markdown(rows).splitlines()
    assert len(table) == 4 and "| w | 512 | lighter | 256 | 1 | 1.0 | 1 | 132.0 | 768.0 | 0.853 |" in table[3]


def test_a_lighter_modes_options_stay_with_it_in_a_list_of_modes():
    from vllm_lighter_mamba.bench.sim import parse_mode, split_modes

    modes = split_modes("align,lighter:off,inside,lighter,lighter:alpha=8,ckpt=1/2/4,none")
    assert modes == ["align", "lighter:off,inside", "lighter", "lighter:alpha=8,ckpt=1/2/4", "none"]
    assert parse_mode(modes[1]) == ("lighter", (("retention", "off"), ("internal_checkpoints", True)))
