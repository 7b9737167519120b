"""ReDrafter (engine/executor/speculative/redrafter.py): Apple's recurrent drafter made here on random
weights in its published layouts (Apple's ml-recurrent-drafter and TensorRT-LLM's converted
checkpoint, split over 2 ranks). It loads, its beam search equals a module-by-module reference of
Apple's, and ``decoding_mode redrafter`` in the executor gives transformers' greedy ids; drafters
that do not fit are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from executor_testing import collect, final_tokens
from safetensors.torch import save_file

from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig
from engine.executor.request import OutputConfig, Request, SamplingConfig
from engine.executor.speculative.redrafter import ReDrafterConfigError, load_drafter, pack_beams

HIDDEN, VOCAB, NEW_TOKENS = 64, 128, 12
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [100, 7, 7, 7, 120, 33, 9], [1, 2, 3, 4]]


class AppleDrafter(torch.nn.Module):
    """The module layout of Apple's Drafter (input_proj, lm_head = ResBlocks + Linear, rnn_u, rnn_w)."""

    def __init__(self, exit_dim: int, layers: int, hidden: int = HIDDEN, vocab: int = VOCAB):
        super().__init__()
        if exit_dim != 2 * hidden:
            self.input_proj = torch.nn.Linear(2 * hidden, exit_dim)
        blocks = [torch.nn.Module() for _ in range(layers)]
        for b in blocks:
            b.linear = torch.nn.Linear(exit_dim, exit_dim)
        self.lm_head = torch.nn.Sequential(*blocks, torch.nn.Linear(exit_dim, vocab, bias=False))
        self.rnn_u = torch.nn.Linear(hidden, hidden)
        self.rnn_w = torch.nn.Linear(hidden, hidden, bias=False)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))

    def log_probs(self, context, state):
        x = torch.cat([context, state], -1)
        x = self.input_proj(x) if hasattr(self, "input_proj") else x
        for block in list(self.lm_head)[:-1]:
            x = x + torch.nn.functional.silu(block.linear(x))
        logits = self.lm_head[-1](x)
        logits = logits - logits.max(-1, keepdim=True).values
        logits[logits < logits.topk(50, -1).values[..., -1:]] = -50000.0
        return logits.log_softmax(-1)

    @torch.no_grad()
    def beams(self, hidden, init_token: int, embed, width: int, length: int) -> list[list[int]]:
        """Apple's beam_search_candidates for one sequence, written out per beam."""
        beams = [([init_token], 0.0 if b == 0 else -50000.0, torch.zeros(HIDDEN)) for b in range(width)]
        for _ in range(length):
            grown = []
            for tokens, score, state in beams:
                state = torch.nn.functional.silu(self.rnn_w(embed(torch.tensor(tokens[-1]))) + self.rnn_u(state))
                lp = self.log_probs(hidden, state)
                top = lp.topk(width)  # the best width overall are among each beam's best width
                grown += [(score + float(p), tokens + [int(v)], state) for p, v in zip(top.values, top.indices)]
            grown.sort(key=lambda x: -x[0])
            beams = [(tokens, score, state) for score, tokens, state in grown[:width]]
        return [tokens for tokens, _, _ in beams]


def save_apple(directory, drafter: AppleDrafter, exit_dim: int, layers: int) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "recurrent_drafting_drafter", "vocab_size": VOCAB, "hidden_size": HIDDEN, "exit_dim": exit_dim,
        "num_draft_layers": layers, "num_lookback_tokens": -1, "rnn": True}))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(directory / "model.safetensors"))
    return str(directory)


def save_trtllm(directory, drafter: AppleDrafter, exit_dim: int, layers: int, beams: int, length: int) -> str:
    """TensorRT-LLM's converted layout: drafter.* tensors split along dim 0 over 2 ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architecture": "ReDrafterForCausalLM", "base_model_architecture": "LlamaForCausalLM", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "redrafter_num_layers": layers, "redrafter_hidden_size": HIDDEN,
        "redrafter_exit_dim": exit_dim, "redrafter_is_rnn": True, "redrafter_num_beams": beams,
        "redrafter_draft_len_per_beam": length, "redrafter_greedy_search": True, "mapping": {"tp_size": 2}}))
    sd = drafter.state_dict()
    names = {"input_proj.weight": "input_proj.weight", "input_proj.bias": "input_proj.bias",
             f"lm_head.{layers}.weight": "lm_head.weight", "rnn_u.weight": "rnn_u.weight",
             "rnn_u.bias": "rnn_u.bias", "rnn_w.weight": "rnn_w.weight",
             **{f"lm_head.{j}.linear.{p}": f"layers.{j}.linear.{p}" for j in range(layers) for p in ("weight", "bias")}}
    for rank in range(2):
        save_file({"transformer.vocab_embedding.weight": torch.zeros(4, 4),  # base weights are skipped
                   **{f"drafter.{new}": sd[old].chunk(2)[rank].contiguous() for old, new in names.items() if old in sd}},
                  str(directory / f"rank{rank}.safetensors"))
    return str(directory)


def test_pack_beams_merges_shared_prefixes():
    beams = [[9, 1, 2, 3], [9, 1, 2, 4], [9, 1, 5, 3], [9, 6, 2, 3]]
    assert pack_beams(beams) == ([-1, 0, 1, 1, 0, 4, -1, 6, 7], [1, 2, 3, 4, 5, 3, 6, 2, 3])


@pytest.mark.parametrize("exit_dim", [2 * HIDDEN, 96], ids=["no_input_proj", "input_proj"])
def test_beam_search_equals_apples(tmp_path, tiny_hf, exit_dim):
    reference = AppleDrafter(exit_dim, 2)
    apple, _ = load_drafter(save_apple(tmp_path / "apple", reference, exit_dim, 2), hidden_size=HIDDEN, vocab_size=VOCAB)
    converted, settings = load_drafter(save_trtllm(tmp_path / "trt", reference, exit_dim, 2, 3, 4), hidden_size=HIDDEN,
                                       vocab_size=VOCAB)
    assert settings == {"redrafter_num_beams": 3, "redrafter_draft_len_per_beam": 4}
    embed = tiny_hf.model.embed_tokens
    hidden = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    want = reference.beams(hidden, 17, embed, 3, 3)
    assert apple.beam_search(hidden, 17, embed, 3, 3).tolist() == want
    assert converted.beam_search(hidden, 17, embed, 3, 3).tolist() == want


def test_drafters_that_do_not_fit_are_refused(tmp_path, tiny_engine):
    path = save_apple(tmp_path / "d", AppleDrafter(2 * HIDDEN, 1), 2 * HIDDEN, 1)
    with pytest.raises(ReDrafterConfigError, match="the target has hidden_size 32 and vocab_size 128"):
        load_drafter(path, hidden_size=32, vocab_size=VOCAB)
    with pytest.raises(ExecutorConfigError, match=r"redrafter_model_path: '.*/redrafter' has no config.json"):
        Executor(tiny_engine, ExecutorConfig(speculative=SpeculativeConfig("explicit_draft_tokens")))
    with pytest.raises(ExecutorConfigError, match="redrafter_num_beams x redrafter_draft_len_per_beam = 9 x 8 drafts; "
                                                  "a tree holds at most 64"):
        Executor(tiny_engine, ExecutorConfig(speculative=SpeculativeConfig(
            "redrafter", redrafter_model_path=path, redrafter_num_beams=9, redrafter_draft_len_per_beam=8)))


@pytest.fixture(scope="module")
def plain_refs(tiny_hf) -> list[list[int]]:
    return [tiny_hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]


def test_executor_redrafter_greedy_ids_equal_transformers(tmp_path, tiny_engine, plain_refs):
    """3 greedy requests and 1 sampled one in one batch on random drafter weights (beams 3 x 3);
    then the drafter's beam search is swapped for one whose second beam is the true continuation:
    deep paths are accepted and the ids stay transformers'."""
    path = save_trtllm(tmp_path / "trt", AppleDrafter(96, 1), 96, 1, 3, 3)
    spec = SpeculativeConfig("redrafter", redrafter_model_path=path)
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, speculative=spec)) as executor:
        assert spec.max_draft_len == 9  # the checkpoint's 3 beams x 3 drafts
        requests = [Request(p, NEW_TOKENS, output=OutputConfig(return_perf_metrics=True)) for p in PROMPTS]
        sampled = Request(PROMPTS[0], NEW_TOKENS, sampling=SamplingConfig(top_k=5, temperature=0.8, seed=3))
        got = collect(executor, executor.enqueue_requests(requests + [sampled]), timeout=300)
        results = [got[i] for i in sorted(got)]
        assert [final_tokens(r) for r in results[:3]] == plain_refs
        assert len(final_tokens(results[3])) == NEW_TOKENS
        assert all(r[-1].result.perf.total_draft_tokens > 0 for r in results[:3])
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks

        truth = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
        drafter, beam_search = executor.proposer.drafter, executor.proposer.drafter.beam_search
        seqs = {}

        def oracle_beams(hidden, root, embed, width, length):
            beams = beam_search(hidden, root, embed, width, length).clone()
            seq = seqs["current"]
            ref = truth[tuple(seq.token_ids[:seq.num_prompt_tokens])] + [0] * 8
            beams[1, 1:] = torch.tensor(ref[seq.num_generated_tokens:seq.num_generated_tokens + length])
            return beams

        propose = executor.proposer.propose

        def propose_each(batch, max_draft_len):
            out = []
            for seq in batch:
                seqs["current"] = seq
                out += propose([seq], max_draft_len)
            return out

        drafter.beam_search, executor.proposer.propose = oracle_beams, propose_each
        got = collect(executor, executor.enqueue_requests(
            [Request(p, NEW_TOKENS, output=OutputConfig(return_perf_metrics=True)) for p in PROMPTS]), timeout=300)
        results = [got[i] for i in sorted(got)]
        assert [final_tokens(r) for r in results] == plain_refs
        assert all(r[-1].result.perf.total_accepted_draft_tokens >= 6 for r in results)
        executor.blocks.check_invariants()
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks
