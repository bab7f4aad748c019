"""The KV-cache spec of Mamba-type layers under the lighter layout.

A subclass of vLLM's ``MambaSpec`` with the same fields: its type carries the switch to the
code that only sees a spec (the manager lookup, the metadata builders), and it sizes block
tables and memory budgets for the position-indexed layout. vLLM groups it with ``MambaSpec``
(``uniform_type_base_spec``) and builds ``LighterMambaManager`` for it through its own
``KVCacheSpecRegistry`` (``patch_kv_cache_spec_registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import MambaSpec


@dataclass(frozen=True)
class LighterMambaSpec(MambaSpec):
    @classmethod
    def from_mamba_spec(cls, spec: MambaSpec) -> LighterMambaSpec:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(MambaSpec)})

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        # Rows are position-indexed over the whole sequence (most entries are null blocks),
        # as in vLLM's align mode (``MambaSpec.max_num_blocks_per_req``).
        return cdiv(max_len, self.block_size) + self.num_speculative_blocks

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.page_size_bytes * resident_blocks_per_request(
            self.num_speculative_blocks,
            vllm_config.scheduler_config.async_scheduling,
            internal_checkpoint=self.prefill_checkpoint_alignment is not None,
        )


def resident_blocks_per_request(
    num_speculative_blocks: int, async_scheduling: bool, internal_checkpoint: bool = False
) -> int:
    """State blocks one request holds at most (``LighterMambaManager``'s layout).

    The running block(s), plus the previous running block: this step's copy source (or the
    prefix hit), freed once the processed-token count has moved past it. Under async
    scheduling the step before is still in flight when the next one is allocated, and its
    copy reads the block before that, so one more is held. vLLM's align mode budgets
    ``2 + spec`` in both cases (``MambaSpec.max_memory_usage_bytes``), plus its checkpoint blocks.
    Where the forward writes the last boundary state of a prefill inside its chunk
    (``internal_checkpoint``), that chunk holds one more block, the checkpoint's.
    """
    return 2 + num_speculative_blocks + int(async_scheduling) + int(internal_checkpoint)
