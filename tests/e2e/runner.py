"""Run waves of prompts through vLLM's offline ``LLM`` in one engine and print JSON results.

    python -m tests.e2e.runner SPEC.json OUT.json      (from the repository root)

SPEC: {"mode": "none"|"align"|"lighter", "model": DIR, "engine": {EngineArgs...},
       "waves": [[prompt, ...], ...], "max_tokens": N}
Each wave is one ``generate`` call issued after the previous one finished. A prompt may be
``{"follow": i, "text": str}``: the next turn of the i-th earlier request (all waves in
order), i.e. its prompt and output token ids followed by ``text``'s tokens; or
``{"prompt_token_ids": [...]}``, given as token ids. ``"top2": true`` records each output
token's two highest log-probabilities. The mode is
applied the way a user would: ``none`` disables prefix caching, ``align`` passes
``mamba_cache_mode="align"``, ``lighter`` sets ``VLLM_USE_LIGHTER_MAMBA_CACHE=1`` (which
must be set before vLLM loads its plugins, so run this in a fresh process per mode).
"""

from __future__ import annotations

import os
import time


def engine_kwargs(mode: str, model: str, extra: dict) -> dict:
    kwargs = {"model": model, "dtype": "bfloat16", "seed": 0, **extra}
    if mode == "none":
        kwargs["enable_prefix_caching"] = False
    elif mode == "align":
        kwargs["enable_prefix_caching"] = True
        kwargs["mamba_cache_mode"] = "align"
    elif mode == "lighter":
        assert os.environ.get("VLLM_USE_LIGHTER_MAMBA_CACHE") == "1", "set the variable first"
    else:
        raise ValueError(mode)
    return kwargs


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(spec["mode"], spec["model"], spec.get("engine", {})))
    if spec.get("engine", {}).get("pipeline_parallel_size", 1) > 1:
        llm.collective_rpc(allocate_stage_inputs)  # needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
    # A seed gives every request its own random stream (synthetic draft acceptance draws
    # from it), the same in every mode.
    params = SamplingParams(
        temperature=spec.get("temperature", 0.0),
        max_tokens=spec.get("max_tokens", 16),
        ignore_eos=True,
        seed=spec.get("seed"),
        logprobs=2 if spec.get("top2") else None,
    )
    waves = []
    done: list[dict] = []  # every earlier request, in order
    for prompts in spec["waves"]:
        prompts = [follow_up(llm, done, p) if isinstance(p, dict) and "follow" in p else p for p in prompts]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        waves.append(
            {
                "seconds": time.perf_counter() - start,
                "requests": [
                    {
                        "prompt_tokens": len(o.prompt_token_ids),
                        "prompt_token_ids": list(o.prompt_token_ids),
                        "cached_tokens": o.num_cached_tokens or 0,
                        "token_ids": list(o.outputs[0].token_ids),
                        **({"top2": top2(o.outputs[0].logprobs)} if spec.get("top2") else {}),
                    }
                    for o in outputs
                ],
            }
        )
        done.extend(waves[-1]["requests"])
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()} if spec.get("metrics") else {}
    return {
        "kv_cache_usage": metrics.get("vllm:kv_cache_usage_perc"),
        "spec_decode": {
            key: metrics.get(f"vllm:spec_decode_num_{key}_tokens") for key in ("draft", "accepted")
        },
        "ranks": llm.collective_rpc(rank_state) if spec.get("ranks") else None,
        "mode": spec["mode"],
        "block_size": block_size,
        "waves": waves,
        # The plugin's patches exist only in lighter-mode processes.
        "lighter_counters": engine_counters(llm) if spec["mode"] == "lighter" else None,
    }


def top2(logprobs: list[dict]) -> list[list[float]]:
    """Per output token, the two highest log-probabilities (a near tie when close)."""
    return [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in logprobs]


def follow_up(llm, done: list[dict], prompt: dict) -> dict:
    """A next turn: an earlier request's prompt and output, then new text (token ids)."""
    earlier = done[prompt["follow"]]
    extra = llm.get_tokenizer().encode(prompt["text"], add_special_tokens=False)
    return {"prompt_token_ids": [*earlier["prompt_token_ids"], *earlier["token_ids"], *extra]}


def allocate_stage_inputs(worker) -> None:
    """Runs on every worker (``collective_rpc``): gives a later pipeline stage the buffer its
    inputs from the stage before are copied into. vLLM 0.32's CPU backend allocates it only
    in a warm-up forward pass (``_dummy_run``), which it skips in eager mode with an explicit
    KV cache size (``CPUWorker._should_warm_up_model``; ``warming_up_model`` returns early
    in eager mode anyway): every engine with ``pipeline_parallel_size > 1`` and
    ``enforce_eager`` then fails its first step (``assert self.intermediate_tensors is not
    None`` on the last stage), caching on, off or align alike. Allocated here as
    ``_dummy_run`` does."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def rank_state(worker) -> dict:
    """Runs on every worker (``collective_rpc``): which model runner it has, what this rank's
    state copier did and the shapes of the state shards it moved (V1 keeps the copier on the
    runner, Model Runner V2 on its model state)."""
    from vllm_lighter_mamba.v1.worker.mamba_state_copy import COPIER_ATTR

    runner = worker.model_runner
    model_state = getattr(runner, "model_state", None)
    copier = runner.__dict__.get(COPIER_ATTR)
    if copier is None and model_state is not None:
        copier = model_state.__dict__.get(COPIER_ATTR)
    state = {"runner": f"{type(runner).__module__}.{type(runner).__name__}", "copier": copier is not None}
    if copier is None:
        return state
    return {
        **state,
        "num_moves": copier.num_moves,
        "recent_moves": list(copier.recent_moves),
        "shapes": [[list(t.shape[1:]) for t in tensors] for _, _, tensors in copier.groups],
    }


def engine_counters(llm) -> dict:
    """The engine core's lighter-cache counters, through the same utility call the serving
    front end uses."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):  # engine core in its own process
        return client.call_utility("lighter_mamba_counters")
    return client.engine_core.lighter_mamba_counters()  # in-process engine core


if __name__ == "__main__":
    from .helpers import fresh_process_main

    fresh_process_main(run)
