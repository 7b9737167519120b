"""Speculative decoding without a model: the acceptance rules, the n-gram proposer, drafts in the scheduler."""
from __future__ import annotations

import pytest
import torch
from executor_testing import fake_update, make_seq

from engine.executor.kv_cache import BlockManager
from engine.executor.scheduler import Scheduler
from engine.executor.speculative.acceptance import accept_by_rejection, accept_by_threshold, accept_greedy
from engine.executor.speculative.ngram import NgramProposer
from engine.executor.speculative.proposer import draft_room

VOCAB = 6
TRIALS = 10_000
# Chi-square critical value for VOCAB - 1 = 5 degrees of freedom at p = 0.001: a correct sampler
# fails one run in a thousand (the seeds are fixed: these runs pass), a sampler that moves 3 points of
# probability between two tokens near 0.3 fails 9,998 runs in 10,000 (noncentrality 60; 2 points: 85%).
# (20,000 trials until 2026-11-30: 13.6 s of CI's fresh clone for the file, 2 points caught 99.9%.)
CHI2_CRITICAL_5_DOF = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def first_token_counts(target: torch.Tensor, drafts_of, draft_probs_of, seed: int) -> torch.Tensor:
    """How often each token is the first one emitted, over TRIALS verify steps whose drafts are
    ``drafts_of(generator)``'s rows (TRIALS of them, drawn from the draft's law when it has one).
    (Counted in a list, the drafts drawn in one call: a tensor update and a draw per trial were
    ~40% of these tests' time.)"""
    generator = torch.Generator().manual_seed(seed)
    counts = [0] * VOCAB
    for drafts in drafts_of(generator):
        counts[accept_by_rejection(target, drafts, draft_probs_of, generator)[0]] += 1
    return torch.tensor(counts, dtype=torch.float32)


def random_law(seed: int, rows: int) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_greedy_keeps_the_drafts_up_to_the_first_mismatch_then_the_targets_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, then the bonus token
    assert accept_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # the target's token replaces the first miss
    assert accept_greedy([5, 6], [4]) == [5]
    assert accept_greedy([5], []) == [5]


def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution():
    target, draft = random_law(1, 3), random_law(2, 2)

    def drafts_of(generator):  # drafts drawn from the draft's own law, as a draft model would
        return torch.multinomial(draft, TRIALS, replacement=True, generator=generator).T.tolist()

    counts = first_token_counts(target, drafts_of, draft, seed=3)
    assert chi_square(counts, target[0]) < CHI2_CRITICAL_5_DOF


def test_rejection_sampling_of_a_fixed_draft_keeps_the_target_distribution():
    """No draft logits (n-gram, client drafts without logits): each draft is a point mass."""
    target = random_law(4, 2)
    for fixed in (0, int(target[0].argmax()), int(target[0].argmin())):
        counts = first_token_counts(target, lambda generator: [[fixed]] * TRIALS, None, seed=5 + fixed)
        assert chi_square(counts, target[0]) < CHI2_CRITICAL_5_DOF, fixed


def test_all_drafts_accepted_draws_the_bonus_token_from_the_last_position():
    target = random_law(6, 2)
    target[0] = torch.nn.functional.one_hot(torch.tensor(3), VOCAB).float()  # the draft is certain to pass
    generator = torch.Generator().manual_seed(7)
    counts = [0] * VOCAB
    for _ in range(TRIALS):
        emitted = accept_by_rejection(target, [3], None, generator)
        assert emitted[0] == 3 and len(emitted) == 2
        counts[emitted[1]] += 1
    assert chi_square(torch.tensor(counts, dtype=torch.float32), target[1]) < CHI2_CRITICAL_5_DOF


def test_a_draft_the_target_rules_out_is_always_rejected_and_never_emitted():
    target = random_law(8, 2)
    target[0, 2] = 0
    target[0] /= target[0].sum()
    generator = torch.Generator().manual_seed(9)
    for _ in range(200):
        emitted = accept_by_rejection(target, [2], None, generator)
        assert len(emitted) == 1 and emitted[0] != 2


def test_threshold_rule_keeps_drafts_as_likely_as_the_threshold():
    target = torch.tensor([[0.5, 0.3, 0.2, 0, 0, 0], [0.1, 0.1, 0.8, 0, 0, 0], [0, 0, 0, 0, 0, 1.0]])
    generator = torch.Generator().manual_seed(10)
    assert accept_by_threshold(target, [1, 2], 0.3, generator) == [1, 2, 5]  # 0.3 >= 0.3, 0.8 >= 0.3
    for _ in range(50):
        emitted = accept_by_threshold(target, [1, 0], 0.3, generator)  # 0.1 < 0.3: drawn from target[1]
        assert emitted[0] == 1 and len(emitted) == 2 and emitted[1] in (0, 1, 2)


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_longest_match_first():
    seq = make_seq([1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3], max_tokens=20)
    proposer = NgramProposer(max_matching_ngram_size=3)
    # "2 3" (no earlier "7 2 3") last occurred at 5..6, followed by 4 5 6
    assert proposer.propose([seq], max_draft_len=3) == [[4, 5, 6]]
    seq.token_ids += [4]  # now "2 3 4" matches at 5..7: 5 6 7 2 ...
    assert proposer.propose([seq], max_draft_len=8) == [[5, 6, 7, 2, 3, 4]]  # stops at the known tokens
    seq.token_ids += [42]  # never seen: no draft
    assert proposer.propose([seq], max_draft_len=8) == [[]]
    proposer.release(seq)
    assert not proposer._indexes


def test_ngram_drafts_stay_within_max_tokens():
    seq = make_seq([1, 2, 1, 2, 1, 2, 1], max_tokens=3)
    seq.token_ids += [2]  # 1 generated, 2 left: one verify step may keep 1 draft + its own token
    assert draft_room(seq, 8) == 1
    assert NgramProposer(2).propose([seq], max_draft_len=8) == [[1]]
    seq.token_ids += [1, 2]
    assert NgramProposer(2).propose([seq], max_draft_len=8) == [[]]


def make_scheduler(max_num_tokens=16) -> Scheduler:
    return Scheduler(BlockManager(16, 4), max_batch_size=4, max_num_tokens=max_num_tokens)


def test_a_decode_with_drafts_is_one_chunk_of_one_plus_k_tokens_that_still_samples():
    sched = make_scheduler()
    a, b = make_seq([1, 2, 3], max_tokens=10), make_seq([4, 5, 6], max_tokens=10)
    sched.add(a), sched.add(b)
    fake_update(sched, sched.schedule())
    a.draft_token_ids = [7, 7, 7]
    out = sched.schedule()
    (da, db) = out.scheduled
    assert (da.num_new_tokens, da.num_draft_tokens, da.samples) == (4, 3, True)
    assert (db.num_new_tokens, db.num_draft_tokens, db.samples) == (1, 0, True)  # rows without drafts share the step
    assert len(a.block_ids) == 2  # positions 3..6 need a second block


def test_drafts_are_cut_to_the_token_budget_and_ride_only_with_a_prompts_last_chunk():
    sched = make_scheduler(max_num_tokens=6)
    a = make_seq([1, 2, 3, 4], max_tokens=10)
    a.draft_token_ids = [9, 9, 9, 9]  # external drafts: verified with the prompt
    sched.add(a)
    (item,) = sched.schedule().scheduled
    assert (item.num_new_tokens, item.num_draft_tokens, item.samples) == (6, 2, True)


@pytest.mark.parametrize("budget", [1, 2])
def test_a_decode_without_budget_for_drafts_runs_plain(budget):
    sched = make_scheduler(max_num_tokens=4)
    a = make_seq([1, 2, 3], max_tokens=10)
    sched.add(a)
    fake_update(sched, sched.schedule())
    sched.max_num_tokens = budget
    a.draft_token_ids = [7, 7]
    (item,) = sched.schedule().scheduled
    assert (item.num_new_tokens, item.num_draft_tokens) == (budget, budget - 1)


def test_a_draft_its_own_law_rules_out_is_judged_as_a_fixed_draft():
    target, draft = random_law(11, 2), random_law(12, 1)
    draft[0, 4] = 0  # the draft is token 4, which the draft's law says it never proposes
    counts = first_token_counts(target, lambda generator: [[4]] * TRIALS, draft, seed=13)
    assert chi_square(counts, target[0]) < CHI2_CRITICAL_5_DOF
