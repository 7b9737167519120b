"""The executor's per-step draft proposer for ``ExecutorConfig.speculative``, started by mode.

Each mode's own module loads and checks its drafter (a ProposerConfigError names the field); this
file only picks it. It is not proposers.py (imported by the package's __init__): the heavy modes
(EAGLE-3, MTP, Medusa, ReDrafter) would then load with any import of the package.
"""
from __future__ import annotations

from engine.executor.speculative.eagle3 import start_eagle3
from engine.executor.speculative.lookahead import start_lookahead
from engine.executor.speculative.medusa_executor import start_medusa
from engine.executor.speculative.mtp import start_mtp
from engine.executor.speculative.proposer import DraftProposer
from engine.executor.speculative.proposers import make_proposer
from engine.executor.speculative.redrafter import start_redrafter


def start_proposer(runner, spec, *, engine_dir: str, has_state: bool, kv_cache_dtype: str | None,
                   enable_reuse: bool) -> DraftProposer | None:
    """The proposer of ``spec.mode`` over the target ``runner`` (None without ``spec``).
    ``has_state``: the target keeps recurrent (Mamba) states, which some modes refuse."""
    if spec is None:
        return None
    if spec.mode == "medusa":
        return start_medusa(runner, spec.medusa_model_path, spec.medusa_choices, engine_dir=engine_dir,
                            has_state=has_state)
    if spec.mode == "lookahead":
        return start_lookahead(runner, spec, has_state=has_state)
    if spec.mode == "eagle":
        return start_eagle3(runner, spec, engine_dir=engine_dir, has_state=has_state)
    if spec.mode == "redrafter":
        return start_redrafter(runner, spec, engine_dir=engine_dir, has_state=has_state)
    if spec.mode == "mtp":
        return start_mtp(runner, has_state=has_state, kv_cache_dtype=kv_cache_dtype, enable_reuse=enable_reuse)
    return make_proposer(spec.mode, max_matching_ngram_size=spec.max_matching_ngram_size,
                         draft_engine_dir=spec.draft_engine_dir, target_engine_dir=engine_dir,
                         target_runner=runner, enable_reuse=enable_reuse, kv_cache_dtype=kv_cache_dtype)
