"""Read a hybrid model's Mamba/GDN state tensors out of a running engine, to compare them with
another engine's directly (not through the tokens they lead to).

    python -m tests.e2e.state_probe SPEC.json OUT.pt      (from the repository root)

SPEC: {"mode": "none"|"align"|"lighter", "model": DIR, "engine": {EngineArgs...},
       "requests": [{"text": str, "num_tokens": N, "cached_boundaries": [B, ...]}, ...]}
Each request is the first ``num_tokens`` token ids of ``text`` (tokenized once, as a text
prompt would be), served alone with ``max_tokens=1``: the engine prefills those tokens and
samples one token without another forward, so the states are the ones after exactly the prompt.
After it finished, before the next request can reuse a block, the probe saves, per Mamba
layer, a copy of every state tensor (conv state, SSM/recurrent state) of

- ``running``: the request's state block as it was when the request was freed (its last
  non-null Mamba block, per group; caching off keeps one block per request);
- ``cached[B]``: for each boundary ``B`` in ``cached_boundaries`` (caching on), the block vLLM's
  prefix cache maps the prompt's first ``B`` tokens to, per group: the block a later hit on
  that prefix is served from (the same hash lookup as the Mamba managers'
  ``find_longest_cache_hit``).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker), so the
scheduler's block pool and the worker's state tensors are both plain attributes here.
:func:`probe` runs this in a fresh process per mode (the lighter-cache variable must be set
before vLLM loads its plugins).
"""

from __future__ import annotations

from typing import Any

import torch

from .helpers import fresh_process_main, run_in_fresh_process
from .runner import engine_kwargs

# {layer name: [state tensor, ...]} in the layer's own order (GDN: conv state, then SSM state).
LayerStates = dict[str, list[torch.Tensor]]


def probe(mode: str, model: str, requests: list[dict], engine: dict) -> dict[str, Any]:
    """One in-process engine in a fresh process; the saved record (see the module docstring)."""
    spec = {"mode": mode, "model": model, "engine": engine, "requests": requests}
    # In-process engine: the scheduler's block pool and the worker's tensors in one process.
    return run_in_fresh_process("tests.e2e.state_probe", mode, spec, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                                "out.pt", torch.load)


def mamba_group_ids(kv_cache_config: Any) -> list[int]:
    """The KV-cache groups holding Mamba-type states (the lighter spec subclasses MambaSpec)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return [
        group_id
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, MambaSpec)
    ]


def read_states(worker: Any, blocks: dict[int, int]) -> LayerStates:
    """Runs on the worker (``collective_rpc``): a copy of block ``blocks[group]`` of every state
    tensor of every layer of each group."""
    runner = worker.model_runner
    forward_context = runner.compilation_config.static_forward_context
    states: LayerStates = {}
    for group_id, block_id in blocks.items():
        for name in runner.kv_cache_config.kv_cache_groups[group_id].layer_names:
            states[name] = [tensor[block_id].clone() for tensor in forward_context[name].kv_cache]
    return states


def cached_blocks(scheduler: Any, request: Any, boundary: int, group_ids: list[int]) -> dict[int, int]:
    """Per Mamba group, the block the prefix cache serves the request's first ``boundary``
    tokens from (vLLM's hash lookup at the group's block size)."""
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    blocks = {}
    for group_id in group_ids:
        block_size = manager.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size
        assert boundary % block_size == 0, (boundary, block_size)
        hashes = resolve_block_hashes(request.block_hashes, pool.hash_block_size, block_size)
        found = pool.get_cached_block(hashes[boundary // block_size - 1], [group_id])
        assert found is not None, f"boundary {boundary} of group {group_id} is not cached"
        blocks[group_id] = found[0].block_id
    return blocks


def run(spec: dict) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    import vllm_lighter_mamba

    llm = LLM(**engine_kwargs(spec["mode"], spec["model"], spec.get("engine", {})))
    core = llm.llm_engine.engine_core.engine_core  # in-process: the EngineCore itself
    scheduler = core.scheduler
    group_ids = mamba_group_ids(scheduler.kv_cache_config)
    # Keep every request the scheduler receives (its prompt's block hashes are needed after
    # it finished) and the Mamba blocks each held when it was freed.
    added: list[Any] = []
    freed: dict[str, tuple[list[int], ...]] = {}
    add_request, free = scheduler.add_request, scheduler.kv_cache_manager.free

    def keep_added(request: Any) -> None:
        added.append(request)
        add_request(request)

    def keep_freed(request: Any) -> None:
        freed[request.request_id] = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        free(request)

    scheduler.add_request = keep_added
    scheduler.kv_cache_manager.free = keep_freed

    def read(blocks: dict[int, int]) -> LayerStates:
        return llm.collective_rpc(read_states, args=(blocks,))[0]  # one worker

    null_block = scheduler.kv_cache_manager.block_pool.null_block.block_id
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    records = []
    for entry in spec["requests"]:
        token_ids = tokenizer.encode(entry["text"])
        assert len(token_ids) >= entry["num_tokens"], "text shorter than the tokens asked for"
        prompt = {"prompt_token_ids": token_ids[: entry["num_tokens"]]}
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        request = added[-1]
        tables = freed[request.request_id]
        # Without speculative blocks the last non-null block is the running one, in either
        # layout (caching off: the only one; the lighter cache: the last computed token's).
        running = {g: [b for b in tables[g] if b != null_block][-1] for g in group_ids}
        boundaries = entry.get("cached_boundaries", [])
        cached = {b: cached_blocks(scheduler, request, b, group_ids) for b in boundaries}
        records.append(
            {
                "prompt_tokens": len(output.prompt_token_ids),
                "cached_tokens": output.num_cached_tokens or 0,
                "mamba_tables": {g: list(tables[g]) for g in group_ids},
                "running_blocks": running,
                "running": read(running),
                "cached_blocks": cached,
                "cached": {b: read(blocks) for b, blocks in cached.items()},
            }
        )
    return {
        "mode": spec["mode"],
        "plugin": vllm_lighter_mamba.__file__,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        # Where the lighter engine writes a prefill's last boundary state inside the forward.
        "checkpoint_alignment": getattr(scheduler, "lighter_checkpoint_alignment", None),
        "requests": records,
    }


if __name__ == "__main__":
    fresh_process_main(run, torch.save)
