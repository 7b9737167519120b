"""Speculative decoding with a draft model (engine/executor/speculative/draft_model.py).

Greedy ids must be plain decoding's whatever the draft: the tiny random Llama target (vocab 128,
4-token blocks) drafted by itself (every draft kept), by a noisy copy of itself (some kept), and
by tiny random engines of other families built with the same vocabulary (almost none kept); and
the embedded SmolLM2 drafted by itself on a summary and a code edit of the acceptance benchmark. Both KV
pools must end empty; drafts must be rolled back exactly like the target's. Refusals name the field.
"""
from __future__ import annotations

import shutil
import time

import pytest
import torch
import transformers
from tiny_engines import VOCAB, build_tiny_engine, tiny_hf_model
from executor_testing import collect, final_tokens

from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig
from engine.executor.request import FinishReason, OutputConfig, Request, SamplingConfig
from engine.executor.runner import ModelRunner
from engine.executor.speculative.draft_model import DraftModelProposer, check_draft_engine
from engine.executor.speculative.proposer import ProposerConfigError

PROMPTS = [[(7 * i + 3 * j + j * j) % VOCAB for j in range(3 + 5 * i)] for i in range(8)]  # 3 .. 38 tokens
MAX_TOKENS = 24


def run(executor, requests: list[Request], streams: dict | None = None) -> list[list]:
    ids = executor.enqueue_requests(requests)
    got = collect(executor, ids, timeout=300, streams=streams)
    return [got[i] for i in ids]


def drafted(engine_dir: str, draft_dir: str, max_draft_len: int = 4, response_callback=None, **kw) -> Executor:
    spec = SpeculativeConfig("draft_model", max_draft_len=max_draft_len, draft_engine_dir=draft_dir)
    return Executor(engine_dir, ExecutorConfig(exclude_input_from_output=True, speculative=spec, **kw),
                    response_callback=response_callback)


def assert_no_blocks_held(executor) -> None:
    """Neither the target's pool nor the draft's keeps a block once every request has ended."""
    for blocks in (executor.blocks, executor.proposer.blocks):
        blocks.check_invariants()
        assert blocks.num_free_blocks == blocks.num_blocks, "a finished request left KV blocks behind"
    assert executor.proposer.num_sequences == 0, "the draft model kept a finished sequence"


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """The target's weights plus noise: a draft that agrees with it often, not always."""
    generator = torch.Generator().manual_seed(seed)
    copy = tiny_hf_model()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return copy


def other_family(name: str) -> torch.nn.Module:
    """A tiny random model of another family with the target's vocabulary (so its ids mean the same)."""
    configs = {
        "qwen2": lambda: transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                  max_position_embeddings=256),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=256),
    }
    torch.manual_seed(5)
    config = configs[name]()
    model = (transformers.GPT2LMHeadModel if name == "gpt2" else transformers.Qwen2ForCausalLM)(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            base = 1.0 if ("norm" in param_name or "ln_" in param_name) and param_name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_engine, tiny_hf) -> dict[str, str]:
    """Draft engines for the tiny target. "small_limits": the target's own weights in an engine of
    max_seq_len 32, max_batch_size 2 and max_num_tokens 8 (8-token blocks): long prompts get no
    drafts, catch-ups are chunked, 1-token steps are cut to two rows."""
    tmp = tmp_path_factory.mktemp("drafts")
    return {
        "self": tiny_engine,
        "noisy_copy": build_tiny_engine(tmp / "noisy", perturbed(tiny_hf, 0.005, seed=1)),
        "qwen2": build_tiny_engine(tmp / "qwen2", other_family("qwen2")),
        "gpt2": build_tiny_engine(tmp / "gpt2", other_family("gpt2")),
        "small_limits": build_tiny_engine(tmp / "small", tiny_hf, tokens_per_block=8, max_seq_len=32,
                                          max_batch_size=2, max_num_tokens=8),
    }


@pytest.fixture(scope="module")
def plain(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True)) as executor:
        yield executor


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return [final_tokens(r) for r in run(plain, [Request(p, MAX_TOKENS) for p in PROMPTS])]


@pytest.mark.parametrize("name", ["self", "noisy_copy", "qwen2", "gpt2", "small_limits"])
def test_greedy_ids_are_plain_decodings_whatever_the_draft(tiny_engine, drafts, reference, name):
    """A mixed batch: streaming and not, short and long prompts, a sampled request and one whose
    context logits keep it from drafting, all at once."""
    perf = OutputConfig(return_perf_metrics=True)
    requests = [Request(p, MAX_TOKENS, streaming=i % 2 == 1, output=perf) for i, p in enumerate(PROMPTS)]
    requests.append(Request(PROMPTS[2], MAX_TOKENS, sampling=SamplingConfig(top_k=8, temperature=0.9, seed=1)))
    requests.append(Request(PROMPTS[3], MAX_TOKENS, output=OutputConfig(return_context_logits=True)))
    with drafted(tiny_engine, drafts[name]) as executor:
        responses = run(executor, requests)
        assert [final_tokens(r) for r in responses[:len(PROMPTS)]] == reference
        assert len(final_tokens(responses[-2])) == MAX_TOKENS
        assert final_tokens(responses[-1]) == reference[3]
        assert_no_blocks_held(executor)
        stats = executor.get_latest_iteration_stats()
    metrics = [r[-1].result.perf for r in responses[:len(PROMPTS)]]
    drafted_tokens = sum(m.total_draft_tokens for m in metrics)
    accepted = sum(m.total_accepted_draft_tokens for m in metrics)
    assert stats.num_draft_tokens_total >= drafted_tokens > 0
    rate = accepted / drafted_tokens
    if name in ("self", "small_limits"):  # the target's own weights: every draft is its argmax
        assert rate == 1.0 and all(m.acceptance_rate == 1.0 for m in metrics if m.total_draft_tokens)
    elif name == "noisy_copy":
        assert 0.2 < rate < 1.0
    if name == "small_limits":  # prompts past the draft's max_seq_len (32) never get drafts
        assert [m.total_draft_tokens for m, p in zip(metrics, PROMPTS) if len(p) > 32] == [0, 0]


def test_max_tokens_stop_words_and_end_id_with_drafts(tiny_engine, drafts, reference):
    ref = reference
    requests = ([Request(p, 5) for p in PROMPTS[:4]]
                + [Request(p, MAX_TOKENS, stop_words=[r[9:11]]) for p, r in zip(PROMPTS[4:], ref[4:])]
                + [Request(PROMPTS[0], MAX_TOKENS, end_id=ref[0][6])])
    with drafted(tiny_engine, drafts["noisy_copy"], max_draft_len=6) as executor:
        responses = run(executor, requests)
        assert_no_blocks_held(executor)
    for r, expected in zip(responses[:4], ref[:4]):
        assert final_tokens(r) == expected[:5] and r[-1].result.finish_reasons == [FinishReason.LENGTH]
    for r, expected in zip(responses[4:8], ref[4:]):
        end = next(i + 2 for i in range(len(expected)) if expected[i:i + 2] == expected[9:11])
        assert final_tokens(r) == expected[:end] and r[-1].result.finish_reasons == [FinishReason.STOP_WORDS]
    assert final_tokens(responses[8]) == ref[0][:ref[0].index(ref[0][6])]
    assert responses[8][-1].result.finish_reasons == [FinishReason.END_ID]


def test_a_stream_carries_every_token_a_step_accepted(tiny_engine, drafts, reference):
    delivered = []
    with drafted(tiny_engine, drafts["self"], max_draft_len=5, response_callback=delivered.extend) as executor:
        executor.enqueue_request(Request(PROMPTS[1], MAX_TOKENS, streaming=True))
        deadline = time.monotonic() + 60
        while not (delivered and delivered[-1].is_final):
            assert time.monotonic() < deadline, "no final response in 60 s"
            time.sleep(0.01)
        assert_no_blocks_held(executor)
    chunks = [r.result.output_token_ids[0] for r in delivered]
    assert [t for c in chunks for t in c] == reference[1]
    assert max(len(c) for c in chunks) == 6  # five drafts kept and the target's own token


@pytest.mark.parametrize("options", [
    dict(enable_kv_cache_reuse=False),
    dict(batch_scheduler_policy="max_utilization", max_tokens_in_paged_kv_cache=96),  # the target preempts
    dict(enable_chunked_context=True, max_num_tokens=16, max_batch_size=4),
], ids=["no_reuse", "preemption", "chunked_context"])
def test_plain_ids_without_reuse_under_preemption_and_chunked_prompts(tiny_engine, drafts, reference, options):
    with drafted(tiny_engine, drafts["noisy_copy"], **options) as executor:
        assert [final_tokens(r) for r in run(executor, [Request(p, MAX_TOKENS) for p in PROMPTS])] == reference
        assert_no_blocks_held(executor)
        if "batch_scheduler_policy" in options:
            assert executor.scheduler.num_preemptions > 0


def test_returned_sequences_and_a_shared_prompt_reuse_the_draft_pool(tiny_engine, drafts, reference):
    """Sequences of one prompt draft each for itself; the second request of a prompt finds the
    prompt's full blocks in the draft pool (reuse on) and recomputes only its last ones."""
    prompt = PROMPTS[6]  # 33 tokens: eight full 4-token blocks
    with drafted(tiny_engine, drafts["self"]) as executor:
        (first,) = run(executor, [Request(prompt, MAX_TOKENS)])
        reused = executor.proposer.blocks.total_reused_blocks
        (again,) = run(executor, [Request(prompt, MAX_TOKENS)])
        assert executor.proposer.blocks.total_reused_blocks - reused == (len(prompt) - 1) // 4
        several = SamplingConfig(num_return_sequences=3)
        ids = executor.enqueue_requests([Request(prompt, MAX_TOKENS, sampling=several)])
        finals = [r for r in collect(executor, ids, timeout=60, streams={ids[0]: 3})[ids[0]] if r.result.is_final]
        assert_no_blocks_held(executor)
    assert final_tokens(first) == final_tokens(again) == reference[6]
    assert sorted(r.result.sequence_index for r in finals) == [0, 1, 2]
    assert all(r.result.output_token_ids[0] == reference[6] for r in finals)


def test_cancelled_requests_give_back_their_draft_blocks(tiny_engine, drafts, reference):
    with drafted(tiny_engine, drafts["noisy_copy"]) as executor:
        ids = executor.enqueue_requests([Request(p, 100, streaming=True) for p in PROMPTS[:4]])
        seen = set()
        deadline = time.monotonic() + 60
        while len(seen) < 4:  # every request has drafted at least once when it has streamed twice
            assert time.monotonic() < deadline, "no responses in 60 s"
            seen |= {r.request_id for r in executor.await_responses(timeout=0.5)
                     if r.request_id in ids and len(r.result.output_token_ids[0]) > 1}
        assert executor.proposer.num_sequences > 0
        for request_id in ids:
            executor.cancel_request(request_id)
        collect(executor, ids, timeout=60)
        assert_no_blocks_held(executor)


# ----- the proposer on its own: rollback, pool limits, the CUDA-graph path -----

@pytest.fixture()
def proposer(tiny_engine, plain):
    p = DraftModelProposer(tiny_engine, target_engine_dir=tiny_engine, target_runner=plain.runner)
    p.start(num_target_kv_tokens=256, max_batch_size=4, max_draft_len=4)
    return p


def make_seqs(prompts, max_tokens=MAX_TOKENS):
    from executor_testing import make_seq

    return [make_seq(p, max_tokens) for p in prompts]


def test_rejected_drafts_are_rolled_back_and_kept_ones_stay(proposer, reference):
    """After the target keeps j of the k drafts and adds its own token, the draft's KV keeps the
    kept drafts and recomputes from the target's token on: the next drafts are the target's ids."""
    (seq,) = make_seqs([PROMPTS[4]])
    L = len(seq.token_ids)
    first = proposer.propose([seq], 4)[0]
    assert first == reference[4][:4]
    state = proposer._seqs[seq.seq_id]
    assert (state.num_true, state.drafts, state.num_computed_tokens) == (L, first[:3], L + 3)
    seq.token_ids += first[:2] + [(first[2] + 1) % VOCAB]  # two kept, then a token the draft did not expect
    proposer.propose([seq], 4)
    assert state.num_true == L + 3 and state.num_computed_tokens == L + 3 + 3
    blocks = proposer.blocks
    assert len(state.block_ids) == blocks.blocks_for_tokens(L + 6)  # nothing held past the proposal
    used = blocks.num_used_blocks
    seq.token_ids += [1]  # the target verified nothing of it: its next token only
    proposer.propose([seq], 1)  # one draft: no KV past the true tokens is kept
    assert state.num_computed_tokens == state.num_true == len(seq.token_ids)
    assert blocks.num_used_blocks <= used
    proposer.release(seq)
    assert blocks.num_free_blocks == blocks.num_blocks and proposer.num_sequences == 0


def test_an_unverified_proposal_costs_one_recomputed_position(proposer):
    (seq,) = make_seqs([PROMPTS[2]])
    first = proposer.propose([seq], 4)[0]
    assert proposer.propose([seq], 4)[0] == first  # the target did not run: the same drafts again
    proposer.release(seq)


def test_a_sampled_requests_drafts_are_drawn_and_carry_their_law(proposer):
    """Greedy: argmax drafts, no law. Sampled (top-k 5): each draft is drawn from the draft's law at
    its position, which comes with it: rows summing to 1, five tokens each, the draft among them;
    the same seed and step draw the same drafts. Sampled without a top-k or top-p: the whole law."""
    from executor_testing import make_seq

    greedy = make_seq(PROMPTS[4], MAX_TOKENS)
    assert len(proposer.propose([greedy], 4)[0]) == 4 and greedy.draft_probs is None
    laws = []
    for _ in range(2):
        seq = make_seq(PROMPTS[4], MAX_TOKENS, top_k=5, temperature=0.8)
        seq.seed = 17
        (draft_ids,) = proposer.propose([seq], 4)
        q = seq.draft_probs
        assert q.shape == (4, VOCAB) and torch.allclose(q.sum(dim=1), torch.ones(4), atol=1e-5)
        assert ((q > 0).sum(dim=1) == 5).all() and all(q[j, d] > 0 for j, d in enumerate(draft_ids))
        laws.append((draft_ids, q))
        proposer.release(seq)
    assert laws[0][0] == laws[1][0] and torch.equal(laws[0][1], laws[1][1])
    unlimited = make_seq(PROMPTS[4], MAX_TOKENS, top_p=1.0, temperature=1.0)  # sampled, no top-k or top-p cut
    proposer.propose([unlimited], 4)
    q = unlimited.draft_probs
    assert torch.allclose(q.sum(dim=1), torch.ones(4), atol=1e-5) and ((q > 0).sum(dim=1) > 5).all()
    proposer.release(unlimited)
    proposer.release(greedy)


CHI2_CRITICAL_4_DOF = 18.47  # p = 0.001


def _sampled_runs(engine_dir: str, draft_dir: str, prompt: list[int], trials: int) -> tuple[list[list[int]], float]:
    """``trials`` seeded requests of 3 tokens (top-k 5, temperature 0.7), one draft a step:
    (their tokens, the share of drafts kept)."""
    perf = OutputConfig(return_perf_metrics=True)
    requests = [Request(prompt, 3, sampling=SamplingConfig(seed=seed, top_k=5, temperature=0.7), output=perf)
                for seed in range(trials)]
    with drafted(engine_dir, draft_dir, max_draft_len=1, max_tokens_in_paged_kv_cache=4096) as executor:
        responses = run(executor, requests)
        assert_no_blocks_held(executor)
    metrics = [r[-1].result.perf for r in responses]
    drafted_tokens = sum(m.total_draft_tokens for m in metrics)
    assert drafted_tokens >= trials  # the second token of each was a verified draft
    return [final_tokens(r) for r in responses], sum(m.total_accepted_draft_tokens for m in metrics) / drafted_tokens


def test_sampled_drafts_keep_the_targets_law_and_a_faithful_draft_is_kept_every_time(tiny_engine, tiny_hf, drafts,
                                                                                     tmp_path, plain):
    """Drafted by a noisy copy of the target (q != p), 2,000 seeded requests' second token, the
    first a verify step decides, follows the target's law after the most common first token
    (chi-square). Drafted by the target itself (q = p), nearly every draft is kept, where argmax
    drafts judged as point masses would be kept with the top token's probability only (~0.5 here)."""
    prompt = [9, 8, 7, 6, 5]
    tokens, _ = _sampled_runs(tiny_engine, build_tiny_engine(tmp_path / "noisy", perturbed(tiny_hf, 0.02, seed=3)),
                              prompt, 2000)
    firsts = [t[0] for t in tokens]
    first = max(set(firsts), key=firsts.count)
    seconds = [t[1] for t in tokens if t[0] == first]
    (context,) = run(plain, [Request(prompt + [first], 1, output=OutputConfig(return_context_logits=True))])
    top = (context[-1].result.context_logits[-1] / 0.7).topk(5)
    law = torch.softmax(top.values, dim=-1)
    counts = torch.tensor([seconds.count(int(t)) for t in top.indices], dtype=torch.float32)
    assert counts.sum() == len(seconds) >= 300  # nothing outside the top 5
    expected = law * len(seconds)
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRITICAL_4_DOF
    _, self_rate = _sampled_runs(tiny_engine, drafts["self"], prompt, 500)
    assert self_rate > 0.97 > float(law.max()) + 0.3, (self_rate, float(law.max()))


def test_a_short_pool_gives_fewer_drafts_never_wrong_ones_and_idle_sequences_give_theirs_back(
        tiny_engine, plain, reference):
    p = DraftModelProposer(tiny_engine, target_engine_dir=tiny_engine, target_runner=plain.runner)
    p.start(num_target_kv_tokens=16, max_batch_size=1, max_draft_len=1)  # 4 + 2 blocks: 24 positions
    seqs = make_seqs([PROMPTS[3], PROMPTS[0]])  # 18 and 3 tokens
    out = p.propose(seqs, 8)
    assert out[0] == reference[3][:7]  # 18 + 7 - 1 = 24 positions: the pool's last
    assert out[1] == []  # nothing left for the second
    # The first one stops asking (preempted, say): the second takes back its blocks.
    assert p.propose(seqs[1:], 8)[0] == reference[0][:8]
    assert p.num_sequences == 1
    p.release(seqs[1])
    p.release(seqs[0])  # (already let go: nothing to free)
    assert p.blocks.num_free_blocks == p.blocks.num_blocks


class RecordingGraphs:
    """Stands in for the draft runner's DecodeGraphs on CPU: records each batch offered, replays none."""

    def __init__(self):
        self.batches = []

    def try_run(self, batch, rotary_positions=None):  # DecodeGraphs.try_run's signature
        self.batches.append((list(batch.seq_lens_q), len(batch.logits_indices)))
        return None  # the runner then runs the batch eagerly


def test_the_draft_captures_its_graphs_once_and_offers_them_each_1_token_step(tiny_engine, drafts, monkeypatch):
    """GPU-ready path, checked on CPU: the draft runner captures its CUDA graphs once (at start),
    and every 1-token draft step reaches DecodeGraphs.try_run as a decode-only batch of at most the
    draft's max_batch_size rows, so on CUDA each is one graph replay."""
    captured = []
    original = ModelRunner.capture_cuda_graphs
    monkeypatch.setattr(ModelRunner, "capture_cuda_graphs", lambda self: (captured.append(self), original(self)))
    with drafted(tiny_engine, drafts["small_limits"], max_draft_len=4, max_batch_size=5) as executor:
        draft_runner = executor.proposer.runner
        assert captured.count(draft_runner) == 1 and captured.count(executor.runner) == 1
        draft_runner.decode_graphs = recorder = RecordingGraphs()
        run(executor, [Request(p, 12) for p in PROMPTS[:5]])
        assert_no_blocks_held(executor)
    steps = [b for b in recorder.batches if all(n == 1 for n in b[0])]
    assert steps and all(len(lens) <= 2 and rows == len(lens) for lens, rows in steps)  # max_batch_size 2
    assert len(steps) >= 3 * 5  # three 1-token steps per proposal of four drafts, at least once per request


# ----- refusals -----

def test_a_draft_with_another_vocabulary_is_refused_by_name(tiny_engine, tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256))
    other = build_tiny_engine(tmp_path / "vocab96", model)
    with pytest.raises(ExecutorConfigError, match=r"SpeculativeConfig\.draft_engine_dir: the draft engine's "
                                                   r"vocab_size \(96\) differs from the target's \(128\)"):
        drafted(tiny_engine, other)


def test_a_missing_draft_engine_is_refused_by_name(tiny_engine, tmp_path):
    with pytest.raises(ExecutorConfigError, match=r"SpeculativeConfig\.draft_engine_dir .* is not a directory"):
        drafted(tiny_engine, str(tmp_path / "nowhere"))
    with pytest.raises(ExecutorConfigError, match=r"SpeculativeConfig\.draft_engine_dir must name"):
        ExecutorConfig(speculative=SpeculativeConfig("draft_model")).validate()


def test_another_tokenizer_or_end_token_is_refused_by_name(tiny_engine, tmp_path):
    """Same vocab_size, but the tokenizer files of the two directories map tokens to other ids, or
    name another end token: refused. Formatting of the files does not matter."""
    import json

    def engine_with(name: str, vocab: dict, eos: str, indent: int) -> str:
        path = tmp_path / name
        shutil.copytree(tiny_engine, path)
        (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                                         "added_tokens": [{"id": 0, "content": "<s>"}]}, indent=indent))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        return str(path)

    vocab = {f"t{i}": i for i in range(VOCAB)}
    target = engine_with("target", vocab, "</s>", 0)
    check_draft_engine(engine_with("same", dict(reversed(list(vocab.items()))), "</s>", 2), target, VOCAB)
    swapped = {**vocab, "t1": 2, "t2": 1}
    with pytest.raises(ProposerConfigError, match=r"draft_engine_dir: the draft engine's tokenizer\.json vocabulary"):
        check_draft_engine(engine_with("swapped", swapped, "</s>", 0), target, VOCAB)
    with pytest.raises(ProposerConfigError, match=r"draft_engine_dir: the draft engine's eos_token \('<eos>'"):
        check_draft_engine(engine_with("eos", vocab, "<eos>", 0), target, VOCAB)


# ----- real weights: SmolLM2 drafting for itself -----

# 12 tokens: the first from the prefill, then 3 draft-and-verify steps of up to 5 tokens (4 drafts, one
# bonus) per request; the time goes with the steps (each runs the 135M draft 4 times and the target once),
# hardly with the batch. (24 until 2026-11-30: ~5 steps, the same path twice as long.)
SMOLLM2_MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_engine_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from benchmarks.speculative.speculative_acceptance import PROMPT_SETS, chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(smollm2_engine_dir)
    return [chat_prompt(tokenizer, text) for text in PROMPT_SETS["summarisation"] + PROMPT_SETS["code_edit"]]


# `make test-all`: make test drafts with the target's own weights in test_greedy_ids_are_plain_decodings_whatever_the_draft[self]
# (the tiny engine: ids equal to plain decoding in a mixed, partly streamed batch, acceptance 1.0, no block
# held), the same draft_model path; this is that path at SmolLM2's size (13.5 s of CI's fresh clone).
@pytest.mark.slow
@pytest.mark.extended
def test_smollm2_as_its_own_draft_keeps_every_draft_and_the_plain_ids(smollm2_engine_dir, smollm2_prompts):
    """A prompt of each set, greedy, in one batch (the summary streamed): ids identical to plain
    decoding, acceptance 1.0 (the draft is the target; its argmax after the same tokens is the
    target's), and both pools empty at the end. (Eight prompts go through the n-gram and
    external-draft tests of test_speculative_executor; two prompts of 12 tokens, one streamed, run
    the same drafting path of several rows as eight of 40 did, which took 22 s of the two-core
    fresh-clone run, four of 24, 23 s, and four of 12, 14.5 s.)"""
    config = dict(exclude_input_from_output=True, max_tokens_in_paged_kv_cache=8192)
    prompts = [smollm2_prompts[0], smollm2_prompts[-1]]  # a summary, then a code edit
    requests = [Request(p, SMOLLM2_MAX_TOKENS, streaming=i == 0, output=OutputConfig(return_perf_metrics=True))
                for i, p in enumerate(prompts)]
    with Executor(smollm2_engine_dir, ExecutorConfig(**config)) as executor:
        reference = [final_tokens(r) for r in run(executor, requests)]
    spec = SpeculativeConfig("draft_model", max_draft_len=4, draft_engine_dir=smollm2_engine_dir)
    with Executor(smollm2_engine_dir, ExecutorConfig(speculative=spec, **config)) as executor:
        responses = run(executor, requests)
        assert [final_tokens(r) for r in responses] == reference
        assert_no_blocks_held(executor)
    perf = [r[-1].result.perf for r in responses]
    drafted_tokens = sum(p.total_draft_tokens for p in perf)
    assert drafted_tokens >= len(prompts) * (SMOLLM2_MAX_TOKENS // 5)
    assert sum(p.total_accepted_draft_tokens for p in perf) == drafted_tokens
    assert all(p.acceptance_rate == 1.0 for p in perf)
