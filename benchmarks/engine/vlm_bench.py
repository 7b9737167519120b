"""Vision-language serving (issue 48): the Qwen2.5-VL-7B shape, random weights, one GPU.

    python benchmarks/engine/vlm_bench.py --out vlm.json --results-md benchmarks/results/engine.md

Sections (``--sections``, all by default):

1. ``encoder``: the vision tower (engine/vision/qwen2_5_vl.py: 32 blocks of width 1280, windows of
   112 pixels, four full-attention blocks, the 2 x 2 merger into 3,584) on batches of 448 x 448 and
   1024 x 1024 images, the grids Qwen2.5-VL's processor makes of them (smart_resize to multiples of
   28 pixels: 32 x 32 and 74 x 74 patches -> 256 and 1,369 rows); images/s at each of
   ``--encoder-batches``, the best batch counts. ``--tower-variants fused,unfused,sdpa-flash,...``
   times the tower again in the same process with TRITONLLM_TOWER_UNFUSED=1 (``unfused``: the blocks
   and layout as before), TRITONLLM_TOWER_SDPA=<backend> (``sdpa-<backend>``) or
   TRITONLLM_TOWER_WINDOW_SDPA=<backend> (``window-sdpa-<backend>``: the window blocks only) set.
2. ``ttft``: one request of one 448 x 448 image and 128 text tokens at low load (nothing else
   running): transformers' Qwen2-VL image processor on the PIL image, the tower, the request's
   M-RoPE rows (engine/vision/mrope.py), then the executor to its first token; the median of
   ``--ttft-runs``, beside a text-only prompt of the same length through the same executor.
3. ``offline``: ``--requests`` requests of one 448 x 448 image + 128 text tokens and 128 output
   tokens (no end id), all at once: every image is submitted to the encode queue
   (engine/vision/encode_queue.py: pending images batched, ``--encode-batch`` at most a forward, on a
   CUDA stream of its own; the queue warmed by an untimed round) and each request is enqueued by a
   thread of the bench as soon as its table exists (the executor runs the earlier ones meanwhile);
   output tokens/s until the last finishes, encoding included. Beside it the same through a queue
   whose stream has the executor's priority (CUDA; the A/B of engine/executor/device_stream.py), the
   first run's way (batches encoded by the bench's thread on the executor's stream) and the requests
   with their tables made beforehand (the executor's share); ``--offline-variants`` adds the queue run
   changed in one way each (OFFLINE_VARIANTS: the tower's linears in FP8, all or the MLPs', a full first
   forward). Every
   run has images of its own (the prefix cache would otherwise skip a re-sent image's prefill; each run
   reports the blocks it reused). Against (a)
   text-only requests of the same prompt length (386 tokens) through the same executor (goal >=
   0.85x), (b) transformers' Qwen2_5_VLForConditionalGeneration.generate (bf16, sdpa) on the same
   patches and prompts at each of ``--hf-batches`` (goal >= 5x the best batch; ``--hf-batches=``: none).

Random weights of the real shapes, made on the GPU (engine and tower: engine/executor/random_weights.py;
transformers: its own init). ``--device cpu`` runs tiny shapes of the same family (a smoke run of
every path).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (command_line, environment_set, free_device_memory, git_commit,  # noqa: E402
                               machine_summary, print_table, sync, timed_generate, utc_now)
from benchmarks.engine.engine_bench import (decode_step_parts_text, drain_offline, iteration_breakdown,  # noqa: E402
                                            profile_executor_loop)
from benchmarks.engine.gc_pauses import GcPauses  # noqa: E402
from benchmarks.engine.vlm_timeline import LoopTimeline  # noqa: E402
from benchmarks.sync_watch import SyncWatch  # noqa: E402
from engine.config import BuildConfig, EngineConfig  # noqa: E402
from engine.convert import model_config_from_hf  # noqa: E402
from engine.executor.device_stream import TOWER_PRIORITY  # noqa: E402
from engine.executor.executor import Executor, ExecutorConfig  # noqa: E402
from engine.executor.gc_freeze import GC_FREEZE_ENV, freeze_after_load, unfreeze  # noqa: E402
from engine.executor.load_phases import LOAD_LOG_ENV, load_phase  # noqa: E402
from engine.executor.mrope_rotary import Mrope  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.executor.random_weights import materialize_random_weights  # noqa: E402
from engine.executor.request import OutputConfig, Request  # noqa: E402
from engine.vision import qwen2_5_vl, qwen2_vl  # noqa: E402
from engine.vision.qwen2_vl import sdpa_backend  # noqa: E402
from engine.vision.encode_queue import ImageEncodeQueue  # noqa: E402
from engine.vision.mlp_width import pad_mlp_widths, padded_width  # noqa: E402
from engine.vision.mrope import request_mrope  # noqa: E402
from engine.vision.tower_fp8 import TOWER_FP8_ENV, embedding_cosines, quantize_tower_linears, tower_fp8_scope  # noqa: E402
from kernels.window_attention import TILING_ENV as WINDOW_TILING_ENV, tiling as window_tiling  # noqa: E402

SECTIONS = ["encoder", "ttft", "offline"]
GOALS = {"offline_vs_text": 0.85, "offline_vs_hf": 5.0}
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL-7B-Instruct's preprocessor_config.json
WARM_TOKENS = 32  # output tokens a request in the first untimed encode-queue round (bench_offline)
MAX_ENQUEUES_SHOWN = 24  # a queue run's first enqueue calls' times in its timeline line


def hf_config(device: str):
    """transformers' Qwen2_5_VLConfig: Qwen2.5-VL-7B-Instruct's shape on a GPU, a tiny one on the CPU."""
    from transformers import Qwen2_5_VLConfig

    if device == "cpu":
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4,
                      fullatt_block_indexes=[1])
        text = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_parameters={
                        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
        ids = dict(image_token_id=1000, vision_start_token_id=1001, vision_end_token_id=1002)
    else:
        vision = dict(depth=32, hidden_size=1280, out_hidden_size=3584, intermediate_size=3420, num_heads=16,
                      fullatt_block_indexes=[7, 15, 23, 31])
        text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_parameters={
                        "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
        ids = dict(image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653)
    vision.update(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=112,
                  in_channels=3, hidden_act="silu")
    text.update(max_position_embeddings=128000, bos_token_id=151643 if device != "cpu" else 1,
                eos_token_id=151645 if device != "cpu" else 2, pad_token_id=151643 if device != "cpu" else 4,
                tie_word_embeddings=False)
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, architectures=["Qwen2_5_VLForConditionalGeneration"],
                            **ids)


def image_grid(side: int) -> list[int]:
    """The processor's (t, h, w) patch grid of a side x side image: its smart_resize to a multiple of
    28 pixels within the pixel limits (the TTFT section checks it against the processor itself)."""
    factor = PATCH * MERGE
    edge = max(factor, round(side / factor) * factor)
    if edge * edge > MAX_PIXELS:
        edge = max(factor, math.floor(side / math.sqrt(side * side / MAX_PIXELS) / factor) * factor)
    elif edge * edge < MIN_PIXELS:
        edge = math.ceil(side * math.sqrt(MIN_PIXELS / (side * side)) / factor) * factor
    return [1, edge // PATCH, edge // PATCH]


def random_patches(grids: list[list[int]], device: str, seed: int = 0) -> torch.Tensor:
    """(patches, 3 * temporal * patch * patch) float32 normalized-pixel-like values for these grids, made on
    ``device`` (128 images' 616 MB took the host ~1-2 s; the offline section makes one set per run)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    count = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(count, 3 * TEMPORAL * PATCH * PATCH, generator=generator, device=device)
    sync(device)  # made before the streams that read them (the encode queue's, the executor's) look
    return patches


def load_encoder(config, args) -> torch.nn.Module:
    """Our tower with random weights on the device (the layout load_vision_encoder builds: on CUDA the MLP
    width 3,420 zero-padded to 3,456, engine/vision/mlp_width.py; the CPU smoke run pads its 48 to 128 too)."""
    encoder = qwen2_5_vl.Qwen25VisionEncoder(qwen2_5_vl.encoder_config(config), dtype=args.torch_dtype, device="meta")
    encoder = materialize_random_weights(encoder, torch.device(args.device), seed=0).eval()
    if not args.unpadded_mlp:
        pad_mlp_widths(encoder)
    if tower_fp8_scope():  # the ``fp8`` / ``fp8-mlp`` tower variants: as load_vision_encoder with TRITONLLM_TOWER_FP8
        quantize_tower_linears(encoder, tower_fp8_scope())
    return encoder


def write_language_engine(config, args, max_batch_size: int) -> str:
    """An engine directory of the language model (a plain Qwen2, as engine.build writes it) holding
    only config.json; the runner makes random weights at load."""
    root = tempfile.mkdtemp(prefix="bench-qwen2_5_vl-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # (as benchmarks/common.py's config-only engines)
    build = BuildConfig(dtype=args.dtype, max_batch_size=max_batch_size, max_input_len=1024, max_seq_len=2048,
                        max_num_tokens=args.max_num_tokens, tokens_per_block=32, quantization=args.quantization)
    model = model_config_from_hf(qwen2_vl.text_config(config))
    # "vision_encoder": what engine.build writes for a vision-language checkpoint (the runner captures the
    # prefill graphs' table twins for it, engine/executor/table_graphs.py); the tower here is the bench's own
    EngineConfig(model=model, build=build, extra={"random_weights_seed": 0, "vision_encoder": "vision_encoder"}
                 ).validate().save(root)
    return root


# ---- 1. the tower alone -------------------------------------------------------------------------

# kernels/window_attention.py tilings (heads, warps a program)
WINDOW_TILINGS = ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8))
TOWER_VARIANTS = {"fused": {}, "unfused": {qwen2_vl.UNFUSED_ENV: "1"},
                  **{f"sdpa-{name}": {qwen2_vl.SDPA_ENV: name} for name in qwen2_vl.SDPA_BACKENDS},
                  **{f"window-sdpa-{name}": {qwen2_vl.WINDOW_SDPA_ENV: name} for name in qwen2_vl.SDPA_BACKENDS},
                  "fp8": {TOWER_FP8_ENV: "1"}, "fp8-mlp": {TOWER_FP8_ENV: "mlp"},
                  # the window blocks' attention (engine/vision/qwen2_5_vl.py WINDOW_KERNEL_ENV); -hNwM: N heads, M warps a program
                  **{f"window-{name}": {qwen2_5_vl.WINDOW_KERNEL_ENV: name} for name in qwen2_5_vl.WINDOW_KERNELS},
                  **{f"window-triton-h{h}w{w}": {qwen2_5_vl.WINDOW_KERNEL_ENV: "triton", WINDOW_TILING_ENV: f"{h},{w}"}
                     for h, w in WINDOW_TILINGS},
                  # the blocks' residual adds in the products (engine/vision/qwen2_5_vl.py RESIDUAL_ENV) or the norms
                  **{f"residual-{name}": {qwen2_5_vl.RESIDUAL_ENV: name} for name in qwen2_5_vl.RESIDUALS},
                  "window-triton+residual-product": {qwen2_5_vl.WINDOW_KERNEL_ENV: "triton",
                                                     qwen2_5_vl.RESIDUAL_ENV: "product"},
                  "window-sdpa+residual-norm": {qwen2_5_vl.WINDOW_KERNEL_ENV: "sdpa", qwen2_5_vl.RESIDUAL_ENV: "norm"},
}
# --offline-variants: queue runs of the offline section changed in one way each, "+" joins them. fp8-tower: the
# tower's linears in E4M3 (engine/vision/tower_fp8.py), fp8-mlp-tower: its MLPs' only; flash-attn: the tower's
# attention on flash (TRITONLLM_TOWER_SDPA=flash: no per-shape plan); cudnn-attn: on torch's own choice, cuDNN on an
# H200 (TRITONLLM_TOWER_SDPA=auto: the default before 2026-11-30 session 22; a plan built per new shape); first-odd: the timed run's first forward takes
# 5 images (then 32, 32, 32, 27: image counts the untimed round did not make, as when a burst's first requests beat the
# rest to the queue; call 14's stalled runs had 4-5, then 27-28); first-full: the queue's first forward takes the whole
# batch (not 8 images), so the executor's first step is a full one; tower-graphs: the queue replays the forwards of
# image batches seen before from CUDA graphs (engine/vision/tower_graphs.py; TRITONLLM_TOWER_GRAPHS=8; off by default);
# window-triton / window-sdpa: the window blocks' attention (TRITONLLM_TOWER_WINDOW_KERNEL: kernels/window_attention.py
# or rotary + SDPA); residual-product / residual-norm: where the blocks' residual adds happen (TRITONLLM_TOWER_RESIDUAL)
OFFLINE_VARIANTS = ("fp8-tower", "fp8-mlp-tower", "flash-attn", "cudnn-attn", "first-odd", "first-full", "tower-graphs",
                    "window-triton", "window-sdpa", "residual-product", "residual-norm")
TOWER_GRAPHS_KEPT = 8
ODD_FIRST_IMAGES = 5
FP8_TOWER_SCOPES = {"fp8-tower": "all", "fp8-mlp-tower": "mlp"}  # (engine/vision/tower_fp8.py FP8_SCOPES)


def tower_variant(name: str):
    """The environment of a ``--tower-variants`` entry (TOWER_VARIANTS), restored after."""
    if name not in TOWER_VARIANTS:
        raise SystemExit(f"--tower-variants: {name!r} is not one of {', '.join(TOWER_VARIANTS)}")
    return environment_set(TOWER_VARIANTS[name])


def bench_encoder(args, config, variant: str = "") -> dict:
    encoder = load_encoder(config, args)
    entry = {}
    for side, batches in zip(args.image_sizes, args.encoder_batches):
        grid = image_grid(side)
        rows = []
        for batch in batches:
            patches = random_patches([grid] * batch, args.device)
            encoder.image_features(patches, [grid] * batch)  # warm-up
            sync(args.device)
            times = []
            for _ in range(args.encoder_repeats):
                started = time.perf_counter()
                out = encoder.image_features(patches, [grid] * batch)
                sync(args.device)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            rows.append({"batch": batch, "seconds": seconds, "images_per_s": batch / seconds,
                         "finite": bool(torch.isfinite(out[0]).all())})
        best = max(rows, key=lambda row: row["images_per_s"])
        if args.profile_dir and args.device != "cpu":
            rows[-1]["profile"] = profile_tower(encoder, random_patches([grid] * batches[-1], args.device), [grid] * batches[-1],
                                                Path(args.profile_dir) / f"vlm_tower_{side}{variant}_profile.txt")
        print(f"encoder {side}: " + ", ".join(f"b{r['batch']} {r['images_per_s']:.1f} images/s" for r in rows)
              + f" ({tower_setting(args.device)})", file=sys.stderr, flush=True)
        entry[str(side)] = {"grid": grid, "rows_per_image": grid[0] * grid[1] * grid[2] // MERGE ** 2,
                            "batches": rows, "best_images_per_s": best["images_per_s"], "best_batch": best["batch"]}
    del encoder
    free_device_memory(args.device)
    return entry


def tower_setting(device: str) -> str:
    """How the tower's blocks ran: fused (engine/vision/qwen2_5_vl.py) or as before (TRITONLLM_TOWER_UNFUSED=1),
    and the attention backends asked of torch (TRITONLLM_TOWER_SDPA, TRITONLLM_TOWER_WINDOW_SDPA) or the window
    blocks' Triton kernel (TRITONLLM_TOWER_WINDOW_KERNEL, on CUDA by default where DEFAULT_WINDOW_KERNEL says)."""
    blocks = "unfused blocks" if os.environ.get(qwen2_vl.UNFUSED_ENV) == "1" else "fused blocks"
    fp8 = f", FP8 linears ({tower_fp8_scope()})" if tower_fp8_scope() else ""
    windows = ("the Triton window kernel (heads, warps a program: {}, {})".format(*window_tiling())
               if qwen2_5_vl.window_kernel(torch.empty(0, device=device)) == "triton" else sdpa_backend(windows=True))
    return f"{blocks}{fp8}, SDPA {sdpa_backend()}, windows {windows}, residual added by the {qwen2_5_vl.residual_choice(torch.empty(0, device=device))}"


def profile_tower(encoder, patches: torch.Tensor, grids: list[list[int]], path: Path) -> str:
    """torch-profiler table (by CUDA time) of one tower forward, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        encoder.image_features(patches, grids)
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    return str(path)


# ---- prompts ------------------------------------------------------------------------------------

def prompt_ids(config, num_rows: int, text_len: int, rng: random.Random, fake_from: int | None) -> list[int]:
    """<|vision_start|> + the image's rows + <|vision_end|> + ``text_len`` text ids; rows as fake ids
    from ``fake_from`` (ours: the table's rows) or as <|image_pad|> (transformers')."""
    rows = list(range(fake_from, fake_from + num_rows)) if fake_from is not None else [config.image_token_id] * num_rows
    return [config.vision_start_token_id, *rows, config.vision_end_token_id, *text_prompt(text_len, config, rng)]


def text_prompt(length: int, config, rng: random.Random) -> list[int]:
    """Random ordinary ids: below the vision/image special ids (in both shapes the vocabulary's last ones)."""
    return [rng.randrange(3, min(config.vision_start_token_id, config.image_token_id)) for _ in range(length)]




def image_requests(config, encoder_config: dict, tables: list[torch.Tensor], grid: list[int], prompts: list[list[int]],
                   vocab: int, max_tokens: int) -> list[Request]:
    """One Request per image: its table (float16 on the host, as multimodal_encoders sends it) and its
    M-RoPE rows and delta."""
    out = OutputConfig(exclude_input_from_output=True)
    requests = []
    for table, ids in zip(tables, prompts):
        rotary, delta = request_mrope(ids, [grid], encoder_config, vocab_size=vocab)
        requests.append(Request(ids, max_tokens, output=out, prompt_table=PromptTable(table),
                                mrope=Mrope(rotary, delta)))
    return requests


# ---- 2 + 3. through the executor ----------------------------------------------------------------

def bench_executor(args, config, sections: list[str]) -> dict:
    """TTFT and offline throughput through one executor (its warm-up first), then transformers."""
    with load_phase("vision tower, random weights", args.device):
        encoder = load_encoder(config, args)
    encoder_config = qwen2_5_vl.encoder_config(config)
    vocab = config.text_config.vocab_size
    side = args.image_sizes[0]
    grid = image_grid(side)
    num_rows = grid[0] * grid[1] * grid[2] // MERGE ** 2
    engine = write_language_engine(config, args, max_batch_size=args.max_batch_size or max(args.requests, 8))
    results = {}
    executor_config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=args.kv_fraction,
                                     max_tokens_in_paged_kv_cache=args.requests * 1024 if args.device == "cpu" else None)
    with Executor(engine, executor_config, device=args.device) as ex:
        def encode(pixels: torch.Tensor, count: int) -> list[torch.Tensor]:
            rows = encoder.image_features(pixels, [grid] * count)
            return list(torch.cat(rows).to(torch.float16).cpu().split(num_rows))  # one copy to the host

        rng = random.Random(0)
        with load_phase("warm-up: an image request and a text one (the tower's kernels)", args.device):
            warm = image_requests(config, encoder_config, encode(random_patches([grid], args.device), 1),
                                  grid, [prompt_ids(config, num_rows, args.text_len, rng, vocab)], vocab, 4)
            ex.enqueue_requests(warm + [Request(text_prompt(num_rows + 2 + args.text_len, config, rng), 4)])
            drain_offline(ex, 2)
        # As the engine process does once its executor has loaded (engine/executor/gc_freeze.py): full collections
        # during the runs then scan only what the runs made. $TRITONLLM_GC_FREEZE=0: the before figure.
        with load_phase("gc.collect + gc.freeze", args.device):
            results["gc_freeze"] = freeze_after_load(args.device)
        twins = count_table_twin_replays(ex)
        if "ttft" in sections:
            results["ttft"] = bench_ttft(args, ex, config, encoder, encoder_config, grid, num_rows, side)
            results["ttft"]["table_twin_replays"] = twins() if twins else None
        if "offline" in sections:
            results["offline"] = bench_offline(args, ex, config, encode, encoder, encoder_config, grid, num_rows)
            results["offline"]["table_twin_replays"] = twins() if twins else None
    del ex, encoder
    unfreeze()  # the executor's objects were frozen with the load's: its cycles (KV pool, graphs) must be collectable
    free_device_memory(args.device)
    if "offline" in sections and args.hf_batches:
        offline = results["offline"]
        offline["hf"] = hf_generate(args, config, grid, num_rows)
        best = max(offline["hf"], key=lambda row: row["output_tok_s"])
        offline["hf_best_batch"], offline["vs_hf"] = best["batch"], offline["image"]["output_tok_s"] / best["output_tok_s"]
    return results


def count_table_twin_replays(ex):
    """A function giving the number of steps with image / M-RoPE rows that replayed the prefill graphs'
    table twins (engine/executor/table_graphs.py) since it was last called; None without twins (CPU)."""
    graphs = ex.runner.prefill_graphs
    if graphs is None or graphs.table is None:
        return None
    counter, fill = [0], graphs.table.fill_device

    def counting(*args):
        counter[0] += 1
        return fill(*args)

    def take() -> int:
        value, counter[0] = counter[0], 0
        return value
    graphs.table.fill_device = counting
    return take


def first_token_seconds(ex, request: Request) -> float:
    """Enqueue ``request`` (max_tokens 1) and wait for its response -> seconds."""
    started = time.perf_counter()
    ex.enqueue_requests([request])
    drain_offline(ex, 1)
    return time.perf_counter() - started


def bench_ttft(args, ex, config, encoder, encoder_config, grid, num_rows, side) -> dict:
    """One image + text_len tokens, nothing else running: processor, tower, M-RoPE rows, first token."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                      min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    vocab = config.text_config.vocab_size
    rng = random.Random(1)
    image = Image.fromarray((torch.rand(side, side, 3, generator=torch.Generator().manual_seed(0)) * 255)
                            .to(torch.uint8).numpy())
    parts = {"preprocess": [], "encoder": [], "mrope": [], "first_token": [], "total": [], "text_only": []}
    for _ in range(args.ttft_runs):
        ids = prompt_ids(config, num_rows, args.text_len, rng, vocab)
        t0 = time.perf_counter()
        pixels = processor(images=[image], return_tensors="pt")
        assert pixels["image_grid_thw"].tolist() == [grid], pixels["image_grid_thw"]
        t1 = time.perf_counter()
        table = encoder.image_features(pixels["pixel_values"].to(args.device), [grid])[0].to(torch.float16).cpu()
        t2 = time.perf_counter()
        rotary, delta = request_mrope(ids, [grid], encoder_config, vocab_size=vocab)
        t3 = time.perf_counter()
        parts["first_token"].append(first_token_seconds(ex, Request(ids, 1, prompt_table=PromptTable(table),
                                                                    mrope=Mrope(rotary, delta))))
        for name, seconds in (("preprocess", t1 - t0), ("encoder", t2 - t1), ("mrope", t3 - t2)):
            parts[name].append(seconds)
        parts["total"].append(time.perf_counter() - t0)
        parts["text_only"].append(first_token_seconds(ex, Request(text_prompt(len(ids), config, rng), 1)))
    return {"runs": args.ttft_runs, "image_side": side, "prompt_len": num_rows + 2 + args.text_len,
            **{f"{name}_ms": statistics.median(values) * 1e3 for name, values in parts.items()}}


def bench_offline(args, ex, config, encode, encoder, encoder_config, grid, num_rows) -> dict:
    """The offline runs, each on images of its own (a seed per run): the prefix cache keys image blocks by
    their rows, so a run re-sending an earlier run's images would skip their prefill (the 13:08 run's
    "first way" and "tables ready" figures did: 4 and 1 iterations with prompt tokens)."""
    vocab = config.text_config.vocab_size
    rng = random.Random(2)
    prompts = [prompt_ids(config, num_rows, args.text_len, rng, vocab) for _ in range(args.requests)]
    per_image = grid[0] * grid[1] * grid[2]
    entry = {"requests": args.requests, "prompt_len": len(prompts[0]), "output_len": args.output_len,
             "encode_batch": args.encode_batch, "also_encode_batches": args.also_encode_batches,
             "offline_variants": args.offline_variants}
    sync(args.device)

    def with_encoding(patches: torch.Tensor) -> dict:
        """(a') images: encode a batch on this thread, enqueue its requests, go on with the next batch; the
        tower on the executor's stream (its kernels queue behind the executor's; the executor's loop has a
        stream of its own in a vision-language engine, engine/executor/device_stream.py, which this uses)."""
        since, reused, allocations = time.time_ns(), reused_blocks(ex), allocator_counts(args.device)
        started = time.perf_counter()
        encoder_seconds = 0.0
        stream = getattr(ex, "device_stream", None)  # (the executor's loop runs on it: engine/executor/device_stream.py)
        with GcPauses(started) as pauses:
            for first in range(0, args.requests, args.encode_batch):
                count = min(args.encode_batch, args.requests - first)
                t0 = time.perf_counter()
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    tables = encode(patches[first * per_image:(first + count) * per_image], count)
                encoder_seconds += time.perf_counter() - t0
                ex.enqueue_requests(image_requests(config, encoder_config, tables, grid, prompts[first:first + count],
                                                   vocab, args.output_len))
            tokens = drain_offline(ex, args.requests)
            seconds = time.perf_counter() - started
        return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "gc": pauses.summary(),
                "encode_and_enqueue_seconds": encoder_seconds, "reused_blocks": reused_blocks(ex) - reused,
                "allocations": allocator_counts(args.device, allocations, stream_names(ex)),
                "iterations": iteration_breakdown(ex, since), "prompt_steps": prompt_steps(ex, since),
                "slow_decode_steps": slow_decode_steps(ex, since), "first_steps": first_steps(ex, since)}

    def queue_run(name: str, priority: int, seed: int, warm_seed: int, warm_tokens: int | None,
                  max_images: int | None = None, tower=None, first_images: int = 8, timed_first_images: int | None = None,
                  environment: dict | None = None, max_graphs: int | None = None) -> None:
        queue = ImageEncodeQueue(tower or encoder, args.device, max_images=max_images or args.encode_batch,
                                 first_images=first_images, priority=priority, max_graphs=max_graphs)
        try:
            # Untimed: one round on images of its own, so the queue's stream (its cached device blocks), its pinned
            # staging and the executor's exist before the clock starts, as in a server that has served a while.
            # warm_tokens None: the executor is warm already; only the queue's own forwards (the same batches)
            warm = random_patches([grid] * args.requests, args.device, seed=warm_seed)
            if warm_tokens is None:
                with load_phase(f"untimed encode-queue forwards ({args.requests} images)", args.device):
                    for future in [queue.submit(warm[i * per_image:(i + 1) * per_image], [grid])
                                   for i in range(args.requests)]:
                        future.result()
            else:
                with load_phase(f"untimed encode-queue round ({args.requests} requests, {warm_tokens} output tokens)",
                                args.device):
                    through_queue(args, ex, queue, config, encoder_config, grid, prompts, warm, vocab, warm_tokens)
            queue.first_images = timed_first_images or queue.first_images
            watch = SyncWatch() if args.sync_watch else contextlib.nullcontext()
            with environment_set(environment or {}), watch:  # (read per forward: qwen2_vl.py sdpa_backend)
                run = through_queue(args, ex, queue, config, encoder_config, grid, prompts,
                                    random_patches([grid] * args.requests, args.device, seed=seed), vocab, args.output_len)
            if args.sync_watch:  # where the run's threads waited for the GPU or compiled (benchmarks/sync_watch.py)
                run["syncs"], run["compiles"] = watch.summary()[:12], watch.compiles
                print(f"offline {name} synchronizing calls (count, first ms, thread, stack): "
                      + json.dumps(run["syncs"]) + "; Triton compiles (at ms, ms, thread, kernel): "
                      + json.dumps([[c["at_ms"], c["ms"], c["thread"], c["kernel"]] for c in run["compiles"]]),
                      file=sys.stderr, flush=True)
            entry[name] = progress(name, run)
            entry.setdefault("first_images", queue.first_images)
            entry[name]["tower_graphs"] = {"captured": queue.graphs.captured, "replays": queue.graphs.replays,
                                           "failures": list(queue.graphs.failures.values())}
        finally:
            queue.close()

    # The first untimed round decodes WARM_TOKENS tokens a request (2 before 2026-11-29 17:00): every request still
    # decodes while the last prompts run, so the timed run's step shapes (decode rows beside prompt tokens up to
    # 112, decode-only steps of 128 rows) are in the executor's stream's cached blocks before the clock starts.
    # With 2 (the 16:17 H200 run) the timed image run made 4 device segments (cudaMalloc: it waits for the
    # whole device, the tower's forward included; a 288 ms step) and the runs after it none.
    queue_run("image", TOWER_PRIORITY, seed=1, warm_seed=4, warm_tokens=min(WARM_TOKENS, args.output_len))
    # Its baseline next (a run cut by a timeout still has the ratio's two lines): text-only prompts of the same length
    out = OutputConfig(exclude_input_from_output=True)
    requests = [Request(text_prompt(len(prompts[0]), config, rng), args.output_len, output=out)
                for _ in range(args.requests)]
    entry["text"] = progress("text", timed_offline(ex, requests))
    stream = getattr(ex, "device_stream", None)
    if stream is not None:  # A/B: the tower's stream at the executor's priority (as before engine/executor/device_stream.py)
        queue_run("image_equal_priority", stream.priority, seed=5, warm_seed=6, warm_tokens=None)  # (executor warm)
    for i, batch in enumerate(args.also_encode_batches):  # the queue run again at another encode batch, same process
        queue_run(f"image_b{batch}", TOWER_PRIORITY, seed=10 + 2 * i, warm_seed=11 + 2 * i, warm_tokens=None,
                  max_images=batch)
    fp8_towers = {}  # FP8_TOWER_SCOPES' name -> that tower, made for its first variant
    for i, variant in enumerate(args.offline_variants):  # the default run changed in one way (OFFLINE_VARIANTS)
        parts = variant.split("+")
        fp8 = next((part for part in parts if part in FP8_TOWER_SCOPES), None)
        try:  # a tower that cannot run here fails in the cosines or the queue's untimed forwards, before any request
            if fp8 is not None and fp8 not in fp8_towers:
                fp8_towers[fp8] = quantize_tower_linears(copy.deepcopy(encoder), FP8_TOWER_SCOPES[fp8])
                entry[f"{fp8}_cosines"] = fp8_cosines(encoder, fp8_towers[fp8], grid, args.device, fp8)
            queue_run(variant_run_name(variant, i, args.offline_variants), TOWER_PRIORITY, seed=30 + 2 * i, warm_seed=31 + 2 * i, warm_tokens=None,
                      tower=fp8_towers.get(fp8), first_images=args.encode_batch if "first-full" in parts else 8,
                      timed_first_images=ODD_FIRST_IMAGES if "first-odd" in parts else None,
                      environment=variant_environment(parts),
                      max_graphs=TOWER_GRAPHS_KEPT if "tower-graphs" in parts else None)
        except Exception as error:  # (a Triton compile error is no RuntimeError)
            entry.setdefault("variant_errors", {})[variant] = repr(error)[:300]
            print(f"offline variant {variant} failed: {error!r}", file=sys.stderr, flush=True)
    del fp8_towers
    # (c) the same image requests with their tables made before the clock starts: the executor's share
    patches = random_patches([grid] * args.requests, args.device, seed=3)
    tables = [t for first in range(0, args.requests, args.encode_batch)
              for t in encode(patches[first * per_image:min(first + args.encode_batch, args.requests) * per_image],
                              min(args.encode_batch, args.requests - first))]
    requests = image_requests(config, encoder_config, tables, grid, prompts, vocab, args.output_len)
    profiler = profile_executor_loop(ex) if args.profile_dir else None
    reused = reused_blocks(ex)
    entry["image_tables_ready"] = progress("image_tables_ready", {**timed_offline(ex, requests),
                                                                  "reused_blocks": reused_blocks(ex) - reused})
    if profiler is not None:
        path = Path(args.profile_dir) / "vlm_executor_profile.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(profiler())
        entry["image_tables_ready"]["profile"] = str(path)
    # Last: the tower on the executor's stream makes segments there of its own (8 in the 16:17 run)
    entry["image_executor_stream"] = progress("image_executor_stream", with_encoding(
        random_patches([grid] * args.requests, args.device, seed=2)))
    entry["vs_text"] = entry["image"]["output_tok_s"] / entry["text"]["output_tok_s"]
    return entry


def fp8_cosines(encoder, fp8_tower, grid: list[int], device: str, name: str, images: int = 8) -> dict:
    """Per image, the cosine of the FP8 tower's rows against the unquantized tower's (bf16 on a GPU; random weights and patches)."""
    patches = random_patches([grid] * images, device, seed=99)
    cosines = embedding_cosines(encoder.image_features(patches, [grid] * images),
                                fp8_tower.image_features(patches, [grid] * images))
    print(f"offline {name}: cosines of {images} images' rows against the unquantized tower's {[round(c, 5) for c in cosines]}",
          file=sys.stderr, flush=True)
    return {"images": images, "min": min(cosines), "mean": statistics.mean(cosines)}


def through_queue(args, ex, queue: ImageEncodeQueue, config, encoder_config, grid, prompts, patches, vocab,
                  output_len: int) -> dict:
    """(a) images as served in one process: every request's image submitted at once to the encode queue
    (engine/vision/encode_queue.py: pending images batched, ``--encode-batch`` at most per forward, on a
    CUDA stream of its own), each request enqueued as soon as its table exists by a thread of its own (a
    server's request handlers: the queue's worker only completes the futures), those ready together in
    one call. ``tables_ready_s``: when the last table was ready."""
    since, reused, allocations = time.time_ns(), reused_blocks(ex), allocator_counts(args.device)
    per_image = grid[0] * grid[1] * grid[2]
    started = time.perf_counter()
    with GcPauses(started) as pauses, LoopTimeline(ex, queue, started) as timeline:
        futures = [queue.submit(patches[i * per_image:(i + 1) * per_image], [grid]) for i in range(args.requests)]
        failed, ready_at, enqueue_s = [], [], []

        def enqueue() -> None:
            index = 0
            try:
                while index < len(futures):
                    futures[index].result()
                    ready = [index]
                    while ready[-1] + 1 < len(futures) and futures[ready[-1] + 1].done():
                        ready.append(ready[-1] + 1)
                    ready_at.append(time.perf_counter() - started)
                    requests = image_requests(config, encoder_config, [futures[i].result() for i in ready], grid,
                                              [prompts[i] for i in ready], vocab, output_len)
                    t0 = time.perf_counter()
                    ex.enqueue_requests(requests)
                    enqueue_s.append(time.perf_counter() - t0)
                    index = ready[-1] + 1
            except BaseException as error:  # the drain below raises it
                failed.append(error)

        thread = threading.Thread(target=enqueue, name="vlm_bench_enqueue", daemon=True)
        thread.start()
        tokens = drain_offline(_Watched(ex, failed), args.requests)
        seconds = time.perf_counter() - started
        thread.join()
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "gc": pauses.summary(),
            "timeline": timeline.summary(), "enqueued_at_ms": [round(t * 1e3, 1) for t in ready_at[:MAX_ENQUEUES_SHOWN]],
            "tables_ready_s": ready_at[-1], "first_table_s": ready_at[0], "enqueue_calls": len(ready_at),
            "enqueue_ms": {"total": round(sum(enqueue_s) * 1e3, 1), "max": round(max(enqueue_s) * 1e3, 1)},
            "reused_blocks": reused_blocks(ex) - reused,
            "allocations": allocator_counts(args.device, allocations, stream_names(ex, queue)),
            "iterations": iteration_breakdown(ex, since), "prompt_steps": prompt_steps(ex, since),
            "slow_decode_steps": slow_decode_steps(ex, since), "first_steps": first_steps(ex, since)}


class _Watched:
    """The executor as drain_offline sees it, raising the enqueuing thread's error instead of waiting forever."""

    def __init__(self, ex, failed: list):
        self.ex, self.failed = ex, failed

    def await_responses(self, timeout: float | None = None):
        if self.failed:
            raise RuntimeError(f"enqueuing failed: {self.failed[0]!r}") from self.failed[0]
        return self.ex.await_responses(timeout=timeout)


def prompt_steps(ex, since_ns: int) -> list[list]:
    """[ms, prompt tokens, decode rows] of each iteration with prompt tokens since ``since_ns``, in order
    (where an image run's prefill time goes, beside the text run's)."""
    return [[round(h.iter_latency_ms, 1), h.num_ctx_tokens, h.num_gen_requests]
            for h in ex.get_iteration_stats_history() if h.timestamp_ns >= since_ns and h.num_context_requests]


def first_steps(ex, since_ns: int, count: int = 40) -> list[list]:
    """[ms, prompt tokens, decode rows] of the first ``count`` iterations since ``since_ns``, in order: while the
    tower still encodes (a stall shows as a long step; with overlap a step's time runs from the step before it
    to when its tokens were read, so a host stall while launching step N lands in step N - 1's figure)."""
    return [[round(h.iter_latency_ms, 1), h.num_ctx_tokens, h.num_gen_requests]
            for h in ex.get_iteration_stats_history() if h.timestamp_ns >= since_ns][:count]


def allocator_counts(device: str, since: dict | None = None, streams: dict | None = None) -> dict:
    """Pinned host blocks created (cudaHostAlloc: the caching host allocator missed), device segments created
    (cudaMalloc) and allocation retries (cache flushes) so far, or since ``since``: each is an implicit
    synchronization of every stream of the device. {} off CUDA. Since ``since`` also ``new_segments``:
    [stream, MiB] of each device segment that exists now and did not then (torch.cuda.memory_snapshot;
    ``streams`` names the streams by their cudaStream_t: "executor", "tower"; others "stream <number>")."""
    if torch.device(device).type != "cuda":
        return {}
    stats = getattr(torch.cuda, "host_memory_stats", None)  # (torch >= 2.7)
    host, dev = (stats() if stats is not None else {}), torch.cuda.memory_stats(device)
    now = {"pinned_host_allocs": host.get("num_host_alloc"), "device_mallocs": dev.get("segment.all.allocated"),
           "device_alloc_retries": dev.get("num_alloc_retries")}  # (None: this torch does not count it)
    if since is None:
        return {**now, "segments": device_segments(device)}
    out = {name: None if value is None or since.get(name) is None else value - since[name] for name, value in now.items()}
    before, names = since.get("segments"), {0: "default", **(streams or {})}
    if before is not None:
        out["new_segments"] = sorted([names.get(stream, f"stream {stream}"), round(size / 2**20, 1)]
                                     for address, (stream, size) in device_segments(device).items() if address not in before)
    return out


def device_segments(device: str) -> dict | None:
    """{address: (cudaStream_t, bytes)} of the caching allocator's device segments on ``device``, or None."""
    try:
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        return {seg["address"]: (seg["stream"], seg["total_size"]) for seg in torch.cuda.memory_snapshot()
                if seg.get("device", index) == index}
    except (RuntimeError, KeyError, TypeError):
        return None


def stream_names(ex, queue=None) -> dict:
    """{cudaStream_t: name} of the executor's loop stream and the encode queue's (allocator_counts)."""
    names = {}
    for name, stream in (("executor", getattr(ex, "device_stream", None)), ("tower", getattr(queue, "stream", None))):
        if stream is not None:
            names[stream.cuda_stream] = name
    return names


def slow_decode_steps(ex, since_ns: int) -> list[list]:
    """[ms, decode rows] of the decode-only iterations since ``since_ns`` that took over twice their median
    (outliers: a garbage collection, a host stall), in order."""
    steps = [h for h in ex.get_iteration_stats_history()
             if h.timestamp_ns >= since_ns and not h.num_context_requests and h.num_gen_requests]
    if not steps:
        return []
    median = statistics.median(h.iter_latency_ms for h in steps)
    return [[round(h.iter_latency_ms, 1), h.num_gen_requests] for h in steps if h.iter_latency_ms > 2 * median]


def progress(name: str, run: dict) -> dict:
    """``run``, after a line on stderr (what a run cut short by a timeout still shows)."""
    it = run["iterations"]
    print(f"offline {name}: {run['output_tok_s']:.0f} tok/s ({run['seconds']:.2f} s), prompt-token iterations "
          f"{it['context_seconds']:.2f} s ({it['context_iterations']}), decode-only {it['decode_seconds']:.2f} s "
          f"({it['decode_iterations']}), outside iterations {run['seconds'] - it['context_seconds'] - it['decode_seconds']:.2f} s"
          f" (enqueue calls {run.get('enqueue_ms')} ms), reused blocks {run.get('reused_blocks')}"
          + (f", tables ready from {run['first_table_s']:.3f} to {run['tables_ready_s']:.3f} s, "
             f"{run['enqueue_calls']} enqueue calls" if "tables_ready_s" in run else "")
          + f"; prompt steps [ms, prompt tokens, decode rows]: {run.get('prompt_steps')}; decode-only steps over twice "
          f"the median [ms, rows]: {run.get('slow_decode_steps')}; allocations during the run {run.get('allocations')}"
          f"; garbage collections {run.get('gc')}"
          + (f"; first iterations [ms, prompt tokens, decode rows]: {run['first_steps']}" if "first_steps" in run else ""),
          file=sys.stderr, flush=True)
    if "timeline" in run:  # (benchmarks/engine/vlm_timeline.py: host launch / device run of each step and forward)
        t = run["timeline"]
        print(f"offline {name} timeline, ms after its start: enqueue calls at {run.get('enqueued_at_ms')}; executor steps "
              f"[host launch began, ended, device start, end, prompt tokens, decode rows] {t['steps']}; token waits "
              f"[began, ended] {t['token_waits']}; tower forwards [host launch began, ended, device start, end, images, "
              f"tables completed] {t['forwards']}", file=sys.stderr, flush=True)
    return run


def reused_blocks(ex) -> int:
    """The executor's cumulative prefix-cache hits (blocks): each run's must be 0 (images of its own)."""
    return ex.get_latest_iteration_stats().kv_cache_stats.reused_blocks


def timed_offline(ex, requests: list[Request]) -> dict:
    """All ``requests`` enqueued at once: seconds until the last finished, output tokens and tok/s, and
    the executor's iteration breakdown over them."""
    since, allocations = time.time_ns(), allocator_counts(str(ex.runner.device))
    started = time.perf_counter()
    with GcPauses(started) as pauses:
        ex.enqueue_requests(requests)
        enqueued = time.perf_counter() - started
        tokens = drain_offline(ex, len(requests))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "gc": pauses.summary(),
            "enqueue_ms": {"total": round(enqueued * 1e3, 1), "max": round(enqueued * 1e3, 1)},
            "allocations": allocator_counts(str(ex.runner.device), allocations, stream_names(ex)),
            "iterations": iteration_breakdown(ex, since), "prompt_steps": prompt_steps(ex, since),
            "slow_decode_steps": slow_decode_steps(ex, since)}


def hf_generate(args, config, grid, num_rows) -> list[dict]:
    """transformers' generate at each batch size: one batch of image prompts, the same lengths."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=args.torch_dtype).eval()
    rng = random.Random(3)
    rows = []
    for batch in args.hf_batches:
        ids = torch.tensor([prompt_ids(config, num_rows, args.text_len, rng, None) for _ in range(batch)],
                           device=args.device)
        pixels = random_patches([grid] * batch, args.device, seed=1).to(args.torch_dtype)
        grids = torch.tensor([grid] * batch, device=args.device)
        kwargs = dict(pixel_values=pixels, image_grid_thw=grids, attention_mask=torch.ones_like(ids),
                      mm_token_type_ids=(ids == config.image_token_id).int(), do_sample=False, num_beams=1,
                      eos_token_id=None, pad_token_id=config.text_config.pad_token_id)
        seconds, out = timed_generate(model, ids, args.output_len, args.device, **kwargs)
        assert out.shape[1] == ids.shape[1] + args.output_len, out.shape
        rows.append({"batch": batch, "seconds": seconds, "output_tok_s": batch * args.output_len / seconds})
    del model
    free_device_memory(args.device)
    return rows


# ---- report -------------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    shapes = "tiny shapes (CPU smoke run)" if results["device"] == "cpu" else "Qwen2.5-VL-7B shape, random weights"
    lines = [f"### Vision-language: {shapes} ({results['machine']}, {results['date']}, commit {results['commit']})",
             "", f"`{results['command']}`", "",
             "| measurement | ours | baseline (same run) | ratio (goal) |", "|---|---|---|---|"]
    for side, e in (results.get("encoder") or {}).items():
        per_batch = ", ".join(f"b{r['batch']}: {r['images_per_s']:.1f}" for r in e["batches"])
        lines.append(f"| vision tower, {side} x {side} images ({e['grid'][1]} x {e['grid'][2]} patches, "
                     f"{e['rows_per_image']} rows each; MLP width {results.get('tower_mlp_width')}; "
                     f"{results.get('tower_setting')}), images/s | "
                     f"{e['best_images_per_s']:.1f} (batch "
                     f"{e['best_batch']}; {per_batch}) | - | - |")
    for variant, v in (results.get("encoder_variants") or {}).items():
        if "error" in v:
            lines.append(f"| the same, {v['setting']} | failed: {v['error'][:120]} | - | - |")
        for side, e in v.get("sides", {}).items():
            lines.append(f"| the same, {side} x {side}, {v['setting']}, images/s | {e['best_images_per_s']:.1f} "
                         f"(batch {e['best_batch']}) | - | - |")
    t = results.get("ttft")
    if t:
        lines.append(f"| TTFT, one {t['image_side']} x {t['image_side']} image + text ({t['prompt_len']} prompt "
                     f"tokens), low load, median of {t['runs']} | {t['total_ms']:.1f} ms (processor "
                     f"{t['preprocess_ms']:.1f}, tower {t['encoder_ms']:.1f}, M-RoPE rows {t['mrope_ms']:.1f}, "
                     f"executor to first token {t['first_token_ms']:.1f}) | text-only prompt of the same length "
                     f"{t['text_only_ms']:.1f} ms | - |")
    o = results.get("offline")
    if o:
        name = (f"{o['requests']} requests {o['prompt_len']}/{o['output_len']} offline (one image each) through the "
                f"encode queue ({o.get('first_images')} then {o['encode_batch']} images a forward), output tok/s")
        lines.append(f"| {name}, encoding included | {o['image']['output_tok_s']:.0f} ({o['image']['seconds']:.2f} s) | "
                     f"text-only {o['prompt_len']}/{o['output_len']}: {o['text']['output_tok_s']:.0f} "
                     f"({o['text']['seconds']:.2f} s) | {o['vs_text']:.2f}x (>= {GOALS['offline_vs_text']}x) |")
        variants = {"image_equal_priority": "the same, the queue's stream at the executor's priority (first come, first "
                                            "served on the SMs: before engine/executor/device_stream.py)",
                    "image_executor_stream": f"the same, the tower run by the bench's thread on the executor's stream, "
                                             f"{o['encode_batch']} images a forward, each batch's requests enqueued after "
                                             f"it (the first run's way)",
                    "image_tables_ready": "the image requests with their tables made beforehand (the executor's share)"}
        # (the default run's A/B rows first: other batches, one change each)
        variants = {**{f"image_b{batch}": f"the same through a queue of {batch} images a forward at most"
                       for batch in o.get("also_encode_batches", [])},
                    **{variant_run_name(v, i, o.get("offline_variants", [])): offline_variant_label(v, o)
                       + (" (again)" if o["offline_variants"][:i].count(v) else "")
                       for i, v in enumerate(o.get("offline_variants", []))}, **variants}
        for variant, error in (o.get("variant_errors") or {}).items():
            lines.append(f"| the same, {variant} | failed: {error[:160]} | - | - |")
        for kind, label in variants.items():
            if kind in o:
                r = o[kind]
                lines.append(f"| {label} | {r['output_tok_s']:.0f} ({r['seconds']:.2f} s) | text-only: "
                             f"{o['text']['output_tok_s']:.0f} | {r['output_tok_s'] / o['text']['output_tok_s']:.2f}x |")
        if "hf" in o:
            hf = ", ".join(f"b{r['batch']}: {r['output_tok_s']:.0f}" for r in o["hf"])
            lines.append(f"| the same against transformers' generate | {o['image']['output_tok_s']:.0f} | {hf} | "
                         f"{o['vs_hf']:.2f}x (>= {GOALS['offline_vs_hf']:.0f}x) |")
        for kind in ("image", "image_equal_priority", *(f"image_b{b}" for b in o.get("also_encode_batches", [])),
                     *(variant_run_name(v, i, o.get("offline_variants", [])) for i, v in enumerate(o.get("offline_variants", []))),
                     "image_executor_stream", "image_tables_ready", "text"):
            if kind not in o:
                continue
            it = o[kind]["iterations"]
            step = (f"; decode-only iterations at batch {it['decode_batch']}: {it['decode_step_ms_median']:.2f} ms median"
                    if "decode_batch" in it else "")
            replay = f" (its graph's replay {it['decode_graph_replay_ms']:.2f} ms)" if "decode_graph_replay_ms" in it else ""
            replay += decode_step_parts_text(it.get("decode_step_parts"))
            extra = (f"tower + tables to the host {o[kind]['encode_and_enqueue_seconds']:.2f} s in batches of "
                     f"{o['encode_batch']}; " if "encode_and_enqueue_seconds" in o[kind] else "")
            if "tables_ready_s" in o[kind]:
                extra += (f"last table ready at {o[kind]['tables_ready_s']:.2f} s, requests enqueued in "
                          f"{o[kind]['enqueue_calls']} calls; ")
            if "reused_blocks" in o[kind]:
                extra += f"prefix-cache blocks reused {o[kind]['reused_blocks']}; "
            graphs = o[kind].get("tower_graphs")  # (the untimed round's forwards included)
            if graphs:
                extra += (f"tower forwards replayed from CUDA graphs {graphs['replays']} ({graphs['captured']} captured"
                          + (f"; failed: {'; '.join(graphs['failures'])[:200]}" if graphs["failures"] else "") + "); ")
            pauses = o[kind].get("gc")
            collections = (f"; garbage collections {pauses['collections']} ({pauses['total_ms']:.0f} ms; "
                           f"generation 2 or >= 5 ms, [at ms, ms, generation]: {pauses['longest'] or 'none'})"
                           if pauses else "")
            lines += ["", f"Offline {kind.replace('_', ' ')} run: {extra}iterations with prompt tokens {it['context_seconds']:.2f} s "
                      f"({it['context_iterations']}), decode-only {it['decode_seconds']:.2f} s "
                      f"({it['decode_iterations']}), outside them {o[kind]['seconds'] - it['context_seconds'] - it['decode_seconds']:.2f} s"
                      f"{step}{replay}{collections}."]
    frozen = results.get("gc_freeze")
    lines += ["", f"Python's collector: {'objects of the load frozen after it (engine/executor/gc_freeze.py): ' + str(frozen) if frozen else 'not frozen (' + GC_FREEZE_ENV + '=0 or CPU)'}."] if "offline" in results or "ttft" in results else []
    replays = [(name, (results.get(name) or {}).get("table_twin_replays")) for name in ("ttft", "offline")]
    if any(count is not None for _, count in replays):
        lines += ["", "Steps with image / M-RoPE rows that replayed the prefill graphs' table twins: " + ", ".join(
            f"{name} section {count}" for name, count in replays if count is not None) + "."]
    return "\n".join(lines) + "\n"


def variant_run_name(variant: str, index: int, variants: list[str]) -> str:
    """The run name of ``variants[index]``: image_<variant>, then image_<variant>_2, _3, ... when it is repeated
    (a variant twice in one process: its spread beside the default's)."""
    repeat = variants[:index].count(variant)
    return f"image_{variant}" + (f"_{repeat + 1}" if repeat else "")


def variant_environment(parts: list[str]) -> dict | None:
    """The environment an offline variant's parts set (None: none)."""
    environment = {}
    for part, name, value in (("flash-attn", qwen2_vl.SDPA_ENV, "flash"), ("cudnn-attn", qwen2_vl.SDPA_ENV, "auto"),
                              ("window-triton", qwen2_5_vl.WINDOW_KERNEL_ENV, "triton"),
                              ("window-sdpa", qwen2_5_vl.WINDOW_KERNEL_ENV, "sdpa"),
                              ("residual-product", qwen2_5_vl.RESIDUAL_ENV, "product"),
                              ("residual-norm", qwen2_5_vl.RESIDUAL_ENV, "norm")):
        if part in parts:
            environment[name] = value
    return environment or None


def offline_variant_label(variant: str, o: dict) -> str:
    cosine = ("(engine/vision/tower_fp8.py; its rows' cosine to the unquantized tower's: min {min:.4f}, mean {mean:.4f} "
              "over {images} images)")
    labels = {"fp8-tower": "the tower's linears in FP8 " + cosine, "fp8-mlp-tower": "the tower's MLP linears in FP8 " + cosine,
              "first-full": f"the queue's first forward {o['encode_batch']} images, not 8",
              "flash-attn": "the tower's attention on flash (TRITONLLM_TOWER_SDPA=flash)",
              "cudnn-attn": "the tower's attention on torch's choice, cuDNN (TRITONLLM_TOWER_SDPA=auto, the old default)",
              "first-odd": f"the first forward {ODD_FIRST_IMAGES} images (counts the untimed round did not make)",
              "tower-graphs": f"the tower's forwards replayed from CUDA graphs (TRITONLLM_TOWER_GRAPHS={TOWER_GRAPHS_KEPT})",
              "window-triton": "the window blocks' rotary and attention in one Triton kernel (TRITONLLM_TOWER_WINDOW_KERNEL=triton)",
              "window-sdpa": "the window blocks' rotary, then SDPA (TRITONLLM_TOWER_WINDOW_KERNEL=sdpa)",
              "residual-product": "the residual added by the proj and down products (TRITONLLM_TOWER_RESIDUAL=product)",
              "residual-norm": "the residual added by the norms (TRITONLLM_TOWER_RESIDUAL=norm)"}
    unknown = {"min": float("nan"), "mean": float("nan"), "images": 0}
    return "the same, " + " and ".join(labels[part].format(**(o.get(f"{part}_cosines") or unknown))
                                       for part in variant.split("+"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of tiny shapes")
    p.add_argument("--dtype", default=None, help="engine and tower dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--image-sizes", default=None, help="image sides; the first is the requests' (default 448,1024; CPU 56,112)")
    p.add_argument("--encoder-batches", default=None,
                   help="per image size, '/'-separated batch lists (default 8,32/2,8; CPU 1,2/1,2)")
    p.add_argument("--encoder-repeats", type=int, default=3)
    p.add_argument("--text-len", type=int, default=128, help="text tokens per request besides the image")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 128; CPU 4)")
    p.add_argument("--requests", type=int, default=None, help="offline requests (default 128; CPU 4)")
    p.add_argument("--encode-batch", type=int, default=None, help="images per tower forward offline (default 32; CPU 2)")
    p.add_argument("--also-encode-batches", default="", help="offline: the encode-queue run again at each of these "
                   "batches (comma-separated), in the same process (runs image_b<N>, after the equal-priority one)")
    p.add_argument("--sync-watch", action="store_true", help="offline: the encode-queue runs under torch's CUDA sync "
                   "debug mode and Triton's compile hooks; each synchronizing call's stack, thread and count, and each "
                   "compile's time and kernel, in the JSON (benchmarks/sync_watch.py)")
    p.add_argument("--offline-variants", default="", help="offline: the encode-queue run again with each change "
                   f"(comma-separated; each one of {', '.join(OFFLINE_VARIANTS)} or several joined by '+'; one named "
                   "twice runs twice), same process")
    p.add_argument("--ttft-runs", type=int, default=None, help="TTFT repetitions (default 5; CPU 2)")
    p.add_argument("--hf-batches", default=None, help="transformers batch sizes (default 128; CPU 2; \"\": none)")
    p.add_argument("--unpadded-mlp", action="store_true", help="keep the tower's MLP width as the checkpoint's "
                   "(3,420) instead of padding it to 3,456 as load_vision_encoder does on CUDA (the before figure)")
    p.add_argument("--tower-variants", default="", help="encoder section: time the tower again with each of "
                   f"{', '.join(TOWER_VARIANTS)} (comma-separated; the environment variables they set)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="the language engine's max batch (default: --requests, one wave; fewer: waves, so later "
                        "requests' tower forwards overlap earlier ones' decode steps, as in steady serving)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="the language engine's linear weights in FP8 (random weights quantized at load, as "
                        "engine_bench's); the text-only baseline uses the same engine, the tower stays as chosen")
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--kv-fraction", type=float, default=0.8, help="kv_cache_free_gpu_mem_fraction of the executor")
    p.add_argument("--profile-dir", default=None, help="write the tower's torch-profiler tables and a cProfile "
                   "of the executor thread (image requests, tables ready) here")
    p.add_argument("--out", default="vlm_bench.json")
    p.add_argument("--results-md", default=None, help="append the markdown table to this file")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    defaults = dict(dtype="float32" if cpu else "bfloat16", image_sizes="56,112" if cpu else "448,1024",
                    encoder_batches="1,2/1,2" if cpu else "8,32/2,8", output_len=4 if cpu else 128,
                    requests=4 if cpu else 128, encode_batch=2 if cpu else 32, ttft_runs=2 if cpu else 5,
                    hf_batches="2" if cpu else "128")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if cpu:
        args.text_len = min(args.text_len, 8)
    args.image_sizes = [int(s) for s in str(args.image_sizes).split(",")]
    args.encoder_batches = [[int(b) for b in part.split(",")] for part in str(args.encoder_batches).split("/")]
    args.tower_variants = [v for v in args.tower_variants.split(",") if v.strip()]
    args.also_encode_batches = [int(b) for b in str(args.also_encode_batches).split(",") if b.strip()]
    args.offline_variants = [v.strip() for v in args.offline_variants.split(",") if v.strip()]
    for variant in args.offline_variants:
        if any(part not in OFFLINE_VARIANTS for part in variant.split("+")):
            raise SystemExit(f"--offline-variants: {variant!r}: each part must be one of {', '.join(OFFLINE_VARIANTS)}")
        if sum(part in FP8_TOWER_SCOPES for part in variant.split("+")) > 1:  # (one tower a run: the first would run alone)
            raise SystemExit(f"--offline-variants: {variant!r}: at most one of {', '.join(FP8_TOWER_SCOPES)} a variant")
    args.hf_batches = [int(b) for b in str(args.hf_batches).split(",") if b.strip()]  # "": no transformers run
    args.torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault(LOAD_LOG_ENV, "1")  # a timestamped line per phase of the executor's start and the bench's
    sections = args.sections.split(",")
    with load_phase("transformers' config"):
        config = hf_config(args.device)
    results = {"date": utc_now(), "device": args.device, "machine": machine_summary(args.device), "commit": git_commit(),
               "command": command_line(__file__, argv), "goals": GOALS,
               "tower_mlp_width": config.vision_config.intermediate_size if args.unpadded_mlp
               else padded_width(config.vision_config.intermediate_size), "tower_setting": tower_setting(args.device)}
    started = time.perf_counter()
    if "encoder" in sections:
        t0 = time.perf_counter()
        results["encoder"] = bench_encoder(args, config)
        for variant in args.tower_variants:
            with tower_variant(variant):
                entry = results.setdefault("encoder_variants", {})[variant] = {"setting": tower_setting(args.device)}
                try:  # a backend that cannot run these shapes fails its variant only
                    entry["sides"] = bench_encoder(args, config, "_" + variant)
                except RuntimeError as err:
                    entry["error"] = str(err)[:500]
                    print(f"encoder variant {variant}: {entry['error']}", file=sys.stderr, flush=True)
                    free_device_memory(args.device)
        print(f"encoder: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))  # what is done survives a later failure
    if "ttft" in sections or "offline" in sections:
        t0 = time.perf_counter()
        results.update(bench_executor(args, config, sections))
        print(f"executor sections: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results["seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(markdown(results), args.results_md)
    return results


if __name__ == "__main__":
    main()
