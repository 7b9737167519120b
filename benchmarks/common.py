"""What the benchmark scripts share: stamping a run (date, machine, commit, command), timing
(CUDA events, CUDA-graph replays, percentiles), argument lists, writing results pages, the
processes of a server, and engines of random weights in real models' shapes.

Every script runs from the checkout (``python benchmarks/<topic>/<script>.py``) and first puts the
checkout's root on sys.path, the same line everywhere, so that ``engine``, ``kernels``, ``serving``
and this module import as packages::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

Importing this module costs only the standard library: torch and the engine are imported inside
the helpers that need them (the soak and the serving clients run without the engine), and
``MODELS`` is made on first use (module ``__getattr__``), since Gemma 3's shape comes from the
engine, which imports torch.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import time
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# ------------------------------------------------------------------------------------------------
# stamping a run: when, where, which code, which command
# ------------------------------------------------------------------------------------------------


def utc_now() -> str:
    """The run's date as every results table shows it: "2026-11-26 05:49 UTC"."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit() -> str:
    """The checkout's short commit; $BENCH_COMMIT first, since a copied checkout (the GPU
    machine's) may carry no .git or a stale one."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=REPO_ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command a results table records: ``python benchmarks/<topic>/<name>.py ARGS`` (the
    script's path from the checkout's root, whatever the current folder)."""
    path = Path(script).resolve().relative_to(REPO_ROOT)
    return " ".join(["python", path.as_posix(), *(sys.argv[1:] if argv is None else argv)])


def device_name(device: str = "cuda") -> str:
    """The GPU's name on a CUDA device, else "cpu"."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> dict:
    """The machine of a served run: GPU (or None), CPU and cores, torch and Python versions."""
    import torch

    cpu = cpu_model()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"gpu": gpu, "cpu": f"{cpu} x{os.cpu_count()}", "device": gpu or f"CPU ({cpu}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "python": platform.python_version()}


def machine_summary(device: str) -> str:
    """One line for a results heading: the GPU, or the CPU's architecture and cores; torch's version."""
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores (torch {torch.__version__})"


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100), as every benchmark here reports; nan when empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def cuda_time_ms(fn, *, warmup: int = 3, repeat: int = 20) -> float:
    """Median milliseconds of fn() timed with CUDA events (device time, launch gaps included)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: str = "cuda", *, repeat: int = 30) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted), the denominator of the benches'
    rooflines and "% of copy" columns; 0.0 off CUDA (no roofline)."""
    if not str(device).startswith("cuda"):
        return 0.0
    import torch

    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)  # random: never zeros
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), repeat=repeat)
    bandwidth = 2 * src.numel() * src.element_size() / (ms / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bandwidth


def graph_call_us(fn, inputs, replays: int = 3) -> float:
    """Device microseconds per fn(*args) call, from CUDA-graph replays: one graph holds one call per
    entry of ``inputs`` (different tensors each, so weights picked by different routings or rows come
    from HBM, not L2), and a replay's device time is divided by the number of calls: launch gaps
    inside the graph count, host overheads do not. One eager call first, on a side stream, compiles
    whatever the call compiles."""
    import torch

    from kernels.linear import replay_time_ms, side_stream

    stream = side_stream()  # one for every call: torch keeps a cuBLAS workspace per stream (kernels/linear.py)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    us = replay_time_ms(graph, replays=replays) / len(inputs) * 1000
    del graph
    return us


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a timer brackets it."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def timed_generate(model, ids, max_new_tokens: int, device: str, **kwargs):
    """transformers' ``generate`` as a baseline: one short warm-up call, then the timed one ->
    (seconds, output ids)."""
    import torch

    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kwargs)  # warm-up
        sync(device)
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, **kwargs)
        sync(device)
    return time.perf_counter() - started, out


def free_device_memory(device: str) -> None:
    """Give back what the last engine held before the next one loads."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# arguments: comma-separated lists and shapes
# ------------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """"1,8,64" -> [1, 8, 64] (empty items skipped)."""
    return [int(item) for item in text.split(",") if item.strip()]


def name_list(text: str) -> list[str]:
    """"decode,offline" -> ["decode", "offline"] (empty items skipped)."""
    return [item for item in text.split(",") if item]


def dims(text: str) -> tuple[int, ...]:
    """"128x128x1024" or "194X5250" -> (128, 128, 1024) / (194, 5250): the shapes every script takes
    as counts joined by x (requests x lengths, sequences x context, ...)."""
    return tuple(int(n) for n in text.lower().split("x"))


def dims_list(text: str) -> list[tuple[int, ...]]:
    """"128x128x1024,2048x128x256" -> [(128, 128, 1024), (2048, 128, 256)]."""
    return [dims(item) for item in text.split(",") if item.strip()]


def add_model_arguments(parser, *, model: str = "llama8b", dtype: str = "bfloat16", device: str = "cuda",
                        dtype_choices: list[str] | None = None, dtype_help: str | None = None,
                        device_help: str | None = None) -> None:
    """``--model`` (a shape of ``MODELS``: random weights), ``--dtype`` and ``--device``, as every
    script with a random-weight engine takes them."""
    parser.add_argument("--model", choices=sorted(__getattr__("MODELS")), default=model,
                        help="the shape of the random-weight engine (benchmarks/common.py MODELS)")
    parser.add_argument("--dtype", choices=dtype_choices, default=dtype, help=dtype_help)
    parser.add_argument("--device", default=device, help=device_help)


# ------------------------------------------------------------------------------------------------
# results: the markdown a run prints and adds to its page under benchmarks/results/
# ------------------------------------------------------------------------------------------------


def results_page(topic: str) -> str:
    """benchmarks/results/<topic>.md, the default page of a script's tables."""
    return str(RESULTS_DIR / f"{topic}.md")


def print_table(table: str, path: str | None) -> None:
    """Print a run's markdown and append it to ``path`` (when given), a blank line before it."""
    print(table)
    if path:
        with open(path, "a") as f:
            f.write("\n" + table)


def json_ready(entry: dict) -> dict:
    """A result row for json.dumps: tuple values (kernel tilings) as their str."""
    return {key: str(v) if isinstance(v, tuple) else v for key, v in entry.items()}


def write_json_rows(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` (json_ready each) to ``path`` as one JSON list, when a path is given."""
    if path:
        import json

        Path(path).write_text(json.dumps([json_ready(row) for row in rows], indent=1))


def relative_difference(out, want) -> float:
    """||out - want|| / ||want|| of two tensors, in float64 (a zero ``want`` counts as 1e-30)."""
    return float((out.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def insert_before_marker(path: str, table: str, marker: str) -> None:
    """Insert the table just before ``marker`` in ``path`` (the end of one benchmark's section, so
    the sections after it stay whole), or append it when the page has no such marker."""
    text = open(path).read() if os.path.exists(path) else ""
    if marker in text:
        text = text.replace(marker, table.strip("\n") + "\n\n" + marker, 1)
    else:
        text += table
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------------
# processes: ports, a server's process tree, environment for what a block starts
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(script: str, args: list[str], timeout: float = 300) -> None:
    """Run ``python script --rank R --port P ARGS`` for ranks 0 and 1, meeting on one free port (as
    mpirun would start them); exit with an error when either fails."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, script, "--rank", str(rank), "--port", str(port), *args])
             for rank in (0, 1)]
    codes = [rank.wait(timeout=timeout) for rank in ranks]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


@contextlib.contextmanager
def environment_set(values: dict[str, str]):
    """os.environ with ``values`` for the block (for what starts in it), then as it was."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces): [0] is the state,
    [1] the parent, [11] and [12] user and system time in clock ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (None once it is gone)."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start_ticks(pid: int) -> str | None:
    """When a live process started (clock ticks since boot; None once it is gone): with its pid it
    names that process, not a later one that reuses the pid."""
    try:
        return _stat_fields(pid)[19]
    except (OSError, IndexError):
        return None


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, read from /proc ({} where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int(_stat_fields(entry.name)[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry.name))
    return children


def descendant_pids(root: int) -> list[int]:
    """Every process below ``root``."""
    children = children_by_parent()
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_name(pid: int) -> str:
    """What a server's process is: tritonserver, stub:<model>, engine_process, serve_default,
    sleep, sh, or the first 40 characters of its command line ("?" once it is gone)."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").rstrip()
    except OSError:
        return "?"
    if "triton_python_backend_stub" in line:
        return "stub:" + line.split("/1/model.py")[0].rsplit("/", 1)[-1]
    for known in ("tritonserver", "engine_process", "serve_default"):
        if known in line:
            return known
    if line.startswith("sleep"):
        return "sleep"
    return "sh" if line.startswith(("/bin/sh", "/bin/bash")) else line[:40]  # a stub's watchdog shell


def process_tree(root: int) -> list[tuple[int, str]]:
    """(pid, "name (pid)") of every process below ``root`` (names: ``process_name``), leaving out
    the children of a stub's watchdog shell."""
    children = children_by_parent()
    names = {pid: process_name(pid) for kids in children.values() for pid in kids}
    found, todo = [], [(root, "")]
    while todo:
        pid, parent_name = todo.pop()
        if names.get(pid) == "sh" and parent_name.startswith("stub:"):
            # A stub's watchdog (serving/stub_watchdog.py): its children (the `$(cut ...)` subshell,
            # cut, the one-second sleep) live for milliseconds to a second, so a snapshot that
            # catches one would see it "gone" in the next.
            continue
        for child in children.get(pid, []):
            found.append((child, f"{names.get(child, '?')} ({child})"))
            todo.append((child, names.get(pid, "?")))
    return found


def is_final_response(result) -> bool:
    """Whether a streamed gRPC result (tritonclient's InferResult, the stream started with
    enable_empty_final_response) is its request's last one."""
    if result is None:
        return False
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def load_script(name: str, folder: str = "scripts"):
    """Import <checkout>/<folder>/<name>.py (scripts/ is not a package) as the module ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------
# engines of random weights in real models' shapes (the runner makes the weights on the device)
# ------------------------------------------------------------------------------------------------


def _model_shapes() -> dict[str, dict]:
    """ModelConfig fields of the shapes the benchmarks run, by name (``--model``)."""
    from engine.executor.random_weights import GEMMA3_12B_SHAPE
    from engine.ssm.spec import JAMBA_MINI_SHAPE, JAMBA_TINY_SHAPE, NEMOTRON_H_8B_SHAPE, NEMOTRON_H_TINY_SHAPE

    shapes = {
        "llama8b": dict(
            architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
            num_kv_heads=8, head_dim=128, intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
            max_position_embeddings=131072,
        ),
        "qwen3_30b_a3b": dict(  # Qwen3-30B-A3B: 48 sparse layers of 128 experts (width 768), 8 active per token
            architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
            num_kv_heads=4, head_dim=128, intermediate_size=6144, norm_eps=1e-6, rope_theta=1000000.0,
            max_position_embeddings=40960, qk_norm=True, num_experts=128, num_experts_per_tok=8,
            moe_intermediate_size=768, norm_topk_prob=True,
        ),
        "gpt_oss_20b": dict(  # gpt-oss-20b: 24 sparse layers of 32 experts (width 2880), 4 active per token;
            # attention sinks, a 128-token window on every other layer, yarn; random bf16 experts (gpt_oss_20b_mxfp4: 4-bit)
            architecture="GptOssForCausalLM", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
            num_kv_heads=8, head_dim=64, intermediate_size=2880, norm_eps=1e-5, rope_theta=150000.0,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096, "max_position_embeddings": 131072},
            max_position_embeddings=131072, qkv_bias=True, num_experts=32, num_experts_per_tok=4,
            moe_intermediate_size=2880, norm_topk_prob=True, swiglu_limit=7.0, sliding_window=128,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        ),
        "tiny_moe": dict(  # smoke tests with experts (CPU works for decode/offline)
            architecture="MixtralForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=4096, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=96,
        ),
        "tiny": dict(  # smoke tests (CPU works for decode/offline/latency)
            architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096,
        ),
        "smollm2": dict(
            architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
            num_kv_heads=3, head_dim=64, intermediate_size=1536, norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True,
        ),
        # The LayerNorm families of issue 54 (engine/models/decoder.py), as engine/convert_decoder.py reads them.
        "bloom7b1": dict(  # BLOOM-7B1: ALiBi, embedding LayerNorm, biases everywhere, GELU-tanh, tied lm_head
            architecture="BloomForCausalLM", vocab_size=250880, hidden_size=4096, num_layers=30, num_heads=32,
            num_kv_heads=32, head_dim=128, intermediate_size=16384, norm_eps=1e-5, max_position_embeddings=2048,
            tie_word_embeddings=True, norm_kind="layernorm", norm_bias=True, mlp_gated=False, positions="alibi",
            alibi_slopes="bloom", hidden_act="gelu_pytorch_tanh", qkv_bias=True, attention_out_bias=True,
            mlp_bias=True, embedding_norm=True,
        ),
        "falcon7b": dict(  # Falcon-7B: multi-query, rotary, parallel attention and MLP under one LayerNorm, GELU
            architecture="FalconForCausalLM", vocab_size=65024, hidden_size=4544, num_layers=32, num_heads=71,
            num_kv_heads=1, head_dim=64, intermediate_size=18176, norm_eps=1e-5, max_position_embeddings=2048,
            tie_word_embeddings=True, rope_theta=10000.0, norm_kind="layernorm", norm_bias=True, mlp_gated=False,
            hidden_act="gelu", residual="parallel",
        ),
        # DeepSeek-V2-Lite (engine/models/deepseek.py, as engine/convert_deepseek.py reads it): MLA (kv_lora_rank
        # 512, no q-lora), 26 sparse layers of 64 experts (width 1408), 6 active + 2 shared; "_mtp" adds a
        # V3-style multi-token prediction module (V2-Lite ships none) for benchmarks/speculative/mtp_bench.py.
        "deepseek_v2_lite": dict(
            architecture="DeepseekV2ForCausalLM", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
            num_kv_heads=16, head_dim=64, intermediate_size=10944, norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
            max_position_embeddings=163840, rotary_interleaved=True, num_experts=64, num_experts_per_tok=6,
            moe_intermediate_size=1408, mlp_only_layers=[0], kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128,
            n_shared_experts=2, topk_method="greedy",
        ),
        "deepseek_tiny": dict(  # smoke tests of the DeepSeek model and its MTP module on the CPU
            architecture="DeepseekV3ForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
            num_kv_heads=4, head_dim=8, intermediate_size=96, max_position_embeddings=4096, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0], q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            topk_method="noaux_tc", norm_topk_prob=True, num_nextn_predict_layers=1,
        ),
        # Llama-4-Scout (engine/models/llama4.py, as engine/convert_llama4.py reads Llama4ForCausalLM's text
        # config): 48 layers, every one MoE (16 experts of width 8192, top-1 by sigmoid, one shared expert),
        # chunked local attention (8192) on RoPE layers, every fourth layer global NoPE with temperature
        # tuning, L2 qk norm; 109B parameters, 17B active. bf16 (218 GB) fits only two H200s (TP2); one H200
        # runs it with --quantization fp8 / fp8_block (110 GB), or "_12l" in bf16: its first 12 layers (27B,
        # 4.2B active), whose batch-1 step times scale to the whole stack by the layer count.
        "llama4_scout": dict(
            architecture="Llama4ForCausalLM", vocab_size=202048, hidden_size=5120, num_layers=48, num_heads=40,
            num_kv_heads=8, head_dim=128, intermediate_size=16384, norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192},
            max_position_embeddings=10485760, rotary_interleaved=True, hidden_act="silu",
            layers_without_rope=list(range(3, 48, 4)), num_experts=16, num_experts_per_tok=1,
            moe_intermediate_size=8192, decoder_sparse_step=1, n_shared_experts=1, attention_chunk_size=8192,
            qk_l2_norm=True, nope_floor_scale=8192.0, nope_attn_scale=0.1,
        ),
        "llama4_tiny": dict(  # smoke tests of the Llama 4 text model on the CPU: chunk 8, NoPE layers 1 and 3
            architecture="Llama4ForCausalLM", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096, rotary_interleaved=True,
            hidden_act="silu", layers_without_rope=[1, 3], num_experts=4, num_experts_per_tok=1,
            moe_intermediate_size=64, decoder_sparse_step=2, n_shared_experts=1, attention_chunk_size=8,
            qk_l2_norm=True, nope_floor_scale=4.0, nope_attn_scale=0.1,
        ),
        "gemma3_12b": GEMMA3_12B_SHAPE,
        "nemotron_h_8b": NEMOTRON_H_8B_SHAPE,  # hybrid Mamba-2 (engine/ssm/): benchmarks/engine/hybrid_bench.py
        "nemotron_h_tiny": NEMOTRON_H_TINY_SHAPE,
        "jamba_mini": JAMBA_MINI_SHAPE,  # Mamba-1 + attention + routed experts (engine/ssm/mamba1.py)
        "jamba_tiny": JAMBA_TINY_SHAPE,
        "gemma3_tiny": dict(  # smoke tests with the Gemma 3 model on CPU
            GEMMA3_12B_SHAPE, vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, sliding_window=16, max_position_embeddings=4096,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)],
        ),
    }
    # Llama-3.1-70B's shape (tp_bench's 70B rows: 141 GB in bf16, two H200s or more)
    shapes["llama70b"] = {**shapes["llama8b"], "hidden_size": 8192, "num_layers": 80, "num_heads": 64,
                          "intermediate_size": 28672}
    # gpt-oss-20b with its experts as OpenAI ships them: MXFP4 codes and E8M0 scales, 4.25 bits a weight.
    shapes["gpt_oss_20b_mxfp4"] = dict(shapes["gpt_oss_20b"], expert_quantization="mxfp4")
    shapes["deepseek_v2_lite_mtp"] = dict(shapes["deepseek_v2_lite"], num_nextn_predict_layers=1)
    shapes["llama4_scout_12l"] = dict(shapes["llama4_scout"], num_layers=12, layers_without_rope=[3, 7, 11])
    return shapes


def __getattr__(name: str):
    """``MODELS`` on first use (module docstring: the engine imports torch)."""
    if name == "MODELS":
        globals()["MODELS"] = _model_shapes()  # later lookups find it without coming here
        return globals()["MODELS"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_config_only_engine(model: str, dtype: str, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                             tokens_per_block: int, quantization: str | None = None,
                             group_size: int | None = None, *, engine_dir: str | None = None,
                             max_input_len: int | None = None) -> str:
    """An engine directory holding only config.json (a new temporary one unless ``engine_dir``); the
    runner makes random weights for it at load, seed 0 (``quantization="fp8"``: quantized from
    random float weights as engine.build quantizes). ``max_input_len`` defaults to
    min(max_seq_len, 4096)."""
    from engine.config import BuildConfig, EngineConfig, ModelConfig

    if engine_dir is None:  # a temporary one, removed when this process exits (benches and their tests made
        engine_dir = tempfile.mkdtemp(prefix=f"bench-{model}-")  # hundreds in /tmp before)
        atexit.register(shutil.rmtree, engine_dir, ignore_errors=True)
    build = BuildConfig(dtype=dtype, max_batch_size=max_batch_size,
                        max_input_len=max_input_len or min(max_seq_len, 4096), max_seq_len=max_seq_len,
                        max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block,
                        quantization=quantization, quant_group_size=group_size)
    shapes = globals().get("MODELS") or __getattr__("MODELS")
    config = EngineConfig(model=ModelConfig(**shapes[model]), build=build, extra={"random_weights_seed": 0})
    config.validate().save(engine_dir)
    return engine_dir
