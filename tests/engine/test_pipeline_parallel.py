"""Pipeline parallelism at the engine: layer splits, rank files, refusals, and pp 2 on two gloo
ranks (gloo_ranks.py's shared pair) giving pp 1's logits, micro-batched or not (two micro-batches
cut the reference steps' 13-token prompt, so its second piece attends to KV its first wrote).

Each pp 2 engine must give its pp 1 logits within 1e-5 (micro-batches change which tokens one
kernel call takes, not the math) and transformers' within 1e-4 (the bound test_equivalence.py holds
pp 1 to)."""
from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from engine.build import build_from_hf, main as build_main
from engine.config import BuildConfig, ConfigError, pipeline_layer_counts
from engine.convert import getter_from_state_dict
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.pipeline.runner import split_micro_batches
from engine.tensor_parallel.distributed import check_world_matches_engine
from engine_testing import VOCAB, hf_logits, tiny_hf, tp_reference_steps
from pipeline_ranks import PP_MORE_LAYERS

# family -> pp_layers of its pp 2 build (None: even; "balanced": --pp_layers balanced, which records 1,2 for
# qwen3_moe's 3 layers, layer 1 dense and so the cheapest).
PP_FAMILIES = {"llama": None, "smollm2_tied": None, "qwen3_moe": "balanced"}
PP_LAYERS = {"llama": [1, 1], "smollm2_tied": [1, 1], "qwen3_moe": [1, 2]}


def build(hf, out_dir, *, pp_size=1, pp_layers=None, tp_size=1) -> str:
    balanced = pp_layers == "balanced"
    config = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=128, max_seq_len=128, max_num_tokens=512,
                         tokens_per_block=16, tp_size=tp_size, pp_size=pp_size, pp_layers=None if balanced else pp_layers)
    build_from_hf(hf.config, getter_from_state_dict(hf.state_dict(), "tiny"), None, str(out_dir), config,
                  progress=False, balance_pp_layers=balanced)
    return str(out_dir)


@pytest.fixture(scope="module")
def hf_models() -> dict:
    return {family: tiny_hf(family) for family in PP_FAMILIES}


@pytest.fixture(scope="module")
def engines(hf_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pp_engines")
    out = {}
    for family, layers in PP_FAMILIES.items():
        hf = hf_models[family]
        out[family] = (build(hf, root / f"{family}-pp1"), build(hf, root / f"{family}-pp2", pp_size=2, pp_layers=layers))
    return out


@pytest.fixture(scope="module")
def more_engines(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pp_more_engines")
    out = {}
    for family, layers in PP_MORE_LAYERS.items():
        hf = tiny_hf(family)
        out[family] = (build(hf, root / f"{family}-pp1"), build(hf, root / f"{family}-pp2", pp_size=2, pp_layers=layers))
    return out


def transformers_rows(hf) -> torch.Tensor:
    """transformers' logits in tp_reference_steps' row order: step 1 = a[:6], b[:13]; step 2 =
    a[6:], b[13:] (the same random sequences a, b)."""
    rng = random.Random(11)
    a, b = [rng.randrange(VOCAB) for _ in range(9)], [rng.randrange(VOCAB) for _ in range(14)]
    la, lb = hf_logits(hf, a), hf_logits(hf, b)
    return torch.cat([la[:6], lb[:13], la[6:], lb[13:]])


def test_layer_split_even_and_explicit():
    assert pipeline_layer_counts(32, 3) == [11, 11, 10]
    assert pipeline_layer_counts(48, 4, [8, 12, 14, 14]) == [8, 12, 14, 14]
    with pytest.raises(ConfigError, match=r"pp_size 5 is larger than the model's 4 layers.*allowed pp_size 1\.\.4"):
        pipeline_layer_counts(4, 5)
    with pytest.raises(ConfigError, match=r"pp_layers 8,12 must give 2 positive layer counts .* adding up to the "
                                          r"model's 24 layers"):
        pipeline_layer_counts(24, 2, [8, 12])


def test_balanced_split_evens_the_stages_by_cost():
    """With --pp_layers balanced the build records the split whose slowest stage is fastest, the last
    stage's LM head and the first stage's rank 0 (which samples every row and runs the executor's
    step) charged two heads: Llama-3.1-8B splits 15,17 at pp 2 (on the H200s rank 0's side set the
    pace: 14,18 and 16,16 stepped alike, 17,15 and 18,14 slower), the middle stages take more at pp 4,
    and a model whose first layers are dense among expert layers gives the first stage more of them.
    The head alone would give 17,15. Equal layers split evenly, later stages the larger."""
    from engine.config import ModelConfig
    from engine.pipeline.layout import balanced_layer_counts, balanced_pp_layers
    from engine.pipeline.step_cost import stage_costs

    llama8b = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                          num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    assert [balanced_pp_layers(llama8b, BuildConfig(dtype="bfloat16", max_batch_size=256, pp_size=pp))
            for pp in (2, 4)] == [[15, 17], [5, 10, 10, 7]]
    layer_costs, head = stage_costs(llama8b, BuildConfig(dtype="bfloat16", max_batch_size=256, pp_size=2))
    assert 2.3 < head / layer_costs[0] < 2.5 and balanced_layer_counts(layer_costs, 2, last_extra=head) == [17, 15]
    assert balanced_layer_counts([1.0] * 32, 3) == [10, 11, 11] and balanced_layer_counts([1.0] * 4, 4, last_extra=9) == [1] * 4
    # a costly third layer: 2 + 2 against 1 + 1 | 3 + 1; with an extra of 2 on the last stage, 5 | 3 against 2 | 6
    assert balanced_layer_counts([1.0, 1.0, 3.0, 1.0], 2) == [2, 2]
    assert balanced_layer_counts([1.0, 1.0, 3.0, 1.0], 2, last_extra=2.0) == [3, 1]
    # At pp 16 the first stage (1 layer and its two heads) sets the pace whatever the rest holds: the rest
    # is split with its fullest stage as small as that allows (3 layers, not 1 x 11 stages and 3, 5, 5, 5, 3)
    assert balanced_pp_layers(llama8b, BuildConfig(dtype="bfloat16", max_batch_size=256, pp_size=16)) == [1] * 8 + [3] * 8
    with pytest.raises(ConfigError, match="pp_size 40 is larger than the model's 32 layers"):
        balanced_pp_layers(llama8b, BuildConfig(pp_size=40))
    moe = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                      num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, mlp_only_layers=[0, 1, 2, 3]).validate()
    layer_costs, _ = stage_costs(moe, BuildConfig(dtype="bfloat16", max_batch_size=256, pp_size=2))
    assert layer_costs[4] == layer_costs[47] > 4 * layer_costs[0]  # 128 experts read against a dense MLP of 6144
    assert balanced_pp_layers(moe, BuildConfig(dtype="bfloat16", max_batch_size=256, pp_size=2)) == [25, 23]


def test_rank_files_hold_their_stage(engines):
    _, pp2 = engines["smollm2_tied"]
    config = json.load(open(os.path.join(pp2, "config.json")))
    assert config["pretrained_config"]["mapping"] == {"world_size": 2, "tp_size": 1, "pp_size": 2, "pp_layers": [1, 1]}
    assert "pp_layers" not in config["build"]  # the even split, the default, is not written out
    moe_config = json.load(open(os.path.join(engines["qwen3_moe"][1], "config.json")))
    assert moe_config["build"]["pp_layers"] == [1, 2]  # --pp_layers balanced's split, recorded
    names = []
    for rank in range(2):
        with safe_open(os.path.join(pp2, f"rank{rank}.safetensors"), "pt") as f:
            names.append(set(f.keys()))
    assert "embed_tokens.weight" in names[0] and "norm.weight" not in names[0]
    assert {"embed_tokens.weight", "norm.weight"} <= names[1]  # tied: the last stage's LM head is the embedding
    assert all(not n.startswith("layers.1.") for n in names[0] | names[1])  # one layer each, renumbered from 0
    with pytest.raises(ValueError, match=r"built with tp_size 1 x pp_size 2 .*world_size 1; launch with --world_size 2"):
        check_world_matches_engine(pp2, 1)


def test_build_refuses_bad_splits_and_unsupported_families(engines, tmp_path, capsys):
    with pytest.raises(ConfigError, match="pipeline parallelism .* not supported for GPT2LMHeadModel"):
        build(tiny_hf("gpt2"), tmp_path / "gpt2", pp_size=2)
    with pytest.raises(ConfigError, match="pp_size 3 is larger than the model's 2 layers"):
        build(tiny_hf("llama"), tmp_path / "deep", pp_size=3)
    _, pp2 = engines["llama"]
    code = build_main(["--checkpoint", pp2, "--output", str(tmp_path / "x"), "--pp_size", "2", "--pp_layers", "1,x"])
    assert code == 2 and "--pp_layers '1,x' must be comma-separated layer counts" in capsys.readouterr().err


def test_micro_batches_split_tokens_evenly_cutting_prompts_and_route_logits():
    batch = ForwardBatch(token_ids=list(range(10)), positions=[0, 1, 2, 3, 8, 0, 1, 2, 3, 4], seq_lens_q=[4, 1, 5],
                         context_lens=[4, 9, 5], block_tables=[[0], [1, 2], [3]], logits_indices=[3, 4, 7, 9])
    parts = split_micro_batches(batch, 2)
    assert [p.batch.seq_lens_q for p in parts] == [[4, 1], [5]]
    assert [p.batch.logits_indices for p in parts] == [[3, 4], [2, 4]]
    assert [p.logits_rows for p in parts] == [[0, 1], [2, 3]]
    assert parts[1].batch.token_ids == [5, 6, 7, 8, 9] and parts[1].batch.block_tables == [[3]]
    # Three parts cut the first and last prompts: each piece's context ends where the piece does.
    parts = split_micro_batches(batch, 3, all_logits=True)
    assert [p.batch.seq_lens_q for p in parts] == [[3], [1, 1, 1], [4]]
    assert [p.batch.context_lens for p in parts] == [[3], [4, 9, 1], [5]]
    assert [p.batch.positions for p in parts] == [[0, 1, 2], [3, 8, 0], [1, 2, 3, 4]]
    assert [p.logits_rows for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert len(split_micro_batches(batch, 50)) == 10  # at most one per token


def test_pp2_on_two_ranks_matches_pp1_and_transformers(engines, hf_models):
    from gloo_ranks import shared_pair
    from pipeline_ranks import pp_rank_logits

    expected = {name: tp_reference_steps(ModelRunner(pp1)) for name, (pp1, _) in engines.items()}
    pp2_dirs = {name: pp2 for name, (_, pp2) in engines.items()}
    for micro_batches in (1, 2):
        rank0, rank1 = shared_pair().run(pp_rank_logits, pp2_dirs, micro_batches)
        for name, reference in expected.items():
            error = (rank0[name][0] - reference).abs().max().item()
            assert error <= 1e-5, f"{name}, {micro_batches} micro-batches: max abs error {error:.3g} vs pp 1"
            layers = PP_LAYERS[name]
            assert [rank0[name][1], rank1[name][1]] == layers  # each stage's KV pool holds its layers only
            # the last step's sends (hidden states, logits) are waited on at the next step, not before returning
            assert rank0[name][2] == micro_batches and rank1[name][2] >= 1
    for name, hf in hf_models.items():
        error = (rank0[name][0] - transformers_rows(hf)).abs().max().item()
        assert error <= 1e-4, f"{name}: max abs error {error:.3g} vs transformers"


def test_pp2_of_every_admitted_architecture_matches_pp1(engines, more_engines):
    """Each architecture check_pipeline_supported admits has a pp 2 engine here or in the test above;
    at pp 2 on two ranks those here give pp 1's logits within 1e-5 and so its greedy ids."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import pp_rank_logits

    from engine.config import EngineConfig
    from engine.models import SUPPORTED_ARCHITECTURES
    from engine.pipeline.stage import pipeline_admits

    covered = {EngineConfig.load(pp1).model.architecture for pp1, _ in (engines | more_engines).values()}
    assert covered == set(filter(pipeline_admits, SUPPORTED_ARCHITECTURES))
    expected = {name: tp_reference_steps(ModelRunner(pp1)) for name, (pp1, _) in more_engines.items()}
    rank0, rank1 = shared_pair().run(pp_rank_logits, {name: pp2 for name, (_, pp2) in more_engines.items()}, 1)
    for name, reference in expected.items():
        logits = rank0[name][0]
        error = (logits - reference).abs().max().item()
        assert error <= 1e-5, f"{name}: max abs error {error:.3g} vs pp 1"
        assert torch.equal(logits.argmax(dim=-1), reference.argmax(dim=-1)), name
        assert [rank0[name][1], rank1[name][1]] == PP_MORE_LAYERS[name]


def test_pp2_graphs_per_stage_match_pp1(engines):
    """Each stage's decode and prefill graphs (emulated on the CPU, graph_emulation.py) over the
    shared gloo pair: prompts, decode steps of 3 and 1 sequences, a mixed step after them (every
    micro-batch replayed: received stream -> the static input), all within 1e-5 of pp 1 eager. With
    2 micro-batches both stages replay (decode buckets 1 and 2, prompt pieces cut mid-prompt); with 1,
    only stage 1 does, against an eager stage 0: the stream on the wire is the same either way."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import graph_reference_steps, pp_graph_logits

    pp1, pp2 = engines["llama"]
    expected = graph_reference_steps(ModelRunner(pp1))
    for micro_batches, graphed in ((2, (0, 1)), (1, (1,))):
        (logits, replays0), (_, replays1) = shared_pair().run(pp_graph_logits, pp2, micro_batches, graphed)
        error = (logits - expected).abs().max().item()
        assert error <= 1e-5, f"{micro_batches} micro-batches, graphs on {graphed}: max abs error {error:.3g} vs pp 1"
        # decode: 4 steps of 3 sequences (micro_batches replays each), 1 of one sequence (1 replay);
        # prefill: the prompts' step and the mixed step, micro_batches replays each
        expected_replays = (4 * micro_batches + 1, 2 * micro_batches)
        assert [replays0, replays1] == [expected_replays if rank in graphed else (0, 0) for rank in (0, 1)]


def test_micro_batches_per_step_one_for_small_decode_steps_more_for_long_work():
    """Llama-3.1-8B's shape at pp 2: a decode step of up to 32 sequences stays whole (a stage reads
    its weights once per micro-batch: cut in two it took 1.5x as long on the H200); 256 sequences
    over 2,100-token contexts and an 8,192-token prompt are cut (at most 4 = 2 per stage)."""
    from engine.config import EngineConfig, ModelConfig
    from engine.pipeline.step_cost import StepCost, choose_micro_batches

    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    cost = StepCost.for_engine(EngineConfig(model=model, build=BuildConfig(dtype="bfloat16", pp_size=2)))
    chosen = {name: choose_micro_batches(cost.work(n, [context] * n), 2, 4)
              for name, (n, context) in {"decode 1": (1, 4096), "decode 32": (32, 256), "decode 256 long": (256, 2100),
                                          "prompt 8192": (8192, 1)}.items()}
    assert chosen == {"decode 1": 1, "decode 32": 1, "decode 256 long": 3, "prompt 8192": 4}
    assert choose_micro_batches(0.0, 4, 8) == 1 and choose_micro_batches(1e9, 2, 4) == 4


def test_steps_in_flight_pay_only_where_a_step_grows_with_its_tokens():
    """Llama-3.1-8B's shape at pp 2 (in_flight_gain): two half-batch steps in flight lose to one
    whole step at decode batch 8 / 32 (the H200: 0.87x / 0.93x), win from ~100 sequences on, with
    prompts to fill and with two steps' worth of sequences; PipelinedSteps goes in flight at 1.1x
    and back below 1.0x (hysteresis), always with the environment variable set."""
    from types import SimpleNamespace

    from engine.config import EngineConfig, ModelConfig
    from engine.pipeline.in_flight import PipelinedSteps
    from engine.pipeline.step_cost import StepCost, in_flight_gain

    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    cost = StepCost.for_engine(EngineConfig(model=model, build=BuildConfig(dtype="bfloat16", pp_size=2)))

    def gain(seqs, tokens=None, context=256):
        tokens = seqs if tokens is None else tokens
        return in_flight_gain(cost, 2, 2, seqs=seqs, tokens=tokens, context=seqs * context, max_batch_size=256,
                              max_num_tokens=8192)

    assert gain(1) == 1.0 and gain(8) < gain(32) < 1.0 < gain(64) < 1.1 < gain(128) < gain(256) < gain(512)
    assert gain(512) > 1.8 and gain(1024, 1024 * 128, 128) > 1.25 and gain(40, 40 * 128, 128) > 1.25
    # The build's balanced split (17,15) takes the head's extra off the slowest stage: steps in flight gain more
    balanced = StepCost.for_engine(EngineConfig(model=model, build=BuildConfig(dtype="bfloat16", pp_size=2,
                                                                               pp_layers=[17, 15])))
    assert balanced.layer_shares == (17 / 16, 15 / 16)
    assert in_flight_gain(balanced, 2, 2, seqs=128, tokens=128, context=128 * 256, max_batch_size=256,
                          max_num_tokens=8192) > 1.03 * gain(128)

    def seqs(n):
        return [SimpleNamespace(token_ids=[0] * 256, num_computed_tokens=255) for _ in range(n)]

    scheduler = SimpleNamespace(running=[], waiting=[], max_batch_size=256, max_num_tokens=8192)
    runner = SimpleNamespace(step_cost=cost, place=SimpleNamespace(stage=SimpleNamespace(pp_size=2)))
    steps = PipelinedSteps(SimpleNamespace(scheduler=scheduler, runner=runner), 2)
    chosen = []
    for n in (8, 32, 64, 128, 64, 48, 32, 64, 300):
        scheduler.running = seqs(n)
        chosen.append(steps._pays())
    assert chosen == [False, False, False, True, True, True, False, False, True]
    assert PipelinedSteps(SimpleNamespace(scheduler=scheduler, runner=runner), 2, always=True).in_flight

    # A launched step is one micro-batch next to a step of its size, cut for its excess over it.
    decode_256, prompt_2048 = cost.work(256, [192] * 256), cost.work(2048, [2048])
    assert steps._micro_batches(prompt_2048) == 4  # (nothing in flight: cut as one step alone)
    steps.pending.append(SimpleNamespace(work=decode_256))
    assert steps._micro_batches(cost.work(256, [200] * 256)) == 1 and steps._micro_batches(prompt_2048) == 3
    steps.pending[-1].work = prompt_2048
    assert steps._micro_batches(prompt_2048) == 1


def test_rank0_receives_each_micro_batch_logits_right_after_sending_it(engines):
    """At pp 2 one NCCL communicator and stream carry both directions between rank 0 and the last
    stage: rank 0's calls must interleave as the last stage's do (receive a micro-batch, send its
    logits), or a send bigger than NCCL's buffers waits on a peer blocked in its own send."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import pp_p2p_order

    _, pp2 = engines["llama"]
    assert shared_pair().run(pp_p2p_order, pp2) == [["send", "recv", "send", "recv"], ["recv", "send", "recv", "send"]]


def test_pp2_executor_with_two_steps_in_flight_matches_pp1(engines):
    """The executor keeps two steps in flight over the shared gloo pair (engine/pipeline/in_flight.py):
    six greedy prompts through a batch of 4 (two wait, then join) give pp 1's tokens; rank 0 launches
    a step before finishing the one before it, and steps in flight together hold disjoint sequences;
    a request cancelled mid-flight stops with a prefix of its tokens while the others finish; a
    request with a repetition penalty then takes the one-step path (no launch) and still matches."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import _run_streaming, pipelined_executor_run

    from engine.executor import Executor, ExecutorConfig
    from engine.executor.request import Request, SamplingConfig
    from engine_testing import EXECUTOR_POOL, random_tokens

    def greedy(prompt, max_tokens, **sampling):
        return Request(prompt, max_tokens, streaming=True, sampling=SamplingConfig(top_k=1, **sampling))

    requests = [greedy(random_tokens(3 + 2 * i, seed=40 + i), 14 if i == 0 else 5 + i) for i in range(6)]
    then = [greedy(random_tokens(7, seed=50), 6, repetition_penalty=1.3), greedy(random_tokens(4, seed=51), 5)]
    pp1, pp2 = engines["llama"]
    with Executor(pp1, ExecutorConfig(**EXECUTOR_POOL), device="cpu") as executor:
        expected = _run_streaming(executor, requests, None)
        expected_then = _run_streaming(executor, then, None)
    result, _ = shared_pair().run(pipelined_executor_run, pp2, requests, 3, then)

    cancelled, *rest = result["tokens"]
    assert rest == expected[1:]
    assert cancelled[1] == "CANCELLED" and 0 < len(cancelled[0]) < 14 and cancelled[0] == expected[0][0][:len(cancelled[0])]
    assert result["then"] == expected_then and result["then_calls"] == []  # (the penalty: one step at a time)

    calls, launches = result["calls"], result["launches"]
    order = {call: index for index, call in enumerate(calls)}
    overlapped = [n for n in range(1, len(launches)) if order[("launch", n + 1)] < order[("finish", n)]]
    assert len(overlapped) >= len(launches) // 2, calls  # (steady state: every step)
    for n in overlapped:  # launched while step n was in flight: other sequences
        assert not set(launches[n - 1]) & set(launches[n]), (n, launches[n - 1], launches[n])
    assert result["forwards"] == [] and set(result["micro_batches"]) == {1}  # (=2: every step launched, whole)

    # The default (no TRITONLLM_PP_STEPS_IN_FLIGHT): steps in flight only while they pay, here (a
    # stand-in for in_flight_gain) from 3 sequences on: in flight while 6 then 5..3 run, then the
    # launched steps drain and the last 2 sequences go one step at a time; same tokens, with each
    # launched step in two micro-batches (as a long prompt's next to a decode step would be).
    auto, _ = shared_pair().run(pipelined_executor_run, pp2, requests, None, None, "auto")
    assert auto["tokens"] == expected
    assert auto["launches"] and max(map(len, auto["launches"])) <= 3  # (6 over 2 steps in flight)
    assert set(auto["micro_batches"]) == {2}
    assert auto["forwards"] and max(auto["forwards"]) <= 2, auto["forwards"]  # (one step: fewer than 3 left)


def test_steps_in_flight_only_for_pipelines_of_one_rank_per_stage(caplog):
    from types import SimpleNamespace

    from engine.pipeline.in_flight import STEPS_IN_FLIGHT_ENV, steps_in_flight

    def runner(pp_size, tp_size):
        return SimpleNamespace(launch=None, place=SimpleNamespace(tp_size=tp_size, stage=SimpleNamespace(pp_size=pp_size)))

    on = {STEPS_IN_FLIGHT_ENV: "2"}
    assert steps_in_flight(runner(2, 1), on) == 2 and steps_in_flight(runner(4, 1), {STEPS_IN_FLIGHT_ENV: "4"}) == 4
    assert steps_in_flight(runner(2, 1), {}) == 2 and steps_in_flight(runner(4, 1), {}) == 4  # (default: pp_size)
    assert steps_in_flight(runner(2, 1), {STEPS_IN_FLIGHT_ENV: "1"}) == 1 == steps_in_flight(runner(2, 1), {STEPS_IN_FLIGHT_ENV: "0"})
    assert steps_in_flight(runner(2, 2), {}) == 1 and not caplog.text  # (tp_size 2 by default: quietly one)
    assert steps_in_flight(SimpleNamespace(launch=None), on) == 1  # (a LeaderRunner over tensor-parallel ranks)
    assert steps_in_flight(runner(2, 2), on) == 1 and "ignored with tp_size 2" in caplog.text


def test_plan_carries_whether_the_last_stage_samples():
    """Rank 0 decides; every rank reads it from the plan (a bool field: sent as 0/1, back as a bool)."""
    from engine.tensor_parallel.step_protocol import decode_batch, encode_batch

    batch = ForwardBatch(token_ids=[5, 6], positions=[0, 3], seq_lens_q=[1, 1], context_lens=[1, 4],
                         block_tables=[[2], [0]], logits_indices=[0, 1], sampled_tokens_slot=4, micro_batches=2)
    for flag in (True, False):
        sent = torch.frombuffer(bytearray(encode_batch(replace(batch, sample_on_last_stage=flag)).numpy().tobytes()),
                                dtype=torch.int32)
        received = decode_batch(sent, ForwardBatch)
        assert received == replace(batch, sample_on_last_stage=flag) and received.sample_on_last_stage is flag


def test_last_stage_sends_rank0_the_greedy_ids_of_the_logits_it_would_have_sent(engines):
    """Each step of tp_reference_steps sampled on the last stage: rank 0 receives exactly
    greedy_tokens of the logits it receives today (same run, same float32 logits), which are
    pp 1's argmax; the last stage sends one int64 id per row (per micro-batch), no logits."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import pp_rank_last_stage_ids

    from kernels.sampling import greedy_tokens

    pp1, pp2 = engines["llama"]
    reference = tp_reference_steps(ModelRunner(pp1))
    for micro_batches in (1, 2):
        (logits, ids, to_rank0), (_, _, sent) = shared_pair().run(pp_rank_last_stage_ids, pp2, micro_batches)
        assert ids.dtype == torch.int64 and torch.equal(ids, greedy_tokens(logits))
        assert torch.equal(ids, reference.argmax(dim=-1))
        assert to_rank0 == []  # (rank 0 is stage 0: it sends rank 1 the hidden states, nothing to itself)
        assert {dtype for dtype, _ in sent} == {torch.int64} and all(len(shape) == 1 for _, shape in sent)
        assert sum(shape[0] for _, shape in sent) == len(ids) and len(sent) == 2 * micro_batches  # (2 steps)


def test_last_stage_draws_rank0s_seeded_tokens_from_the_packed_settings(engines):
    """Steps of greedy rows beside rows drawn at temperature 0.7 with top-k and top-p, each seeded
    (pipeline_ranks.step_draws), sampled on the last stage, per micro-batch: rank 0 receives exactly
    what its own sampler draws from the logits it receives today (the whole step at once, with the
    settings build_sampling_metadata would give it: packed_draws.draw_metadata of the step)."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import pp_rank_last_stage_ids, step_draws

    from engine.executor.packed_draws import draw_metadata
    from engine.executor.sampler import sample

    _, pp2 = engines["llama"]
    for micro_batches in (1, 2):
        (logits, ids, _), (_, _, sent) = shared_pair().run(pp_rank_last_stage_ids, pp2, micro_batches, True)
        steps = logits.split([19, 4])  # (tp_reference_steps: a prompt step of 6 + 13 rows, then 3 + 1)
        expected = torch.cat([sample(step, draw_metadata(step_draws(len(step), VOCAB), list(range(len(step))), VOCAB,
                                                         "cpu")).token_ids for step in steps])
        assert torch.equal(ids, expected) and not torch.equal(ids, logits.argmax(dim=-1))  # (drawn, not the argmax)
        assert {dtype for dtype, _ in sent} == {torch.int64} and len(sent) == 2 * micro_batches


def test_pp2_executor_samples_on_the_last_stage_and_falls_back_for_the_rest(engines):
    """Greedy requests beside two seeded sampled ones (top-k; top-p) and one asking for log-probs:
    the same tokens as pp 1 whether two steps are in flight or one at a time. Steps whose rows only
    draw (greedy or seeded) were sampled on the last stage, with the draws packed where a sampled
    row is among them; those with the log-prob request's row on rank 0 (both kinds occur on both
    paths); a penalty request (host tokens every step) keeps every step on rank 0; with
    TRITONLLM_PP_SAMPLE_ON_LAST_STAGE=0 no step is, same tokens."""
    from gloo_ranks import shared_pair
    from pipeline_ranks import _run_streaming, pipelined_executor_run

    from engine.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request, SamplingConfig
    from engine_testing import EXECUTOR_POOL, random_tokens

    def request(prompt_seed, max_tokens, **sampling):
        return Request(random_tokens(4 + prompt_seed % 5, seed=prompt_seed), max_tokens, streaming=True,
                       sampling=SamplingConfig(**({"top_k": 1} | sampling)))

    requests = [request(60 + i, 6 + i) for i in range(4)]
    requests.append(request(70, 7, temperature=0.8, top_k=5, seed=5))
    requests.append(request(74, 6, temperature=1.3, top_k=None, top_p=0.9, seed=2**40 + 3))
    log_probs = request(71, 5)
    log_probs.output = OutputConfig(return_log_probs=True)
    requests.append(log_probs)
    then = [request(72, 5), request(73, 6, repetition_penalty=1.3)]
    pp1, pp2 = engines["llama"]
    with Executor(pp1, ExecutorConfig(**EXECUTOR_POOL), device="cpu") as executor:
        expected = _run_streaming(executor, requests, None)
        expected_then = _run_streaming(executor, then, None)

    def flags(result, kind, of="sampled_on_last_stage"):
        return [flag for step, flag, _ in result[of] if step == kind]

    def with_draws(result):
        return [step for step, flag, draws in result["sampled_on_last_stage"] if flag and draws]

    in_flight, _ = shared_pair().run(pipelined_executor_run, pp2, requests, None, then)
    assert in_flight["tokens"] == expected and in_flight["then"] == expected_then
    assert True in flags(in_flight, "launch") and False in flags(in_flight, "launch"), in_flight["sampled_on_last_stage"]
    assert "launch" in with_draws(in_flight)  # (the seeded requests' steps)
    then_steps = flags(in_flight, "forward", "then_sampled_on_last_stage")
    assert then_steps and not any(then_steps)  # (the penalty request's steps, one at a time)

    one_step, _ = shared_pair().run(pipelined_executor_run, pp2, requests, None, None, "1")
    assert one_step["tokens"] == expected and not flags(one_step, "launch")
    assert True in flags(one_step, "forward") and False in flags(one_step, "forward"), one_step["sampled_on_last_stage"]
    assert "forward" in with_draws(one_step)

    off, _ = shared_pair().run(pipelined_executor_run, pp2, requests, None, None, "2", False)
    assert off["tokens"] == expected
    assert off["sampled_on_last_stage"] and not any(flag for _, flag, _ in off["sampled_on_last_stage"])


def test_dropped_steps_are_finished_in_launch_order_whatever_their_runner_raises():
    """After an internal error the executor drops its launched steps (PipelinedSteps.drop): each is finished,
    oldest first (its transfers waited on, its result unread), so that the leader's count of unfinished steps goes
    back to zero (LeaderRunner sends no heartbeat while it is not: the workers' plan receive would time out while
    the executor idles), and a runner that fails there does not stop the others from being finished."""
    from types import SimpleNamespace

    from engine.pipeline.in_flight import PipelinedSteps

    finished = []

    def finish(launched):
        finished.append(launched)
        if launched == "second":
            raise RuntimeError("rank lost")

    scheduler = SimpleNamespace(max_batch_size=4)
    steps = PipelinedSteps(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(finish=finish)), 2)
    steps.pending.extend(SimpleNamespace(launched=name) for name in ("first", "second", "third"))
    steps.drop()
    assert finished == ["first", "second", "third"] and not steps.pending
