"""Start-up rules, checked on the config vLLM builds (before any engine or memory)."""

from __future__ import annotations

import logging

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_lighter_mamba.bench.sim import install_patches
from vllm_lighter_mamba.config import CONFIG_KEY, block_size_conflicts, check_block_size, is_active
from vllm_lighter_mamba.envs import VARIABLE, LighterMambaConfigError


@pytest.fixture(autouse=True)
def _patches_installed():
    install_patches()  # what register() does in a vLLM process with the variable on


def engine_config(model: str, lighter: bool, monkeypatch, **kwargs):
    """The config `vllm serve MODEL ...` builds, with the variable on or off."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv(VARIABLE, "1" if lighter else "0")
    try:
        return EngineArgs(model=model, dtype="bfloat16", max_model_len=4096, **kwargs).create_engine_config()
    finally:
        monkeypatch.delenv(VARIABLE)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny model without Mamba-type layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_lighter_mamba.bench.tiny_models import build_tokenizer

    out = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory):
    """A pure Mamba2 model (no attention layers); only its config is read."""
    from transformers import Mamba2Config

    from vllm_lighter_mamba.bench.tiny_models import build_tokenizer

    out = tmp_path_factory.mktemp("mamba2")
    Mamba2Config(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                 state_size=16, n_groups=1, expand=2).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return str(out)


def test_variable_on_decides_once_and_keeps_upstream_modes_off(qwen3_next_dir, monkeypatch):
    config = engine_config(qwen3_next_dir, True, monkeypatch)
    assert is_active(config) and config.additional_config[CONFIG_KEY] is True
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "none"  # align never turned on
    # The one writer of the Mamba block size runs in the worker, once the block size is final.
    assert config.cache_config.mamba_block_size is None


def test_variable_off_leaves_vllm_defaults(qwen3_next_dir, monkeypatch):
    default = engine_config(qwen3_next_dir, False, monkeypatch)
    opted_in = engine_config(qwen3_next_dir, False, monkeypatch, enable_prefix_caching=True)
    assert not is_active(default) and not is_active(opted_in)
    # vLLM 0.32: prefix caching on by default for hybrids, with its align mode.
    assert default.cache_config.enable_prefix_caching is True
    assert default.cache_config.mamba_cache_mode == "align"
    assert opted_in.cache_config.mamba_cache_mode == "align"


def test_the_decision_cannot_be_forced_without_the_variable(qwen3_next_dir, monkeypatch):
    config = engine_config(qwen3_next_dir, False, monkeypatch, additional_config={CONFIG_KEY: True})
    assert not is_active(config)


@pytest.mark.parametrize("mode", ["align"])  # vLLM 0.32 has no "all" mode
@pytest.mark.skipif(
    EngineArgs.mamba_cache_mode is None,
    reason="vLLM 0.34: --mamba-cache-mode is a deprecated no-op, nothing reaches the config",
)
def test_explicit_mamba_cache_mode_conflicts(qwen3_next_dir, monkeypatch, mode):
    with pytest.raises(LighterMambaConfigError, match=f"--mamba-cache-mode {mode} was given"):
        engine_config(qwen3_next_dir, True, monkeypatch, enable_prefix_caching=True, mamba_cache_mode=mode)


def test_prefix_caching_explicitly_disabled_conflicts(qwen3_next_dir, monkeypatch):
    with pytest.raises(LighterMambaConfigError, match="explicitly disabled"):
        engine_config(qwen3_next_dir, True, monkeypatch, enable_prefix_caching=False)


def test_chunked_prefill_disabled_conflicts(qwen3_next_dir, monkeypatch):
    with pytest.raises(LighterMambaConfigError, match="chunked prefill is disabled"):
        engine_config(qwen3_next_dir, True, monkeypatch, enable_chunked_prefill=False,
                      max_num_batched_tokens=4096)


def test_kv_offloading_is_checked_on_the_final_config(qwen3_next_dir, monkeypatch):
    """`--kv-offloading-size` becomes a kv_transfer_config only at the end of VllmConfig."""
    with pytest.raises(LighterMambaConfigError, match="KV offloading") as excinfo:
        engine_config(qwen3_next_dir, True, monkeypatch, kv_offloading_size=1.0)
    assert str(excinfo.value).count(VARIABLE) == 1  # one line


def test_budget_and_long_prefill_threshold_below_one_block_are_rejected():
    assert block_size_conflicts(256, 256, 0) == []
    assert block_size_conflicts(256, 8192, 256) == []
    (budget,) = block_size_conflicts(256, 128, 0)
    assert "max_num_batched_tokens (128)" in budget and "(256)" in budget
    (threshold,) = block_size_conflicts(256, 8192, 100)
    assert "--long-prefill-token-threshold (100)" in threshold and "(256)" in threshold


def test_block_size_check_runs_on_the_config(qwen3_next_dir, monkeypatch):
    config = engine_config(qwen3_next_dir, True, monkeypatch, max_num_batched_tokens=4096,
                           long_prefill_token_threshold=100)
    config.cache_config.block_size = 256  # as the worker finalizes it
    with pytest.raises(LighterMambaConfigError, match="long-prefill-token-threshold \\(100\\)"):
        check_block_size(config)


def test_non_hybrid_model_is_untouched(llama_dir, caplog, monkeypatch):
    stock = engine_config(llama_dir, False, monkeypatch)
    with caplog.at_level(logging.INFO):
        ours = engine_config(llama_dir, True, monkeypatch)
    assert not is_active(ours)
    assert ours.cache_config.enable_prefix_caching == stock.cache_config.enable_prefix_caching
    assert ours.cache_config.mamba_cache_mode == stock.cache_config.mamba_cache_mode == "none"
    assert "lighter Mamba cache on" not in caplog.text
    assert "is not a hybrid attention + Mamba model: the lighter Mamba cache changes nothing" in caplog.text


def test_pure_mamba_model_is_cleanly_off(mamba2_dir, caplog, monkeypatch):
    """Issue 13: one behaviour for models without attention: vLLM's own, with an info line."""
    stock = engine_config(mamba2_dir, False, monkeypatch, enable_prefix_caching=True)
    with caplog.at_level(logging.INFO):
        ours = engine_config(mamba2_dir, True, monkeypatch, enable_prefix_caching=True)
    assert not is_active(ours)
    assert ours.cache_config.mamba_cache_mode == stock.cache_config.mamba_cache_mode != "none"
    assert "changes nothing" in caplog.text and "lighter Mamba cache on" not in caplog.text


def test_unsupported_options_each_get_one_line(monkeypatch):
    from types import SimpleNamespace as NS

    from vllm_lighter_mamba.config import config_conflicts

    def fake(**overrides):
        config = NS(
            model_config=NS(architecture="Qwen3NextForCausalLM"),
            cache_config=NS(mamba_cache_mode="none", enable_prefix_caching=True, block_size=16,
                            prefix_match_unit=None, enable_mamba_shared_prefix_checkpoint=False,
                            prefix_cache_retention_interval=0, use_replayssm=False),
            scheduler_config=NS(enable_chunked_prefill=True),
            parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               pipeline_parallel_size=1),
            speculative_config=None,
            kv_transfer_config=None,
            use_v2_model_runner=False,
        )
        for path, value in overrides.items():
            section, _, field = path.partition("__")
            if field:
                setattr(getattr(config, section), field, value)
            else:
                setattr(config, section, value)
        return config

    assert config_conflicts(fake()) == []
    assert config_conflicts(fake(use_v2_model_runner=True)) == []  # Model Runner V2 is supported
    cases = {
        "context parallelism": {"parallel_config__decode_context_parallel_size": 2},
        "KV connectors": {"kv_transfer_config": object()},
        "chunked prefill is disabled": {"scheduler_config__enable_chunked_prefill": False},
        "--mamba-cache-mode align": {"cache_config__mamba_cache_mode": "align"},
        "--prefix-match-unit 8": {"cache_config__prefix_match_unit": 8},
        "--enable-mamba-shared-prefix-checkpoint": {
            "cache_config__enable_mamba_shared_prefix_checkpoint": True
        },
        "--prefix-cache-retention-interval 32": {"cache_config__prefix_cache_retention_interval": 32},
        "--prefix-cache-retention-interval None": {"cache_config__prefix_cache_retention_interval": None},
        "--use-replayssm": {"cache_config__use_replayssm": True},
        "KimiK3ForConditionalGeneration reads": {
            "model_config": NS(architecture="KimiK3ForConditionalGeneration")
        },
    }
    for phrase, overrides in cases.items():
        problems = config_conflicts(fake(**overrides))
        assert len(problems) == 1 and phrase in problems[0], (phrase, problems)

    # Speculative decoding: MTP with Qwen3-Next or NemotronH is accepted (shown lossless); every other
    # method or architecture only when asked for as experimental (one line naming the opt-in);
    # the CPU backend and steps longer than a block are rejected either way.
    from vllm.platforms import current_platform

    def drafting(method: str, architecture: str = "Qwen3NextForCausalLM", **overrides):
        return fake(speculative_config=NS(method=method, num_speculative_tokens=2),
                    model_config=NS(architecture=architecture), **overrides)

    ngram = NS(method="ngram", num_speculative_tokens=2)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert config_conflicts(drafting("mtp")) == []
    assert config_conflicts(drafting("mtp", "NemotronHForCausalLM")) == []
    for method, architecture in [("ngram", "Qwen3NextForCausalLM"), ("eagle3", "Qwen3NextForCausalLM"),
                                 ("mtp", "JambaForCausalLM")]:
        problems = config_conflicts(drafting(method, architecture))
        assert len(problems) == 1 and f"speculative method {method!r} with {architecture}" in problems[0]
        assert "shown: mtp with Qwen3NextForCausalLM, NemotronHForCausalLM" in problems[0]
        assert "lighter_mamba_speculative" in problems[0]
        opt_in = {"lighter_mamba_speculative": "experimental"}
        opted_in = drafting(method, architecture, additional_config=opt_in)
        assert config_conflicts(opted_in) == []
    pipelined = config_conflicts(drafting("mtp", parallel_config=NS(
        decode_context_parallel_size=1, prefill_context_parallel_size=1, pipeline_parallel_size=2)))
    assert len(pipelined) == 1 and "pipeline parallelism" in pipelined[0]
    long_step = config_conflicts(fake(speculative_config=NS(method="ngram", num_speculative_tokens=16)))
    assert any("at most one block boundary" in p for p in long_step)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    assert any("CPU backend" in p for p in config_conflicts(fake(speculative_config=ngram)))


def test_cold_checkpoints_setting_is_parsed_and_a_bad_one_is_one_clear_error(qwen3_next_dir, monkeypatch):
    from vllm_lighter_mamba.config import COLD_CHECKPOINTS_KEY, cold_checkpoints, parse_cold_checkpoints

    assert parse_cold_checkpoints(None) == ()  # none unless asked for
    assert parse_cold_checkpoints([4, 1]) == (1, 4)
    assert parse_cold_checkpoints([]) == ()
    for bad in ([0], [1, 1], "1,2", [True], [1.5]):
        with pytest.raises(LighterMambaConfigError, match=COLD_CHECKPOINTS_KEY):
            parse_cold_checkpoints(bad)
    config = engine_config(qwen3_next_dir, True, monkeypatch, enable_prefix_caching=True,
                           additional_config={COLD_CHECKPOINTS_KEY: [2]})
    assert cold_checkpoints(config) == (2,)
    with pytest.raises(LighterMambaConfigError, match="expected a list of distinct block counts"):
        engine_config(qwen3_next_dir, True, monkeypatch, enable_prefix_caching=True,
                      additional_config={COLD_CHECKPOINTS_KEY: [-1]})
