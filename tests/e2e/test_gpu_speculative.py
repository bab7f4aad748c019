"""GPU end to end (skipped without CUDA): speculative decoding with the lighter cache is lossless.

Tiny Qwen3-Next (GDN) with an MTP layer, eager, float32 states, greedy, one request at a time
(a spec-decode row makes vLLM run other decodes of its batch through the prefill kernel, which
changes their rounding), vLLM's defaults otherwise. The reference is caching off without
drafting. Drafts come from

- the oracle drafter (``oracle_proposer.py``): the reference continuation with the drafts from
  a length-dependent cut on replaced, so steps accept 0 to all of them and, when the states
  are right, the outputs equal the reference exactly;
- the model's MTP layer (``qwen3_next_mtp``; random weights accept few drafts).

Caching off with the same drafting is the control (it must equal the reference, or the test
cannot judge); align is recorded. The lighter cache must equal the reference, serve the second
wave from the cache, (oracle) accept drafts, and serve the first request's next turn from the
deepest boundary it crossed while decoding with drafts.

On the device: ``python -m pytest tests/e2e/test_gpu_speculative.py``;
``LIGHTER_MAMBA_GPU_E2E_JSON=PATH`` also writes every run's outputs there.
Not run yet: the H200 runs of 2026-12-01 used ngram and vLLM's synthetic acceptance, which
could not judge (docs/design.md, "Speculative decoding").
"""

from __future__ import annotations

import json

import pytest
import torch

from .helpers import flat_requests, parts_only_at_a_near_tie, run_mode, shared_text
from .oracle_proposer import ORACLE_FILE
from .test_gpu_models import engine_args, record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PREFIX = shared_text(5, 1500)
WAVES = [
    [PREFIX + " first?"],
    [PREFIX + " second?", PREFIX + " third, longer?", shared_text(6, 600) + " b"],
    [shared_text(6, 600) + " b", shared_text(7, 900) + " z"],
    # The first request's next turn: its hit is a boundary crossed while decoding with drafts.
    [{"follow": 0, "text": " and then?"}],
]
NUM_SPEC = 3
METHODS = {
    "oracle": {"method": "custom_class", "model": "tests.e2e.oracle_proposer.OracleProposer"},
    "mtp": {"method": "mtp"},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_speculative_outputs_equal_no_drafting(method, tmp_path):
    from tests.conftest import tiny_model

    model = tiny_model("qwen3_next_mtp")
    base = {**engine_args("qwen3_next", eager=True), "max_num_seqs": 1}
    reference = flat_requests(run_mode("none", model, WAVES, base, max_tokens=96, top2=True))
    oracle = tmp_path / "references.json"
    oracle.write_text(json.dumps([[r["prompt_token_ids"], r["token_ids"]] for r in reference]))
    engine = {**base, "disable_log_stats": False,
              "speculative_config": {**METHODS[method], "num_speculative_tokens": NUM_SPEC}}
    # Speculative decoding with the lighter cache is accepted only when asked for.
    engine["additional_config"] = {**engine["additional_config"], "lighter_mamba_speculative": "experimental"}
    env = {ORACLE_FILE: str(oracle)}
    results = {
        mode: run_mode(mode, model, WAVES, engine, max_tokens=96, metrics=True, env=env)
        for mode in ("none", "align", "lighter")
    }
    record(f"qwen3_next_mtp-{method}", True, {"reference": reference, **results})
    tokens = [r["token_ids"] for r in reference]
    assert [r["token_ids"] for r in flat_requests(results["none"])] == tokens, "control: caching off changed"
    lighter = flat_requests(results["lighter"])
    assert lighter[1]["cached_tokens"] > 0 and lighter[4]["cached_tokens"] > 0
    if method == "oracle":
        assert results["lighter"]["spec_decode"]["accepted"] > 0
    assert [r["token_ids"] for r in lighter[:-1]] == tokens[:-1]
    # The next turn starts from a state drafting steps computed (the reference's from a
    # prefill): it may part from the reference only at a near tie.
    assert parts_only_at_a_near_tie(lighter[-1], reference[-1])
    block = results["lighter"]["block_size"]
    assert lighter[-1]["cached_tokens"] >= (lighter[0]["prompt_tokens"] + 96 - 1) // block * block
