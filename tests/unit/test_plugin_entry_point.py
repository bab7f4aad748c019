"""vLLM's own plugin loader finds our entry point and calls register()."""

import importlib.metadata as metadata


def test_entry_point_is_declared():
    eps = metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == "vllm_lighter_mamba:register"]
    assert len(ours) == 1


def test_vllm_plugin_loader_calls_register(monkeypatch):
    import vllm.plugins as plugins

    import vllm_lighter_mamba

    calls = []
    monkeypatch.setattr(vllm_lighter_mamba, "register", lambda: calls.append(1))
    monkeypatch.setattr(plugins, "plugins_loaded", False, raising=False)
    plugins.load_general_plugins()
    assert calls == [1]
