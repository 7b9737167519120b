"""EAGLE-3 heads with FP8 products (engine/executor/speculative/eagle3.py ``fp8``, SpeculativeConfig
``eagle_fp8_head``): quantized at load from the published-format head (kernels/fp8.py's per-row E4M3
scheme; on the CPU its reference, dequantize then matmul), drafting mostly what the head in its own
dtype drafts (top-1 agreement per tree node), and greedy ids through the executor equal to plain
decoding (transformers): verification keeps them whatever the drafts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_speculative_eagle3 import CHOICES, HIDDEN, VOCAB, check_windows, save_eagle3

from engine.executor.executor_config import ExecutorConfigError, SpeculativeConfig
from engine.executor.speculative.eagle3 import PRODUCTS, eagle_head_fp8, load_eagle3
from engine.executor.speculative.eagle3_drafter import DraftCache, StaticPlan, draft_static
from engine.executor.speculative.eagle3_graphs import StaticDraftGraphs
from engine.executor.speculative.tree import shape_from_choices
from kernels.fp8 import FP8_DTYPE, fp8_linear_ref

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def drafted_trees(head, tiny_hf, prompts: list[list[int]]) -> list[list[int]]:
    """The static tree ``TREE`` the head drafts after every prefix of each prompt (the target's
    layer-0 stream and token embedding from transformers; the draft cache committed in one go)."""
    embed, plan = tiny_hf.model.embed_tokens, StaticPlan(shape_from_choices(TREE, field="eagle_choices"), "cpu")
    trees = []
    with torch.no_grad():
        for tokens in prompts:
            states = tiny_hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[1][0]
            for end in range(4, len(tokens) + 1):
                cache = DraftCache(0, head, torch.device("cpu"))
                cache.add_features(head.features(states, states, states)[:end - 1])
                cache.commit(head, tokens[:end], embed)
                trees.append(draft_static(head, cache, plan, embed)[1])
    return trees


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    path = save_eagle3(tmp_path_factory.mktemp("fp8") / "eagle3", layers=[0, 0, 0])
    load = lambda fp8: load_eagle3(path, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=2, fp8=fp8)[0]  # noqa: E731
    return load(False), load(True), path


def test_fp8_head_holds_e4m3_products_and_drafts_mostly_the_same_trees(heads, tiny_hf):
    plain, fp8, _ = heads
    assert not plain.scales and set(fp8.scales) == set(PRODUCTS)
    for name in PRODUCTS:  # E4M3 weights, one float32 scale a row, within E4M3's rounding of the weight
        w, s = fp8.products[name], fp8.scales[name]
        assert w.dtype == FP8_DTYPE and s.shape == (w.shape[0],) and s.dtype == torch.float32
        torch.testing.assert_close(w.float() * s[:, None], plain.products[name], atol=0, rtol=2 ** -4)
    assert fp8.w["norm.weight"].dtype == torch.float32  # the norms stay in the head's dtype
    x = torch.randn(3, HIDDEN)
    assert torch.equal(fp8.product("o", x), fp8_linear_ref(x, fp8.products["o"], fp8.scales["o"]))
    h = torch.randn(3, HIDDEN, dtype=torch.bfloat16)  # the logits: float32 accumulators, not rounded to h's dtype
    assert torch.equal(fp8.product("lm_head", h, float32_out=True),
                       fp8_linear_ref(h, fp8.products["lm_head"], fp8.scales["lm_head"], out_dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (10,), generator=g).tolist() for _ in range(2)]
    want, got = drafted_trees(plain, tiny_hf, prompts), drafted_trees(fp8, tiny_hf, prompts)
    nodes = sum(len(t) for t in want)
    agree = sum(a == b for w, f in zip(want, got) for a, b in zip(w, f)) / nodes
    print(f"FP8 head: top-1 drafts equal the fp32 head's at {agree:.1%} of {nodes} tree nodes")
    assert agree >= 0.8


def test_executor_fp8_head_greedy_ids_equal_plain_decoding(heads, tiny_engine, tiny_hf):
    from executor_testing import collect, final_tokens

    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import Request

    plain, _, path = heads
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 9, 11]]
    refs = [tiny_hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    spec = SpeculativeConfig("eagle", max_draft_len=8, eagle_model_path=path, eagle_choices=CHOICES, eagle_fp8_head=True)
    config = ExecutorConfig(exclude_input_from_output=True, speculative=spec, enable_kv_cache_reuse=False)
    with Executor(tiny_engine, config, device="cpu") as executor:
        assert executor.proposer.head.fp8
        ids = executor.enqueue_requests([Request(p, 10) for p in prompts])
        got = collect(executor, ids, timeout=300)
        assert [final_tokens(got[i]) for i in ids] == refs
        assert executor._num_draft_tokens_total > 0  # (random heads: drafts verified, few accepted)
        # tree_bench --other-head: the bf16 head beside it over the same taps
        executor.proposer = executor.proposer.with_head(plain)
        before = executor._num_draft_tokens_total
        ids = executor.enqueue_requests([Request(prompts[0], 10)])
        assert final_tokens(collect(executor, ids, timeout=300)[ids[0]]) == refs[0]
        assert executor._num_draft_tokens_total > before and not executor.proposer.head.fp8
        assert executor.blocks.num_free_blocks == executor.blocks.num_blocks


def test_fp8_head_default_follows_the_target():
    bf16, fp8 = SimpleNamespace(quantization=None), SimpleNamespace(quantization="fp8")
    assert not eagle_head_fp8(SpeculativeConfig("eagle"), bf16) and eagle_head_fp8(SpeculativeConfig("eagle"), fp8)
    assert eagle_head_fp8(SpeculativeConfig("eagle", eagle_fp8_head=True), bf16)
    assert not eagle_head_fp8(SpeculativeConfig("eagle", eagle_fp8_head=False), fp8)
    with pytest.raises(ExecutorConfigError, match="eagle_fp8_head must be true, false or unset"):
        SpeculativeConfig("eagle", eagle_fp8_head="yes").validate()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_fp8_head_windows_draft_what_draft_static_drafts(tmp_path, tiny_hf, device):
    """The drafting windows (the body CUDA graphs record) with an FP8 head: on the CPU they draft
    draft_static's tokens (test_speculative_eagle3.py's check); on CUDA (gpu mark) the recorded
    replays draft what the same windows draft eagerly (the W8A8 products inside a recording; eager
    commits of many rows take cuBLASLt, not the skinny kernel: their roundings differ, so the CPU's
    comparison with draft_static does not carry over exactly). Not in Triton's CPU interpreter: its
    E4M3 conversion rounds otherwise than the GPU's."""
    import copy

    dev = torch.device(device)
    head, _ = load_eagle3(save_eagle3(tmp_path / "eagle3", layers=[0, 1, 1]), hidden_size=HIDDEN, vocab_size=VOCAB,
                          num_layers=2, device=dev, fp8=True)
    plan = StaticPlan(shape_from_choices(TREE[:7], field="eagle_choices"), dev)
    embed = copy.deepcopy(tiny_hf.model.embed_tokens).to(dev)
    make = lambda graphs: StaticDraftGraphs(head, plan, embed, max_positions=128, device=dev,  # noqa: E731
                                            use_graphs=graphs)
    if device == "cpu":
        check_windows(head, embed, tiny_hf, make(True), plan)
        return
    recorded, eager = make(True), make(False)
    tokens = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        states = tiny_hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        feats = head.features(*(s[0].to(dev) for s in (states[1], states[2], states[2])))[:-1]
        caches, done = [DraftCache(0, head, dev) for _ in range(2)], 0
        for end in (20, 21, 63, 70, 79):
            for cache in caches:
                cache.add_features(feats[done:end])
            done = end
            assert recorded.run(caches[0], tokens).tolist() == eager.run(caches[1], tokens).tolist(), end
            torch.testing.assert_close(caches[0].k[:end], caches[1].k[:end], rtol=1e-5, atol=1e-5)
    assert recorded.replays == 5 and eager.replays == 0
