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

Speculative decoding (``num_spec > 0``; vLLM's rule: a row is a spec-decode row when its
scheduled tokens are its drafts plus one) follows the runner and vLLM's kernels: the kernel
reads column 0 (the runner passes one accepted token) and writes the state after the step's
token ``t`` into column ``t``, drafts included; once the step's output is processed
(``after_output``), the accepted states move as ``ops/spec_settle.py`` says, and then every
block the manager has hashed must hold the state of exactly its boundary's token prefix.
A state is then ``(request, length, drafts)``: its last ``len(drafts)`` tokens were drafts.

Internal checkpoints (``checkpoint_alignment``, the spec's ``prefill_checkpoint_alignment``):
the worker also writes, inside a row's forward, the state at the offset its plan names
(``plan_checkpoints``, the worker's own function) into the block its table holds at the plan's
column, unless that entry is the null block; the manager must have put there exactly the block
that gets hashed for that boundary.
"""

from __future__ import annotations

import torch

from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import plan_checkpoints
from vllm_lighter_mamba.ops.spec_settle import settle_moves
from vllm_lighter_mamba.ops.state_indices import state_indices_torch


class ShadowWorker:
    def __init__(
        self, group_id: int, block_size: int, num_spec: int = 0, checkpoint_alignment: int | None = None
    ) -> None:
        self.group_id = group_id
        self.checkpoint_alignment = checkpoint_alignment
        self.num_checkpoints = 0
        self.block_size = block_size
        self.num_spec = num_spec
        self.tables: dict[str, list[int]] = {}
        self.content: dict[int, tuple[str, int, tuple[int, ...]]] = {}
        self.reads: list[tuple[str, int, tuple[str, int, tuple[int, ...]], int]] = []
        self.num_copies = 0
        self.step_index = 0
        # This step's spec-decode rows: request -> (computed, scheduled, table row).
        self.spec_rows: dict[str, tuple[int, int, list[int]]] = {}
        self.num_settle_moves = 0
        self.num_hashed_checked = 0

    def __call__(self, output, requests: dict) -> None:
        self.step(output, requests)

    def _sync_tables(self, output) -> None:
        g = self.group_id
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[g])
        cached = output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in getattr(cached, "resumed_req_ids", ()):  # (vLLM 0.34 resends resumed as new)
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
        # Phase 2: each kernel reads its initial state (column 0) and writes its states.
        written = set()
        drafts_of = output.scheduled_spec_decode_tokens
        self.spec_rows = {}
        for rid, computed, n, plan in plans:
            index = int(plan.state_indices[0, 0])
            assert index > 0, f"{rid}: state index {index} is the null block or missing"
            if computed > 0:
                found = self.content.get(index)
                assert found is not None and found[1] == computed, (
                    f"step {self.step_index} {rid}: block {index} holds {found}, "
                    f"not the state after {computed} tokens"
                )
                self.reads.append((rid, computed, found, self.step_index))
            drafts = drafts_of.get(rid)
            if drafts is None or n != len(drafts) + 1:
                assert index not in written, f"{rid}: block {index} is another request's state"
                written.add(index)
                self.content[index] = (rid, computed + n, ())
                self._write_checkpoint(rid, computed, n, written)
                continue
            columns = [int(c) for c in plan.state_indices[0, :n]]
            for t, column in enumerate(columns):
                assert column > 0 and column not in written, f"{rid}: column {t} is block {column}"
                written.add(column)
                self.content[column] = (rid, computed + 1 + t, tuple(drafts[:t]))
            self.spec_rows[rid] = (computed, n, list(self.tables[rid]))
        self.step_index += 1

    def _write_checkpoint(self, rid: str, computed: int, n: int, written: set[int]) -> None:
        """The worker's internal checkpoint of this row, if its plan has one and the block
        table holds a block there (a row alone: a decode row or one prefill row)."""
        if self.checkpoint_alignment is None:
            return
        decode = int(n == 1 and computed > 0)
        plan = plan_checkpoints([0, n], [computed + n], decode, 1 - decode, self.block_size,
                                self.checkpoint_alignment, chunk=self.checkpoint_alignment)
        if not plan.rows:
            return
        col, offset = plan.cols[0], plan.offsets[0]
        table = self.tables[rid]
        block = table[col] if col < len(table) else 0
        if block == 0:
            return  # the manager kept no block there (a chunk that does not reach the prefill end)
        assert block not in written, f"{rid}: checkpoint block {block} is another request's state"
        written.add(block)
        self.content[block] = (rid, computed + offset, ())
        self.num_checkpoints += 1

    def tokens(self, state: tuple[str, int, tuple[int, ...]], requests: dict) -> list[int]:
        writer, length, drafts = state
        return list(requests[writer].all_token_ids[: length - len(drafts)]) + list(drafts)

    def after_output(self, scheduler, output, requests: dict) -> None:
        """The step's output is processed: move the accepted states (``settle_moves``), then
        check every hashed block of the step's requests against its boundary's prefix."""
        for rid, (computed, n, table) in self.spec_rows.items():
            accepted = requests[rid].num_computed_tokens - computed
            assert 1 <= accepted <= n, (rid, computed, n, accepted)
            for move in settle_moves(computed + n, n, accepted, self.block_size):
                src, dst = table[move.running + move.token], table[move.dst]
                assert src > 0 and dst > 0, f"{rid}: settle {move} touches the null block"
                self.content[dst] = self.content.get(src)
                self.num_settle_moves += 1
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[self.group_id]
        for rid in output.num_scheduled_tokens:
            blocks = manager.req_to_blocks.get(rid, [])
            for i, block in enumerate(blocks):
                if block.is_null or block.block_hash is None:
                    continue
                boundary = (i + 1) * self.block_size
                found = self.content.get(block.block_id)
                assert found is not None and found[1] == boundary, (
                    f"step {self.step_index - 1} {rid}: hashed block {block.block_id} at "
                    f"position {i} holds {found}, not the state after {boundary} tokens"
                )
                mine = list(requests[rid].all_token_ids[:boundary])
                assert self.tokens(found, requests) == mine, f"{rid}: hashed block {i} has another prefix"
                self.num_hashed_checked += 1

    def verify(self, requests: dict) -> int:
        """Every read found the state of the reader's own token prefix; returns the reads."""
        for reader, computed, found, step in self.reads:
            mine = list(requests[reader].all_token_ids[:computed])
            assert mine == self.tokens(found, requests), f"step {step} {reader}: read the state of {found}"
        return len(self.reads)


def replay_with_shadow(requests, model_dir: str, mode: str = "lighter", **kwargs):
    """``replay(mode, ...)`` (a lighter mode) with a shadow worker; every read verified at the end."""
    from vllm_lighter_mamba.bench.sim import lighter_checkpoint_fields, replay

    block_size = kwargs.get("block_size", 16)
    alignment = lighter_checkpoint_fields(
        block_size, kwargs.get("prefill_checkpoints"), kwargs.get("num_speculative_blocks", 0),
        kwargs.get("use_eagle", False),
    ).get("prefill_checkpoint_alignment")
    shadow = ShadowWorker(
        group_id=1,
        block_size=block_size,
        num_spec=kwargs.get("num_speculative_blocks", 0),
        checkpoint_alignment=alignment,
    )
    observers = [*kwargs.pop("observers", ()), shadow]
    after = [*kwargs.pop("after_output", ()), shadow.after_output]
    result = replay(mode, requests, model_dir, observers=observers, after_output=after, **kwargs)
    shadow.verify(result.requests)
    result.shadow = shadow
    return result
