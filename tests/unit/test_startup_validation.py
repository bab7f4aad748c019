"""Start-up rules, checked where vLLM builds its config (before any engine or memory)."""

from __future__ import annotations

import logging

import pytest

from vllm_lighter_mamba.config import check_block_size
from vllm_lighter_mamba.envs import LighterMambaConfigError
from vllm_lighter_mamba.testing.sim import lighter_variable


def engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="bfloat16", max_model_len=4096, **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny model without Mamba-type layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_lighter_mamba.testing.tiny_models import build_tokenizer

    out = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return str(out)


def test_variable_on_enables_prefix_caching_and_keeps_upstream_modes_off(qwen3_next_dir):
    with lighter_variable(True):
        config = engine_config(qwen3_next_dir)
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "none"  # align never turned on
    assert scheduler_cls.__name__.startswith("LighterMamba")


def test_variable_off_leaves_vllm_defaults(qwen3_next_dir):
    with lighter_variable(False):
        default = engine_config(qwen3_next_dir)
        opted_in = engine_config(qwen3_next_dir, enable_prefix_caching=True)
        scheduler_cls = default.scheduler_config.get_scheduler_cls()
    assert default.cache_config.enable_prefix_caching is False  # vLLM 0.26: opt-in for hybrids
    assert opted_in.cache_config.mamba_cache_mode == "align"
    assert not scheduler_cls.__name__.startswith("LighterMamba")


@pytest.mark.parametrize("mode", ["align", "all"])
def test_explicit_mamba_cache_mode_conflicts(qwen3_next_dir, mode):
    with lighter_variable(True), pytest.raises(Exception, match=f"--mamba-cache-mode {mode} was given"):
        engine_config(qwen3_next_dir, enable_prefix_caching=True, mamba_cache_mode=mode)


def test_prefix_caching_explicitly_disabled_conflicts(qwen3_next_dir):
    with lighter_variable(True), pytest.raises(LighterMambaConfigError, match="explicitly disabled"):
        engine_config(qwen3_next_dir, enable_prefix_caching=False)


def test_chunked_prefill_disabled_conflicts(qwen3_next_dir):
    with lighter_variable(True), pytest.raises(Exception, match="chunked prefill is disabled"):
        engine_config(qwen3_next_dir, enable_chunked_prefill=False, max_num_batched_tokens=4096)


def test_budget_below_one_block_is_rejected():
    check_block_size(256, 256)
    with pytest.raises(LighterMambaConfigError, match="max_num_batched_tokens \\(128\\)"):
        check_block_size(256, 128)


def test_non_hybrid_model_is_untouched(llama_dir, caplog):
    with lighter_variable(False):
        stock = engine_config(llama_dir)
    with lighter_variable(True), caplog.at_level(logging.INFO):
        ours = engine_config(llama_dir)
    assert ours.cache_config.enable_prefix_caching == stock.cache_config.enable_prefix_caching
    assert ours.cache_config.mamba_cache_mode == stock.cache_config.mamba_cache_mode == "none"
    assert "lighter Mamba cache on" not in caplog.text
    assert "has no Mamba-type layers: the lighter Mamba cache changes nothing" in caplog.text


def test_unsupported_options_each_get_one_line():
    from types import SimpleNamespace as NS

    from vllm_lighter_mamba.config import config_conflicts

    def fake(**overrides):
        config = NS(
            cache_config=NS(mamba_cache_mode="none", enable_prefix_caching=True),
            scheduler_config=NS(enable_chunked_prefill=True),
            parallel_config=NS(pipeline_parallel_size=1),
            speculative_config=None,
            kv_transfer_config=None,
        )
        for path, value in overrides.items():
            section, _, field = path.partition("__")
            if field:
                setattr(getattr(config, section), field, value)
            else:
                setattr(config, section, value)
        return config

    assert config_conflicts(fake()) == []
    cases = {
        "pipeline parallelism": {"parallel_config__pipeline_parallel_size": 2},
        "speculative decoding": {"speculative_config": object()},
        "KV connectors": {"kv_transfer_config": object()},
        "chunked prefill is disabled": {"scheduler_config__enable_chunked_prefill": False},
        "--mamba-cache-mode all": {"cache_config__mamba_cache_mode": "all"},
    }
    for phrase, overrides in cases.items():
        problems = config_conflicts(fake(**overrides))
        assert len(problems) == 1 and phrase in problems[0], (phrase, problems)
