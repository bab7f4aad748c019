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


def test_qwen3_next_remembers_a_state_a_thousand_tokens_back(tmp_path):
    """A wrong GatedDeltaNet state must change tokens long after it (bench/tiny_models.SLOW_DECAY):
    zeroing the states after 768 tokens moves the next-token log-probabilities 1,000 tokens
    later by more than 1 nat (4.3 measured; 0.007 with transformers' initialisation)."""
    import copy

    from transformers import AutoModelForCausalLM

    from tests.e2e.helpers import shared_text

    path = build_tiny_model("qwen3_next", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prefix = torch.tensor([list(shared_text(1, 768).encode())])
    later = torch.tensor([list(shared_text(4, 1000).encode())])
    with torch.no_grad():
        cache = model(prefix, use_cache=True).past_key_values
        wiped = copy.deepcopy(cache)
        per_layer = [getattr(layer, "recurrent_states", None) or {} for layer in wiped.layers]
        states = [s for layer in per_layer for s in layer.values() if torch.is_tensor(s)]
        assert len(states) == 3  # the three GDN layers
        for state in states:
            state.zero_()
        right = model(later, past_key_values=cache).logits[0, -1].log_softmax(-1)
        wrong = model(later, past_key_values=wiped).logits[0, -1].log_softmax(-1)
    assert (right - wrong).abs().max() > 1.0


def test_the_80b_shaped_model_has_qwen3_next_80b_sizes_and_no_weights(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from vllm_lighter_mamba.bench.tiny_models import build_tiny_model

    out = build_tiny_model("qwen3_next_80b_shape", tmp_path / "m")
    config = AutoConfig.from_pretrained(out)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (48, 2048, 151936)
    assert config.layer_types.count("full_attention") == 12 and config.layer_types[3] == "full_attention"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 2, 256)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 10, 512)
    assert not list(out.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer("abc def").input_ids) == 7  # one token per byte
    assert tokenizer.decode([151935]) == "<|unused_151935|>"
