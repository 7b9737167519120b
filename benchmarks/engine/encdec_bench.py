"""Encoder-decoder engines (issue 49): Whisper large-v3 and Flan-T5-XL shapes against transformers, one GPU.

    python benchmarks/engine/encdec_bench.py --out encdec.json --results-md benchmarks/results/engine.md

Sections (``--sections``, all by default; run in the order given):

1. ``whisper``: ``--clips`` (64) concurrent 30-s clips (3,000 log-mel frames each), a 4-token
   prompt and exactly ``--transcript`` (100) tokens each (no end id), all enqueued at once into the
   executor; audio seconds processed per second. Against transformers' WhisperForConditionalGeneration
   (bf16, sdpa) generating the same lengths (GenerationMixin.generate, greedy, no eos) at each of
   ``--hf-whisper-batches``: one batch per size, audio seconds / its wall time; the best size counts
   ("" runs none). After the timed run (CUDA): one encoder pass over all clips alone and with the
   cross K/V projections and writes, and the widest decode graph's replay (``profile_whisper_run``).
2. ``whisper_step``: batch-1 decoder step of the Whisper large-v3 shape through the runner (its
   decode CUDA graph) after one 30-s clip was encoded, against the step's weight-read roofline:
   the bytes one step must move (every decoder weight but the cross K/V projections, which run
   once per request at encode time, and the two embedding tables, of which one row each is read;
   the clip's cross K/V; the self KV so far) over the bandwidth of a device-to-device copy. Also
   the device time of one graph replay alone, and a torch-profiler summary of replays (``--profile-dir``).
3. ``t5``: Flan-T5-XL shape, ``--t5-requests`` (256) requests of 512 input / 128 output tokens
   (no end id) all enqueued at once: output tokens/s, against transformers' T5ForConditionalGeneration
   generate (bf16) at each of ``--hf-t5-batches`` (one batch per size, the best counts; up to the
   run's 256 requests, since transformers is host-bound at these batches: b128 3,218 tok/s, b256 5,280).

``--cross-kv-cache-dtype auto,fp8`` runs ``whisper`` and ``t5`` once per cross-pool type in the same
process (the kernels compiled once; transformers, when asked for, only with the first): entries
``whisper`` / ``t5`` for the first type, ``whisper@fp8`` / ``t5@fp8`` for the next. Each run reports
its pools' types, the encoder's device time and the decode-only iterations (``executor_offline``).
``--quantization none,fp8`` likewise runs them once per weight scheme (fp8: every layer linear of
both stacks in E4M3 with per-output-channel scales, engine/encoder_decoder/model.py Fp8Linear; the
engine's random weights quantized so at load), nested outside the cross-pool types: entries
``t5@fp8-weights`` / ``t5@fp8@fp8-weights`` and so on for values after the first of each list
(whisper_step runs once, with the first of each).

``--tp 1,2`` runs ``whisper`` and ``t5`` once per tensor-parallel size, nested outside the weight schemes:
entries ``t5@tp2`` and so on for sizes after the first. This process is rank 0 (its executor's
LeaderRunner, on cuda:0); ranks 1..N-1 are ``python -m engine.tensor_parallel.worker`` processes on the next
GPUs, started for each run (``tensor_parallel_ranks``) and ended by the executor's shutdown. At TP > 1 the
Whisper run skips its after-run encoder and replay profile (rank 0's stacks alone cannot run: their
all-reduces need every rank).

Random weights of the real shapes, made on the GPU (engine: ``extra.random_weights_seed``;
transformers: its own init, on the device). ``--device cpu`` runs tiny shapes of the same
families (a smoke run of every path).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (command_line, copy_bandwidth, environment_set, free_device_memory,  # noqa: E402
                               git_commit, machine_summary, print_table, sync, timed_generate, utc_now)
from benchmarks.engine.engine_bench import drain_offline, iteration_breakdown  # noqa: E402
from engine.config import BuildConfig, EngineConfig  # noqa: E402
from engine.encoder_decoder.spec import spec_from_hf  # noqa: E402
from engine.executor.executor import Executor, ExecutorConfig  # noqa: E402
from engine.executor.request import OutputConfig, Request  # noqa: E402
from engine.executor.runner import ForwardBatch  # noqa: E402

SECTIONS = ["whisper", "whisper_step", "t5"]
GOALS = {"whisper_speedup": 5.0, "whisper_step_roofline_fraction": 0.70, "t5_speedup": 5.0}
WHISPER_PROMPT = [50258, 50259, 50360, 50364]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|> (large-v3)
CLIP_SECONDS, FRAMES_PER_SECOND = 30, 100


def whisper_config(device: str):
    """transformers' WhisperConfig: large-v3 on a GPU, a tiny one on the CPU."""
    from transformers import WhisperConfig

    if device == "cpu":
        return WhisperConfig(vocab_size=51866, num_mel_bins=8, d_model=64, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                             decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
                             decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50256,
                             architectures=["WhisperForConditionalGeneration"])
    return WhisperConfig(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=32,
                         encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120,
                         decoder_ffn_dim=5120, max_source_positions=1500, max_target_positions=448,
                         decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50256,
                         architectures=["WhisperForConditionalGeneration"])


def t5_config(device: str):
    """Flan-T5-XL (google/flan-t5-xl's config) on a GPU, a tiny T5 v1.1 on the CPU."""
    from transformers import T5Config

    shape = (dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4)
             if device == "cpu" else
             dict(d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24, num_heads=32))
    return T5Config(vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                    architectures=["T5ForConditionalGeneration"], **shape)


def write_random_engine(hf_config, *, dtype: str, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                        tokens_per_block: int, max_encoder_input_len: int, quantization: str | None = None,
                        tp_size: int = 1) -> str:
    """OUTPUT/encoder and OUTPUT/decoder holding only config.json (the layout engine.build writes),
    random weights made at load (``quantization`` "fp8": the layer linears' quantized to E4M3 as
    engine.build quantizes them); returns the decoder directory."""
    spec = spec_from_hf(hf_config)
    root = tempfile.mkdtemp(prefix=f"bench-{spec.family}-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # (as benchmarks/common.py's config-only engines)
    build = BuildConfig(dtype=dtype, max_batch_size=max_batch_size, max_input_len=min(max_seq_len, 64),
                        max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block,
                        quantization=quantization, tp_size=tp_size)
    extra = {"encoder_decoder": spec.to_dict(), "max_encoder_input_len": max_encoder_input_len,
             "random_weights_seed": 0}
    for stack, more in (("encoder", {}), ("decoder", {"encoder_engine_dir": "../encoder"})):
        config = EngineConfig(model=spec.decoder_model_config(), build=build, extra={**extra, "stack": stack, **more})
        config.validate().save(os.path.join(root, stack))
    return os.path.join(root, "decoder")


@contextlib.contextmanager
def tensor_parallel_ranks(engine: str, tp_size: int):
    """Inside: this process is rank 0 of ``tp_size`` (OpenMPI's variables, as mpirun sets them, so the
    executor's make_runner makes a LeaderRunner) and ranks 1.. run ``python -m engine.tensor_parallel.worker``
    on ``engine``; the executor's shutdown ends them. One rank: nothing."""
    if tp_size == 1:
        yield
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])

    def rank_env(rank: int) -> dict:
        return {**saved, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(tp_size),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(tp_size),
                "TRITONLLM_DIST_ADDR": "127.0.0.1", "TRITONLLM_DIST_PORT": str(port),
                "PYTHONPATH": os.pathsep.join(p for p in (root, saved.get("PYTHONPATH")) if p)}

    # (-X faulthandler: a worker's stacks on SIGUSR1 too, as main registers this process's: a hung run shows where)
    workers = [subprocess.Popen([sys.executable, "-c", "import faulthandler, signal, sys; "
                                 "faulthandler.register(signal.SIGUSR1, all_threads=True); "
                                 "from engine.tensor_parallel.worker import exit_now, main; exit_now(main(sys.argv[1:]))",
                                 "--engine_dir", engine], env=rank_env(rank), cwd=root) for rank in range(1, tp_size)]
    os.environ.update(rank_env(0))
    failed = True
    try:
        yield
        failed = False
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for worker in workers:  # (the executor's shutdown ended them; after a failure before it, nothing will)
            try:
                worker.wait(timeout=5 if failed else 60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


def run_offline(executor, requests: list[Request]) -> tuple[float, int]:
    """All requests enqueued at once -> (seconds until the last one finished, output tokens)."""
    started = time.perf_counter()
    executor.enqueue_requests(requests)
    tokens = drain_offline(executor, len(requests))
    return time.perf_counter() - started, tokens


def executor_offline(args, engine: str, requests, tokens: int, cpu_kv_tokens: int,
                     profile_path: Path | None = None, after=None) -> dict:
    """Start an executor on ``engine``, warm it up with ``requests(4)`` twice (the encoder's kernels at
    this batch, the prompt step, the graphs), then time ``requests(tokens)`` enqueued at once.
    Returns seconds, output_tokens, graphed (decode graphs captured), graph_steps / steps (decode
    steps replayed from them / all forwards), encoder_seconds (the encoder runs' device time) and
    the executor's iteration breakdown (engine_bench.iteration_breakdown). The executor and its
    pools are gone when this returns (the transformers model comes next on the same GPU).
    ``cpu_kv_tokens``: the self pool's tokens on the CPU (its default pool there is a few blocks;
    the cross pool is as large), so that every request runs at once there too. ``profile_path``
    (CUDA): after the timed run, the same requests again under the torch profiler, its kernel table
    written there (the figures come from the unprofiled run). ``after(executor)``, when given, runs
    after the timed run, before the executor closes; its dict joins the entry."""
    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=args.kv_fraction, kv_cache_dtype=args.kv_cache_dtype,
                            cross_kv_cache_dtype=args.cross_kv_cache_dtype,
                            max_tokens_in_paged_kv_cache=cpu_kv_tokens if args.device == "cpu" else None)
    with tensor_parallel_ranks(engine, args.tp_size), Executor(engine, config, device=args.device) as ex:
        # Warmed up twice: the process's first two encoder passes at a batch run slow whatever their order (Whisper
        # 64 clips: 1,224 and 870 ms, then 365-382 ms in every later pass, a fresh executor's included; no
        # allocations in the second; the GPU at full clocks; the same with the cyclic collector off: session 26,
        # benchmarks/results/engine.md), so one warm-up left the timed run's encoder at 0.86 s of its 1.57 s.
        run_offline(ex, requests(4))
        run_offline(ex, requests(4))
        runner, counts = ex.runner, {"graph_steps": 0, "steps": 0, "encoder_seconds": 0.0}
        encode_into, forward, graphs = runner.encode_into, runner.forward, runner.decode_graphs

        encode_events = []  # CUDA: (start, end) events of each encoder run: timed without a sync,
        # which would stop the host work the executor overlaps with the pass

        def timed_encode(*a, **k):
            if args.device == "cpu":
                started = time.perf_counter()
                encode_into(*a, **k)
                counts["encoder_seconds"] += time.perf_counter() - started
                return
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            encode_into(*a, **k)
            end.record()
            encode_events.append((start, end))

        def counted_forward(*a, **k):
            counts["steps"] += 1
            return forward(*a, **k)

        runner.encode_into, runner.forward = timed_encode, counted_forward
        run = None
        if graphs is not None:
            run = graphs.run
            graphs.run = lambda *a: counts.__setitem__("graph_steps", counts["graph_steps"] + 1) or run(*a)
        since = time.time_ns()
        seconds, output_tokens = run_offline(ex, requests(tokens))
        if encode_events:
            sync(args.device)
            counts["encoder_seconds"] = sum(start.elapsed_time(end) for start, end in encode_events) / 1e3
        entry = {"seconds": seconds, "output_tokens": output_tokens, "graphed": graphs is not None, **counts,
                 "iterations": iteration_breakdown(ex, since), "self_pool_dtype": str(runner.kv_cache.dtype),
                 "cross_pool_dtype": str(runner.cross_pool.dtype),
                 "weights": runner.build_config.quantization or "none"}
        if profile_path is not None and args.device != "cpu":
            entry["profile"] = profile_offline(ex, requests(tokens), profile_path)
        if after is not None:
            entry.update(after(ex))
        # the wrappers above hold the runner (runner.forward -> counted_forward -> forward -> runner): a cycle that
        # only gc frees, and not while this frame's locals still reach it; the transformers model after this call
        # then ran out of memory beside the executor's pools (x2 call 34, Flan-T5-XL at batch 256)
        del runner.encode_into, runner.forward  # back to the class's methods
        if graphs is not None:
            del graphs.run
    del ex, runner, graphs, encode_into, forward, timed_encode, counted_forward, run
    free_device_memory(args.device)
    return entry


def profile_offline(executor, requests: list[Request], path: Path) -> str:
    """torch-profiler tables (kernels by device time; ops with their call sites' totals) of one
    offline run of ``requests``, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds, _ = run_offline(executor, requests)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"profiled run: {seconds:.2f} s\n\n" + averages.table(sort_by="cuda_time_total", row_limit=70)
                    + "\n\n" + averages.table(sort_by="cpu_time_total", row_limit=40))
    return str(path)


# ---- Whisper ------------------------------------------------------------------------------------

def clip_features(config, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` 30-s clips of log-mel features (frames, mel bins), float32 on the host."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(CLIP_SECONDS * FRAMES_PER_SECOND, config.num_mel_bins, generator=generator) for _ in range(count)]


def whisper_engine(args, config, max_batch_size: int, tp_size: int | None = None) -> str:
    """Whisper's config-only engine at ``tp_size`` (default: the run's)."""
    return write_random_engine(config, dtype=args.dtype, max_batch_size=max_batch_size,
                               max_seq_len=len(WHISPER_PROMPT) + args.transcript + 12, max_num_tokens=4096,
                               tokens_per_block=32, max_encoder_input_len=config.max_source_positions,
                               quantization=args.quantization, tp_size=tp_size or args.tp_size)


def bench_whisper(args) -> dict:
    config = whisper_config(args.device)
    engine = whisper_engine(args, config, max_batch_size=args.clips)
    features = clip_features(config, args.clips)
    out = OutputConfig(exclude_input_from_output=True)

    def requests(tokens: int) -> list[Request]:
        return [Request(list(WHISPER_PROMPT), tokens, encoder_input_features=f, output=out) for f in features]

    run = executor_offline(args, engine, requests, args.transcript, args.clips * (config.max_source_positions + 128),
                           profile_path=Path(args.profile_dir) / "whisper_offline_profile.txt" if args.profile_dir else None,
                           after=(lambda ex: profile_whisper_run(args, ex, features)) if args.tp_size == 1 else None)
    entry = {"clips": args.clips, "transcript_tokens": args.transcript, "tp_size": args.tp_size, **run,
             "audio_s_per_s": args.clips * CLIP_SECONDS / run["seconds"], "hf": hf_whisper(args, config, features)}
    if entry["hf"]:
        best = max(entry["hf"], key=lambda row: row["audio_s_per_s"])
        entry["hf_best_batch"], entry["speedup"] = best["batch"], entry["audio_s_per_s"] / best["audio_s_per_s"]
    return entry


def profile_whisper_run(args, ex, features: list[torch.Tensor]) -> dict:
    """After the timed run (CUDA): the widest decode graph's replay time and kernels, and one encoder
    pass over all clips (encoder alone, then with the cross K/V projections and writes), timed and
    with ``--profile-dir`` profiled."""
    if args.device == "cpu":
        return {}
    runner, out = ex.runner, {}
    blocks = list(range(-(-runner.spec.encoder_max_positions // runner.tokens_per_block)))
    for name, fn in (("encoder", lambda: runner.encoder.encode(features)),
                     ("encode_into", lambda: runner.encode_into(features, [blocks] * len(features)))):
        fn()
        sync(args.device)
        started = time.perf_counter()
        fn()
        sync(args.device)
        out[f"{name}_pass_seconds"] = time.perf_counter() - started
        if args.profile_dir:
            out[f"{name}_profile"] = safe_profile(fn, Path(args.profile_dir) / f"whisper_{name}_profile.txt", 1)
    graphs = runner.decode_graphs
    if graphs is not None and graphs.graphs:
        from kernels.linear import replay_time_ms

        bucket = graphs.bucket_for(min(len(features), graphs.max_batch_size))
        out["widest_bucket"], out["widest_replay_ms"] = bucket, replay_time_ms(graphs.graphs[bucket], replays=20)
        if args.profile_dir:
            out["widest_profile"] = safe_profile(graphs.graphs[bucket].replay,
                                                  Path(args.profile_dir) / f"whisper_b{bucket}_step_profile.txt", 10)
    return out


def hf_whisper(args, config, features: list[torch.Tensor]) -> list[dict]:
    """transformers' generate at each batch size: one batch of clips, the same prompt and length."""
    from transformers import GenerationMixin, WhisperForConditionalGeneration

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = WhisperForConditionalGeneration(config).to(dtype).eval()
    rows = []
    for batch in args.hf_whisper_batches:
        batch = min(batch, len(features))
        inputs = torch.stack([f.t() for f in features[:batch]]).to(args.device, dtype)  # (batch, mels, frames)
        prompt = torch.tensor([WHISPER_PROMPT] * batch, device=args.device)

        def generate(tokens: int):
            return GenerationMixin.generate(model, input_features=inputs, decoder_input_ids=prompt,
                                            max_new_tokens=tokens, do_sample=False, num_beams=1, eos_token_id=None,
                                            pad_token_id=config.pad_token_id, forced_decoder_ids=None,
                                            suppress_tokens=None, begin_suppress_tokens=None)
        with torch.inference_mode():
            generate(2)  # warm-up
            sync(args.device)
            started = time.perf_counter()
            ids = generate(args.transcript)
            sync(args.device)
        seconds = time.perf_counter() - started
        assert ids.shape[1] == len(WHISPER_PROMPT) + args.transcript, ids.shape
        rows.append({"batch": batch, "seconds": seconds, "audio_s_per_s": batch * CLIP_SECONDS / seconds})
    del model
    free_device_memory(args.device)
    return rows


def decoder_step_bytes(runner, context: int, encoder_len: int) -> int:
    """Bytes a batch-1 decoder step must move (module docstring, section 2)."""
    model = runner.model
    skipped = {id(model.embed_tokens.weight), id(model.embed_positions.weight)}
    skipped |= {id(p) for layer in model.layers for p in (layer.cross_attn.k.weight, layer.cross_attn.v.weight)}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skipped)
    rows = 2 * model.embed_tokens.weight.shape[1] * model.embed_tokens.weight.element_size()
    per_token = runner.kv_block_bytes // runner.tokens_per_block  # self and cross blocks have one shape
    return weights + rows + (encoder_len + context) * per_token


# --step-variants: name -> the decode-path switches (engine/encoder_decoder/cross_attention.py), every other switch
# unset (its default), set before the decode graphs are captured again on the same runner (the graphs read them at
# capture)
STEP_VARIANTS = {
    "default": {},  # every switch unset: the engine's defaults, captured again (the re-capture's own cost)
    "paged": {"TRITONLLM_ENCDEC_CROSS_KERNEL": "0"},  # the cross-attention through the general paged kernel
}


def bench_whisper_step(args, bandwidth: float) -> dict:
    import kernels.linear as linear

    time_shape, timed = linear._time_shape, {}

    def time_shape_once(shape, dtype, device, rows, gated=False, activation=None):
        """Each capture (one per --step-variants entry) times the skinny tilings per weight shape: once is enough."""
        key = (shape, dtype, str(device), tuple(rows), gated, activation)
        if key not in timed:
            timed[key] = time_shape(shape, dtype, device, rows, gated=gated, activation=activation)
        return timed[key]

    if args.step_variants:
        linear._time_shape = time_shape_once
    try:
        return _bench_whisper_step(args, bandwidth)
    finally:
        linear._time_shape = time_shape


def _bench_whisper_step(args, bandwidth: float) -> dict:
    from engine.encoder_decoder.runner import EncDecRunner

    config = whisper_config(args.device)
    runner = EncDecRunner(whisper_engine(args, config, max_batch_size=8, tp_size=1), device=args.device)  # (one rank)
    page, encoder_len = runner.tokens_per_block, config.max_source_positions
    runner.allocate_kv_cache(runner.num_kv_blocks_for(max_tokens=4096))
    runner.capture_cuda_graphs()
    cross = list(range(-(-encoder_len // page)))
    runner.encode_into([clip_features(config, 1)[0]], [cross])
    entry = time_whisper_step(args, bandwidth, runner, encoder_len, cross, "whisper_step_profile.txt")
    print(f"whisper_step default: step {entry['step_ms_median']:.3f} ms, replay {entry.get('replay_ms', 0):.3f} ms; "
          f"breakdown {entry.get('breakdown')}", file=sys.stderr, flush=True)
    if args.step_variants:
        entry["variants"] = {}
        every_switch = {name: "" for switches in STEP_VARIANTS.values() for name in switches}
        with environment_set(every_switch):  # (as they were, after)
            for name in args.step_variants:
                for switch in every_switch:  # unset: a switch's own default ("" is not always it)
                    os.environ.pop(switch, None)
                os.environ.update(STEP_VARIANTS[name])
                runner.decode_graphs = None
                free_device_memory(args.device)
                started = time.perf_counter()
                runner.capture_cuda_graphs()
                capture = time.perf_counter() - started
                entry["variants"][name] = v = {**time_whisper_step(args, bandwidth, runner, encoder_len, cross,
                                                                   f"whisper_step_{name}_profile.txt"),
                                               "switches": STEP_VARIANTS[name], "capture_seconds": capture}
                # one line each: a run cut short still shows the variants done
                kernels = v["profile"].get("kernels_per_call") if isinstance(v.get("profile"), dict) else None
                wide = {key: round(value, 3) for key, value in v.items() if key.startswith("replay_ms_b")}
                default = {key: round(value, 3) for key, value in entry.items() if key.startswith("replay_ms")}
                print(f"whisper_step {name}: step {v['step_ms_median']:.3f} ms, replay {v.get('replay_ms', 0):.3f} ms, "
                      f"{kernels} kernels, capture {capture:.1f} s, {wide} (default: step {entry['step_ms_median']:.3f} "
                      f"ms, {default}); breakdown {v.get('breakdown')}", file=sys.stderr, flush=True)
    del runner
    free_device_memory(args.device)
    return entry


def time_whisper_step(args, bandwidth: float, runner, encoder_len: int, cross: list[int], profile_name: str) -> dict:
    """The batch-1 step of ``runner`` over the encoded clip's cross blocks ``cross``: prompt, then
    ``--transcript`` steps timed (median past the first 8), its graph's replay and profile."""
    page = runner.tokens_per_block
    steps, prompt = args.transcript, list(WHISPER_PROMPT)
    table = list(range(1, -(-(len(prompt) + steps + 1) // page) + 1))

    def step(tokens, positions, context):
        return runner.forward(ForwardBatch(tokens, positions, [len(tokens)], [context], [table[:-(-context // page)]],
                                           [len(tokens) - 1], cross_lengths=[encoder_len], cross_block_tables=[cross]))

    token = int(step(prompt, list(range(len(prompt))), len(prompt)).argmax(-1).item())
    times = []
    for i in range(steps):
        position = len(prompt) + i
        started = time.perf_counter()
        token = int(step([token], [position], position + 1).argmax(-1).item())  # the sampler's sync
        times.append(time.perf_counter() - started)
    steady = times[min(8, len(times) // 2):]
    entry = {"step_ms_median": statistics.median(steady) * 1e3, "tok_s": len(steady) / sum(steady),
             "graphed": runner.decode_graphs is not None,
             "bytes_per_step": decoder_step_bytes(runner, len(prompt) + steps // 2, encoder_len)}
    if bandwidth:
        entry["roofline_step_ms"] = entry["bytes_per_step"] / bandwidth * 1e3
        entry["roofline_fraction"] = entry["roofline_step_ms"] / entry["step_ms_median"]
    if runner.decode_graphs is not None:
        from kernels.linear import replay_time_ms

        calls = min(steps, 30)  # (the last ``calls`` positions again: within the table and max_seq_len)
        entry["breakdown"] = step_breakdown(step, runner, token, len(prompt) + steps - calls, calls)

        graph = runner.decode_graphs.graphs[1]
        entry["replay_ms"] = replay_time_ms(graph, replays=50)
        if bandwidth:
            entry["replay_roofline_fraction"] = entry["roofline_step_ms"] / entry["replay_ms"]
        if args.profile_dir:
            entry["profile"] = safe_profile(graph.replay, Path(args.profile_dir) / profile_name, 20)
        wide = max(runner.decode_graphs.graphs)  # (8 here) the widest bucket, its rows over the same clip
        if wide > 1:
            position = len(prompt) + steps // 2
            blocks = len(table)
            runner.forward(ForwardBatch([token] * wide, [position] * wide, [1] * wide, [position + 1] * wide,
                                        [[1 + row * blocks + b for b in range(blocks)] for row in range(wide)],
                                        list(range(wide)), cross_lengths=[encoder_len] * wide,
                                        cross_block_tables=[cross] * wide))
            entry[f"replay_ms_b{wide}"] = replay_time_ms(runner.decode_graphs.graphs[wide], replays=50)
    return entry


def step_breakdown(step, runner, token: int, position: int, calls: int) -> dict:
    """Where a graphed step's wall time goes (CUDA events and host clocks around its parts; medians of
    ``calls`` steps at positions ``position``..., in us): ``host_to_replay`` the host from the step's start to the graph launch;
    ``launch`` the host inside ``graph.replay()``; ``gpu_before_replay`` the device from the step's start
    event to the replay's (idle while the host packs, then the input copies); ``replay`` the replay on the
    device as the step runs it (not back to back); ``logits`` the LM head after it; ``after_logits`` the
    argmax; ``sync`` the host's wait in ``.item()``; ``wall`` the whole step (``step``: time_whisper_step's)."""
    graph = runner.decode_graphs.graphs[1]
    model = runner.model
    replay, compute_logits = graph.replay, model.compute_logits
    marks: dict[str, object] = {}

    def event(name):
        marks[name] = e = torch.cuda.Event(enable_timing=True)
        e.record()

    def timed_replay():
        marks["host_replay"] = time.perf_counter()
        event("replay_start")
        replay()
        event("replay_end")
        marks["host_replayed"] = time.perf_counter()

    def timed_logits(hidden):
        logits = compute_logits(hidden)
        event("logits_end")
        return logits

    rows: dict[str, list[float]] = {}
    graph.replay, model.compute_logits = timed_replay, timed_logits
    try:
        for i in range(calls):
            marks.clear()
            started = time.perf_counter()
            event("start")
            argmax = step([token], [position + i], position + i + 1).argmax(-1)
            event("end")
            synced = time.perf_counter()
            token = int(argmax.item())
            done = time.perf_counter()
            gpu = {name: marks[name] for name in ("start", "replay_start", "replay_end", "logits_end", "end")}
            figures = {"host_to_replay": (marks["host_replay"] - started) * 1e6,
                       "launch": (marks["host_replayed"] - marks["host_replay"]) * 1e6,
                       "gpu_before_replay": gpu["start"].elapsed_time(gpu["replay_start"]) * 1e3,
                       "replay": gpu["replay_start"].elapsed_time(gpu["replay_end"]) * 1e3,
                       "logits": gpu["replay_end"].elapsed_time(gpu["logits_end"]) * 1e3,
                       "after_logits": gpu["logits_end"].elapsed_time(gpu["end"]) * 1e3,
                       "sync": (done - synced) * 1e6, "wall": (done - started) * 1e6}
            for name, value in figures.items():
                rows.setdefault(name, []).append(value)
    finally:
        del graph.replay, model.compute_logits  # the instance attributes: the class's methods again
    return {name: round(statistics.median(values), 1) for name, values in rows.items()}


def safe_profile(fn, path: Path, calls: int) -> dict | str:
    """profile_calls, or why it failed (a profiler failure costs the table, not the figures)."""
    try:
        return profile_calls(fn, path, calls)
    except Exception as err:  # noqa: BLE001
        return f"failed: {err!r}"


def profile_calls(fn, path: Path, calls: int) -> dict:
    """torch-profiler table of ``calls`` calls of ``fn`` (top kernels by device time), written to
    ``path``; returns its path, the kernels launched per call and their device time per call (ms)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = (events.table(sort_by="cuda_time_total", row_limit=40) + "\n\nby host time:\n"
             + events.table(sort_by="cpu_time_total", row_limit=25))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    return {"path": str(path), "kernels_per_call": sum(e.count for e in kernels) / calls,
            "kernel_ms_per_call": sum(getattr(e, "self_device_time_total", 0) for e in kernels) / calls / 1e3}


# ---- Flan-T5 ------------------------------------------------------------------------------------

def bench_t5(args) -> dict:
    config = t5_config(args.device)
    engine = write_random_engine(config, dtype=args.dtype, max_batch_size=args.t5_requests,
                                 max_seq_len=args.t5_output + 16, max_num_tokens=8192, tokens_per_block=32,
                                 max_encoder_input_len=args.t5_input, quantization=args.quantization,
                                 tp_size=args.tp_size)
    rng = random.Random(0)
    inputs = [[rng.randrange(2, config.vocab_size) for _ in range(args.t5_input)] for _ in range(args.t5_requests)]
    out = OutputConfig(exclude_input_from_output=True)

    def requests(tokens: int) -> list[Request]:
        return [Request([], tokens, encoder_input_ids=ids, output=out) for ids in inputs]

    run = executor_offline(args, engine, requests, args.t5_output,
                           args.t5_requests * (args.t5_input + args.t5_output + 64),
                           profile_path=Path(args.profile_dir) / "t5_offline_profile.txt" if args.profile_dir else None)
    entry = {"requests": args.t5_requests, "input_len": args.t5_input, "output_len": args.t5_output,
             "tp_size": args.tp_size, **run,
             "output_tok_s": run["output_tokens"] / run["seconds"], "hf": hf_t5(args, config, inputs)}
    if entry["hf"]:
        best = max(entry["hf"], key=lambda row: row["output_tok_s"])
        entry["hf_best_batch"], entry["speedup"] = best["batch"], entry["output_tok_s"] / best["output_tok_s"]
    return entry


def hf_t5(args, config, inputs: list[list[int]]) -> list[dict]:
    from transformers import T5ForConditionalGeneration

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with torch.device(args.device):
        model = T5ForConditionalGeneration(config).to(dtype).eval()
    rows = []
    for batch in args.hf_t5_batches:
        batch = min(batch, len(inputs))
        ids = torch.tensor(inputs[:batch], device=args.device)
        kwargs = dict(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))
        seconds, out = timed_generate(model, ids, args.t5_output, args.device, **kwargs)
        assert out.shape[1] == 1 + args.t5_output, out.shape  # decoder start + the new tokens
        rows.append({"batch": batch, "seconds": seconds, "output_tok_s": batch * args.t5_output / seconds})
    del model
    free_device_memory(args.device)
    return rows


# ---- report -------------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    shapes = "tiny shapes (CPU smoke run)" if results["device"] == "cpu" else "Whisper large-v3 and Flan-T5-XL shapes"
    lines = [f"### Encoder-decoder engines: {shapes} ({results['machine']}, "
             f"{results['date']}, commit {results['commit']})", "", f"`{results['command']}`", "",
             "| measurement | ours | transformers (best batch) | ratio (goal) |", "|---|---|---|---|"]
    for key, run in section_runs(results, "whisper"):
        hf = ", ".join(f"b{r['batch']}: {r['audio_s_per_s']:.0f}" for r in run["hf"])
        ratio = f"{run['speedup']:.2f}x (>= {GOALS['whisper_speedup']:.0f}x)" if "speedup" in run else "-"
        lines.append(f"| Whisper: {run['clips']} concurrent 30-s clips, {run['transcript_tokens']}-token transcripts, "
                     f"audio s/s (graphs: {run['graphed']}{pool_label(run)}) | {run['audio_s_per_s']:.0f} "
                     f"({run['seconds']:.2f} s) | {hf or 'not run'} | {ratio} |")
    s = results.get("whisper_step")
    if s:
        roof = (f"{s['roofline_fraction']:.0%} of the {s['roofline_step_ms']:.3f} ms roofline "
                f"(>= {GOALS['whisper_step_roofline_fraction']:.0%})" if "roofline_fraction" in s else "no roofline (CPU)")
        replay = (f"; graph replay alone {s['replay_ms']:.3f} ms = {s['replay_roofline_fraction']:.0%}"
                  if "replay_roofline_fraction" in s else "")
        lines.append(f"| Whisper batch-1 decoder step (graphs: {s['graphed']}), {s['bytes_per_step'] / 1e9:.2f} GB "
                     f"moved | {s['step_ms_median']:.3f} ms | - | {roof}{replay} |")
    for key, run in section_runs(results, "t5"):
        hf = ", ".join(f"b{r['batch']}: {r['output_tok_s']:.0f}" for r in run["hf"])
        name = "tiny T5" if results["device"] == "cpu" else "Flan-T5-XL"
        ratio = f"{run['speedup']:.2f}x (>= {GOALS['t5_speedup']:.0f}x)" if "speedup" in run else "-"
        lines.append(f"| {name}: {run['requests']} requests {run['input_len']}/{run['output_len']} offline, output "
                     f"tok/s (graphs: {run['graphed']}{pool_label(run)}) | {run['output_tok_s']:.0f} "
                     f"({run['seconds']:.2f} s) | {hf or 'not run'} | {ratio} |")
    for key, run in section_runs(results, "whisper"):
        if "encoder_pass_seconds" not in run:
            continue
        kernels = (f" ({run['widest_profile']['kernels_per_call']:.0f} kernels)"
                   if isinstance(run.get("widest_profile"), dict) else "")
        lines += ["", f"{key} after the run: one encoder pass over the {run['clips']} clips "
                  f"{run['encoder_pass_seconds']:.3f} s, with the cross K/V projections and writes "
                  f"{run['encode_into_pass_seconds']:.3f} s; the b{run['widest_bucket']} decode graph's replay "
                  f"{run['widest_replay_ms']:.2f} ms{kernels}."]
    if s and isinstance(s.get("profile"), dict):
        lines += ["", f"Whisper batch-1 step: {s['profile']['kernels_per_call']:.0f} kernels per replay (torch profiler)."]
    if s and s.get("variants"):
        lines += ["", "| Whisper batch-1 step variant (switches) | step | graph replay | kernels per replay | roofline "
                  "| widest bucket's replay |", "|---|---:|---:|---:|---:|---:|"]
        for name, v in s["variants"].items():
            switches = ", ".join(f"{key.removeprefix('TRITONLLM_')}={value}" for key, value in v["switches"].items())
            kernels = v["profile"]["kernels_per_call"] if isinstance(v.get("profile"), dict) else float("nan")
            lines.append(f"| {name} ({switches}) | {v['step_ms_median']:.3f} ms | {v.get('replay_ms', float('nan')):.3f} ms "
                         f"| {kernels:.0f} | {v.get('roofline_fraction', float('nan')):.0%} | "
                         + ", ".join(f"{key[len('replay_ms_'):]} {value:.3f} ms" for key, value in v.items()
                                     if key.startswith("replay_ms_b")) + " |")
    if s and s.get("breakdown"):
        lines += ["", "Where a graphed batch-1 step's wall time goes (step_breakdown, medians, us):", ""]
        for name, entry in [("default", s)] + list(s.get("variants", {}).items()):
            if entry.get("breakdown"):
                lines.append(f"- {name}: " + ", ".join(f"{key} {value:.1f}" for key, value in entry["breakdown"].items()))
    for name, entry in section_runs(results, "whisper") + section_runs(results, "t5"):
        if "iterations" in entry:
            it = entry["iterations"]
            step = (f"; decode-only iterations at batch {it['decode_batch']}: {it['decode_step_ms_median']:.2f} ms "
                    f"median" if "decode_batch" in it else "")
            step += ("; slowest decode-only iterations (index, ms): "
                     + ", ".join(f"{i} {ms:.1f}" for i, ms in it["decode_slowest"]) if it.get("decode_slowest") else "")
            replay = f" (its graph's replay {it['decode_graph_replay_ms']:.2f} ms)" if "decode_graph_replay_ms" in it else ""
            pools = (f"KV pools: self {entry['self_pool_dtype'].removeprefix('torch.')}, cross "
                     f"{entry['cross_pool_dtype'].removeprefix('torch.')}; " if "cross_pool_dtype" in entry else "")
            pools += f"weights {entry['weights']}; " if "weights" in entry else ""
            lines += ["", f"{name} run: {pools}encoder {entry['encoder_seconds']:.2f} s; {entry['graph_steps']} of "
                      f"{entry['steps']} forwards replayed from graphs; iterations with prompt tokens "
                      f"{it['context_seconds']:.2f} s, decode-only {it['decode_seconds']:.2f} s ({it['decode_iterations']})"
                      f"{step}{replay}."]
    if results.get("copy_GBps"):
        lines += ["", f"Copy bandwidth {results['copy_GBps']:.0f} GB/s (2 GiB device-to-device, read + write)."]
    return "\n".join(lines) + "\n"


def section_runs(results: dict, name: str) -> list[tuple[str, dict]]:
    """(key, entry) of ``name``'s runs: ``name`` itself, then ``name@<cross pool type>`` ones (main)."""
    return [(key, entry) for key, entry in results.items()
            if isinstance(entry, dict) and (key == name or key.startswith(name + "@"))]


def pool_label(run: dict) -> str:
    weights = f"; weights {run['weights']}" if run.get("weights", "none") != "none" else ""
    weights += f"; TP {run['tp_size']}" if run.get("tp_size", 1) != 1 else ""
    if "cross_pool_dtype" not in run:
        return weights
    return f"; KV pools self {run['self_pool_dtype'].removeprefix('torch.')}, cross " \
           f"{run['cross_pool_dtype'].removeprefix('torch.')}{weights}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of tiny shapes")
    p.add_argument("--dtype", default=None, help="engine dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--clips", type=int, default=None, help="concurrent Whisper clips (default 64; CPU 4)")
    p.add_argument("--transcript", type=int, default=None, help="tokens per transcript (default 100; CPU 6)")
    p.add_argument("--hf-whisper-batches", default=None, help="transformers batch sizes (default 16,32,64; CPU 2,4)")
    p.add_argument("--t5-requests", type=int, default=None, help="Flan-T5 requests (default 256; CPU 4)")
    p.add_argument("--t5-input", type=int, default=None, help="encoder tokens per request (default 512; CPU 16)")
    p.add_argument("--t5-output", type=int, default=None, help="output tokens per request (default 128; CPU 6)")
    p.add_argument("--hf-t5-batches", default=None,
                   help="transformers batch sizes (default 32,64,128,256: up to the run's 256 requests; CPU 2,4)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="fp8: both KV pools, the cross-KV pool included, in E4M3 (docs/features/encoder-decoder.md)")
    p.add_argument("--cross-kv-cache-dtype", default="auto",
                   help="comma-separated of auto, fp8: the whisper and t5 runs once per value (fp8: the cross-KV "
                        "pool alone in E4M3; auto: the self pool's type; ExecutorConfig.cross_kv_cache_dtype)")
    p.add_argument("--quantization", default="none",
                   help="comma-separated of none, fp8: the whisper and t5 runs once per value (fp8: the layer "
                        "linears of both stacks E4M3 per output channel, engine.build --quantization fp8)")
    p.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (module docstring)")
    p.add_argument("--kv-fraction", type=float, default=0.8, help="kv_cache_free_gpu_mem_fraction of the executors")
    p.add_argument("--profile-dir", default=None, help="write the decoder step's profiler table here")
    p.add_argument("--step-variants", default="",
                   help=f"whisper_step: after the default run, the step again per variant (comma-separated, of "
                        f"{list(STEP_VARIANTS)}), its decode graphs captured again with that variant's switches")
    p.add_argument("--out", default="encdec_bench.json")
    p.add_argument("--results-md", default=None, help="append the markdown table to this file")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    defaults = dict(dtype="float32" if cpu else "bfloat16", clips=4 if cpu else 64, transcript=6 if cpu else 100,
                    hf_whisper_batches="2,4" if cpu else "16,32,64", t5_requests=4 if cpu else 256,
                    t5_input=16 if cpu else 512, t5_output=6 if cpu else 128,
                    hf_t5_batches="2,4" if cpu else "32,64,128,256")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.step_variants = [v for v in args.step_variants.split(",") if v]
    unknown = [v for v in args.step_variants if v not in STEP_VARIANTS]
    if unknown:
        p.error(f"--step-variants: unknown {unknown}; allowed: {list(STEP_VARIANTS)}")
    args.cross_kv_cache_dtypes = [v for v in args.cross_kv_cache_dtype.split(",") if v] or ["auto"]
    if set(args.cross_kv_cache_dtypes) - {"auto", "fp8"}:
        p.error(f"--cross-kv-cache-dtype: {args.cross_kv_cache_dtype!r}; allowed: auto, fp8 (comma-separated)")
    args.cross_kv_cache_dtype = args.cross_kv_cache_dtypes[0]
    args.quantizations = [v for v in args.quantization.split(",") if v] or ["none"]
    if set(args.quantizations) - {"none", "fp8"}:
        p.error(f"--quantization: {args.quantization!r}; allowed: none, fp8 (comma-separated)")
    args.quantizations = [None if v == "none" else v for v in args.quantizations]
    args.quantization = args.quantizations[0]
    args.tp_sizes = [int(v) for v in args.tp.split(",") if v] or [1]
    args.tp_size = args.tp_sizes[0]
    args.hf_whisper_batches = [int(b) for b in str(args.hf_whisper_batches).split(",") if b]  # "": not run
    args.hf_t5_batches = [int(b) for b in str(args.hf_t5_batches).split(",") if b]  # "": transformers not run
    return args


def main(argv=None) -> dict:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `timeout -s USR1`: every thread's stack, then on
    args = parse_args(argv)
    sections = args.sections.split(",")
    results = {"date": utc_now(), "device": args.device, "machine": machine_summary(args.device), "commit": git_commit(),
               "command": command_line(__file__, argv), "goals": GOALS}
    bandwidth = copy_bandwidth(args.device)
    results["copy_GBps"] = bandwidth / 1e9
    started = time.perf_counter()
    first, first_weights, first_tp = args.cross_kv_cache_dtypes[0], args.quantizations[0], args.tp_sizes[0]
    runs = [("whisper_step", first, first_weights, first_tp, lambda: bench_whisper_step(args, bandwidth))]
    for name, bench in (("whisper", bench_whisper), ("t5", bench_t5)):
        runs += [(name, dtype, weights, tp, lambda bench=bench: bench(args)) for tp in args.tp_sizes
                 for weights in args.quantizations for dtype in args.cross_kv_cache_dtypes]
    runs = [run for name in dict.fromkeys(sections) for run in runs if run[0] == name]  # in --sections' order
    hf_batches = args.hf_whisper_batches, args.hf_t5_batches
    for name, dtype, weights, tp, run in runs:
        if name in sections:
            key = "@".join([name] + ([dtype] if dtype != first else []) +
                           ([f"{weights or 'none'}-weights"] if weights != first_weights else []) +
                           ([f"tp{tp}"] if tp != first_tp else []))
            args.cross_kv_cache_dtype, args.quantization, args.tp_size = dtype, weights, tp
            # transformers only with the first run (its figure does not depend on ours)
            args.hf_whisper_batches, args.hf_t5_batches = hf_batches if key == name else ([], [])
            t0 = time.perf_counter()
            results[key] = run()
            results[key]["section_seconds"] = time.perf_counter() - t0
            base, rate = results.get(name, {}), {"whisper": "audio_s_per_s", "t5": "output_tok_s"}.get(name)
            if key != name and "speedup" in base:  # against the first run's transformers figure
                results[key]["speedup"] = results[key][rate] / (base[rate] / base["speedup"])
            Path(args.out).write_text(json.dumps(results, indent=2))  # what is done survives a later failure
            print(f"{key}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results["seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(markdown(results), args.results_md)
    return results


if __name__ == "__main__":
    main()
