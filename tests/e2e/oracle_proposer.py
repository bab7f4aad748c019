"""A drafter for end-to-end tests of speculative decoding that makes greedy outputs testable.

vLLM loads it as a custom proposer (``speculative_config={"method": "custom_class", "model":
"tests.e2e.oracle_proposer.OracleProposer", ...}``). It drafts each request's reference
continuation (the outputs of a run without drafting, from the JSON file named by
``LIGHTER_MAMBA_ORACLE_DRAFTS``: ``[[prompt_token_ids, output_token_ids], ...]``), the drafts
from a cut onwards replaced by other tokens; the cut is a function of the context length, so
steps accept 0 to all drafts. Greedy rejection sampling accepts a draft only if it is the target
model's own choice, so when the model agrees with its reference run the outputs equal the
reference exactly, with many drafts accepted; a wrong state shows as a different token.
"""

from __future__ import annotations

import json
import os
from typing import Any

ORACLE_FILE = "LIGHTER_MAMBA_ORACLE_DRAFTS"


def oracle_drafts(context: list[int], references: list[tuple[list[int], list[int]]], k: int) -> list[int]:
    """The next ``k`` reference tokens after ``context`` with those from the cut on replaced.

    Every decode step gets ``k`` drafts, also once a request has left its reference (filler,
    rejected): a request then never switches between spec-decode and plain decode rows, which
    vLLM 0.26's caching-off path does not survive (after a step that accepted drafts, a plain
    decode row reads the state of the step's first token)."""
    # The longest prompt that starts the context (a next turn starts with an earlier prompt).
    matches = [(p, o) for p, o in references if len(context) > len(p) and context[: len(p)] == p]
    if not matches:
        return [0] * k
    prompt, output = max(matches, key=lambda match: len(match[0]))
    done = context[len(prompt) :]
    if output[: len(done)] != done:
        return [0] * k
    # Always k drafts (past the reference's end, filler that is rejected): vLLM 0.26's CPU
    # spec path cannot shrink a row below the previous step's accepted count.
    upcoming = output[len(done) : len(done) + k]
    upcoming += [0] * (k - len(upcoming))
    # A well-mixed function of the length (a step that accepts all k + 1 tokens must not
    # land on the same cut again).
    cut = (len(context) * 2654435761 >> 11) % (k + 1)
    return upcoming[:cut] + [(token + 1) % 256 for token in upcoming[cut:]]


class OracleProposer:
    def __init__(self, vllm_config: Any) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        with open(os.environ[ORACLE_FILE]) as f:
            self.references = [(list(p), list(o)) for p, o in json.load(f)]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: vLLM's runners call this on every drafter."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            if not len(sampled):
                drafts.append([])
                continue
            context = token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist()
            drafts.append(oracle_drafts(context, self.references, self.k))
        return drafts


def skips_step(context_length: int) -> bool:
    """About one step in three drafts nothing (a well-mixed function of the length, like the cut)."""
    return (context_length * 2246822519 >> 13) % 3 == 0


class SkippingOracleProposer(OracleProposer):
    """The oracle that drafts nothing on some steps, as ngram does where the text does not
    repeat: a plain decode row then follows a step that accepted drafts, with many drafts
    accepted (ngram on a random model accepts almost none). GPU only: vLLM 0.26's CPU spec path
    cannot shrink a row below the previous step's accepted count."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts = super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)
        return [
            [] if skips_step(int(num_tokens_no_spec[i])) else d for i, d in enumerate(drafts)
        ]
