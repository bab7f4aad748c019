"""A shadow of the worker for scheduler replays: every state copy and every state read and
write that the lighter layout implies, on symbolic states.

Block tables are rebuilt from the scheduler outputs exactly as the worker does
(append-only, replaced on resume); each step first performs every state copy, then every
kernel reads its initial state and writes its final one. A state is "the state of request
R after L tokens"; a read is correct when the state found is the one after exactly the
reader's computed tokens and the two token prefixes are equal. Token equality is checked
in :meth:`ShadowWorker.verify`, once every token is known (under async overlap a step is
scheduled before the previous step's token exists), so a wrong block, a premature free,
a bad hit or a lost copy fails the replay.
"""

from __future__ import annotations

import torch

from vllm_lighter_mamba.ops.state_indices import state_indices_torch


class ShadowWorker:
    def __init__(self, group_id: int, block_size: int, num_spec: int = 0) -> None:
        self.group_id = group_id
        self.block_size = block_size
        self.num_spec = num_spec
        self.tables: dict[str, list[int]] = {}
        self.content: dict[int, tuple[str, int]] = {}
        self.reads: list[tuple[str, int, tuple[str, int] | None, int]] = []
        self.num_copies = 0
        self.step_index = 0

    def __call__(self, output, requests: dict) -> None:
        self.step(output, requests)

    def _sync_tables(self, output) -> None:
        g = self.group_id
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[g])
        cached = output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = list(ids[g]) if ids is not None else []
            elif ids is not None:
                self.tables[rid].extend(ids[g])
        for rid in output.finished_req_ids:
            self.tables.pop(rid, None)

    def step(self, output, requests: dict) -> None:
        self._sync_tables(output)
        plans = []
        for rid, n in output.num_scheduled_tokens.items():
            computed = requests[rid].num_computed_tokens - n
            table = torch.tensor([self.tables[rid]], dtype=torch.int64)
            plan = state_indices_torch(
                table, torch.tensor([computed + n]), self.block_size, self.num_spec, torch.tensor([n])
            )
            plans.append((rid, computed, n, plan))
        # Phase 1: the runner's copies, all before the forward.
        snapshot = dict(self.content)
        for rid, _, _, plan in plans:
            src, dst = int(plan.copy_src[0]), int(plan.copy_dst[0])
            if src >= 0:
                assert src != 0 and dst != 0, f"{rid}: copy touches the null block"
                self.content[dst] = snapshot.get(src)
                self.num_copies += 1
        # Phase 2: each kernel reads its initial state and writes its final state.
        written = set()
        for rid, computed, n, plan in plans:
            index = int(plan.state_indices[0, 0])
            assert index > 0, f"{rid}: state index {index} is the null block or missing"
            assert index not in written, f"{rid}: block {index} is another request's state"
            written.add(index)
            if computed > 0:
                found = self.content.get(index)
                assert found is not None and found[1] == computed, (
                    f"step {self.step_index} {rid}: block {index} holds {found}, "
                    f"not the state after {computed} tokens"
                )
                self.reads.append((rid, computed, found, self.step_index))
            self.content[index] = (rid, computed + n)
        self.step_index += 1

    def verify(self, requests: dict) -> int:
        """Every read found the state of the reader's own token prefix; returns the reads."""
        for reader, computed, (writer, _), step in self.reads:
            mine = requests[reader].all_token_ids[:computed]
            theirs = requests[writer].all_token_ids[:computed]
            assert mine == theirs, f"step {step} {reader}: read the state of {writer}'s prefix"
        return len(self.reads)


def replay_with_shadow(requests, model_dir: str, **kwargs):
    """``replay("lighter", ...)`` with a shadow worker; every read verified at the end."""
    from vllm_lighter_mamba.bench.sim import replay

    shadow = ShadowWorker(
        group_id=1,
        block_size=kwargs.get("block_size", 16),
        num_spec=kwargs.get("num_speculative_blocks", 0),
    )
    observers = [*kwargs.pop("observers", ()), shadow]
    result = replay("lighter", requests, model_dir, observers=observers, **kwargs)
    shadow.verify(result.requests)
    result.shadow = shadow
    return result
