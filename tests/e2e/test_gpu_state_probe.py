"""GPU end to end (skipped without CUDA), an oracle that is not ourselves: the state the lighter
cache keeps at a prefill's last cache position, written *inside* the forward (internal
checkpoint, vLLM 0.34 with the Triton GDN prefill and bf16 SSM states), read out of its engine,
against caching off's state after the same tokens.

Tiny Qwen3-Next (three GDN layers), eager, one request at a time, a budget larger than the
prompt: the lighter engine serves a 1,100-token prompt in one chunk and writes the state at
1,024 inside it (block 128 asked; vLLM 0.34 raised it to 256 on an H100, 2026-12-06: 1,024 is
the last cache position either way); caching off serves the first 1,024 tokens, and the first
896 (128 tokens earlier: what a state read early would hold). The two engines run different
batches (1,100 against 1,024 rows in every projection), so their bf16 numbers could differ in
the last bit; the test asks the checkpoint to be within a small tolerance of caching off's state
at 1,024 and far from its state at 896, and records whether it is bit-equal (H100, vLLM 0.34.0,
2026-12-06: all 6 state tensors bit-equal; 896's at least 7% away).

On the device: ``python -m pytest tests/e2e/test_gpu_state_probe.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from .helpers import shared_text
from .state_probe import LayerStates, probe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TEXT = shared_text(3, 1100)
PROMPT_TOKENS = 1100  # the byte-level tokenizer: one token per character
BLOCK_SIZE = 128
CHECKPOINT = 1024  # the last cache position: (1100 - 1) // 128 * 128
EARLIER = CHECKPOINT - BLOCK_SIZE
ENGINE = {
    "max_model_len": 2048,
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 4,
    "block_size": BLOCK_SIZE,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.12,
    "additional_config": {"gdn_prefill_backend": "triton"},
}
if os.environ.get("LIGHTER_MAMBA_GPU_KV_BYTES"):  # beside other processes on one GPU
    ENGINE["kv_cache_memory_bytes"] = int(os.environ["LIGHTER_MAMBA_GPU_KV_BYTES"])
    ENGINE["gpu_memory_utilization"] = 0.05


@pytest.fixture(scope="module")
def lighter(qwen3_next_dir: str) -> dict:
    requests = [{"text": TEXT, "num_tokens": PROMPT_TOKENS, "cached_boundaries": [CHECKPOINT]}]
    return probe("lighter", qwen3_next_dir, requests, ENGINE)


@pytest.fixture(scope="module")
def off(qwen3_next_dir: str) -> dict:
    lengths = (CHECKPOINT, EARLIER)
    result = probe("none", qwen3_next_dir, [{"text": TEXT, "num_tokens": n} for n in lengths], ENGINE)
    return dict(zip(lengths, result["requests"], strict=True))


def distance(ours: LayerStates, theirs: LayerStates) -> dict[tuple[str, int], float]:
    """Per state tensor: max |ours - theirs| relative to max |theirs|."""
    assert ours.keys() == theirs.keys()
    return {
        (name, index): float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
        for name in ours
        for index, (a, b) in enumerate(zip(ours[name], theirs[name], strict=True))
    }


def test_the_checkpoint_is_written_inside_the_forward(lighter):
    block_size = lighter["block_size"]
    assert block_size % 64 == 0 and (PROMPT_TOKENS - 1) // block_size * block_size == CHECKPOINT
    assert lighter["checkpoint_alignment"] == 64
    request = lighter["requests"][0]
    assert request["prompt_tokens"] == PROMPT_TOKENS and request["cached_tokens"] == 0
    states = request["cached"][CHECKPOINT]
    assert len(states) == 3 and all(t[1].dtype == torch.bfloat16 for t in states.values())


def test_checkpoint_state_is_caching_offs_state_after_the_same_tokens(lighter, off, record_property):
    ours = lighter["requests"][0]["cached"][CHECKPOINT]
    same = distance(ours, off[CHECKPOINT]["running"])
    early = distance(ours, off[EARLIER]["running"])
    theirs = off[CHECKPOINT]["running"]
    bit_equal = sum(torch.equal(a, b) for name in ours for a, b in zip(ours[name], theirs[name], strict=True))
    record_property("bit_equal_tensors", f"{bit_equal} of {len(same)}")
    record_property("max_relative_distance", max(same.values()))
    record_property("min_relative_distance_one_block_early", min(early.values()))
    print(f"bit-equal tensors: {bit_equal} of {len(same)}; max relative distance {max(same.values()):.3g};"
          f" one block early: min {min(early.values()):.3g}")
    # bf16 keeps 8 bits of mantissa: a few roundings of difference stay near 1e-2 of the largest
    # value; a state one block (128 tokens) off is far outside that.
    assert max(same.values()) < 0.02, same
    assert min(early.values()) > 10 * max(max(same.values()), 1e-3), early
