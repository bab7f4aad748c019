"""The tiny models: deterministic, small, load in transformers, peaky logits, and their
configs resolve to hybrid architectures in vLLM."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from vllm_lighter_mamba.bench.tiny_models import ARCHS, build_tiny_model, build_tokenizer

VLLM_ARCH = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_next_pp": "Qwen3NextForCausalLM",
    "qwen3_next_mtp": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "nemotron_h_mtp": "NemotronHForCausalLM",
    "jamba": "JambaForCausalLM",
}


def digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_model_builds_loads_and_is_peaky(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(arch, tmp_path / "a", seed=1)
    assert digest(out) == digest(build_tiny_model(arch, tmp_path / "b", seed=1))
    assert digest(out) != digest(build_tiny_model(arch, tmp_path / "c", seed=2))
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < 20 * 2**20
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([list(b"hello, hybrid world")])
    logits = model(ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    # Peaky: the best token leads the runner-up by far more than bf16 rounding noise.
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_sees_a_hybrid_model(arch, tmp_path):
    from vllm.config import ModelConfig

    out = build_tiny_model(arch, tmp_path / arch)
    config = ModelConfig(model=str(out), dtype="bfloat16")
    assert config.architecture == VLLM_ARCH[arch]
    assert config.is_hybrid


def test_tokenizer_is_byte_level():
    tok = build_tokenizer()
    text = "Mamba states at block boundaries: ü!"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode())
    assert tok.decode(ids) == text
