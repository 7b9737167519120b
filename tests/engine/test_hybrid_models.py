"""Hybrid Mamba / attention models (Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Mamba-2, Mamba-1, Jamba)
against transformers, and their state cache.

- The runner's logits equal transformers' (CPU float32, 1e-4) for a prompt prefilled in chunks
  whose edges fall inside SSD chunks and conv windows, then decoded token by token: chunked prefill
  carries each Mamba layer's state between chunks (the states equal one chunk's), and decode
  continues it.
- Through the executor (in-flight batching, chunked context under a small token budget, so prompt
  chunks and decodes of other requests share steps), greedy ids of prompts of 5, 40 and 300
  tokens equal transformers' ``generate``; after they finish, and after cancels, every state slot
  is free again. Under max_utilization with a KV pool too small for all, sequences are preempted
  (their slots freed) and recompute from a fresh state, with the same ids.
- What a state cannot serve is refused by name: beams, several returned sequences, speculative
  decoding; prefix caching is off for these models. (Tensor parallelism and FP8 weights:
  test_hybrid_tp_fp8.py.)
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict
from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig
from engine.executor.request import Request, SamplingConfig
from engine.executor.runner import ForwardBatch, ModelRunner

from hybrid_testing import HYBRIDS, VOCAB, hf_greedy, router_logits, steered, tiny_hybrid

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "executor"))
from executor_testing import collect, fake_update, final_tokens, make_seq  # noqa: E402

FAMILIES = list(HYBRIDS)
PROMPT_LENGTHS = (5, 40, 300)
NEW_TOKENS = 6


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tmp_path_factory):
    """(family, transformers model, engine dir, expected greedy ids per prompt length)."""
    family = request.param
    model = tiny_hybrid(family)
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=320, max_seq_len=320, max_num_tokens=512,
                        tokens_per_block=16)
    engine_dir = str(tmp_path_factory.mktemp(family))
    build_from_hf(model.config, getter_from_state_dict(model.state_dict(), family), None, engine_dir, build,
                  progress=False)
    expected = {n: hf_greedy(model, _tokens(n, n), NEW_TOKENS) for n in PROMPT_LENGTHS}
    return family, model, engine_dir, expected


def test_chunked_prefill_then_decode_equal_transformers_logits(hybrid):
    _, model, engine_dir, _ = hybrid
    runner = ModelRunner(engine_dir)
    runner.allocate_state_cache(4)
    runner.allocate_kv_cache(32)
    prompt = _tokens(40, 1)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    blocks = [7, 3, 12]  # scattered pool blocks: attention must go through the table
    outs = []
    for start, end in [(0, 11), (11, 30), (30, 36)] + [(p, p + 1) for p in range(36, 40)]:
        n = end - start
        batch = ForwardBatch(prompt[start:end], list(range(start, end)), [n], [end], [blocks[:-(-end // 16)]],
                             list(range(n)), state_slots=[2])
        outs.append(runner.forward(batch))
        if end == 36:  # the same 36 tokens in one chunk (slot 3, other blocks) leave the same states
            runner.forward(ForwardBatch(prompt[:36], list(range(36)), [36], [36], [[20, 21, 22]], list(range(36)),
                                        state_slots=[3]))
            for pool in (runner.model.conv_states, runner.model.ssm_states):
                assert (pool[:, 2] - pool[:, 3]).abs().max().item() <= 1e-5
    assert (torch.cat(outs) - expected).abs().max().item() <= 1e-4


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("policy,kv_tokens", [("guaranteed_no_evict", 4096), ("max_utilization", 336)])
def test_in_flight_batching_greedy_equals_transformers(hybrid, policy, kv_tokens):
    family, _, engine_dir, expected = hybrid
    if policy == "max_utilization" and family != "nemotron_h":
        pytest.skip("preemption is the scheduler's: one family shows it (CI time)")
    config = ExecutorConfig(enable_chunked_context=True, max_num_tokens=64, batch_scheduler_policy=policy,
                            max_tokens_in_paged_kv_cache=kv_tokens)
    with Executor(engine_dir, config) as executor:
        requests = [Request(_tokens(n, n), max_tokens=NEW_TOKENS, streaming=n == 40) for n in PROMPT_LENGTHS]
        ids = executor.enqueue_requests(requests)
        responses = collect(executor, ids)
        got = {n: final_tokens(responses[i])[-NEW_TOKENS:] for n, i in zip(PROMPT_LENGTHS, ids)}
        stats = executor.get_iteration_stats_history()
        _wait_until(lambda: executor.state_slots.num_used == 0)
        assert not executor.blocks.enable_reuse  # a cached KV prefix has no Mamba state at its end
        preemptions = executor.scheduler.num_preemptions
    assert got == expected
    assert max(s.num_scheduled_requests for s in stats) >= 2  # prompt chunks and decodes shared steps
    if policy == "max_utilization":
        assert preemptions > 0  # the 300-token prompt cannot keep its blocks beside the others


def test_cancel_frees_state_slots_and_refusals(hybrid):
    family, _, engine_dir, _ = hybrid
    if family not in ("nemotron_h", "jamba"):
        pytest.skip("the state cache's bookkeeping is the executor's: one family per state shape shows it (CI time)")
    with Executor(engine_dir, ExecutorConfig(max_num_tokens=64, enable_chunked_context=True)) as executor:
        ids = executor.enqueue_requests([Request(_tokens(300, i), max_tokens=10) for i in range(3)])
        _wait_until(lambda: executor.state_slots.num_used > 0)
        for request_id in ids:
            executor.cancel_request(request_id)
        collect(executor, ids)
        _wait_until(lambda: executor.state_slots.num_used == 0)
        beams = Request([1, 2, 3], 4, sampling=SamplingConfig(beam_width=2))
        pair = Request([1, 2, 3], 4, sampling=SamplingConfig(num_return_sequences=2))
        bad = collect(executor, executor.enqueue_requests([beams, pair]))
    errors = [responses[-1].error for responses in bad.values()]
    assert "beam_width 2: beam search is not supported" in errors[0]
    assert "num_return_sequences 2" in errors[1]
    with pytest.raises(ExecutorConfigError, match="speculative decoding"):
        Executor(engine_dir, ExecutorConfig(speculative=SpeculativeConfig("ngram")))



def test_emulated_decode_graphs_carry_state_slots(tmp_path, monkeypatch):
    """Bamba's decode steps through the decode graphs emulated on the CPU (graph_emulation.py: a replay reruns the
    forward over the graphs' staged inputs) equal an eager runner's, step by step: each row's state slot rides in the
    graphs' one staged copy (engine/executor/cuda_graphs.py), and the padding row of 3 rows in bucket 4 has slot -1
    (a padding row on slot 0 would advance the third sequence's state twice a step)."""
    from graph_emulation import emulate_cuda_graphs

    replays = emulate_cuda_graphs(monkeypatch)
    model = tiny_hybrid("bamba")
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=64, max_seq_len=64, max_num_tokens=128,
                        tokens_per_block=16)
    build_from_hf(model.config, getter_from_state_dict(model.state_dict(), "bamba"), None, str(tmp_path), build,
                  progress=False)
    graphed, eager = (ModelRunner(str(tmp_path)) for _ in range(2))
    for runner in (graphed, eager):
        runner.allocate_state_cache(4)
        runner.allocate_kv_cache(16)
    graphed.capture_cuda_graphs()
    prompts, slots, tables = [_tokens(n, n) for n in (30, 10, 12)], [1, 3, 0], [[5, 9, 1], [11, 12], [7, 8]]
    for runner in (graphed, eager):
        for prompt, slot, table in zip(prompts, slots, tables):
            n = len(prompt) - 5
            runner.forward(ForwardBatch(prompt[:n], list(range(n)), [n], [n], [table[:-(-n // 16)]], [n - 1],
                                        state_slots=[slot]))
    for step in range(5):
        positions = [len(p) - 5 + step for p in prompts]
        batch = ForwardBatch([p[i] for p, i in zip(prompts, positions)], positions, [1] * 3, [i + 1 for i in positions],
                             [t[:-(-(i + 1) // 16)] for t, i in zip(tables, positions)], [0, 1, 2], state_slots=slots)
        before = sum(replays.values())
        logits = graphed.forward(batch)
        assert sum(replays.values()) == before + 1 and graphed.decode_graphs.bucket_for(3) == 4
        torch.testing.assert_close(logits, eager.forward(batch), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"step {step}: {m}")


def test_scheduler_runs_no_more_sequences_than_state_slots():
    """Fewer slots than max_batch_size (a GPU's memory cap, state_cache.STATE_SHARE): the rest wait
    for a slot, and every slot is free once all have finished."""
    from engine.executor.kv_cache import BlockManager
    from engine.executor.scheduler import Scheduler
    from engine.executor.state_cache import StateSlots

    slots = StateSlots(2)
    scheduler = Scheduler(BlockManager(64, 4, enable_reuse=False), max_batch_size=8, max_num_tokens=64,
                          state_slots=slots)
    for n in (3, 5, 7, 9):
        scheduler.add(make_seq(list(range(1, n + 1)), max_tokens=3))
    most = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        most = max(most, len(scheduler.running))
        assert sorted(slots.slots_of(out.scheduled)) == sorted(set(slots.slots_of(out.scheduled)))
        fake_update(scheduler, out)
    assert most == 2 and slots.num_used == 0


@pytest.mark.parametrize("family,architecture", [("mamba", "MambaForCausalLM"), ("jamba", "JambaForCausalLM")])
def test_tensor_parallel_build_of_mamba1_is_refused(tmp_path, family, architecture):
    """Mamba-1 layers take one rank (the Mamba-2 hybrids split: test_hybrid_tp_fp8.py)."""
    from engine.config import ConfigError

    model = tiny_hybrid(family)
    build = BuildConfig(dtype="float32", max_batch_size=2, max_input_len=64, max_seq_len=64, max_num_tokens=64,
                        tp_size=2)
    with pytest.raises(ConfigError, match=f"{architecture}: tensor parallelism"):
        build_from_hf(model.config, getter_from_state_dict(model.state_dict(), "t"), None, str(tmp_path), build,
                      progress=False)


# ---- CUDA: the Triton kernels and the decode CUDA graphs (the lead's GPU suite) --------------

# bf16: the equivalence tests' bound (test_equivalence.py says why); float32: room for GPU kernels
# that may take tf32 products for float32 operands (the SSD kernel's own dots are IEEE), still two
# orders below what a wrong state, slot or block produces.
CUDA_TOLERANCE = {"float32": 1e-2, "bfloat16": 0.15}
CUDA_PROMPTS = ((150, 3), (30, 4))  # (length, seed) of the two prompts below


def test_tiny_jamba_routing_is_clear_of_bfloat16_rounding():
    """The bf16 comparison below holds Jamba to a float32 reference only if no token's top-2 expert
    set is a near tie: bf16 rounding (~1% of the router's input, in transformers' own bf16 forward
    too) legitimately flips such a token to another expert and moves its logits ~0.6 (the random
    router had a 0.35% gap at token 68 of the 150-token prompt). hybrid_testing.clear_routing_margins
    makes the sets clear; this holds it so, with every set of adjacent experts in use."""
    model = tiny_hybrid("jamba")
    for n, seed in CUDA_PROMPTS:
        logits = router_logits(model, _tokens(n, seed))
        ranked = logits.sort(-1, descending=True).values
        gap = (ranked[:, 1] - ranked[:, 2]) / logits.abs().max(-1).values
        assert gap.min().item() >= 0.1
        sets = {tuple(sorted(row)) for row in logits.topk(2).indices.tolist()}
        assert sets == {(0, 1), (1, 2), (2, 3), (0, 3)}


STEERED = ("granite_moe", "nemotron_h_moe")  # hybrid_testing.steered


def test_steered_moe_hybrids_route_clear_of_bfloat16_rounding():
    """The bf16 comparison below uses hybrid_testing.steered for the Mamba-2 MoE hybrids: over its
    prompts every router's top-2 (Granite: 2nd-3rd logit gap >= 0.3 of the largest |logit|) and
    Nemotron-H's group choice and top-2 within the group (biased sigmoid scores >= 0.02 apart, as
    bf16 rounding of the router input moves them ~0.002) are clear-cut."""
    for family in STEERED:
        model = steered(family)
        routers = [m for m in model.modules() if type(m).__name__ in ("GraniteMoeHybridTopKRouter", "NemotronHTopkRouter")]
        inputs = []
        hooks = [r.register_forward_hook(lambda m, args, out: inputs.append((m, args[0]))) for r in routers]
        with torch.no_grad():
            for n, seed in CUDA_PROMPTS:
                model(torch.tensor([_tokens(n, seed)]))
        for hook in hooks:
            hook.remove()
        assert routers and len(inputs) == len(routers) * len(CUDA_PROMPTS)
        for router, x in inputs:
            logits = x.reshape(-1, x.shape[-1]).float() @ router.weight.float().T
            if family == "granite_moe":
                ranked = logits.sort(-1, descending=True).values
                assert ((ranked[:, 1] - ranked[:, 2]) / logits.abs().max(-1).values).min().item() >= 0.3
                continue
            scores = (logits.sigmoid() + router.e_score_correction_bias).view(logits.shape[0], router.num_group, -1)
            group_scores = scores.topk(2, dim=-1).values.sum(-1)
            ranked_groups = group_scores.sort(-1, descending=True).values
            assert (ranked_groups[:, 0] - ranked_groups[:, 1]).min().item() >= 0.02
            best = scores[torch.arange(len(scores)), group_scores.argmax(-1)].sort(-1, descending=True).values
            assert (best[:, 1] - best[:, 2]).min().item() >= 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_chunks_mixed_step_and_graphed_decodes_equal_transformers(hybrid, dtype, tmp_path):
    family, model, _, _ = hybrid
    if dtype == "bfloat16" and family in STEERED:
        model = steered(family)  # clear routing margins: bf16 must not flip a near tie of experts
    build = BuildConfig(dtype=dtype, max_batch_size=4, max_input_len=320, max_seq_len=320, max_num_tokens=512,
                        tokens_per_block=16)
    build_from_hf(model.config, getter_from_state_dict(model.state_dict(), family), None, str(tmp_path), build,
                  progress=False)
    runner = ModelRunner(str(tmp_path), device="cuda")
    runner.allocate_state_cache(4)
    runner.allocate_kv_cache(64)
    runner.capture_cuda_graphs()
    assert runner.decode_graphs is not None
    a, b = (_tokens(n, seed) for n, seed in CUDA_PROMPTS)
    with torch.no_grad():
        expected_a, expected_b = (model(torch.tensor([p])).logits[0] for p in (a, b))
    table_a, table_b = [5, 9, 1, 30, 2, 17, 8, 40, 41, 42], [11, 12]
    outs_a = [runner.forward(ForwardBatch(a[:100], list(range(100)), [100], [100], [table_a[:7]], list(range(100)),
                                          state_slots=[1]))]
    mixed = runner.forward(ForwardBatch([a[100]] + b, [100] + list(range(30)), [1, 30], [101, 30],
                                        [table_a[:7], table_b], list(range(31)), state_slots=[1, 3]))
    outs_a.append(mixed[:1])
    for p in range(101, 150):  # decode-only steps: replayed from the bucket-1 graph
        outs_a.append(runner.forward(ForwardBatch([a[p]], [p], [1], [p + 1], [table_a[:-(-(p + 1) // 16)]], [0],
                                                  state_slots=[1])))
    bound = CUDA_TOLERANCE[dtype]
    assert (torch.cat(outs_a).float().cpu() - expected_a).abs().max().item() <= bound
    assert (mixed[1:].float().cpu() - expected_b).abs().max().item() <= bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_executor_serves_and_frees_every_state_slot(hybrid, tmp_path):
    """The executor's CUDA start (state slots sized from free memory, the step-memory profile and the
    warm-up over the state pool, decode graphs), then prompts of 5 to 300 tokens together: every
    request ends with its tokens and every slot is free again. (Greedy ids are held to transformers
    on CPU; on the GPU other accumulation orders may flip a near tie, so most tokens must agree.)"""
    family, model, _, expected = hybrid
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=320, max_seq_len=320, max_num_tokens=512,
                        tokens_per_block=16)
    build_from_hf(model.config, getter_from_state_dict(model.state_dict(), family), None, str(tmp_path), build,
                  progress=False)
    config = ExecutorConfig(enable_chunked_context=True, max_num_tokens=64, max_tokens_in_paged_kv_cache=4096)
    with Executor(str(tmp_path), config, device="cuda") as executor:
        assert executor.runner.decode_graphs is not None
        ids = executor.enqueue_requests([Request(_tokens(n, n), max_tokens=NEW_TOKENS) for n in PROMPT_LENGTHS])
        responses = collect(executor, ids)
        got = {n: final_tokens(responses[i])[-NEW_TOKENS:] for n, i in zip(PROMPT_LENGTHS, ids)}
        _wait_until(lambda: executor.state_slots.num_used == 0)
    assert all(len(tokens) == NEW_TOKENS for tokens in got.values())
    agree = sum(a == b for n in PROMPT_LENGTHS for a, b in zip(got[n], expected[n]))
    assert agree >= 0.75 * NEW_TOKENS * len(PROMPT_LENGTHS), (got, expected)
