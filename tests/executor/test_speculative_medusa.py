"""Medusa heads (engine/executor/speculative/medusa.py) in FasterDecoding's medusa_lm_head format,
made here on random weights: they load, draft a medusa_choices tree, and greedy ids through tree
verification equal transformers' greedy decoding; sampled requests verify trees by typical acceptance.
Heads that do not fit the target are refused by name.
"""
from __future__ import annotations

import json
import random

import pytest
from executor_testing import collect, final_tokens
import torch
from safetensors.torch import save_file

from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig
from engine.executor.request import OutputConfig, Request, SamplingConfig
from engine.executor.runner import ModelRunner
from engine.executor.speculative.medusa import MedusaConfigError, MedusaProposer, load_medusa_heads, propose_tree
from engine.executor.speculative.tree import shape_from_choices
from engine.executor.speculative import verify as verify_module
from engine.executor.speculative.tree_step import TreeDecoder
from engine.executor.speculative.typical import accept_typical_tree, typical_thresholds

HIDDEN, VOCAB, NEW_TOKENS = 64, 128, 12
CHOICES = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [2, 0], [0, 0, 1], [0, 1, 0], [1, 1]]


class ResBlock(torch.nn.Module):
    """FasterDecoding's: x + SiLU(linear(x))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_lm_head(num_heads: int, num_layers: int, hidden: int = HIDDEN, vocab: int = VOCAB) -> torch.nn.ModuleList:
    torch.manual_seed(1)
    heads = torch.nn.ModuleList(torch.nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                                                    torch.nn.Linear(hidden, vocab, bias=False))
                                for _ in range(num_heads))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return heads


def save_heads(directory, heads: torch.nn.ModuleList, num_layers: int, fmt: str = "safetensors") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": len(heads), "medusa_num_layers": num_layers,
                                                       "base_model_name_or_path": "tiny"}))
    state = {k: v.contiguous() for k, v in heads.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, str(directory / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, directory / "medusa_lm_head.pt")
    return str(directory)


def save_trtllm_heads(directory, heads: torch.nn.ModuleList, num_layers: int, choices=None) -> str:
    """TensorRT-LLM's converted layout: config.json (num_medusa_heads, num_medusa_layers, max_draft_len,
    mapping) and the heads' tensors split along dim 0 over 2 rank files beside the target's."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architecture": "MedusaForCausalLM", "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_medusa_heads": len(heads),
        "num_medusa_layers": num_layers, "max_draft_len": 63, "mapping": {"world_size": 2, "tp_size": 2},
        **({"medusa_choices": choices} if choices else {})}))
    for rank in range(2):
        state = {"transformer.vocab_embedding.weight": torch.zeros(4, 4)}  # the target's tensors are not read
        for k, head in enumerate(heads):
            for j in range(num_layers):
                for part in ("weight", "bias"):
                    full = getattr(head[j].linear, part).detach()
                    state[f"medusa_heads.{k}.medusa_layers.{j}.linear.{part}"] = full.chunk(2)[rank].contiguous()
            state[f"medusa_heads.{k}.lm_head.weight"] = head[num_layers].weight.detach().chunk(2)[rank].contiguous()
        save_file(state, str(directory / f"rank{rank}.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def decoder(tiny_engine) -> TreeDecoder:
    return TreeDecoder(ModelRunner(tiny_engine), num_blocks=64)


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "trtllm"])
def test_heads_load_as_published(tmp_path, fmt):
    reference = medusa_lm_head(3, 2)
    path = save_trtllm_heads(tmp_path, reference, 2) if fmt == "trtllm" else save_heads(tmp_path / fmt, reference, 2, fmt)
    heads = load_medusa_heads(path, hidden_size=HIDDEN, vocab_size=VOCAB)
    hidden = torch.randn(HIDDEN)
    with torch.no_grad():
        want = torch.stack([head(hidden) for head in reference])
    torch.testing.assert_close(heads(hidden), want, rtol=1e-5, atol=1e-5)


def test_tree_from_head_ranks():
    shape = shape_from_choices([[0], [1], [0, 0], [0, 1]])  # nodes: root, (0), (1), (0,0), (0,1)
    logits = torch.tensor([[0.0, 5, 3, 1], [9, 0, 0, 8]])  # head 0 ranks 1, 2, 3, 0; head 1 ranks 0, 3, ...
    assert propose_tree(logits, shape, 2) == ([-1, -1, 0, 0], [1, 2, 0, 3])


def test_heads_that_do_not_fit_are_refused(tmp_path):
    path = save_heads(tmp_path / "narrow", medusa_lm_head(2, 1, hidden=32), 1)
    with pytest.raises(MedusaConfigError, match="the target has vocab_size 128 and hidden_size 64"):
        load_medusa_heads(path, hidden_size=HIDDEN, vocab_size=VOCAB)
    path = save_heads(tmp_path / "vocab", medusa_lm_head(2, 1, vocab=100), 1)
    with pytest.raises(MedusaConfigError, match="target has vocab_size 128"):
        load_medusa_heads(path, hidden_size=HIDDEN, vocab_size=VOCAB)
    heads = load_medusa_heads(save_heads(tmp_path / "two", medusa_lm_head(2, 1), 1), hidden_size=HIDDEN,
                              vocab_size=VOCAB)
    with pytest.raises(MedusaConfigError, match="medusa_choices: paths 3 deep need as many heads; the checkpoint has 2"):
        MedusaProposer(heads, CHOICES)
    with pytest.raises(MedusaConfigError, match="has no config.json"):
        load_medusa_heads(str(tmp_path), hidden_size=HIDDEN, vocab_size=VOCAB)


# ----- decoding_mode medusa in the in-flight executor -----

class OracleTrees:
    """A proposer of trees holding the true continuation (and random siblings), so that the
    executor's tree steps accept deep paths and move their KV: the same hooks as Medusa's."""

    def __init__(self, refs: dict[tuple, list[int]], prompt_lens: dict[int, tuple]):
        self.refs, self.rng = refs, random.Random(0)

    def observe(self, hidden_rows, last_rows):
        pass

    def propose(self, seqs, max_draft_len):
        out = []
        for seq in seqs:
            ref = self.refs[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            truth = ref[seq.num_generated_tokens:] + [0] * 8
            parents, drafts = [-1, 0, -1, 1, 1, 3], [truth[0], truth[1], self.rng.randrange(128),
                                                    self.rng.randrange(128), truth[2], truth[3]]
            room = min(max_draft_len, seq.max_total_tokens - len(seq.token_ids) - 1)
            seq.draft_parents = parents[:room]
            out.append(drafts[:room])
        return out

    def release(self, seq):
        pass


EXEC_PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [100, 7, 7, 7, 120, 33, 9], [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def plain_refs(tiny_hf) -> list[list[int]]:
    return [tiny_hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in EXEC_PROMPTS]


def test_executor_medusa_greedy_ids_equal_transformers(tmp_path, tiny_engine, plain_refs):
    """Greedy requests verify Medusa trees, a sampled one verifies head chains, all in one batch."""
    path = save_heads(tmp_path / "heads", medusa_lm_head(3, 1), 1)
    spec = SpeculativeConfig("medusa", max_draft_len=8, medusa_model_path=path, medusa_choices="{0}, {1}, {0, 0}, {0, 0, 0}")
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, speculative=spec)) as executor:
        requests = [Request(p, NEW_TOKENS, output=OutputConfig(return_perf_metrics=True)) for p in EXEC_PROMPTS]
        sampled = Request(EXEC_PROMPTS[0], NEW_TOKENS, sampling=SamplingConfig(top_k=5, temperature=0.8, seed=3))
        got = collect(executor, executor.enqueue_requests(requests + [sampled]), timeout=300)
        results = [got[i] for i in sorted(got)]
        assert [final_tokens(r) for r in results[:3]] == plain_refs
        assert len(final_tokens(results[3])) == NEW_TOKENS
        assert results[0][-1].result.perf.total_draft_tokens > 0
        executor.blocks.check_invariants()
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks


def test_executor_runs_tensorrt_llm_medusa_checkpoints(tmp_path, tiny_engine, plain_refs):
    """A TensorRT-LLM converted checkpoint (2 rank files) with medusa_choices in its config.json."""
    path = save_trtllm_heads(tmp_path / "trt", medusa_lm_head(2, 1), 1, choices=[[0], [1], [0, 0], [1, 0]])
    spec = SpeculativeConfig("medusa", max_draft_len=4, medusa_model_path=path)
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, speculative=spec)) as executor:
        assert executor.proposer.tree.shape.num_nodes == 5  # the config's tree
        requests = [Request(p, NEW_TOKENS, output=OutputConfig(return_perf_metrics=True)) for p in EXEC_PROMPTS]
        got = collect(executor, executor.enqueue_requests(requests), timeout=300)
        assert [final_tokens(got[i]) for i in sorted(got)] == plain_refs
        assert all(got[i][-1].result.perf.total_draft_tokens > 0 for i in got)
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks


def test_executor_tree_steps_accept_deep_paths_and_move_their_kv(tmp_path, tiny_engine, plain_refs):
    path = save_heads(tmp_path / "heads", medusa_lm_head(3, 1), 1)
    spec = SpeculativeConfig("medusa", max_draft_len=6, medusa_model_path=path)
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, speculative=spec)) as executor:
        executor.proposer = OracleTrees({tuple(p): r for p, r in zip(EXEC_PROMPTS, plain_refs)}, {})
        requests = [Request(p, NEW_TOKENS, output=OutputConfig(return_perf_metrics=True)) for p in EXEC_PROMPTS]
        got = collect(executor, executor.enqueue_requests(requests), timeout=300)
        results = [got[i] for i in sorted(got)]
        assert [final_tokens(r) for r in results] == plain_refs
        # A full tree's step keeps the true path (root -> 0 -> 1 -> 4 -> 5): 4 of its 6 drafts; steps
        # near max_tokens get fewer nodes (the room left). The counts are the same for every prompt.
        assert [(r[-1].result.perf.total_draft_tokens, r[-1].result.perf.total_accepted_draft_tokens)
                for r in results] == [(14, 8)] * 3
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks


def test_executor_refuses_medusa_without_heads(tiny_engine, tmp_path):
    with pytest.raises(ExecutorConfigError, match=r"medusa_model_path: '.*/medusa' has no config.json"):
        Executor(tiny_engine, ExecutorConfig(speculative=SpeculativeConfig("medusa")))
    path = save_heads(tmp_path / "heads", medusa_lm_head(2, 1), 1)
    with pytest.raises(ExecutorConfigError, match="Invalid format for medusa_choices"):
        Executor(tiny_engine, ExecutorConfig(speculative=SpeculativeConfig("medusa", medusa_model_path=path,
                                                                           medusa_choices="{0}, {0")))


@pytest.mark.parametrize("options", [
    dict(enable_chunked_context=True, max_num_tokens=8, max_batch_size=4),
    dict(batch_scheduler_policy="max_utilization", max_tokens_in_paged_kv_cache=48),  # tree steps preempt
], ids=["chunked_prompt", "preemption"])
def test_executor_tree_steps_with_chunked_prompts_and_preemption(tmp_path, tiny_engine, plain_refs, options):
    spec = SpeculativeConfig("medusa", max_draft_len=6, medusa_model_path=save_heads(tmp_path / "h", medusa_lm_head(3, 1), 1))
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, speculative=spec, **options)) as executor:
        executor.proposer = OracleTrees({tuple(p): r for p, r in zip(EXEC_PROMPTS, plain_refs)}, {})
        got = collect(executor, executor.enqueue_requests([Request(p, NEW_TOKENS) for p in EXEC_PROMPTS]), timeout=300)
        assert [final_tokens(got[i]) for i in sorted(got)] == plain_refs
        executor.blocks.check_invariants()
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks
        if "batch_scheduler_policy" in options:
            assert executor.scheduler.num_preemptions > 0


# ----- sampled requests: Medusa's typical acceptance over the tree (speculative/typical.py) -----

def test_typical_acceptance_rule():
    """Root -> a (0.6) -> c, root -> b (0.05): a clears min(0.09, 0.3 e^-H), b does not; c is judged at a."""
    probs = torch.tensor([[0.6, 0.05, 0.35, 0.0], [0.0, 0.0, 0.5, 0.5], [1.0, 0, 0, 0], [0.25] * 4])
    assert torch.allclose(typical_thresholds(probs), torch.tensor([0.09, 0.09, 0.09, 0.075]), atol=1e-4)  # 0.3 e^-ln4 = 0.075
    parents, tokens = [-1, 0, 0, 1], [-1, 0, 1, 2]
    path, emitted = accept_typical_tree(parents, tokens, probs, torch.Generator().manual_seed(0))
    assert path == [0, 1, 3] and emitted[:2] == [0, 2] and emitted[2] in (0, 1, 2, 3)
    # c below a is rejected when a's law gives it too little (0.03 < 0.09); the bonus is drawn at a
    probs[1] = torch.tensor([0.0, 0.97, 0.03, 0.0])
    path, emitted = accept_typical_tree(parents, tokens, probs, torch.Generator().manual_seed(0))
    assert path == [0, 1] and emitted[0] == 0 and emitted[1] in (1, 2)


class Recorded:
    """Wraps verify.accept_typical_tree: every tree it judged, for checks on the emitted tokens."""

    def __init__(self):
        self.calls = []

    def __call__(self, parents, tokens, probs, generator):
        path, emitted = accept_typical_tree(parents, tokens, probs, generator)
        self.calls.append((probs, path, emitted))
        return path, emitted


@pytest.mark.parametrize("temperature", [1e-4, 1.0], ids=["temperature_to_0", "sampled"])
def test_executor_sampled_requests_verify_trees_typically(tmp_path, tiny_engine, plain_refs, temperature, monkeypatch):
    """Sampled requests verify the oracle trees (true greedy path + random siblings). As the
    temperature goes to 0 typical acceptance is greedy acceptance: plain greedy ids, deep paths.
    At temperature 1: seeded, reproducible, every emitted token has p > 0 under the target's
    top-k law, accepted lengths within the tree's depth; no block held afterwards."""
    recorded = Recorded()
    monkeypatch.setattr(verify_module, "accept_typical_tree", recorded)
    spec = SpeculativeConfig("medusa", max_draft_len=6, medusa_model_path=save_heads(tmp_path / "h", medusa_lm_head(3, 1), 1))
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, speculative=spec)) as executor:
        executor.proposer = OracleTrees({tuple(p): r for p, r in zip(EXEC_PROMPTS, plain_refs)}, {})
        sampling = SamplingConfig(top_k=8, temperature=temperature, seed=11)
        requests = [Request(p, NEW_TOKENS, sampling=sampling, output=OutputConfig(return_perf_metrics=True))
                    for p in EXEC_PROMPTS]
        got = collect(executor, executor.enqueue_requests(requests), timeout=300)
        results = [got[i] for i in sorted(got)]
        perf = [(r[-1].result.perf.total_draft_tokens, r[-1].result.perf.total_accepted_draft_tokens) for r in results]
        executor.blocks.check_invariants()
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks
    assert recorded.calls
    for probs, path, emitted in recorded.calls:
        assert all(float(probs[node, token]) > 0 for node, token in zip(path, emitted))
        assert len(path) <= 4  # the oracle tree is 3 drafts deep
    if temperature < 1:
        assert [final_tokens(r) for r in results] == plain_refs
        assert perf == [(14, 8)] * 3  # as greedy tree verification accepts
    else:
        assert all(len(final_tokens(r)) == NEW_TOKENS for r in results)
        assert all(0 <= accepted <= drafted and drafted > 0 for drafted, accepted in perf)
        assert sum(accepted for _, accepted in perf) > 0  # the true greedy path is likely enough to pass sometimes
