"""Tensor and pipeline parallelism on 2 GPUs: TP 2 and PP 2 must equal TP 1 on greedy outputs; decode and offline speed of each.

    python benchmarks/engine/tp_bench.py --out tp_bench.json --results-md benchmarks/results/engine.md

One command, from the checkout's root, on a machine with 2 GPUs (no mpirun or torchrun needed: it
starts every rank itself, with the variables mpirun would set). Four phases, each a fresh set of processes (``--phase_timeout`` each):

1. ``greedy_tp1`` / ``greedy_tp2`` (float32): 8 prompts of random token ids, 32 greedy tokens each,
   straight through ``make_runner`` (rank 0) and ``engine.tensor_parallel.worker``'s loop (rank 1),
   stepped as the overlapped executor steps them (each step's tokens stay on the devices and the
   next step names them by placeholder ids). The check passes when every generated token is
   equal; the first step's logits are compared too.
   float32 because bf16 greedy decoding of a random 32-layer model differs between *any* two
   summation orders after a few tokens (near-ties); that says nothing about sharding.
2. ``perf_tp1`` / ``perf_tp2`` (bfloat16): decode tokens/s through the runner at batch 1, 8, 32
   (prompt 128, 128 steps, argmax synced every step as a sampler would), then offline
   throughput through the in-flight-batching Executor (all requests enqueued at once).
3. ``greedy_pp2`` / ``perf_pp2`` (not in the default ``--phases``): the same with two pipeline stages
   (engine.build's even split, 16 and 16 layers of this shape, or ``--pp_layers`` (``balanced``: by cost);
   engine/pipeline; each stage replays its own decode graphs; micro-batches per step chosen per
   step, or fixed by ``$TRITONLLM_PP_MICRO_BATCHES``). Each perf phase also reports its KV pool
   (``kv_tokens``: tokens of every layer it holds; a stage holds half the layers, so the pool grows).
   With CUDA graphs, each perf phase first checks them against its own eager steps
   (``graphs_vs_eager``: the same prompt step and decode steps replayed, then run eagerly, at batch
   1, 3 and 8). ``--perf_sections offline`` keeps only the offline runs (each with its steps' periods).
   ``--trace_steps N`` (PP phases): a torch.profiler window on every rank over N decode-only steps at the widest
   batch, summarised per rank and step and as the pipeline's loop across the ranks (benchmarks/engine/step_trace.py).

The model has Llama-3.1-8B's shape (32 layers, 32/8 heads, hidden 4096, vocab 128256) and
random weights made on the GPUs: every rank generates the same full tensors from a fixed seed
(one per tensor name) and keeps its shard, through the engine's own converter
(``engine.convert.iter_rank_weights``), so TP 1 and TP 2 hold exactly the same model.
``--model tiny --device cpu`` runs the whole flow on CPU (gloo) as a smoke test.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import engine.executor.runner as runner_module  # noqa: E402
from benchmarks.common import (MODELS, add_model_arguments, command_line, cuda_time_ms, free_port, git_commit,  # noqa: E402
                               print_table, utc_now)
from benchmarks.engine.engine_bench import bench_executor_decode, drain_offline  # noqa: E402
from benchmarks.engine.step_timeline import describe, reset, summarize, timed  # noqa: E402
from benchmarks.engine import step_trace  # noqa: E402
from engine.config import BuildConfig, EngineConfig, ModelConfig  # noqa: E402
from engine.convert import CheckpointError, iter_rank_weights  # noqa: E402
from engine.executor.overlap import placeholder  # noqa: E402
from engine.executor.runner import ForwardBatch, ModelRunner  # noqa: E402
from engine.pipeline.layout import balanced_pp_layers, parse_pp_layers, stage_of_rank, stage_tensor_name  # noqa: E402
from engine.tensor_parallel.distributed import make_runner, run_worker  # noqa: E402


PHASES = ("greedy_tp1", "greedy_tp2", "perf_tp1", "perf_tp2")
PP_PHASES = ("greedy_pp2", "perf_pp2")  # asked for by name in --phases
GRAPH_CHECK_BATCHES = (1, 3, 8)  # 3: a bucket of 4 with a padding row
PERF_SECTIONS = ("graphs", "decode", "executor_decode", "offline")
# Steps whose stats the perf phases' executor keeps: all of an offline run's (step_periods reads them; the
# executor's default 1,000 dropped the first steps of a longer run, whose first period then spanned them)
STEP_STATS_KEPT = 1 << 16


def phase_mapping(phase: str) -> tuple[int, int]:
    """``perf_tp2`` -> (tp 2, pp 1); ``greedy_pp2`` -> (tp 1, pp 2)."""
    size = int(phase[-1])
    return (1, size) if phase[-3:-1] == "pp" else (size, 1)
DECODE_BATCHES = (1, 8, 32)


# ---- the model: identical random weights on every rank, sharded by the engine's converter ------


def hf_llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for a Llama-family checkpoint of ``cfg`` (no biases; Qwen3's
    q/k norms; a mixture of experts' router and stacked experts on its sparse layers)."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        })
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)})
        if cfg.num_experts and cfg.is_moe_layer(i):  # transformers 5's stacked experts, [gate | up] rows
            experts, expert_inter = cfg.num_experts, cfg.moe_intermediate_size
            shapes.update({p + "mlp.gate.weight": (experts, h),
                           p + "mlp.experts.gate_up_proj": (experts, 2 * expert_inter, h),
                           p + "mlp.experts.down_proj": (experts, h, expert_inter)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def random_getter(cfg: ModelConfig, device: torch.device, seed: int):
    """A TensorGetter of random full tensors: the same values on every device for the same name.

    Scales keep a random 32-layer model numerically tame and its logits peaked: matrices
    N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.05^2), lm_head 4x a matrix.
    """
    shapes = hf_llama_shapes(cfg)

    def get(name: str) -> torch.Tensor:
        if name not in shapes:
            raise CheckpointError(f"random checkpoint has no tensor {name!r}")
        shape = shapes[name]
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            return 1.0 + 0.05 * values
        if name == "model.embed_tokens.weight":
            return values
        scale = (4.0 if name == "lm_head.weight" else 1.0) / shape[-1] ** 0.5
        return values * scale

    return get


def random_rank_weights(engine_dir: str, rank: int, device, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Stands in for ``load_rank_weights``: the rank's shard of the seeded random model."""
    config = EngineConfig.load(engine_dir)
    dtype = getattr(torch, config.build.dtype)
    get = random_getter(config.model, torch.device(device), seed)
    if config.build.pp_size == 1:
        return dict(iter_rank_weights(get, config.model, rank, config.build.tp_size, dtype))
    # A pipeline stage's file: its layers renumbered from 0, as engine.build writes them (rank = stage * tp + tp_rank).
    stage, tp_rank = stage_of_rank(config.model, config.build, rank)
    held = {}
    for name, tensor in iter_rank_weights(get, config.model, tp_rank, config.build.tp_size, dtype):
        local = stage_tensor_name(name, stage, config.model.tie_word_embeddings)
        if local is not None:
            held[local] = tensor
    return held


class EagerRunner(ModelRunner):
    """The runner without decode CUDA graphs (``--no_graphs``)."""

    def capture_cuda_graphs(self) -> None:
        pass


def runner_class(args) -> type:
    """Every rank must use the same class: graph capture runs collectives."""
    base = EagerRunner if args.no_graphs else ModelRunner
    return timed(base) if args.timing else base


def use_random_weights() -> None:
    """Every runner of this process loads its shard from ``random_rank_weights``.

    (Not the runner's own ``extra.random_weights_seed`` engines: those draw each rank's shard
    from its own seed, so TP 1 and TP 2 would be different models.)
    """
    runner_module.load_rank_weights = random_rank_weights


def write_engine_config(root: str, model: str, dtype: str, tp_size: int, max_batch_size: int = 64, pp_size: int = 1,
                        pp_layers: list[int] | str | None = None) -> str:
    engine_dir = os.path.join(root, f"{model}-{dtype}-tp{tp_size}" + (f"-pp{pp_size}" if pp_size > 1 else ""))
    build = BuildConfig(dtype=dtype, max_batch_size=max_batch_size, max_input_len=2048, max_seq_len=4096, max_num_tokens=8192,
                        tokens_per_block=32, tp_size=tp_size, pp_size=pp_size)
    model_config = ModelConfig(**MODELS[model])
    if pp_size > 1 and pp_layers == "balanced":  # engine.build --pp_layers balanced
        build.pp_layers = balanced_pp_layers(model_config, build)
    elif pp_size > 1:
        build.pp_layers = pp_layers  # None: the even split, as engine.build without --pp_layers
    EngineConfig(model=model_config, build=build, extra={"tp_bench_seed": 0}).validate().save(engine_dir)
    return engine_dir


# ---- rank 0's work -----------------------------------------------------------------------------------


class SequenceBlocks:
    """Sequence i owns the blocks [1 + i * per_seq, 1 + (i + 1) * per_seq) of the pool."""

    def __init__(self, tokens_per_block: int, max_len: int):
        self.page = tokens_per_block
        self.per_seq = -(-max_len // tokens_per_block)

    def table(self, seq: int, length: int) -> list[int]:
        first = 1 + seq * self.per_seq
        return list(range(first, first + -(-length // self.page)))

    def blocks_needed(self, num_seqs: int) -> int:
        return 1 + num_seqs * self.per_seq


def prefill_batch(prompts: list[list[int]], blocks: SequenceBlocks) -> ForwardBatch:
    """One packed prefill of every prompt, scoring each prompt's last token."""
    tokens, positions, ends = [], [], []
    for prompt in prompts:
        tokens += prompt
        positions += range(len(prompt))
        ends.append(len(tokens) - 1)
    lens = [len(p) for p in prompts]
    tables = [blocks.table(i, n) for i, n in enumerate(lens)]
    return ForwardBatch(tokens, positions, lens, list(lens), tables, ends)


def prefill(runner, prompts: list[list[int]], blocks: SequenceBlocks) -> torch.Tensor:
    """One packed prefill of every prompt -> last-token logits (len(prompts), vocab)."""
    return runner.forward(prefill_batch(prompts, blocks))


def decode_step(runner, last: list[int], lengths: list[int], blocks: SequenceBlocks) -> torch.Tensor:
    """One token per sequence; ``lengths`` are the sequences' lengths including ``last``."""
    n = len(last)
    tables = [blocks.table(i, length) for i, length in enumerate(lengths)]
    return runner.forward(ForwardBatch(list(last), [x - 1 for x in lengths], [1] * n, list(lengths), tables,
                                       list(range(n))))


def greedy(runner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor, bool]:
    """Greedy decoding as the overlapped executor drives the ranks: each step's argmax stays on the
    device (stored in the runner's sampled-token ring, and broadcast to every rank in leader mode)
    and the next step names it by placeholder ids; the host reads the tokens only at the end.
    Pipeline stages: the decode steps are sampled on the last stage (its ids come back instead of
    the logits) where the runner offers it, as the executor does for greedy steps
    (engine/pipeline/runner.py; off with TRITONLLM_PP_SAMPLE_ON_LAST_STAGE=0); the prompt step's
    logits come back for the first-step comparison. Returns (tokens, first logits, whether the
    decode steps were sampled on the last stage)."""
    on_last_stage = bool(getattr(runner, "samples_on_last_stage", False))
    blocks = SequenceBlocks(runner.tokens_per_block, max(map(len, prompts)) + steps)
    runner.allocate_kv_cache(runner.num_kv_blocks_for(max_tokens=blocks.blocks_needed(len(prompts)) * blocks.page))
    half = runner.sampled_ring_slots // 2  # (draft slots past the two halves are not the ring's)
    lens = [len(p) for p in prompts]
    tokens, positions, ends = [t for p in prompts for t in p], [i for n in lens for i in range(n)], []
    for n in lens:
        ends.append((ends[-1] if ends else -1) + n)
    batch = ForwardBatch(tokens, positions, lens, list(lens), [blocks.table(i, n) for i, n in enumerate(lens)], ends, 0)
    logits = runner.forward(batch)
    first_logits = logits.cpu()
    on_device = [logits.argmax(-1)]
    runner.store_sampled_tokens(on_device[-1], batch)
    lengths = [n + 1 for n in lens]
    for step in range(1, steps):
        n = len(prompts)
        last = [placeholder(batch.sampled_tokens_slot + i) for i in range(n)]
        batch = ForwardBatch(last, [x - 1 for x in lengths], [1] * n, list(lengths),
                             [blocks.table(i, length) for i, length in enumerate(lengths)], list(range(n)),
                             (step % 2) * half, sample_on_last_stage=on_last_stage)
        out = runner.forward(batch)
        on_device.append(out if on_last_stage else out.argmax(-1))
        runner.store_sampled_tokens(on_device[-1], batch)
        lengths = [x + 1 for x in lengths]
    columns = [t.tolist() for t in on_device]
    return [list(row) for row in zip(*columns)], first_logits, on_last_stage


def greedy_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(vocab) for _ in range(length)] for length in (5, 17, 33, 64, 100, 128, 200, 250)]


def bench_decode(runner, batch_size: int, prompt_len: int = 128, steps: int = 128) -> dict:
    """Decode tokens/s of ``batch_size`` sequences through the runner, argmax synced every step."""
    rng = random.Random(batch_size)
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]
    blocks = SequenceBlocks(runner.tokens_per_block, prompt_len + steps + 1)
    last = prefill(runner, prompts, blocks).argmax(-1).tolist()
    lengths = [prompt_len + 1] * batch_size
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        last = decode_step(runner, last, lengths, blocks).argmax(-1).tolist()
        times.append(time.perf_counter() - started)
        lengths = [x + 1 for x in lengths]
    steady = sorted(times[8:])
    return {"batch": batch_size, "tok_s": batch_size * len(steady) / sum(steady),
            "step_ms_median": steady[len(steady) // 2] * 1e3}


def graphs_vs_eager(runner, batch_size: int, prompt_len: int = 64, steps: int = 8) -> dict:
    """The prompts' step and each decode step twice: as served (decode and mixed-step graphs; a
    pipeline stage's too) and eagerly (``all_logits``: no graph takes such a step), over the same
    KV state: a step's KV writes are the same tokens at the same slots. Logits compared row by row
    (the prompts' last tokens, then every decode row); the eager argmax goes on."""
    rng = random.Random(7 + batch_size)
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]
    blocks = SequenceBlocks(runner.tokens_per_block, prompt_len + steps + 1)
    batch = prefill_batch(prompts, blocks)
    worst, largest, argmax_equal, last = 0.0, 0.0, 0, []
    lengths = [prompt_len] * batch_size
    for _ in range(steps + 1):
        graphed = runner.forward(batch).float()
        eager = runner.forward(batch, all_logits=True).float()[batch.logits_indices]
        worst = max(worst, (graphed - eager).abs().max().item())
        largest = max(largest, eager.abs().max().item())
        argmax_equal += int((graphed.argmax(-1) == eager.argmax(-1)).sum())
        last = eager.argmax(-1).tolist()
        lengths = [x + 1 for x in lengths]
        batch = ForwardBatch(list(last), [x - 1 for x in lengths], [1] * batch_size, list(lengths),
                             [blocks.table(i, length) for i, length in enumerate(lengths)], list(range(batch_size)))
    return {"batch": batch_size, "rows": batch_size * (steps + 1), "argmax_equal": argmax_equal,
            "logits_max_abs_diff": worst, "logits_max_abs": largest}


def bench_offline(executor, vocab: int, in_len: int, out_len: int, num_requests: int) -> dict:
    from engine.executor.request import OutputConfig, Request

    rng = random.Random(in_len * 31 + out_len)
    requests = [Request(input_token_ids=[rng.randrange(vocab) for _ in range(in_len)], max_tokens=out_len,
                        output=OutputConfig(exclude_input_from_output=True)) for _ in range(num_requests)]
    since_ns, started = time.time_ns(), time.perf_counter()
    executor.enqueue_requests(requests)
    output_tokens = drain_offline(executor, num_requests)
    elapsed = time.perf_counter() - started
    return {"input_len": in_len, "output_len": out_len, "requests": num_requests, "seconds": elapsed,
            "output_tok_s": output_tokens / elapsed, "steps": step_periods(executor, since_ns)}


def step_periods(executor, since_ns: int) -> dict:
    """Where an offline run's wall time went, from the executor's per-step stats. A step's period is
    the time since the step recorded before it, or since the enqueue (each step records once its tokens are sampled, so
    with steps in flight too the periods add up to the run); steps with prompt tokens and
    decode-only ones apart. The decode-only period at the widest batch is the steady state: with
    pipeline stages and steps in flight, one GPU's step at that batch over ~pp_size when the stages
    keep each other busy."""
    history = [h for h in executor.get_iteration_stats_history() if h.timestamp_ns >= since_ns]
    stamps = [since_ns] + [h.timestamp_ns for h in history]  # (the first step's period starts at the enqueue)
    periods = [(h, (stamp - before) / 1e6) for before, stamp, h in zip(stamps, stamps[1:], history)]
    prompt = [ms for h, ms in periods if h.num_context_requests]
    decode = [(h.num_gen_requests, ms) for h, ms in periods if not h.num_context_requests and h.num_gen_requests]
    out = {"steps": len(history), "prompt_steps": len(prompt), "prompt_seconds": sum(prompt) / 1e3,
           "decode_steps": len(decode), "decode_seconds": sum(ms for _, ms in decode) / 1e3}
    if decode:
        widest = max(batch for batch, _ in decode)
        at_widest = sorted(ms for batch, ms in decode if batch == widest)
        out.update(decode_batch=widest, decode_steps_at_batch=len(at_widest),
                   decode_period_ms_median=at_widest[len(at_widest) // 2])
        graphs = getattr(executor.runner, "decode_graphs", None)
        # (not with tensor-parallel ranks: their graphs hold all-reduces, which a replay on rank 0 alone would wait in)
        if (graphs is not None and executor.runner.device.type == "cuda" and widest <= graphs.max_batch_size
                and executor.runner.build_config.tp_size == 1):
            time.sleep(0.2)  # (the executor samples what it still had launched: its last steps' sequences finished)
            # Rank 0's graph at that batch alone: one GPU's step, or a pipeline's first stage (no transfers in it).
            # A figure on the side: its failure must not cost the run's throughput (first tried on a GPU call).
            try:
                out["decode_graph_inputs"] = replay_inputs_of_a_widest_step(graphs, widest)
                out["decode_graph_replay_ms"] = cuda_time_ms(graphs.graphs[graphs.bucket_for(widest)].replay, repeat=10)
            except Exception as err:  # noqa: BLE001
                out["decode_graph_replay_error"] = f"{type(err).__name__}: {err}"
    return out


WIDEST_STEP_SAVED = 60  # the widest decode step whose inputs the graph-alone timing replays (a steady one)


def remember_a_widest_step(graphs) -> None:
    """Keep the inputs of the WIDEST_STEP_SAVED-th decode step of ``graphs.max_batch_size`` sequences (and of the
    first, in case there are fewer) that this DecodeGraphs replays (``graphs.widest_inputs``). Why: the graphs' static
    inputs are one set for every bucket, each run writing only its own bucket's rows and the step's key splits,
    so after a run the widest graph replayed what the last steps left there (a few rows of the last step, the rest
    older steps', the key splits of a small batch): its time alone moved from run to run (session 21, one lease:
    3.91 ms with 17 layers on rank 0, 4.47 with 15, 4.28 with 16)."""
    run = graphs.run
    seen = [0]

    def remembering_run(token_ids, positions, context_lens, block_tables, *args, **kwargs):
        if len(token_ids) == graphs.max_batch_size:
            seen[0] += 1
            if seen[0] in (1, WIDEST_STEP_SAVED):
                graphs.widest_inputs = (seen[0], list(token_ids), list(positions), list(context_lens),
                                        [list(table) for table in block_tables])
        return run(token_ids, positions, context_lens, block_tables, *args, **kwargs)

    graphs.run = remembering_run


def replay_inputs_of_a_widest_step(graphs, widest: int) -> str:
    """Put a remembered widest step's inputs back in the graphs' static buffers (one run: its KV writes go to
    blocks of sequences that have finished) and say which; else say that the buffers hold what was left."""
    saved = getattr(graphs, "widest_inputs", None)
    if saved is None or len(saved[1]) != widest:
        return "left over from the run's last steps"
    number, token_ids, positions, context_lens, tables = saved
    graphs.run(token_ids, positions, context_lens, tables)
    return f"decode step {number} of {widest} sequences, contexts {min(context_lens)}-{max(context_lens)}"


def describe_steps(steps: dict) -> str:
    text = (f"{steps['prompt_steps']} steps with prompt tokens {steps['prompt_seconds']:.2f} s, "
            f"{steps['decode_steps']} decode-only {steps['decode_seconds']:.2f} s")
    if "decode_batch" in steps:
        text += (f"; decode-only at batch {steps['decode_batch']}: period {steps['decode_period_ms_median']:.2f} ms "
                 f"(median of {steps['decode_steps_at_batch']})")
    if "decode_graph_replay_ms" in steps:
        text += (f", rank 0's decode graph alone {steps['decode_graph_replay_ms']:.2f} ms"
                 f" (inputs: {steps.get('decode_graph_inputs', '-')})")
    return text


def run_greedy_phase(args) -> dict:
    runner = make_runner(args.engine_dir, device=args.device)  # eager: no graphs are captured here
    prompts = greedy_prompts(runner.vocab_size)
    started = time.perf_counter()
    tokens, first_logits, on_last_stage = greedy(runner, prompts, args.greedy_steps)
    torch.save(first_logits, args.out + ".logits.pt")
    result = {"tokens": tokens, "seconds": time.perf_counter() - started, "sampled_on_last_stage": on_last_stage}
    if hasattr(runner, "shutdown"):
        runner.shutdown()
    return result


def run_perf_phase(args) -> dict:
    import engine.executor.executor as executor_module
    from engine.executor.executor import Executor, ExecutorConfig

    # The executor builds its runner through make_runner(..., runner_class=ModelRunner).
    executor_module.ModelRunner = runner_class(args)
    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=0.85, enable_kv_cache_reuse=False,
                            iter_stats_max_iterations=STEP_STATS_KEPT)
    executor = Executor(args.engine_dir, config, device=args.device)
    graphs = args.device.startswith("cuda") and not args.no_graphs
    pipelined = executor.pipelined  # (engine/pipeline/in_flight.py; TRITONLLM_PP_STEPS_IN_FLIGHT)
    steps_in_flight = pipelined.depth if pipelined is not None else 1
    always = pipelined is not None and pipelined.always
    if TRACER is not None:
        TRACER.depth = steps_in_flight  # (the pipeline's loop: step k -> k + depth)
    progress(f"executor ready (weights, KV pool, graphs; steps in flight: {steps_in_flight}"
             + (" always" if always else " where they pay" if pipelined is not None else "")
             + ("; steps sampled on the last stage where they only draw" if executor._last_stage_sampling else "") + ")")

    def launched() -> int:  # steps launched in flight so far (the rest went one at a time)
        return pipelined._launched if pipelined is not None else 0
    if getattr(executor.runner, "decode_graphs", None) is not None:
        remember_a_widest_step(executor.runner.decode_graphs)  # (the graph-alone timing's inputs)
    try:
        vocab = executor.runner.vocab_size
        bench_offline(executor, vocab, 64, 8, 8)  # warm-up: compile kernels for prefill and decode shapes
        progress("warm-up done")
        sections = args.perf_sections
        checks = ([graphs_vs_eager(executor.runner, batch) for batch in GRAPH_CHECK_BATCHES]
                  if graphs and "graphs" in sections else [])
        for check in checks:
            progress(f"graphs vs eager, batch {check['batch']}: argmax equal on {check['argmax_equal']}/{check['rows']} "
                     f"rows, logits max |diff| {check['logits_max_abs_diff']:.3g} (max |logit| {check['logits_max_abs']:.1f})")
        # Direct runner steps while the executor idles (no request in flight, prefix reuse off).
        decode = []
        for batch in DECODE_BATCHES if "decode" in sections else ():
            decode.append(bench_decode(executor.runner, batch))
            progress(f"decode batch {batch}: {decode[-1]['tok_s']:.0f} tok/s")
        if args.timing:
            reset(executor.runner)  # the timeline from here on: the executor's own (overlapped) steps
        executor_decode = []
        for batch in DECODE_BATCHES if "executor_decode" in sections else ():
            # Batch 1 with a profiler window on this rank: the all-reduce kernels' time per step.
            before = launched()
            executor_decode.append(bench_executor_decode(executor, vocab, batch,
                                                         profile_seconds=0.3 if args.timing and batch == 1 else 0.0))
            executor_decode[-1]["steps_launched_in_flight"] = launched() - before
            progress(f"executor decode batch {batch}: {executor_decode[-1]['decode_tok_s']:.0f} tok/s"
                     + (f" ({launched() - before} steps in flight)" if pipelined is not None else ""))
            profiled = executor_decode[-1].get("profile")
            if profiled:
                progress(f"profile of batch {batch} ({profiled.get('steps')} steps):\n{profiled.get('top_kernels', '')}")
        offline = []
        for shape in args.offline_shapes:
            before = launched()
            offline.append(bench_offline(executor, vocab, *shape))
            offline[-1]["steps_launched_in_flight"] = launched() - before
            progress(f"offline {shape}: {offline[-1]['output_tok_s']:.0f} tok/s"
                     + (f" ({launched() - before} steps in flight)" if pipelined is not None else "")
                     + f"; {describe_steps(offline[-1]['steps'])}")
        result = {"decode": decode, "executor_decode": executor_decode, "offline": offline, "graphs": graphs,
                  "steps_in_flight": steps_in_flight, "steps_in_flight_always": always,
                  "graphs_vs_eager": checks,
                  "kv_tokens": executor.blocks.num_blocks * executor.blocks.tokens_per_block}
        progress(f"KV pool: {result['kv_tokens']} tokens")
        if args.timing:
            result["timeline_rank0"] = summarize(executor.runner)
            progress("timeline: " + describe(result["timeline_rank0"]))
        with open(args.out, "w") as f:  # kept even if the teardown below hangs
            json.dump(result, f)
        if TRACER is not None:  # (after: the run's figures are kept whatever the trace's analysis does)
            finish_trace()
    finally:
        executor.shutdown()
        if hasattr(executor.runner, "shutdown"):
            executor.runner.shutdown()
        progress("shut down")
    return result


def progress(message: str) -> None:
    """A rank's timestamped progress line (a hung phase then says how far it got)."""
    print(f"[tp_bench rank {os.environ.get('OMPI_COMM_WORLD_RANK', '0')} +{time.monotonic() - STARTED:.1f}s] {message}",
          file=sys.stderr, flush=True)


STARTED = time.monotonic()
TRACER: step_trace.StepTracer | None = None  # --trace_steps: this rank's profiler window (PP phases)


def saying_its_layers(base: type) -> type:
    """``base`` (a StageRunner class) whose ranks print which of the model's layers they hold, as built (a split's
    figures are read against the layer counts each rank really runs)."""

    class StageRunnerSayingItsLayers(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            stage = self.place.stage
            progress(f"stage {stage.index} of {stage.pp_size}: layers [{stage.start}, {stage.end}) of "
                     f"{self.model_config.num_layers} ({len(self.model.layers)} built, KV pool of {self.kv_layers}"
                     f"{', the LM head' if stage.is_last else ''}) on {self.device}")

        def capture_cuda_graphs(self) -> None:  # and its load-time launch choice (PDL: each rank times its own)
            super().capture_cuda_graphs()
            if getattr(self, "launch_choice", None) is not None:
                progress(f"stage {self.place.stage.index}'s graphs captured; launch choice {self.launch_choice}")

    StageRunnerSayingItsLayers.__name__ = base.__name__
    return StageRunnerSayingItsLayers


def install_tracer(args) -> None:
    """--trace_steps: this rank's stage runner records a profiler window of decode-only steps (step_trace.py)."""
    global TRACER
    import engine.pipeline.runner as pipeline_runner

    batch = args.trace_batch or EngineConfig.load(args.engine_dir).build.max_batch_size
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    raw = os.path.join(args.trace_dir, f"trace_rank{rank}.json.gz") if args.trace_dir else None
    if raw:
        os.makedirs(args.trace_dir, exist_ok=True)
    TRACER = step_trace.StepTracer(steps=args.trace_steps, skip=args.trace_skip, warm=args.trace_warm, batch=batch,
                                   out=f"{args.out}.trace.json", raw_out=raw, rank=rank)
    pipeline_runner.StageRunner = step_trace.traced(pipeline_runner.StageRunner, TRACER)
    step_trace.init_profiler_here()
    step_trace.label_point_to_point(pipeline_runner)


def finish_trace() -> None:
    started = time.monotonic()
    summary = TRACER.finish()
    analysed = sum(1 for row in summary.get("steps", []) if row.get("analysed"))
    progress(f"trace: {analysed} steps analysed of {len(summary.get('steps', []))} recorded (stop, export and "
             f"analysis {summary.get('stop_export_analysis_s', '-')} s, in the steps' loop; "
             f"{time.monotonic() - started:.1f} s now)"
             + (f" ({summary['error']})" if summary.get("error") else ""))


# ---- the orchestrator: one process per rank, the environment mpirun would give ----------------------


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    # Only the variables set here may say which rank this is (engine.tensor_parallel.distributed reads several kinds).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "PMIX_", "SLURM_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    if world_size > 1:
        env.update({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world_size),
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world_size),
                    "TRITONLLM_DIST_ADDR": "127.0.0.1", "TRITONLLM_DIST_PORT": str(port)})
    return env


def run_phase(args, phase: str, engine_dir: str, workdir: str) -> dict:
    tp_size, pp_size = phase_mapping(phase)
    tp = tp_size * pp_size  # the job's world size
    out = os.path.join(workdir, f"{phase}.json")
    common = [sys.executable, os.path.abspath(__file__), "--engine_dir", engine_dir, "--device", args.device,
              "--phase_timeout", str(args.phase_timeout)]
    flags = (["--no_graphs"] if args.no_graphs else []) + (["--timing"] if args.timing else [])
    traced_phase = bool(args.trace_steps) and pp_size > 1 and phase.startswith("perf")
    if traced_phase:
        flags += ["--trace_steps", str(args.trace_steps), "--trace_skip", str(args.trace_skip), "--trace_warm",
                  str(args.trace_warm), "--trace_batch", str(args.trace_batch)]
        if args.trace_dir:
            flags += ["--trace_dir", os.path.abspath(args.trace_dir)]
    leader_cmd = common + ["--role", "greedy" if phase.startswith("greedy") else "perf", "--out", out,
                           "--greedy_steps", str(args.greedy_steps), "--offline", args.offline,
                           "--perf_sections", ",".join(args.perf_sections), *flags]
    port = free_port()
    procs = [subprocess.Popen(leader_cmd, env=rank_env(0, tp, port))]
    procs += [subprocess.Popen(common + ["--role", "worker", "--out", f"{out}.rank{r}", *flags], env=rank_env(r, tp, port))
              for r in range(1, tp)]
    print(f"[tp_bench] {phase}: {tp} rank(s) ...", flush=True)
    started = time.monotonic()
    try:
        codes = [p.wait(timeout=max(1.0, args.phase_timeout - (time.monotonic() - started))) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["timeout"]
        # Say where every rank is stuck before killing it: each rank dumps its threads' stacks
        # on SIGUSR1 (faulthandler, registered in main), to the console.
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(3)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        if traced_phase:  # what the ranks wrote before the end is still read
            merge_traces(args, phase, [f"{out}.trace.json"] + [f"{out}.rank{r}.trace.json" for r in range(1, tp)])
        raise SystemExit(f"[tp_bench] {phase} failed: exit codes {codes} (after {time.monotonic() - started:.0f} s)")
    print(f"[tp_bench] {phase}: done in {time.monotonic() - started:.0f} s", flush=True)
    with open(out) as f:
        result = json.load(f)
    for r in range(1, tp):  # the workers' step timelines (--timing)
        if os.path.exists(f"{out}.rank{r}"):
            with open(f"{out}.rank{r}") as f:
                result[f"timeline_rank{r}"] = json.load(f)
    if traced_phase:
        result["trace"] = merge_traces(args, phase, [f"{out}.trace.json"] + [f"{out}.rank{r}.trace.json"
                                                                              for r in range(1, tp)])
    return result


def merge_traces(args, phase: str, paths: list[str]) -> dict:
    """The ranks' --trace_steps summaries, the pipeline's loop (two ranks) and their text, printed."""
    ranks = []
    for rank, path in enumerate(paths):
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
        else:
            ranks.append({"rank": rank, "error": "no trace summary written"})
    loop = (step_trace.pipeline_loop(ranks[0], ranks[1], depth=ranks[0].get("depth") or 2)
            if len(ranks) == 2 else None)
    text = step_trace.describe(ranks, loop)
    print(f"[tp_bench] {phase} trace (the phase's own speed is perturbed by the profiler):\n{text}", flush=True)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        with open(os.path.join(args.trace_dir, f"{phase}_trace.txt"), "w") as f:
            f.write(text + "\n")
    return {"ranks": ranks, "loop": loop, "text": text}


def compare_greedy(workdir: str, tp1: dict, tp2: dict, phase: str = "greedy_tp2") -> dict:
    logits1 = torch.load(os.path.join(workdir, "greedy_tp1.json.logits.pt"))
    logits2 = torch.load(os.path.join(workdir, f"{phase}.json.logits.pt"))
    equal = [a == b for a, b in zip(tp1["tokens"], tp2["tokens"])]
    return {"prompts": len(equal), "prompts_equal": sum(equal), "tokens_per_prompt": len(tp1["tokens"][0]),
            "passed": all(equal), "first_step_argmax_equal": bool((logits1.argmax(-1) == logits2.argmax(-1)).all()),
            "first_step_logits_max_abs_diff": float((logits1 - logits2).abs().max()),
            "first_step_logits_max_abs": float(logits1.abs().max()),
            "sampled_on_last_stage": bool(tp2.get("sampled_on_last_stage"))}


def mapping_name(phase: str) -> str:
    """``perf_pp2`` -> "PP 2"."""
    return f"{phase[-3:-1].upper()} {phase[-1]}"


def markdown(results: dict) -> str:
    perfs = [(mapping_name(p) + (f" ({','.join(map(str, results[p]['pp_layers']))} layers)" if results[p].get("pp_layers")
                                 else ""), results[p])
             for p in PHASES + PP_PHASES if p.startswith("perf") and p in results]
    perf1 = perfs[0][1]
    lines = [f"\n### Tensor and pipeline parallelism: {results['model']} random weights, {results['date']}\n",
             f"`{results['command']}` on {results['gpus']} (commit {results['commit']}; decode graphs: "
             + ", ".join(f"{name} {perf['graphs']}" for name, perf in perfs) + "; executor steps in flight: "
             + ", ".join(f"{name} {perf.get('steps_in_flight', 1)}" for name, perf in perfs) + ").",
             " ".join(greedy_sentence(results.get(key), key) for key in ("greedy", "greedy_pp")) + "\n",
             "| mapping | " + " | ".join([f"decode B={d['batch']} tok/s" for d in perf1["decode"]]
                                         + [f"offline {o['input_len']}/{o['output_len']} x{o['requests']} out tok/s"
                                            for o in perf1["offline"]])
             + " | KV pool tokens |",
             "|---" * (2 + len(perf1["decode"]) + len(perf1["offline"])) + "|"]
    for name, perf in perfs:
        cells = [f"{d['tok_s']:.0f}" for d in perf["decode"]] + [f"{o['output_tok_s']:.0f}" for o in perf["offline"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {perf.get('kv_tokens', '-')} |")
    if perf1.get("executor_decode"):
        lines.append("\nThrough the executor (overlapped scheduling), decode tok/s by batch: "
                     + "; ".join(f"{name}: " + ", ".join(f"B={d['batch']} {d['decode_tok_s']:.0f}"
                                                         for d in perf.get("executor_decode", []))
                                 for name, perf in perfs) + ".")
    lines.append("\nOffline steps (the executor's per-step stats): " + "; ".join(
        f"{name} {o['input_len']}/{o['output_len']}: {describe_steps(o['steps'])}"
        for name, perf in perfs for o in perf["offline"] if "steps" in o) + ".")
    checked = [(name, perf["graphs_vs_eager"]) for name, perf in perfs if perf.get("graphs_vs_eager")]
    if checked:
        lines.append("CUDA graphs against the same steps run eagerly (a prompt step of 64 tokens a sequence and 8 decode steps at batch "
                     + "/".join(str(c["batch"]) for c in checked[0][1]) + "): "
                     + "; ".join(f"{name} argmax equal on {sum(c['argmax_equal'] for c in checks)}/"
                                 f"{sum(c['rows'] for c in checks)} rows, logits max |diff| "
                                 f"{max(c['logits_max_abs_diff'] for c in checks):.3g}" for name, checks in checked) + ".")
    for name, perf in perfs:
        for key in sorted(k for k in perf if k.startswith("timeline_rank")):
            lines.append(f"- {name} {key.replace('timeline_', '')} step timeline (executor steps): {describe(perf[key])}")
    return "\n".join(lines) + "\n"


def greedy_sentence(greedy: dict | None, key: str = "greedy") -> str:
    other = "PP 2" if key == "greedy_pp" else "TP 2"
    if greedy is None:
        return "" if key == "greedy_pp" else "Greedy check: not run (--phases without greedy_tp1,greedy_tp2)."
    if greedy.get("sampled_on_last_stage"):
        other += " (decode steps sampled on the last stage)"
    return (f"Greedy check (float32, {greedy['prompts']} prompts x {greedy['tokens_per_prompt']} tokens): {other} == TP 1 "
            f"on {greedy['prompts_equal']}/{greedy['prompts']} prompts, first-step logits max |diff| "
            f"{greedy['first_step_logits_max_abs_diff']:.2e} (max |logit| {greedy['first_step_logits_max_abs']:.1f}).")


def orchestrate(args) -> dict:
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"tp_bench needs 2 GPUs, found {torch.cuda.device_count()}")
    workdir = tempfile.mkdtemp(prefix="tp_bench-")
    results = {"date": utc_now(), "model": args.model, "commit": git_commit(), "command": command_line(__file__),
               "gpus": (f"2x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu (gloo)")}
    for phase in args.phases:
        dtype = "float32" if phase.startswith("greedy") else args.dtype
        tp_size, pp_size = phase_mapping(phase)
        engine_dir = write_engine_config(workdir, args.model, dtype, tp_size, args.max_batch_size, pp_size, args.pp_layers)
        try:
            results[phase] = run_phase(args, phase, engine_dir, workdir)
            if pp_size > 1:
                results[phase]["pp_layers"] = EngineConfig.load(engine_dir).build.pp_layers
        finally:  # whatever ran is kept, even when a later phase fails or times out
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
        if phase == "greedy_tp2" and "greedy_tp1" in results:
            results["greedy"] = compare_greedy(workdir, results["greedy_tp1"], results["greedy_tp2"])
            print(json.dumps(results["greedy"], indent=2), flush=True)
        if phase == "greedy_pp2" and "greedy_tp1" in results:
            results["greedy_pp"] = compare_greedy(workdir, results["greedy_tp1"], results["greedy_pp2"], phase)
            print(json.dumps(results["greedy_pp"], indent=2), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    if sum(p in results for p in ("perf_tp1", "perf_tp2", "perf_pp2")) >= 2:
        print_table(markdown(results), args.results_md)
    if "greedy" in results and not results["greedy"]["passed"]:
        raise SystemExit("[tp_bench] FAILED: TP 2 greedy outputs differ from TP 1")
    if "greedy_pp" in results and not results["greedy_pp"]["passed"]:
        raise SystemExit("[tp_bench] FAILED: PP 2 greedy outputs differ from TP 1")
    return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, dtype_help="dtype of the perf phases (greedy runs float32)",
                        device_help="cuda (rank r uses GPU r) or cpu (gloo smoke test)")
    parser.add_argument("--greedy_steps", type=int, default=32)
    parser.add_argument("--max_batch_size", type=int, default=64, help="the engines' (and executors') batch limit")
    parser.add_argument("--offline", default="128x128x256,512x256x128", help="input x output x requests, comma list")
    parser.add_argument("--no_graphs", action="store_true",
                        help="eager decode (no CUDA graphs) in the perf phases (the greedy check is always eager)")
    parser.add_argument("--skip_perf", action="store_true", help="only the greedy check")
    parser.add_argument("--timing", action="store_true",
                        help="perf phases: per-rank timeline of the executor's decode steps (benchmarks/engine/step_timeline.py)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma list of phases to run, in order (default: all of {','.join(PHASES)}; "
                             f"pipeline stages: {','.join(PP_PHASES)})")
    parser.add_argument("--phase_timeout", type=float, default=240, help="seconds per phase (4 phases)")
    parser.add_argument("--pp_layers", default=None,
                        help="the PP phases' layers per stage, e.g. 14,18, or balanced (engine.build's --pp_layers; default: "
                             "even)")
    parser.add_argument("--perf_sections", default=",".join(PERF_SECTIONS),
                        help=f"what the perf phases measure after their warm-up, comma list of {','.join(PERF_SECTIONS)} "
                             "(graphs: graphs against eager steps; decode: the runner alone; executor_decode: "
                             "through the executor; offline: the --offline shapes)")
    parser.add_argument("--trace_steps", type=int, default=0,
                        help="PP perf phases: a torch.profiler window on every rank over this many decode-only steps "
                             "of --trace_batch sequences, summarised per rank and step (benchmarks/engine/"
                             "step_trace.py: host waits, the compute stream's busy and idle time and what ended each "
                             "gap, the NCCL kernels; with two stages the loop from rank 0's graph of a step to that "
                             "of the step launched depth steps later). The phase's own speed is then perturbed")
    parser.add_argument("--trace_skip", type=int, default=60, help="matching steps launched before the window")
    parser.add_argument("--trace_warm", type=int, default=5, help="steps recorded but not analysed (the profiler's start)")
    parser.add_argument("--trace_batch", type=int, default=0,
                        help="steps of at least this many sequences are counted (default: the engine's max_batch_size)")
    parser.add_argument("--trace_dir", default=None,
                        help="also write each rank's raw chrome trace (trace_rank<r>.json.gz) and the text summary here")
    parser.add_argument("--out", default="tp_bench.json")
    parser.add_argument("--results-md", dest="results_md", default=None, help="append the markdown table here")
    # internal: one rank of one phase
    parser.add_argument("--role", choices=["orchestrate", "greedy", "perf", "worker"], default="orchestrate")
    parser.add_argument("--engine_dir", default=None)
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p and not (args.skip_perf and p.startswith("perf"))]
    unknown = sorted(set(args.phases) - set(PHASES + PP_PHASES))
    if unknown:
        parser.error(f"--phases: unknown phase(s) {unknown}; allowed: {', '.join(PHASES + PP_PHASES)}")
    args.offline_shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.offline.split(",") if shape]
    args.perf_sections = [name for name in args.perf_sections.split(",") if name]
    if unknown := sorted(set(args.perf_sections) - set(PERF_SECTIONS)):
        parser.error(f"--perf_sections: unknown section(s) {unknown}; allowed: {', '.join(PERF_SECTIONS)}")
    if "offline" not in args.perf_sections:
        args.offline_shapes = []
    args.pp_layers = args.pp_layers if args.pp_layers == "balanced" else parse_pp_layers(args.pp_layers)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.role == "orchestrate":
        orchestrate(args)
        return
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # And unconditionally before the orchestrator's deadline: a rank stuck inside the driver may
    # never take the signal, while this timer thread dumps regardless.
    faulthandler.dump_traceback_later(max(5.0, args.phase_timeout - 15), exit=False)
    use_random_weights()
    # Pipeline stages are built by make_stage_runner from this name, not from runner_class.
    import engine.pipeline.runner as pipeline_runner

    if args.no_graphs:
        pipeline_runner.StageRunner = type("EagerStageRunner", (pipeline_runner.StageRunner,),
                                           {"capture_cuda_graphs": EagerRunner.capture_cuda_graphs})
    if args.timing:
        pipeline_runner.StageRunner = timed(pipeline_runner.StageRunner)
    pipeline_runner.StageRunner = saying_its_layers(pipeline_runner.StageRunner)
    if args.trace_steps and args.role in ("perf", "worker") and EngineConfig.load(args.engine_dir).build.pp_size > 1:
        install_tracer(args)
    if args.role == "worker":
        cls = runner_class(args)
        if args.timing:  # keep the worker's runner to report its timeline after the job
            built = []

            class Recorded(cls):
                def __init__(self, *a, **k):
                    super().__init__(*a, **k)
                    built.append(self)

            cls = Recorded
        run_worker(args.engine_dir, device=args.device, runner_class=cls)
        if TRACER is not None:
            finish_trace()
        if args.timing and built:
            timeline = summarize(built[0])
            progress("timeline: " + describe(timeline))
            with open(args.out, "w") as f:
                json.dump(timeline, f)
        progress("worker left the groups")
        sys.stderr.flush()
        os._exit(0)  # as engine.tensor_parallel.worker does: no interpreter teardown after a timed-out group teardown
    result = run_greedy_phase(args) if args.role == "greedy" else run_perf_phase(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    if TRACER is not None:  # no interpreter teardown after a profiler window (step_trace.StepTracer._stop says why)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
