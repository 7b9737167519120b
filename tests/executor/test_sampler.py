"""Sampler on hand-made logits: penalties as defined, bans, top-k/top-p, seeded draws."""
from __future__ import annotations

import dataclasses

import torch
from executor_testing import make_seq

from engine.executor.request import OutputConfig
from engine.executor.packed_draws import draw_metadata, pack_draws
from engine.executor.sampler import (
    apply_top_k_top_p, build_sampling_metadata, draws_alone, greedy_alone, greedy_metadata, process_logits, sample,
)
from kernels.sampling import greedy_tokens

VOCAB = 8


def metadata(seqs, log_probs=False):
    return build_sampling_metadata(seqs, VOCAB, "cpu", log_probs)


def with_output(seq, tokens):
    seq.token_ids += tokens
    return seq


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0, 0.0, 3.0, -1.0]])
    # prompt holds tokens 0 and 1; output holds 2 twice and 3 once.
    seq = with_output(make_seq([0, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [2, 2, 3])
    out = process_logits(logits, metadata([seq]))[0]
    expected = logits[0].clone()
    expected[0] = 2.0 / 2  # repetition over prompt: positive logit divided
    expected[1] = -2.0 * 2  # negative logit multiplied
    expected[2] = 1.0 / 2 - 0.5 - 0.25 * 2  # repetition, presence, frequency x count
    expected[3] = 0.5 / 2 - 0.5 - 0.25
    torch.testing.assert_close(out, expected)


def test_no_penalty_leaves_logits_untouched():
    logits = torch.randn(2, VOCAB)
    seqs = [with_output(make_seq([0, 1]), [2]), make_seq([3])]
    torch.testing.assert_close(process_logits(logits, metadata(seqs)), logits)


def test_min_tokens_bans_end_id_until_reached_and_bad_words_ban_their_last_token():
    seq = make_seq([5, 6], min_tokens=2)
    seq.state.request.end_id = 4
    seq.state.request.bad_words = [[1], [6, 2], [7, 3]]
    out = process_logits(torch.zeros(1, VOCAB), metadata([seq]))[0]
    # end_id 4 (min_tokens), 1 (single-token word), 2 (prompt ends with 6); 3 is allowed (no 7 before it)
    assert torch.isinf(out).nonzero().flatten().tolist() == [1, 2, 4]
    with_output(seq, [0, 0])
    out = process_logits(torch.zeros(1, VOCAB), metadata([seq]))[0]
    assert torch.isinf(out).nonzero().flatten().tolist() == [1]  # min_tokens reached, prompt no longer ends in 6


def test_embedding_bias_is_added():
    seq = make_seq([0])
    seq.state.request.embedding_bias = [0.0] * 7 + [100.0]
    assert sample(torch.zeros(1, VOCAB), metadata([seq])).token_ids.tolist() == [7]


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9]]))
    def kept(k, p):
        masked = apply_top_k_top_p(logits, torch.tensor([k]), torch.tensor([p]))[0]
        return (~torch.isinf(masked)).nonzero().flatten().tolist()

    assert kept(2, 1.0) == [0, 1]
    assert kept(8, 0.7) == [0, 1]  # 0.5 < 0.7, 0.8 >= 0.7: the nucleus is the first two
    assert kept(8, 0.5) == [0]
    assert kept(8, 1e-6) == [0]  # the top token always stays
    assert kept(1, 1.0) == [0]


def test_top_k_top_p_in_row_chunks_equals_one_pass(monkeypatch):
    """A large batch is masked in passes of rows (bounded temporaries); each row's mask is its own."""
    import engine.executor.sampler as sampler

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(11, VOCAB, generator=generator) * 3
    top_k = torch.randint(1, VOCAB + 1, (11,), generator=generator)
    top_p = torch.rand(11, generator=generator)
    whole = apply_top_k_top_p(logits, top_k, top_p)
    monkeypatch.setattr(sampler, "TOP_K_TOP_P_CHUNK_LOGITS", 3 * VOCAB)  # passes of 3 rows, the last of 2
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p), whole)


def test_worst_case_metadata_samples_every_row_with_log_probs():
    from engine.executor.sampler import worst_case_metadata

    out = sample(torch.randn(4, VOCAB), worst_case_metadata(4, VOCAB, "cpu"))
    assert out.token_ids.shape == (4,) and out.log_probs.shape == (4,)
    assert out.top_log_probs.shape == (4, min(5, VOCAB))


def test_greedy_rows_take_the_argmax_and_log_probs_are_log_softmax():
    logits = torch.randn(3, VOCAB)
    seqs = [make_seq([0]), make_seq([1], top_k=1, temperature=0.5), make_seq([2], temperature=0.0, top_p=0.9)]
    out = sample(logits, metadata(seqs, log_probs=True))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(out.log_probs, logits.log_softmax(-1).max(-1).values)


def test_seeded_draws_repeat_and_differ_by_seed():
    logits = torch.zeros(1, 1000)  # uniform: any two different streams disagree quickly

    def draws(seed):
        seq = make_seq([0], top_k=0, top_p=1.0, temperature=1.0)
        seq.seed = seed
        out = []
        for _ in range(8):  # each step draws fresh noise (the offset is the number of generated tokens)
            out.append(sample(logits, build_sampling_metadata([seq], 1000, "cpu", False)).token_ids.item())
            seq.token_ids.append(out[-1])
        return out

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert len(set(draws(1))) > 1


def test_a_row_draws_the_same_whatever_shares_its_batch():
    logits = torch.randn(3, VOCAB)
    seqs = [make_seq([0], top_p=1.0), make_seq([1], top_p=1.0), make_seq([2])]
    for i, seq in enumerate(seqs):
        seq.seed = 100 + i
    together = sample(logits, metadata(seqs)).token_ids.tolist()
    alone = [sample(logits[i:i + 1], metadata([seq])).token_ids.item() for i, seq in enumerate(seqs)]
    assert together == alone


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0, 0, 0, 0, 0])
    seq = make_seq([0], top_p=1.0)
    md = metadata([seq])
    logits = probs.log().unsqueeze(0)
    draws = []
    for step in range(2000):
        md.offsets = torch.tensor([step])
        draws.append(sample(logits, md).token_ids.item())
    counts = torch.bincount(torch.tensor(draws), minlength=VOCAB)
    torch.testing.assert_close(counts.float() / 2000, probs, atol=0.04, rtol=0)


def test_unnormalized_log_probs_are_the_processed_logits():
    logits = torch.randn(2, VOCAB)
    md = metadata([make_seq([0]), make_seq([1])], log_probs=True)
    md.normalize_log_probs = False
    out = sample(logits, md)
    torch.testing.assert_close(out.log_probs, logits.max(-1).values)


def test_sampled_rows_draw_only_inside_their_top_k_and_top_p():
    """Through build_sampling_metadata, as the executor samples: a row with top-k 2 draws only its two
    best tokens, a row with top-p 0.5 only its nucleus, a row without limits anything, over many
    seeded draws of a flat-ish distribution."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]]).repeat(3, 1)
    seqs = [make_seq([0], top_k=2, temperature=1.0), make_seq([0], top_p=0.5, temperature=1.0),
            make_seq([0], top_p=1.0, temperature=1.0)]
    md = metadata(seqs)
    assert md.needs_top_k_top_p
    drawn = [set(), set(), set()]
    for step in range(300):
        md.offsets = torch.tensor([step] * 3)
        for row, token in enumerate(sample(logits, md).token_ids.tolist()):
            drawn[row].add(token)
    nucleus = torch.softmax(logits[0], 0).cumsum(0)
    assert drawn[0] == {0, 1}
    assert drawn[1] == set(range(int((nucleus < 0.5).sum()) + 1))
    assert len(drawn[2]) > 4


def change_output(**fields):
    """A change to a row (a callable of its Sequence): its request's output settings OutputConfig(**fields)."""
    def set_output(seq):
        seq.state.request.output = OutputConfig(**fields)
    return set_output


def change_request(**fields):
    """A change to a row (a callable of its Sequence): these fields of its request set."""
    def set_fields(seq):
        for name, value in fields.items():
            setattr(seq.state.request, name, value)
    return set_fields


# Rows of a request that is not greedy_alone, each by one setting: {name: (make_seq's sampling fields, a change
# of the row or None)}. None of them is plain_argmax either; "sampled" and "top-p" still draw_alone.
NOT_GREEDY_ALONE = {
    "sampled": (dict(temperature=0.7, top_k=40), None), "top-p": (dict(top_p=0.9), None),
    "beams": (dict(top_k=1, beam_width=2), None),
    "repetition penalty": (dict(top_k=1, repetition_penalty=1.2), None),
    "presence penalty": (dict(top_k=1, presence_penalty=0.5), None),
    "frequency penalty": (dict(top_k=1, frequency_penalty=0.5), None),
    "min tokens": (dict(top_k=1, min_tokens=2), change_request(end_id=4)),
    "bad words": (dict(top_k=1), change_request(bad_words=[[3]])),
    "embedding bias": (dict(top_k=1), change_request(embedding_bias=[0.0] * VOCAB)),
    "log-probs": (dict(top_k=1), change_output(return_log_probs=True)),
    "top log-probs": (dict(top_k=1), change_output(num_top_log_probs=2)),
}


def plain_argmax(seq) -> bool:
    """A greedy row that only draws: of a step of such rows, Executor._mark_last_stage_sampling has a
    pipeline's last stage send ``greedy_tokens`` of the logits (engine/pipeline/runner.py)."""
    return seq.state.request.sampling.is_greedy and draws_alone(seq)


def test_plain_argmax_rows_are_sampled_by_greedy_tokens_alone():
    """plain_argmax (a pipeline's last stage samples such rows: engine/pipeline/runner.py) holds
    exactly where sample() is greedy_tokens of the raw logits: greedy, nothing processed, no log-probs.
    Any one setting that changes the sampler's work makes it False."""
    plain = [make_seq([0, 1], top_k=1), make_seq([2], temperature=0.0), make_seq([3], repetition_penalty=1.0),
             make_seq([4], temperature=0.7)]  # (no top-k or top-p: the argmax, whatever the temperature)
    assert all(map(plain_argmax, plain))
    md = metadata(plain)
    assert md.all_greedy and not md.return_log_probs and md.token_bitmask is None and md.timestamps is None
    assert (md.repetition_penalty, md.banned, md.embedding_bias) == (None, None, None)
    logits = torch.randn(4, VOCAB)
    logits[1, 2] = logits[1, 5] = logits[1].max() + 1  # a tie: the first index, in both
    assert torch.equal(sample(logits, md).token_ids, greedy_tokens(logits))

    not_plain = {**NOT_GREEDY_ALONE, "top-k 2": (dict(top_k=2), None),
                 "context logits": (dict(top_k=1), change_output(return_context_logits=True)),
                 "generation logits": (dict(top_k=1), change_output(return_generation_logits=True))}
    draws = ("sampled", "top-k 2", "top-p")  # (not greedy, but nothing beside the draw: draws_alone)
    for name, (sampling, change) in not_plain.items():
        seq = make_seq([0, 1], **sampling)
        if change is not None:
            change(seq)
        assert not plain_argmax(seq), name
        assert draws_alone(seq) == (name in draws), name
    guided = make_seq([0], top_k=1)
    guided.grammar = object()  # (a GrammarMatcher: its mask is applied before the argmax)
    assert not plain_argmax(guided) and not draws_alone(guided)


def metadata_fields(md) -> dict:
    """A SamplingMetadata's fields, each tensor as its kind and values (dataclass equality would compare tensors)."""
    return {f.name: (("tensor", getattr(md, f.name).tolist()) if isinstance(getattr(md, f.name), torch.Tensor)
                     else getattr(md, f.name)) for f in dataclasses.fields(md)}


def test_greedy_alone_rows_get_the_greedy_metadata_and_no_other_row_does():
    """Executor._sample takes greedy_metadata() without a pass over a step's rows while every active request is
    greedy_alone: that is build_sampling_metadata's result for any batch of such rows (log-probs asked as the
    executor asks them: when a row's request does), and for no row of a request that is not."""
    def built(seqs):
        return metadata(seqs, log_probs=any(s.state.request.output.return_log_probs for s in seqs))

    alone = [make_seq([0, 1], top_k=1), make_seq([2], temperature=0.0), make_seq([3], repetition_penalty=1.0),
             make_seq([4], temperature=0.7), make_seq([5])]
    for seq, change in zip(alone[:2], (change_output(return_context_logits=True),
                                       change_output(return_generation_logits=True))):
        change(seq)  # (logits returned to the host do not change the metadata; they take the synchronous path)
    assert all(greedy_alone(s.state.request) for s in alone)
    assert metadata_fields(built(alone)) == metadata_fields(greedy_metadata())
    assert greedy_metadata() is not greedy_metadata()  # (a step's grammar masks are set on its own object)
    for name, (sampling, change) in NOT_GREEDY_ALONE.items():
        seq = make_seq([0, 1], **sampling)
        if change is not None:
            change(seq)
        assert not greedy_alone(seq.state.request), name
        if name != "beams":  # (beam rows never reach the sampler's batch: beam_search.py takes them)
            assert metadata_fields(built([alone[-1], seq])) != metadata_fields(greedy_metadata()), name


def test_packed_draws_rebuild_the_metadata_rank0_builds():
    """A pipeline's last stage samples from draw_metadata(pack_draws(seqs)) (engine/executor/packed_draws.py):
    field for field build_sampling_metadata's (float settings through their float32 bits, seeds up
    to 2**62 in two halves), so sample() draws the same tokens; a micro-batch's rows keep the step's
    top-k / top-p pass."""
    seqs = [make_seq([0], top_k=1), make_seq([1], temperature=0.7, top_k=3), make_seq([2], top_p=0.85),
            make_seq([3], temperature=1.3, top_k=4, top_p=0.6), make_seq([4]), make_seq([5], temperature=0.1, top_k=5)]
    for i, seq in enumerate(seqs):
        seq.seed = (1 << 62) - 1 - 7 * i
        seq.token_ids += [1] * i  # offsets 0..5
    expected, packed = metadata(seqs), pack_draws(seqs, VOCAB)
    assert all(-2**31 <= value < 2**31 for value in packed)  # (int32, as every plan field)
    rebuilt = draw_metadata(packed, list(range(len(seqs))), VOCAB, "cpu")
    for name in ("is_greedy", "temperature", "top_k", "top_p", "draw_temperature", "seeds", "offsets"):
        assert torch.equal(getattr(rebuilt, name), getattr(expected, name)), name
    for name in ("all_greedy", "needs_top_k_top_p", "return_log_probs", "repetition_penalty", "banned",
                 "embedding_bias", "token_bitmask", "timestamps", "top_log_prob_rows"):
        assert getattr(rebuilt, name) == getattr(expected, name), name
    logits = torch.randn(len(seqs), VOCAB)
    tokens = sample(logits, expected).token_ids
    assert torch.equal(sample(logits, rebuilt).token_ids, tokens)
    part = draw_metadata(packed, [4, 5], VOCAB, "cpu")  # a micro-batch's rows
    assert part.needs_top_k_top_p and torch.equal(part.seeds, expected.seeds[4:])
    assert torch.equal(sample(logits[4:], part).token_ids, tokens[4:])
