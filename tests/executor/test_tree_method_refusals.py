"""Tree methods (Medusa, ReDrafter, EAGLE-3, Lookahead) verify on one rank of a model without
recurrent state; a pipeline stage, a tensor-parallel rank or a Mamba hybrid is refused by name at
load (engine/executor/speculative/proposer.py refuse_unless_one_rank_without_state)."""
import dataclasses

import pytest

from engine.config import BuildConfig
from engine.executor.runner import ModelRunner
from engine.executor.speculative.proposer import ProposerConfigError, refuse_unless_one_rank_without_state


def runner_of(**mapping) -> ModelRunner:
    """A ModelRunner that holds only its build config: the refusal reads nothing else."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.build_config = dataclasses.replace(BuildConfig(), **mapping)
    return runner


@pytest.mark.parametrize("mode", ["medusa", "redrafter", "eagle", "lookahead"])
def test_one_rank_without_state_is_accepted_and_the_rest_refused_by_name(mode):
    refuse_unless_one_rank_without_state(runner_of(), mode, has_state=False)
    for mapping in ({"pp_size": 2}, {"tp_size": 2}):
        with pytest.raises(ProposerConfigError, match=f"decoding_mode {mode} runs on one rank .tp_size 1, pp_size 1."):
            refuse_unless_one_rank_without_state(runner_of(**mapping), mode, has_state=False)
    with pytest.raises(ProposerConfigError, match=f"decoding_mode {mode}: models with recurrent state"):
        refuse_unless_one_rank_without_state(runner_of(), mode, has_state=True)
    with pytest.raises(ProposerConfigError, match="runs on one rank"):  # a leader's wrapper, not a ModelRunner
        refuse_unless_one_rank_without_state(object(), mode, has_state=False)
