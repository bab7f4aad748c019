"""The serving comparison's pool-use figures, from ``/metrics`` samples."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_serving.py"
_spec = importlib.util.spec_from_file_location("benchmark_serving", SCRIPT)
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)


def test_blocks_per_running_request_averages_busy_samples():
    # 1000 blocks; 10% used by 2 requests (50 each), 30% by 3 (100 each); idle samples ignored.
    samples = [(0.0, 0.0), (0.1, 2.0), (0.3, 3.0), (0.05, 0.0)]
    use = serving.pool_use(samples, 1000)
    assert use["peak_kv_usage"] == 0.3
    assert use["blocks_per_running_request"] == pytest.approx(75.0)


def test_pool_use_without_samples_or_pool_size_is_unknown():
    assert serving.pool_use([], 1000) == {"peak_kv_usage": None, "blocks_per_running_request": None}
    assert serving.pool_use([(0.2, 1.0)], None)["blocks_per_running_request"] is None


def test_num_gpu_blocks_from_cache_config_info_labels():
    values = {'vllm:cache_config_info{block_size="16",num_gpu_blocks="4321"}': 1.0,
              'vllm:num_requests_running{engine="0"}': 3.0}
    assert serving.num_gpu_blocks(values) == 4321
    assert serving.num_gpu_blocks({}) is None
