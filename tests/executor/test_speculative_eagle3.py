"""EAGLE-3 heads (engine/executor/speculative/eagle3.py) in the published checkpoint layout, made here
on random weights: they load, draft a tree from the target's low/mid/high layer streams, and
greedy ids through tree verification (TreeDecoder and decoding_mode eagle in the executor, static
and dynamic trees, the draft layer's KV cache: eagle3_drafter.py) equal transformers' greedy
decoding; on CUDA (gpu mark) the same through the executor's CUDA graphs, whose replays keep the
tapped layers' streams (engine/executor/layer_taps.py) and verify trees (prefill_graphs.py)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.speculative.tree_runs import force_acceptance
from engine.executor.runner import ModelRunner
from engine.executor.speculative.eagle3 import Eagle3ConfigError, Eagle3TreeProposer, draft_tree, load_eagle3
from engine.executor.speculative.eagle3_drafter import DraftCache, StaticPlan, draft_dynamic, draft_static
from engine.executor.speculative.eagle3_graphs import StaticDraftGraphs
from engine.executor.speculative.tree import shape_from_choices
from engine.executor.speculative.tree_step import TreeDecoder

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 128, 32
CHOICES = "{0}, {1}, {0, 0}, {0, 1}, {0, 0, 0}"


def save_eagle3(directory, hidden: int = HIDDEN, seed: int = 0, layers: list[int] | None = None) -> str:
    """Random weights under the EAGLE-3 authors' key names; draft vocab = every 4th target id (d2t)."""
    if os.path.isdir(directory):
        return str(directory)
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    heads, kv, head_dim, inter = 4, 2, 16, 128
    state = {"fc.weight": r(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
             "midlayer.hidden_norm.weight": torch.ones(hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
             "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
             "midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
             "midlayer.self_attn.k_proj.weight": r(kv * head_dim, 2 * hidden),
             "midlayer.self_attn.v_proj.weight": r(kv * head_dim, 2 * hidden),
             "midlayer.self_attn.o_proj.weight": r(hidden, heads * head_dim),
             "midlayer.mlp.gate_proj.weight": r(inter, hidden), "midlayer.mlp.up_proj.weight": r(inter, hidden),
             "midlayer.mlp.down_proj.weight": r(hidden, inter), "lm_head.weight": r(DRAFT_VOCAB, HIDDEN),
             "d2t": torch.arange(DRAFT_VOCAB) * 3,  # draft id i -> target id 4i
             "t2d": torch.arange(VOCAB) % 4 == 0}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "num_hidden_layers": 1,
        **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}} if layers else {})}))
    save_file(state, str(directory / "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def runner(tiny_engine) -> ModelRunner:
    return ModelRunner(tiny_engine)


def test_greedy_ids_through_eagle3_trees_equal_transformers(tmp_path, runner, tiny_hf):
    head, layers = load_eagle3(save_eagle3(tmp_path / "eagle3"), hidden_size=HIDDEN, vocab_size=VOCAB,
                               num_layers=len(runner.model.layers))
    assert layers == [1, 0, 0]  # the default [1, L/2 - 1, L - 4] clamped to the 2-layer target
    proposer = Eagle3TreeProposer(runner, head, layers, choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    decoder = TreeDecoder(runner, num_blocks=64)
    try:
        for prompt in ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3],):
            want = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
            proposer._previous = None  # a new sequence
            got, stats = decoder.generate(prompt, 12, proposer)
            assert got == want
            assert stats.tree_sizes and set(stats.tree_sizes) <= {5, 4, 2, 1}
            assert all(t % 4 == 0 for t in proposer._previous[2][1:])  # drafts are d2t-mapped target ids
        assert decoder.blocks.num_free_blocks == decoder.blocks.num_blocks
    finally:
        proposer.close()


class OracleHead:
    """The loaded head, but ranking the true next token first: deep paths get accepted, so the
    proposer's bookkeeping of accepted rows (and their target features) is exercised."""

    def __init__(self, head, full: list[int]):
        self.head, self.full = head, full

    def features(self, *streams):
        return self.head.features(*streams)

    def forward(self, embeds, g):
        h, ranked = self.head.forward(embeds, g)
        true = self.full[embeds.shape[0] + 1]  # row r embeds x_{r+1} and guesses x_{r+2}
        return h, torch.cat([torch.tensor([true]), ranked[ranked != true]])


def test_accepted_paths_keep_the_targets_features_in_order(tmp_path, runner, tiny_hf):
    """With drafts accepted several deep, the features the proposer keeps for every computed token
    equal fc([h0; h0; h0]) of transformers' stream after layer 0 over the same tokens."""
    head, layers = load_eagle3(save_eagle3(tmp_path / "eagle3", layers=[0, 0, 0]), hidden_size=HIDDEN,
                               vocab_size=VOCAB, num_layers=len(runner.model.layers))
    prompt = [5, 9, 13, 2, 7]
    full = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0].tolist()
    proposer = Eagle3TreeProposer(runner, OracleHead(head, full + [0] * 8), layers,
                                  choices=[[0], [1], [0, 0], [0, 0, 0]])
    try:
        got, stats = TreeDecoder(runner, num_blocks=64).generate(prompt, 16, proposer)  # (the runner's pool)
    finally:
        proposer.close()
    assert got == full[len(prompt):len(prompt) + 16]
    assert max(stats.accepted) == 3 and stats.steps < 8
    with torch.no_grad():
        stream = tiny_hf(torch.tensor([full[:len(proposer._g)]]), output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(proposer._g, head.features(stream, stream, stream), rtol=1e-4, atol=1e-4)


def test_checkpoints_that_do_not_fit_are_refused_by_name(tmp_path):
    path = save_eagle3(tmp_path / "wide", hidden=32)
    with pytest.raises(Eagle3ConfigError, match="hidden_size 32 does not match the target's 64"):
        load_eagle3(path, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=2)
    with pytest.raises(Eagle3ConfigError, match="expected config.json and model.safetensors"):
        load_eagle3(str(tmp_path), hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=2)
    with pytest.raises(Eagle3ConfigError, match=r"eagle_aux_hidden_state_layer_ids must be 3 layer indices in 0\.\.1"):
        load_eagle3(save_eagle3(tmp_path / "deep", layers=[0, 1, 5]), hidden_size=HIDDEN, vocab_size=VOCAB,
                    num_layers=2)  # (was clamped to layer 1 silently)
    path = save_eagle3(tmp_path / "partial")  # a weight missing: named (was a bare KeyError)
    state = load_file(os.path.join(path, "model.safetensors"))
    del state["midlayer.mlp.up_proj.weight"]
    save_file(state, os.path.join(path, "model.safetensors"))
    with pytest.raises(Eagle3ConfigError, match="lacks model.safetensors midlayer.mlp.up_proj.weight"):
        load_eagle3(path, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=2)


def test_cached_drafter_equals_the_whole_sequence_reference(tmp_path, runner, tiny_hf):
    """The draft layer's KV cache (committed rows + tree rows with ancestor masks) drafts the same
    static tree as the reference that recomputes the layer over whole sequences; the dynamic tree's
    nodes are each among the top-K of the reference's ranking after their parent's path, and score
    order keeps it a tree."""
    head, layers = load_eagle3(save_eagle3(tmp_path / "eagle3", layers=[0, 1, 1]), hidden_size=HIDDEN,
                               vocab_size=VOCAB, num_layers=len(runner.model.layers))
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    with torch.no_grad():
        states = tiny_hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    g = head.features(states[1][0], states[2][0], states[2][0])[:-1]  # every token but the root
    embed = runner.model.embed_tokens
    shape = shape_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]], field="eagle_choices")
    cache = DraftCache(0, head, torch.device("cpu"))
    cache.add_features(g[:5])
    cache.commit(head, tokens, embed)  # in two commits, as steps would
    cache.add_features(g[5:])
    cache.commit(head, tokens, embed)
    assert cache.length == len(tokens) - 1 and cache.end == len(tokens) - 1
    with torch.no_grad():
        want = draft_tree(head, shape, g, tokens, embed)
        plan = StaticPlan(shape, torch.device("cpu"))
        assert draft_static(head, cache, plan, embed) == want
        full = cache.k[:cache.length + 2].clone()  # a tree's scratch rows survive the buffer's growth
        cache.k, cache.v = full.clone(), cache.v[:cache.length + 2].clone()
        cache.reserve(cache.length + 3)
        assert cache.k.shape[0] > full.shape[0] and torch.equal(cache.k[:full.shape[0]], full)
        # tree rows: [0] and [1] (depth 1) see themselves only, [0, 0] (depth 2) sees [0] and itself
        assert [level["seen"].tolist() if level["seen"] is not None else None for level in plan.levels] == [
            [[True, False], [False, True]], [[True, False, True]], None]
        # the tree rows' outputs themselves: the root's, then two nodes of depth 1 and one of depth 2
        h0, law = cache.root(head)
        h1 = cache.tree_rows(head, embed, torch.tensor([8, 12]), h0.expand(2, -1), 1, 0, torch.eye(2, dtype=torch.bool))
        h2 = cache.tree_rows(head, embed, torch.tensor([20]), h1[:1], 2, 2, torch.tensor([[True, False, True]]))
        laws = [law[0], *torch.log_softmax(head.logits(torch.cat([h1, h2])), -1)]
        for law, path in zip(laws, ([], [8], [12], [8, 20])):
            ids = torch.tensor(tokens[1:] + path)
            h, _ = head.forward(embed(ids), _path_features(head, g, tokens, path, embed))
            torch.testing.assert_close(law, torch.log_softmax(head.logits(h[-1:])[0], -1), rtol=1e-4, atol=1e-4)
        parents, drafted = draft_dynamic(head, cache, embed, depth=3, top_k=3, num_nodes=10)
    assert len(parents) == 10 and all(p < i for i, p in enumerate(parents))
    for i, (parent, token) in enumerate(zip(parents, drafted)):
        path, node = [], parent
        while node >= 0:
            path.insert(0, drafted[node])
            node = parents[node]
        ids = torch.tensor(tokens[1:] + path)
        with torch.no_grad():
            _, ranked = head.forward(embed(ids), _path_features(head, g, tokens, path, embed))
        assert token in ranked[:3].tolist(), (i, token)


# Where the windows' tests run: the CPU's torch references; the CUDA path's Triton kernels (norms,
# rotary, SiLU-and-mul, top-k) in Triton's CPU interpreter (TRITON_INTERPRET=1, as tests/kernels run them);
# CUDA (gpu mark), recording the windows.
WINDOW_DEVICES = ["cpu", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (Triton's CPU interpreter)")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs CUDA")])]


def window_device(device: str, monkeypatch) -> torch.device:
    """The torch device of a WINDOW_DEVICES entry; "triton": the CPU, every kernel the head calls
    dispatching to its Triton kernel (interpreted) as on CUDA."""
    if device == "triton":
        import kernels.activation
        import kernels.draft_topk
        import kernels.rmsnorm
        import kernels.rotary

        for module in (kernels.activation, kernels.draft_topk, kernels.rmsnorm, kernels.rotary):
            monkeypatch.setattr(module, "use_triton", lambda t: True)
        return torch.device("cpu")
    return torch.device(device)


def window_parts(tmp_path, runner, device: str, monkeypatch):
    """(device, head, plan, embed) of the window tests: a saved-and-loaded head on the WINDOW_DEVICES entry's
    device, the 7-node tree that expands two nodes at depth 1, and the target's embedding there."""
    import copy

    dev = window_device(device, monkeypatch)
    head, _ = load_eagle3(save_eagle3(tmp_path / "eagle3", layers=[0, 1, 1]), hidden_size=HIDDEN,
                          vocab_size=VOCAB, num_layers=len(runner.model.layers), device=dev)
    plan = StaticPlan(shape_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]],
                                         field="eagle_choices"), dev)
    embed = runner.model.embed_tokens if dev.type == "cpu" else copy.deepcopy(runner.model.embed_tokens).to(dev)
    return dev, head, plan, embed


@pytest.mark.parametrize("device", WINDOW_DEVICES)
def test_window_drafts_equal_draft_static(tmp_path, runner, tiny_hf, monkeypatch, device):
    """eagle3_graphs.py's windows (the body the CUDA graphs record; eager on the CPU) commit the
    pending rows and draft draft_static's tokens: as a cache grows (only new rows copied; after a
    prompt the rows beyond the window's pending rows committed eagerly first), across a capacity
    bucket (64 -> 128 rows), and for a second cache (a restart at token 5) taking over the same
    windows. The tree expands two nodes at depth 1: one position for both rows (on CUDA the rotary
    kernel read a broadcast view's second position past its storage: garbage drafts)."""
    dev, head, plan, embed = window_parts(tmp_path, runner, device, monkeypatch)
    graphs = StaticDraftGraphs(head, plan, embed, max_positions=128, device=dev, use_graphs=True)
    check_windows(head, embed, tiny_hf, graphs, plan)
    assert sorted(graphs.windows) == [64, 128]
    assert graphs.replays == (0 if dev.type == "cpu" else 2 * 5)  # (on CUDA every run replays a recording)


def check_windows(head, embed, tiny_hf, graphs, plan) -> None:
    """Two caches fed the same features: one through graphs.run, one through commit + draft_static."""
    device = head.d2t.device
    tokens = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        states = tiny_hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        feats = head.features(*(s[0].to(device) for s in (states[1], states[2], states[2])))[:-1]  # token t's
    for start in (0, 5):
        windowed, eager, done = DraftCache(start, head, device), DraftCache(start, head, device), start
        for end in (start + 20, start + 21, 63, 70, 79):
            for cache in (windowed, eager):
                cache.add_features(feats[done:end])
            done = end
            assert graphs.fits(windowed)
            with torch.no_grad():
                got = graphs.run(windowed, tokens).tolist()
                eager.commit(head, tokens, embed)
                assert got == draft_static(head, eager, plan, embed)[1], (start, end)
            assert windowed.length == eager.length == end - start and not windowed.pending.shape[0]
            torch.testing.assert_close(windowed.k[:windowed.length], eager.k[:eager.length], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(windowed.last_q, eager.last_q, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", WINDOW_DEVICES)
def test_batched_windows_draft_what_one_sequence_windows_draft(tmp_path, runner, tiny_hf, monkeypatch, device):
    """eagle3_graphs.py's batched windows (one replay for a step's sequences) draft, commit and keep
    the rows one-sequence windows do: sequences of different lengths in one bucket (the length masks),
    a sequence leaving and coming back (it keeps its slot: only new rows copied; a slot left padding
    in a step recopies), windows of 2 and 4 slots over the shared rows (a switch recopies), a bucket
    change (64 -> 128 rows), and a batch split in groups of one window when the shared rows hold fewer
    slots of the bucket (each group's tokens its own). On CUDA the batched windows replay their
    recordings (made on first use) against eager one-sequence windows (the CUDA run of 2026-11-29
    failed here at step 1: the one-sequence side's second depth-1 row rotated at a garbage position,
    kernels/rotary.py; the CPU's reference gap between the right token and the next is 0.38)."""
    import engine.executor.speculative.eagle3_graphs as eagle3_graphs

    dev, head, plan, embed = window_parts(tmp_path, runner, device, monkeypatch)
    make = lambda graphs: StaticDraftGraphs(head, plan, embed, max_positions=128, device=dev,  # noqa: E731
                                            use_graphs=graphs)
    batched, single = make(True), make(False)  # (the CPU never records: both eager there)
    close = dict(rtol=1e-5, atol=1e-5) if dev.type == "cpu" else dict(rtol=1e-4, atol=1e-4)
    tokens = torch.randint(0, VOCAB, (4, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = tiny_hf(tokens, output_hidden_states=True).hidden_states
        feats = head.features(*(s.to(dev) for s in (states[1], states[2], states[2])))[:, :-1]  # (4, 79, H)
    tokens, starts = tokens.tolist(), (0, 5, 0, 3)
    caches = [[DraftCache(s, head, dev) for s in starts] for _ in range(2)]  # [batched, single][sequence]
    done = list(starts)
    # (sequences in the step's order, each one's features up to; 0: not in the step): lengths differ in a bucket
    # (sequence 3 sits out step 1 in the 4-slot window, its slot drafting padding, and comes back in step 2)
    steps = [([0, 1, 2, 3], (20, 30, 10, 8)), ([0, 1, 2], (21, 33, 12, 0)), ([0, 1, 2, 3], (22, 34, 13, 12)),
             ([2, 0], (25, 0, 14, 0)), ([1, 0, 2], (44, 41, 15, 0)), ([0, 1], (70, 50, 0, 0)),
             ([2, 1, 0, 3], (72, 52, 20, 40))]
    for i, (order, ends) in enumerate(steps):
        if i == len(steps) - 1:  # the shared rows hold 2 slots of 128 rows: two groups replaying one window
            monkeypatch.setattr(eagle3_graphs, "BATCH_ROWS", 2 * (128 + plan.num_expanded - 1))
        for j in order:
            for side in caches:
                side[j].add_features(feats[j, done[j]:ends[j]])
            done[j] = ends[j]
        with torch.no_grad():
            got = batched.run_batch([caches[0][j] for j in order], [tokens[j] for j in order]).tolist()
            want = [single.run(caches[1][j], tokens[j]).tolist() for j in order]
        assert got == want, i
        for j in order:
            a, b = caches[0][j], caches[1][j]
            assert a.length == b.length == done[j] - starts[j] and not a.pending.shape[0]
            torch.testing.assert_close(a.k[:a.length], b.k[:b.length], **close)
            torch.testing.assert_close(a.v[:a.length], b.v[:b.length], **close)
            torch.testing.assert_close(a.last_q, b.last_q, **close)
    assert {(2, 64), (4, 64), (2, 128)} <= set(batched.batch_windows)
    assert batched.replays == (0 if dev.type == "cpu" else len(steps) + 1)  # (+1: the last step's two groups)


def _path_features(head, g, tokens, path, embed):
    """g extended along ``path`` with the draft's own outputs (EAGLE's training-time test)."""
    feats = g
    with torch.no_grad():
        for depth in range(len(path)):
            ids = torch.tensor(tokens[1:] + path[:depth])
            h, _ = head.forward(embed(ids), feats)
            feats = torch.cat([feats, h[-1:]])
    return feats


def test_executor_decoding_mode_eagle_greedy_ids_equal_transformers(tmp_path, tiny_engine, tiny_hf):
    """decoding_mode eagle in the in-flight executor, static and dynamic trees: 3 greedy requests and
    a sampled one in one batch (trees verified by argmax / multi-draft rejection): greedy ids equal
    transformers, all blocks back. Then one request with forced paths: accepted deep, and the draft
    cache's committed keys equal the head's keys over transformers' layer-0 stream. Cancels mid-tree
    free the draft caches. Heads of the wrong size are refused at start by name."""
    run_eagle_executor(tmp_path, tiny_engine, tiny_hf, device="cpu")
    from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig

    wrong = SpeculativeConfig("eagle", eagle_model_path=save_eagle3(tmp_path / "wide", hidden=32))
    with pytest.raises(ExecutorConfigError, match="hidden_size 32 does not match the target's 64"):
        Executor(tiny_engine, ExecutorConfig(speculative=wrong))
    with pytest.raises(ExecutorConfigError, match="eagle_dynamic_top_k must be an integer in 1..64"):
        Executor(tiny_engine, ExecutorConfig(speculative=SpeculativeConfig("eagle", eagle_dynamic_top_k=0)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_executor_decoding_mode_eagle_on_cuda_graphs(tmp_path, tiny_engine, tiny_hf):
    """The same on CUDA: decode, prompt and tree verify steps replay CUDA graphs (tree steps their
    own, with the ancestor mask), and the taps read inside the replays give the same draft keys."""
    replays = run_eagle_executor(tmp_path, tiny_engine, tiny_hf, device="cuda")
    assert replays["tree"] > 0 and replays["decode"] > 0


def run_eagle_executor(tmp_path, tiny_engine, tiny_hf, device: str) -> dict:
    from executor_testing import collect, final_tokens

    from engine.executor.executor import Executor, ExecutorConfig, SpeculativeConfig
    from engine.executor.request import Request, SamplingConfig

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 9, 11], [20, 30, 40, 50, 60, 70]]
    refs = [tiny_hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    path = save_eagle3(tmp_path / "heads", layers=[0, 0, 0])
    replays = {"tree": 0, "decode": 0}
    for dynamic in (False, True):
        spec = SpeculativeConfig("eagle", max_draft_len=8, eagle_model_path=path, eagle_choices=CHOICES,
                                 eagle_dynamic_tree=dynamic, eagle_dynamic_depth=3, eagle_dynamic_top_k=3)
        config = ExecutorConfig(exclude_input_from_output=True, speculative=spec, enable_kv_cache_reuse=False)
        with Executor(tiny_engine, config, device=device) as executor:  # (no prefix hits: caches from position 0)
            runner = executor.runner
            if device == "cuda":
                count_replays(runner, replays)
            requests = [Request(p, 10) for p in prompts]
            requests.append(Request(prompts[0], 10, sampling=SamplingConfig(temperature=0.8, top_k=8, seed=1)))
            ids = executor.enqueue_requests(requests)
            got = collect(executor, ids, timeout=300)
            assert [final_tokens(got[i]) for i in ids[:3]] == refs
            assert len(final_tokens(got[ids[3]])) == 10
            assert executor._num_draft_tokens_total > 0
            executor.blocks.check_invariants()
            assert executor.blocks.num_free_blocks == executor.blocks.num_blocks
            assert not executor.proposer._caches  # every cache freed with its sequence
            if dynamic:
                continue
            proposer = executor.proposer
            # the static tree's drafts stayed on the device until each verify step was launched (the ids
            # above went through their placeholders): draft slots past the sampled-token ring's halves
            slots = proposer.device_drafts.rows * len(proposer.plan.parents)
            assert runner.sampled_tokens.shape[0] == runner.sampled_ring_slots + slots
            # the bench's forcing, two prompts in one batch, each forced to its own continuation
            # (a verify step that read one row's logits for another would leave it)
            full, other = (tiny_hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0].tolist()
                           for p in prompts[1:3])
            truths = {tuple(prompts[1]): full, tuple(prompts[2]): other}
            force_acceptance(proposer, {"truth": truths, "depth": 8}, VOCAB)
            before, released = executor._num_accepted_draft_tokens_total, {}
            proposer.release = lambda seq: released.update(
                {tuple(seq.token_ids[:seq.num_prompt_tokens]): proposer._caches.pop(seq.seq_id)})
            rids = executor.enqueue_requests([Request(prompts[1], 16), Request(prompts[2], 16)])
            got = collect(executor, rids, timeout=300)
            assert [final_tokens(got[i]) for i in rids] == [full[len(prompts[1]):], other[len(prompts[2]):]]
            assert executor._num_accepted_draft_tokens_total - before >= 16
            head = proposer.head
            for prompt, truth in ((prompts[1], full), (prompts[2], other)):  # each row's own features
                cache = released[tuple(prompt)]
                n = cache.length
                assert cache.start == 0 and n >= len(truth) - 6
                with torch.no_grad():
                    stream = tiny_hf(torch.tensor([truth[:n]]), output_hidden_states=True).hidden_states[1][0]
                    g = head.features(*(stream.to(cache.k.device),) * 3)
                    _, k, _ = head.qkv(runner.model.embed_tokens(torch.tensor(truth[1:n + 1], device=cache.k.device)),
                                       g, 0)
                torch.testing.assert_close(cache.k[:n], k, rtol=1e-3, atol=1e-3)
            if device == "cuda":  # static trees replayed their recorded proposal, which drafts the eager tree
                assert proposer.graphs.replays > 0
                check_windows(head, runner.model.embed_tokens, tiny_hf, proposer.graphs, proposer.plan)
            # cancels mid-tree free the draft caches too
            drafted = executor._num_draft_tokens_total
            ids = executor.enqueue_requests([Request(p, 60) for p in prompts])
            deadline = time.monotonic() + 60
            while executor._num_draft_tokens_total == drafted:  # a few tree steps in
                assert time.monotonic() < deadline
                time.sleep(0.002)
            for i in ids:
                executor.cancel_request(i)
            collect(executor, ids, timeout=60)
            executor.blocks.check_invariants()
            assert not proposer._caches and executor.blocks.num_free_blocks == executor.blocks.num_blocks
    return replays


def test_drafts_left_on_the_device_make_the_steps_that_ids_read_at_once_make(tmp_path, tiny_engine, tiny_hf,
                                                                              monkeypatch):
    """$TRITONLLM_DEVICE_DRAFTS (engine/executor/speculative/device_drafts.py): a static tree's drafts
    named by placeholders into draft slots of the sampled-token ring (the forward resolves them on the
    device, the host when it verifies) make the same steps as the ids read at the proposal's end: the
    same tokens, drafts and accepted drafts. The drafting replays run, but every node is then set to
    its depth's true token (random heads' drafts are never accepted), so a placeholder resolved to
    another id on either side would change what is accepted or what follows it. Then the host's
    mirror follows the ring's draft slots from one proposal to the next, and the forward's resolution
    reads the ids the host's does."""
    from executor_testing import collect, final_tokens

    from engine.executor.executor import Executor, ExecutorConfig, SpeculativeConfig
    from engine.executor.overlap import resolve_placeholders
    from engine.executor.request import Request
    from engine.executor.speculative.device_drafts import DEVICE_DRAFTS_ENV

    path = save_eagle3(tmp_path / "heads", layers=[0, 0, 0])
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 9, 11]]
    truths = {p[0]: tiny_hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0].tolist()
              for p in prompts}
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv(DEVICE_DRAFTS_ENV, on)
        spec = SpeculativeConfig("eagle", max_draft_len=8, eagle_model_path=path, eagle_choices=CHOICES)
        config = ExecutorConfig(exclude_input_from_output=True, speculative=spec, enable_kv_cache_reuse=False)
        with Executor(tiny_engine, config, device="cpu") as executor:
            proposer, graphs = executor.proposer, executor.proposer.graphs
            assert (proposer.device_drafts is not None) == (on == "1")
            depths = []
            for parent in proposer.plan.parents:
                depths.append(1 if parent < 0 else depths[parent] + 1)

            def true_drafts(token_lists):  # (sequences, nodes): node i the true token depths[i] after the root
                truth = [truths[tokens[0]] + [0] * len(depths) for tokens in token_lists]
                return torch.tensor([[row[len(tokens) - 1 + d] for d in depths]
                                     for row, tokens in zip(truth, token_lists)])
            run, run_batch = graphs.run, graphs.run_batch
            graphs.run = lambda cache, tokens: (run(cache, tokens), true_drafts([tokens])[0])[1]
            graphs.run_batch = lambda caches, lists: (run_batch(caches, lists), true_drafts(lists))[1]
            verified_placeholders = []  # per drafted sequence of each verify step: did it carry placeholders
            resolve = proposer.resolve_drafts

            def resolve_and_note(ids, resolve=resolve, noted=verified_placeholders):
                noted.append(any(t < 0 for t in ids))
                return resolve(ids)
            proposer.resolve_drafts = resolve_and_note
            ids = executor.enqueue_requests([Request(p, 12) for p in prompts])
            got = collect(executor, ids, timeout=120)
            runs[on] = ([final_tokens(got[i]) for i in ids], executor._num_draft_tokens_total,
                        executor._num_accepted_draft_tokens_total)
            assert set(verified_placeholders) == {on == "1"}  # every verified sequence's drafts, or none
            if on == "1":  # (the executor is idle: nothing drafts meanwhile)
                drafts, ring = proposer.device_drafts, executor.runner.sampled_tokens
                for base in (100, 200):  # the second proposal overwrites the first's slots
                    known = torch.arange(2 * drafts.nodes).reshape(2, drafts.nodes) + base
                    rows = drafts.place(known, [drafts.nodes, 2])
                    assert [drafts.resolve(row) for row in rows] == [known[0].tolist(), known[1, :2].tolist()]
                    assert resolve_placeholders(torch.tensor(rows[0]), ring).tolist() == known[0].tolist()
    assert runs["1"] == runs["0"], runs
    assert runs["1"][0] == [truths[p[0]][len(p):len(p) + 12] for p in prompts]
    assert runs["1"][2] >= 12, runs  # the true drafts were accepted, several a step

def count_replays(runner, replays: dict) -> None:
    """Count the tree graphs' and decode graphs' replays (a CUDA runner)."""
    prefill, decode = runner.prefill_graphs, runner.decode_graphs
    prefill_run, decode_run = prefill.try_run, decode.try_run

    def prefill_try(batch, *args):
        hidden = prefill_run(batch, *args)
        replays["tree"] += hidden is not None and batch.tree_parents is not None
        return hidden

    def decode_try(batch, *args):
        hidden = decode_run(batch, *args)
        replays["decode"] += hidden is not None
        return hidden
    prefill.try_run, decode.try_run = prefill_try, decode_try


def test_layer_taps_apply_an_fp8_layers_deferred_scales():
    """An FP8 layer hands its output on as a ScaledProduct (scales applied by the next reader): the
    tapped stream is the product with its scales, plus the pending residual."""
    from engine.executor.layer_taps import LayerTaps
    from kernels.fp8 import ScaledProduct

    class Layer(torch.nn.Module):
        def forward(self, x):
            return ScaledProduct(x, torch.full((x.shape[0],), 2.0), torch.full((x.shape[1],), 3.0)), x + 1

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer()])
    taps = LayerTaps(model, [0])
    x = torch.randn(3, 4)
    model.layers[0](x)
    torch.testing.assert_close(taps.streams[0], 6 * x + x + 1)
    taps.close()


def test_tree_bench_names_the_first_difference_and_its_logit_gap():
    """tree_bench's loop table: where a run's greedy ids leave plain decoding's, plain's logits there
    say whether it was a near-tie (the GPU's random-weight runs) or a real disagreement."""
    from benchmarks.speculative.tree_loop import difference_text, first_difference

    logits = torch.zeros(4, 16)
    logits[2, 5], logits[2, 7] = 4.0, 3.99
    tie = first_difference([1, 2, 7, 3], [1, 2, 5, 3], logits)
    assert tie["position"] == 2 and abs(tie["gap"] - 0.01) < 1e-5 and tie["near_tie"]
    logits[2, 7] = 1.0
    assert "NOT a near-tie" in difference_text(first_difference([1, 2, 7, 3], [1, 2, 5, 3], logits))
    assert first_difference([1, 2], [1, 2], logits) is None and difference_text(None) == "none"


def test_tree_bench_forced_runs_move_the_first_difference_on(monkeypatch):
    """tree_bench's forced runs on a stand-in for the GPU's near-ties (no CPU model has them): a tie
    position's token rounds one way computed as a tree's chain node (the chain held the run's own
    tokens before it) and the other as a step's root, every later token follows from the context.
    Each run forced to the last one's ids keeps them through where that one left, so three ties
    take four runs, one more than the 3 that left calls 15 and 16's 16-node rows at "no"."""
    from types import SimpleNamespace

    from benchmarks.speculative import tree_runs
    from benchmarks.speculative.tree_loop import left_text

    prompt, ties, vocab = [3, 1, 4], {9, 17, 30}, 97

    def generate(truth):  # greedy from the prompt; the chain is right while truth agrees so far
        ids = []
        for at in range(40):
            token = (sum(ids) * 31 + len(ids) * 7) % vocab
            chained = truth[:len(ids)] == ids and len(truth) > len(ids)
            ids.append((token + 1) % vocab if at in ties and chained else token)
        return ids

    state = {}
    run = lambda executor, requests: ([SimpleNamespace(output_token_ids=[generate(  # noqa: E731
        state["truth"][tuple(prompt)][len(prompt):])])], {})
    monkeypatch.setattr(tree_runs, "timed", run)
    plain = generate([])  # plain decoding: every token a step's root
    results, _, runs, agrees, left_at = tree_runs.forced_runs(
        None, SimpleNamespace(output_len=40), [prompt], {tuple(prompt): prompt + plain}, state, 4)
    assert agrees and runs == 4 and left_at == [9, 17, 30, None]
    assert results[0].output_token_ids[0] == generate(results[0].output_token_ids[0])
    assert left_text(left_at) == ", left at 9, 17, 30, -" and left_text([9, None]) == ""
    assert tree_runs.first_left([1, 2], [1, 2, 3]) == 2 and tree_runs.first_left([1], [1]) is None


def test_tree_bench_kernel_tables_say_what_the_tree_step_adds(monkeypatch):
    """tree_bench --kernels: the tree step's kernels against the decode step's, per name, the ones
    the tree step spends most more time in first (a kernel only the decode step runs counts negative)."""
    from benchmarks.speculative import tree_kernels

    tables = iter([({"gemm": (100.0, 10.0), "argmax": (5.0, 1.0)}, 0.2),
                   ({"gemm": (130.0, 10.0), "tree_mask": (20.0, 2.0)}, 0.3)])
    monkeypatch.setattr(tree_kernels, "profile_kernels", lambda fn, calls, cuda: next(tables))
    runner = type("R", (), {"device": torch.device("cpu")})()
    found = tree_kernels.verify_kernels(runner, None, None, 5, "nodes 16")
    assert [(k["kernel"], k["us"], k["per_step"]) for k in found["extra"]] == [
        ("gemm", 30.0, 0.0), ("tree_mask", 20.0, 2.0), ("argmax", -5.0, -1.0)]
    assert (found["tree"]["gpu_us"], found["tree"]["launches"], found["decode"]["launches"]) == (150.0, 12.0, 11.0)
