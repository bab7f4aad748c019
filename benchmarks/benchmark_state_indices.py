"""Micro-benchmark: our state-index gather vs upstream vLLM's ops (not a test).

GPU: one Triton launch (state indices + copy pairs) vs vLLM 0.26's align-mode
``mamba_get_block_table_tensor`` (arange + add + cast + gather), eager and replayed in a
CUDA graph, and the GPU time of the kernels alone (profiler). CPU: numba vs the torch reference.

    python benchmarks/benchmark_state_indices.py [--batches 8,256,1024,4096] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from functools import partial

import torch

from vllm_lighter_mamba.ops.state_indices import mamba_state_indices

BLOCK_SIZE = 256
MAX_BLOCKS = 64  # rows of a 16k-token max_model_len


def make_inputs(batch: int, device: str):
    gen = torch.Generator().manual_seed(batch)
    table = torch.randint(1, 50_000, (batch, MAX_BLOCKS), generator=gen, dtype=torch.int32)
    seq_lens = torch.randint(1, MAX_BLOCKS * BLOCK_SIZE, (batch,), generator=gen, dtype=torch.int32)
    query_lens = torch.minimum(torch.ones(batch, dtype=torch.int32), seq_lens)
    return table.to(device), seq_lens.to(device), query_lens.to(device)


def upstream_gather(table, seq_lens, spec):
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    return mamba_get_block_table_tensor(table, seq_lens, spec, "align")


def time_gpu(fn, iters: int = 2000, graph: bool = False) -> float:
    """Mean microseconds per call, measured with CUDA events over many calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def gpu_kernel_us(fn, iters: int = 200) -> float:
    """GPU time of the kernels one call launches (sum of their durations, mean per call),
    from the profiler: what the call costs the GPU, without the host's launch overhead."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total = sum(e.device_time_total for e in kernels)
    return total / iters


def time_cpu(fn, iters: int = 300) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1e6 / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="8,256,1024,4096")
    parser.add_argument("--json")
    args = parser.parse_args()
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=BLOCK_SIZE, shapes=((1,),), dtypes=(torch.float32,))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    if torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
        for batch in batches:
            table, seq_lens, query_lens = make_inputs(batch, "cuda")
            ours = partial(mamba_state_indices, table, seq_lens, BLOCK_SIZE, 0, query_lens)
            theirs = partial(upstream_gather, table, seq_lens, spec)

            assert torch.equal(ours().state_indices, theirs())
            row = {
                "batch": batch,
                "ours_eager_us": time_gpu(ours),
                "upstream_eager_us": time_gpu(theirs),
                "ours_graph_us": time_gpu(ours, graph=True),
                "upstream_graph_us": time_gpu(theirs, graph=True),
                "ours_kernel_us": gpu_kernel_us(ours),
                "upstream_kernel_us": gpu_kernel_us(theirs),
            }
            row["speedup_eager"] = row["upstream_eager_us"] / row["ours_eager_us"]
            row["speedup_graph"] = row["upstream_graph_us"] / row["ours_graph_us"]
            rows.append(row)
    else:
        machine = platform.processor() or platform.machine()
        for batch in batches:
            table, seq_lens, query_lens = make_inputs(batch, "cpu")
            ours = partial(mamba_state_indices, table, seq_lens, BLOCK_SIZE, 0, query_lens)
            row = {
                "batch": batch,
                "numba_us": time_cpu(partial(ours, backend="numba")),
                "torch_us": time_cpu(partial(ours, backend="torch")),
                "upstream_torch_us": time_cpu(partial(upstream_gather, table, seq_lens, spec)),
            }
            row["speedup_vs_upstream"] = row["upstream_torch_us"] / row["numba_us"]
            rows.append(row)
    header = list(rows[0])
    print(f"# machine: {machine}; torch {torch.__version__}")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
