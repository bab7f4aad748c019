"""Internal checkpoints in vLLM's real scheduler and KV-cache manager (mocked model): where the
workers write a prefill's last boundary state inside the forward (the spec's
``prefill_checkpoint_alignment``, set on a CUDA GPU with the Triton GDN prefill), the chunk that
reaches the prefill end is not cut there, the manager puts a fresh block at that boundary's
position for the forward to write, counts it before it allocates it, and the shadow worker
(``shadow.py``: it writes what the worker's plan says) finds every hashed block holding the state
of exactly its boundary."""

from __future__ import annotations

import random

from vllm_lighter_mamba.bench.sim import SimRequest, replay
from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import LighterMambaManager

from .invariants import check_all_returned, check_pool
from .shadow import replay_with_shadow

BLOCK = 64


def chats(seed: int = 0, num_chats: int = 4, turns: int = 3) -> list[SimRequest]:
    """Chats whose every turn resends the history plus a reply and a question, one turn after
    another (each arrives once the previous one could have finished)."""
    rng = random.Random(seed)
    requests = []
    for c in range(num_chats):
        history = [rng.randrange(900) for _ in range(rng.randrange(300, 700))]
        for t in range(turns):
            requests.append(SimRequest(f"c{c}t{t}", list(history), max_tokens=8, arrival_step=40 * t + c))
            history += [rng.randrange(900) for _ in range(rng.randrange(100, 300))]
    return requests


def prefill_steps(result, requests) -> dict[str, int]:
    prompts = {r.request_id: len(r.prompt_token_ids) for r in requests}
    steps: dict[str, int] = {}
    for rid, start, _, _ in result.chunks:
        if start < prompts[rid]:
            steps[rid] = steps.get(rid, 0) + 1
    return steps


def run(qwen3_next_dir, inside: bool, **kwargs):
    requests = chats()
    result = replay_with_shadow(
        requests, qwen3_next_dir, block_size=BLOCK, max_num_batched_tokens=4096, num_blocks=2000,
        check=lambda scheduler, output, step: check_pool(scheduler), prefill_checkpoints=inside, **kwargs,
    )
    check_all_returned(result.scheduler)
    return requests, result


def test_a_chat_turn_is_one_prefill_step_with_the_same_hits(qwen3_next_dir):
    requests, cut = run(qwen3_next_dir, inside=False)
    _, inside = run(qwen3_next_dir, inside=True)
    assert inside.scheduler.lighter_checkpoint_alignment == BLOCK
    assert cut.scheduler.lighter_checkpoint_alignment is None
    steps_cut, steps_inside = prefill_steps(cut, requests), prefill_steps(inside, requests)
    assert set(steps_inside.values()) == {1}
    assert sum(steps_cut.values()) > 1.5 * len(requests)
    # The same states are kept: every later turn hits as deep as with the cut.
    assert inside.cached_per_request == cut.cached_per_request
    assert sum(inside.cached_per_request.values()) > 0
    assert inside.outputs == cut.outputs
    # The shadow wrote a checkpoint per cold or resumed prompt and checked the hashed blocks.
    assert inside.shadow.num_checkpoints == len(requests)
    assert inside.shadow.num_hashed_checked > 0


def test_blocks_counted_before_the_allocation_are_the_blocks_it_takes(qwen3_next_dir, monkeypatch):
    """vLLM admits a chunk on ``get_num_blocks_to_allocate``; the allocation that follows must
    take exactly that many free blocks (the checkpoint's included), or a full pool fails."""
    counted: dict[tuple[int, str], int] = {}
    taken: list[tuple[int, int]] = []
    get_num = LighterMambaManager.get_num_blocks_to_allocate
    allocate = LighterMambaManager.allocate_new_blocks

    def counting(self, request_id, *args, **kwargs):
        n = get_num(self, request_id, *args, **kwargs)
        if not kwargs.get("apply_admission_cap"):
            counted[(id(self), request_id)] = n - self._get_num_evictable_blocks(args[1])
        return n

    def allocating(self, request_id, *args, **kwargs):
        free = self.block_pool.get_num_free_blocks()
        blocks = allocate(self, request_id, *args, **kwargs)
        taken.append((counted.pop((id(self), request_id)), free - self.block_pool.get_num_free_blocks()))
        return blocks

    monkeypatch.setattr(LighterMambaManager, "get_num_blocks_to_allocate", counting)
    monkeypatch.setattr(LighterMambaManager, "allocate_new_blocks", allocating)
    _, result = run(qwen3_next_dir, inside=True)
    assert result.shadow.num_checkpoints > 0
    mismatched = [(n, t) for n, t in taken if n != t]
    assert not mismatched, mismatched[:5]
    assert any(t >= 2 for _, t in taken)  # steps that took a running block and a checkpoint


def test_without_the_alignment_nothing_changes(qwen3_next_dir):
    """The CPU (and FlashInfer, drafts, float32 SSM caches): no alignment, so the same replay as
    before internal checkpoints existed, chunk for chunk."""
    requests = chats(1)
    a = replay("lighter", requests, qwen3_next_dir, block_size=BLOCK, max_num_batched_tokens=4096)
    b = replay("lighter", requests, qwen3_next_dir, block_size=BLOCK, max_num_batched_tokens=4096,
               prefill_checkpoints=False)
    assert a.chunks == b.chunks and a.cached_per_request == b.cached_per_request
