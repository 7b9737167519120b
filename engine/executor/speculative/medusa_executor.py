"""``decoding_mode medusa`` in the in-flight executor: the heads loaded and checked at start, and
which hidden row each sequence's heads read after a step (speculative/medusa.py holds the heads).
"""
from __future__ import annotations

import os

from engine.executor.speculative.medusa import MedusaDraftProposer, load_medusa_heads
from engine.executor.speculative.proposer import ProposerConfigError, refuse_unless_one_rank_without_state
from engine.executor.speculative.tree import TreeChoicesError, parse_choices
from engine.executor.speculative.verify import Verified

# A small default tree (the reference defaults to Medusa's 63-node mc_sim_7b_63): two candidates
# at depth 1, the top one followed four deep, second guesses under it (cut to the heads' depth).
DEFAULT_MEDUSA_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def start_medusa(runner, medusa_model_path: str | None, medusa_choices, *, engine_dir: str,
                 has_state: bool) -> MedusaDraftProposer:
    """The proposer of ``decoding_mode medusa`` for ``runner``'s target, or ProposerConfigError
    naming the field. The heads live in ``medusa_model_path``, by default the engine directory's
    ``medusa/`` (so the stock repository serves them). The runner keeps its scored rows' hidden
    states from now on."""
    refuse_unless_one_rank_without_state(runner, "medusa", has_state)
    medusa_model_path = medusa_model_path or os.path.join(engine_dir, "medusa")
    try:
        choices = parse_choices(medusa_choices) if isinstance(medusa_choices, str) else medusa_choices
        heads = load_medusa_heads(medusa_model_path, hidden_size=runner.model_config.hidden_size,
                                  vocab_size=runner.vocab_size, device=runner.device)
        if choices is None and heads.default_choices is not None:  # a TensorRT-LLM checkpoint's config
            default = heads.default_choices
            choices = parse_choices(default) if isinstance(default, str) else default
        if choices is None:  # the default tree, as deep as the heads go
            choices = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= heads.num_heads]
        proposer = MedusaDraftProposer(heads, choices)
    except (TreeChoicesError, ValueError) as err:
        raise ProposerConfigError(str(err)) from None
    runner.keep_hidden_rows = True
    return proposer


def last_rows(sampling: list, drafted: list, verified: dict[int, Verified] | None) -> dict[int, int]:
    """seq_id -> the scored row of its last computed token after this step: a sampling sequence's
    row, or a drafted one's at the end of its accepted path (first row + the path's last node)."""
    rows = {seq.seq_id: row for seq, row in sampling}
    for seq, first, _ in drafted:
        v = verified[seq.seq_id]
        rows[seq.seq_id] = first + (v.path[-1] if v.path is not None else v.num_accepted)
    return rows
