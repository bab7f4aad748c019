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
    monkeypatch.delenv(VARIABLE)


def test_register_is_a_no_op_when_off(monkeypatch):
    import vllm.config.scheduler as sched

    import vllm_lighter_mamba

    before = sched.SchedulerConfig.__dict__["get_scheduler_cls"]
    monkeypatch.setenv(VARIABLE, "0")
    vllm_lighter_mamba.register()
    assert sched.SchedulerConfig.__dict__["get_scheduler_cls"] is before or vllm_lighter_mamba._registered
    monkeypatch.delenv(VARIABLE)
