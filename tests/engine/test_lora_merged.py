"""An adapter served at run time equals its merge into the weights (W + scale * B @ A), on the CPU
(torch reference) and on a GPU (the Triton kernels, decode in CUDA graphs with their LoRA twins).

Needs no ``peft``: the adapter is a PEFT directory written directly (the GPU machine has no peft;
tests/engine/test_lora_executor.py checks the PEFT format itself against ``peft``). Every batch
mixes adapter rows, rows of a second adapter and base rows.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from engine.executor import Executor, ExecutorConfig, LoraRequest, OutputConfig, Request
from engine_testing import make_engine, random_tokens, tiny_hf

HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def write_adapter(hf, path, rank: int, alpha: int, seed: int, std: float = 0.3,
                  modules: tuple[str, ...] = tuple(HF_NAMES)) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT directory with random A, B on ``modules`` (default: every projection); returns
    {hf module path: (a, b)}."""
    generator = torch.Generator().manual_seed(seed)
    weights, tensors = {}, {}
    for layer in range(hf.config.num_hidden_layers):
        for name in (HF_NAMES[m] for m in modules):
            module = hf.get_submodule(f"model.layers.{layer}.{name}")
            a = torch.randn(rank, module.in_features, generator=generator) * std
            b = torch.randn(module.out_features, rank, generator=generator) * std
            weights[f"model.layers.{layer}.{name}"] = (a, b)
            tensors[f"base_model.model.model.layers.{layer}.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.model.layers.{layer}.{name}.lora_B.weight"] = b
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "use_dora": False,
        "target_modules": sorted({HF_NAMES[m].split(".")[1] for m in modules})}))
    return weights


def merged(hf, weights, scale: float):
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, (a, b) in weights.items():
            model.get_submodule(name).weight += scale * b @ a
    return model


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merged")
    hf = tiny_hf("llama")
    first = write_adapter(hf, tmp / "a", rank=8, alpha=16, seed=1)
    second = write_adapter(hf, tmp / "b", rank=16, alpha=8, seed=2)
    return {"base": make_engine(hf, tmp / "base"), "a": make_engine(merged(hf, first, 2.0), tmp / "merged_a"),
            "b": make_engine(merged(hf, second, 0.5), tmp / "merged_b"), "dirs": (tmp / "a", tmp / "b")}


def greedy(executor, items) -> list[list[int]]:
    """items: (prompt, LoraRequest | None), enqueued at once -> generated ids of each."""
    ids = executor.enqueue_requests([Request(prompt, 12, lora=lora, output=OutputConfig(exclude_input_from_output=True))
                                     for prompt, lora in items])
    tokens = {i: [] for i in ids}
    pending = set(ids)
    while pending:
        for response in executor.await_responses(timeout=1.0):
            assert response.error is None, response.error
            tokens[response.request_id] += response.result.output_token_ids[0]
            if response.result.is_final:
                pending.discard(response.request_id)
    return [tokens[i] for i in ids]


# A small pool: several executors come and go in one process (on a GPU the default would take 90%).
POOL = {"max_tokens_in_paged_kv_cache": 4096}


@pytest.mark.parametrize("device", DEVICES)
def test_served_adapters_equal_their_merged_weights(engines, device):
    prompts = [random_tokens(5 + 3 * i, seed=20 + i) for i in range(4)]
    wanted = {}
    for key in ("base", "a", "b"):
        with Executor(engines[key], ExecutorConfig(**POOL), device=device) as executor:
            wanted[key] = greedy(executor, [(p, None) for p in prompts])
    assert wanted["a"] != wanted["base"] and wanted["b"] != wanted["base"]
    a, b = (LoraRequest(task_id=i + 1, path=str(path)) for i, path in enumerate(engines["dirs"]))
    with Executor(engines["base"], ExecutorConfig(enable_lora=True, max_loras=2, max_lora_rank=16, **POOL),
                  device=device) as executor:
        items = [(p, lora) for p in prompts for lora in (a, None, b)]
        got = greedy(executor, items)
        # decode-only steps of 3 rows after the prefill: on CUDA the LoRA graph twins replay them
        assert got == [wanted[key][i] for i in range(len(prompts)) for key in ("a", "base", "b")]
        if device == "cuda":
            assert executor.runner.decode_graphs.lora_graphs, "LoRA decode graphs were not captured"


# ---- tensor parallelism: A and B split like the weights they attach to -------------------------

def test_tp2_with_adapters_equals_tp1(tmp_path):
    """Column-parallel projections take their rows of B, row-parallel ones their columns of A
    (their partial products join the all-reduce): both ranks' logits equal TP 1's, and the base
    sequence's logits equal those of an engine without LoRA."""
    from engine.executor.runner import ModelRunner
    from engine_testing import tp_reference_steps
    from lora_tp_worker import lora_reference_steps

    hf = tiny_hf("qwen3")  # GQA 6/2 heads, head_dim 14: q and kv slices shard by heads
    write_adapter(hf, tmp_path / "adapter", rank=8, alpha=16, seed=2)
    tp1 = make_engine(hf, tmp_path / "tp1")
    expected = lora_reference_steps(ModelRunner(tp1), str(tmp_path / "adapter"))
    base = tp_reference_steps(ModelRunner(tp1))
    rows_of_seq0 = list(range(6)) + list(range(19, 22))  # tp_reference_steps: 6 + 13 tokens, then 3 + 1
    assert (expected[rows_of_seq0] - base[rows_of_seq0]).abs().max() > 1e-3  # the adapter matters
    assert (expected[6:19] - base[6:19]).abs().max() <= 1e-5 and (expected[22:] - base[22:]).abs().max() <= 1e-5
    engine = make_engine(hf, tmp_path / "tp2", tp_size=2)
    from gloo_ranks import shared_pair
    from lora_tp_worker import lora_rank_logits

    ranks = shared_pair().run(lora_rank_logits, engine, str(tmp_path / "adapter"))
    for rank in range(2):
        error = (ranks[rank] - expected).abs().max().item()
        assert error <= 1e-5, f"rank {rank}: max abs error {error:.3g} vs tp 1"


def prefill_logits(runner, ids: list[int], lora_slots: list[int] | None = None) -> torch.Tensor:
    """Logits of every position of ``ids`` in one prefill (n, vocab), on ``lora_slots``' adapter."""
    from engine.executor.runner import ForwardBatch

    blocks = -(-len(ids) // runner.tokens_per_block)
    runner.allocate_kv_cache(blocks)
    n = len(ids)
    return runner.forward(ForwardBatch(ids, list(range(n)), [n], [n], [list(range(blocks))], list(range(n)),
                                       lora_slots=lora_slots), all_logits=True)


def test_an_adapter_on_fp8_weights_keeps_to_the_fp8_rounding_bound(tmp_path):
    """Base weights in FP8 (W8A8), adapters in the model dtype: the served adapter's logits stay
    within test_fp8_engine's 10% bound of the float32 merged model, while the adapter itself moves
    them far more than that (so the check tells an applied adapter from a lost one)."""
    from engine.executor.runner import ModelRunner
    from engine.lora.adapter import load_peft_adapter
    from test_fp8_engine import build, llama_of_trained_scale

    hf = llama_of_trained_scale()
    weights = write_adapter(hf, tmp_path / "adapter", rank=8, alpha=16, seed=5, std=0.05)
    ids = [3, 17, 5, 99, 42, 8, 1, 77, 23, 64, 11, 90, 31, 7, 120, 56]
    base = prefill_logits(ModelRunner(build(hf, str(tmp_path / "fp32"), None)), ids)
    wanted = prefill_logits(ModelRunner(build(merged(hf, weights, 2.0), str(tmp_path / "merged"), None)), ids)
    runner = ModelRunner(build(hf, str(tmp_path / "fp8"), "fp8"))
    runner.enable_lora(2, 8)
    runner.load_adapter(1, load_peft_adapter(str(tmp_path / "adapter"), runner.model_config, 8))
    got = prefill_logits(runner, ids, lora_slots=[1])
    relative = lambda x, y: ((x - y).norm() / y.norm()).item()  # noqa: E731
    assert relative(wanted, base) > 0.3
    assert relative(got, wanted) < 0.10


def test_mixture_of_experts_layers_take_attention_adapters_only(tmp_path):
    """Mixtral: an adapter on q/k/v/o equals its merge; one on the MLP is refused by name (the
    routed experts take no adapter)."""
    hf = tiny_hf("mixtral")
    attention = ("q", "k", "v", "o")
    weights = write_adapter(hf, tmp_path / "attn", rank=4, alpha=8, seed=3, modules=attention)
    mlp = tmp_path / "mlp"  # a gate_proj adapter of Mixtral's dense shape (what a Llama-style adapter would bring)
    mlp.mkdir()
    hidden, inter = hf.config.hidden_size, hf.config.intermediate_size
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.randn(4, hidden),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.randn(inter, 4)},
              str(mlp / "adapter_model.safetensors"))
    (mlp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "target_modules": ["gate_proj"]}))
    prompts = [random_tokens(6 + i, seed=40 + i) for i in range(2)]
    with Executor(make_engine(merged(hf, weights, 2.0), tmp_path / "merged"), ExecutorConfig(**POOL)) as executor:
        wanted = greedy(executor, [(p, None) for p in prompts])
    with Executor(make_engine(hf, tmp_path / "base"), ExecutorConfig(enable_lora=True, max_loras=2, **POOL)) as executor:
        assert greedy(executor, [(p, LoraRequest(task_id=1, path=str(tmp_path / "attn"))) for p in prompts]) == wanted
        (request_id,) = executor.enqueue_requests([Request(prompts[0], 4, lora=LoraRequest(task_id=2, path=str(tmp_path / "mlp")))])
        (response,) = [r for r in executor.await_responses(timeout=30) if r.request_id == request_id]
        assert "module gate of layer 0" in response.error and "mixture of experts" in response.error


def test_lora_prefetch_dir_loads_adapters_at_start(tmp_path):
    """Subdirectories <id>-<name> of TensorRT-LLM's two arrays or of a PEFT adapter: in the cache
    (and the free slots) before any request, so a request may send the id alone."""
    import numpy as np

    from engine.lora.adapter import peft_to_trtllm

    hf = tiny_hf("llama")
    first = write_adapter(hf, tmp_path / "peft_a", rank=8, alpha=16, seed=1)
    second = write_adapter(hf, tmp_path / "prefetch" / "7-sql", rank=4, alpha=4, seed=2)
    rows, config = peft_to_trtllm(str(tmp_path / "peft_a"), "float32")
    (tmp_path / "prefetch" / "3").mkdir()
    np.save(tmp_path / "prefetch" / "3" / "model.lora_weights.npy", rows)
    np.save(tmp_path / "prefetch" / "3" / "model.lora_config.npy", config)
    prompts = [random_tokens(7, seed=50)]
    wanted = {}
    for key, engine_weights, scale in (("a", first, 2.0), ("b", second, 1.0)):
        with Executor(make_engine(merged(hf, engine_weights, scale), tmp_path / f"merged_{key}"),
                      ExecutorConfig(**POOL)) as executor:
            wanted[key] = greedy(executor, [(p, None) for p in prompts])
    config = ExecutorConfig(enable_lora=True, max_loras=2, lora_prefetch_dir=str(tmp_path / "prefetch"), **POOL)
    with Executor(make_engine(hf, tmp_path / "base"), config) as executor:
        stats = executor.adapters.stats
        assert stats.host_loads == 2 and stats.gpu_loads == 2 and stats.adapters_in_gpu == 2
        got = greedy(executor, [(prompts[0], LoraRequest(task_id=3)), (prompts[0], LoraRequest(task_id=7))])
        assert got == wanted["a"] + wanted["b"]
        assert executor.adapters.stats.gpu_hits == 2 and executor.adapters.stats.requests["sql"] == 1


def test_base_requests_pass_an_adapter_request_waiting_for_a_slot(tmp_path):
    """One slot, held by a long adapter request: a second adapter's request waits for it, and a
    base-model request sent after that one is served meanwhile (it needs no slot)."""
    hf = tiny_hf("llama")
    write_adapter(hf, tmp_path / "a", rank=4, alpha=8, seed=1)
    write_adapter(hf, tmp_path / "b", rank=4, alpha=8, seed=2)
    config = ExecutorConfig(enable_lora=True, max_loras=1, **POOL)
    with Executor(make_engine(hf, tmp_path / "engine", max_seq_len=256), config) as executor:
        (long_a,) = executor.enqueue_requests([Request(random_tokens(6, seed=1), 120, streaming=True,
                                                       lora=LoraRequest(task_id=1, path=str(tmp_path / "a")))])
        first = []
        while not first:  # A runs (its adapter holds the one slot) before the others arrive
            first = [r for r in executor.await_responses(timeout=1.0) if r.request_id == long_a]
        short_b, base = executor.enqueue_requests([
            Request(random_tokens(6, seed=2), 4, lora=LoraRequest(task_id=2, path=str(tmp_path / "b"))),
            Request(random_tokens(6, seed=3), 4)])
        finished = []
        while len(finished) < 3:
            for response in executor.await_responses(timeout=1.0):
                assert response.error is None, response.error
                if response.result.is_final:
                    finished.append(response.request_id)
        assert finished == [base, long_a, short_b]
        assert executor.adapters.stats.gpu_evictions == 1
