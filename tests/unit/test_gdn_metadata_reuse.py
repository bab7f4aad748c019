"""The GDN builder's metadata reuse across KV-cache groups, for our spec.

vLLM builds a step's GDN metadata once and, for every further GDN group, calls
``update_block_table(metadata, that group's block table, ...)``, which reads the running
block from column 0 of what it is given. In our layout column 0 of the raw table is the
request's first block, so the wrapper must hand it the gathered indices. The reference is an
exact read of the group's table at ``(seq_len - 1) // block_size``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata, GDNAttentionMetadataBuilder

from vllm_lighter_mamba.bench.sim import install_patches
from vllm_lighter_mamba.patch.patch_attention_backends import SEQ_LENS_ATTR
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

BLOCK = 16


@pytest.fixture(autouse=True)
def _patched() -> None:
    install_patches()


def _builder() -> GDNAttentionMetadataBuilder:
    """A GDN builder of our spec with only what ``update_block_table`` reads (no device)."""
    builder = object.__new__(GDNAttentionMetadataBuilder)
    builder.kv_cache_spec = LighterMambaSpec(
        block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="none")
    builder.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    builder.use_full_cuda_graph = False
    builder.num_spec = 0
    return builder


def _metadata(seq_lens: torch.Tensor | None) -> GDNAttentionMetadata:
    # Two decodes, then two prefills (vLLM orders decodes first).
    metadata = GDNAttentionMetadata(
        num_prefills=2, num_prefill_tokens=40, num_decodes=2, num_decode_tokens=2,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=42)
    if seq_lens is not None:
        setattr(metadata, SEQ_LENS_ATTR, seq_lens)
    return metadata


def test_reused_metadata_reads_each_groups_running_block():
    seq_lens = torch.tensor([17, 33, 16, 50], dtype=torch.int32)
    # Another group's table: distinct ids per (request, position).
    table = (torch.arange(4 * 5, dtype=torch.int32).reshape(4, 5) + 100)
    updated = GDNAttentionMetadataBuilder.update_block_table(_builder(), _metadata(seq_lens), table, None)
    expected = torch.stack([table[r, (int(s) - 1) // BLOCK] for r, s in enumerate(seq_lens)])
    assert updated.non_spec_state_indices_tensor.tolist() == expected.tolist()
    assert updated.prefill_state_indices.tolist() == expected[2:].tolist()
    # The next group reuses the updated metadata in turn.
    assert torch.equal(getattr(updated, SEQ_LENS_ATTR), seq_lens)


def test_reuse_without_the_steps_seq_lens_is_refused():
    table = torch.zeros((4, 5), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_lens"):
        GDNAttentionMetadataBuilder.update_block_table(_builder(), _metadata(None), table, None)


def test_gdn_keeps_upstreams_reuse_flag_and_other_builders_turn_it_off():
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    from vllm_lighter_mamba.patch.patch_attention_backends import _wrap_builder_init

    def init(self, spec):
        self.kv_cache_spec = spec
        self.supports_update_block_table = True

    spec = _builder().kv_cache_spec
    gdn, mamba2 = object.__new__(GDNAttentionMetadataBuilder), object.__new__(Mamba2AttentionMetadataBuilder)
    _wrap_builder_init(init)(gdn, spec)
    _wrap_builder_init(init)(mamba2, spec)
    assert gdn.supports_update_block_table is True
    assert mamba2.supports_update_block_table is False
