"""Issue 53's anchor: the Triton fused-MoE kernel SGLang ships (the same fused_moe_kernel lineage as vLLM's), run as
a reference script beside ours on Qwen3-30B-A3B's routed experts (E 128, top 8, H 2048, I 768) at 1, 8, 64, 512
and 2,048 tokens, in bf16 and in FP8 with 128 x 128 weight blocks. Nothing of theirs is in this repository:
benchmarks/kernels/fetch_moe_anchor.sh extracts their kernel file and their tuned H200 tile tables from the sglang
wheel (PyPI, 0.5.23) into the git-ignored .anchors/ (.anchors/README names the files), and this script loads the
file with importlib. On the device machine (nothing outside reachable) pass ".anchors" in the run's carry.

    bash benchmarks/kernels/fetch_moe_anchor.sh            # once, on a machine with the network
    python benchmarks/kernels/moe_anchor_bench.py [--kinds bf16 fp8_block] [--tokens 1 8 64 512 2048] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/kernels/moe_anchor_bench.py --device cpu --tiny   # the harness's smoke check

Both sides go from router logits (T, E) to the summed output (T, H), timed as CUDA-graph replays (one graph
holds a call per routing set, so the experts' weights come from HBM: kernels/moe_gemv_choice.py routing_sets):
- ours: kernels/fused_moe.py moe_forward (bf16) / kernels/fused_moe_fp8.py moe_forward_fp8, after the engine's
  load-time GEMV choice (kernels/moe_gemv_choice.py choose_gemv) marked the experts, as the engine runs them;
- theirs: our route_tokens and moe_align (their alignment is a CUDA op of sgl-kernel, not Triton; our moe_align
  returns their layout: assignment ids grouped by expert, each run padded to BLOCK_SIZE_M with T * K, one expert
  id per block, the padded count), then their invoke_fused_moe_kernel for gate_up (top_k K, no routing weight),
  their act_and_mul_triton (SiLU and mul), invoke_fused_moe_kernel for down (top_k 1, routing weight applied),
  their moe_sum_reduce_triton, with their tile table's entry nearest T (their try_get_optimal_moe_config rule;
  one table for both GEMMs, as they do without a "_down" table). On CUDA their fused_moe.py calls sgl-kernel's
  CUDA silu_and_mul and moe_sum_reduce instead of these two Triton kernels: their Triton fallbacks stand in here.
The shims (sys.modules stand-ins for the sglang modules the file imports, ``install_shims``): helpers and
constants only (platform checks, their PDL check = Hopper or later, no AITER, no padding, batch-invariant mode
off), and their FP8 activation quantizers -> our kernels/fused_moe_fp8.py quantize_activations (per 1 x 128 group,
row-major scales: the layout their kernel's strides read); the INT8 quantizers raise (unused).

Printed per kind and token count: each side's microseconds a call, GB/s of the expert weights the routing touches
(distinct experts chosen x an expert's bytes: weights and block scales) and TFLOPS (6 T K H I); the JSON and a
markdown table go to --out. Correctness first (both sides against the plain-torch reference, fused_moe_ref /
fused_moe_fp8_ref, at a small shape and at 8 tokens of the full one on CUDA), printed as relative errors; the
table's "our path" says which of ours moe_forward took (gemv: marked at load; one-token; block-tiled). Both sides
launch with PDL on Hopper (ours: kernels/_triton.py's default; theirs: their check, shimmed as Hopper or later).
--tiny (with --device cpu under TRITON_INTERPRET=1): the checks, then the bench once through eagerly at 1 / 5 / 40
tokens of a tiny shape, so a harness bug shows before a GPU call; its timings mean nothing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from kernels.fp8_block import quantize_blocks  # noqa: E402
from kernels.fused_moe import fused_moe_ref, fused_moe_triton, moe_align, moe_forward, route_tokens  # noqa: E402
from kernels.fused_moe_fp8 import (fused_moe_fp8_ref, fused_moe_fp8_triton,  # noqa: E402
                                   moe_forward_fp8, quantize_activations)
from kernels.moe_gemv_choice import routing_sets  # noqa: E402

ANCHORS = ROOT / ".anchors"
KERNEL_FILE = ANCHORS / "sglang_fused_moe_triton_kernels.py"
CONFIG_FILES = {"bf16": ANCHORS / "sglang_config_bf16_h200.json",
                "fp8_block": ANCHORS / "sglang_config_fp8_block_h200.json"}
QWEN3_30B_A3B = dict(experts=128, top_k=8, hidden=2048, inter=768)
TINY = dict(experts=8, top_k=2, hidden=256, inter=128)  # (FP8 blocks: H and I multiples of 128)
TOKENS = (1, 8, 64, 512, 2048)
GROUP = 128  # FP8 block edge (weights 128 x 128, activations 1 x 128)
# ||side - reference|| / ||reference||: tests/kernels/test_fused_moe_fp8.py's bounds (bf16: one rounding of a
# product moved by accumulation order, carried into the next GEMM; float32: the interpreter's)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-3}


# ---- their file: shims and loading --------------------------------------------------------------

def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _unused(name: str):
    def refuse(*_args, **_kwargs):
        raise NotImplementedError(f"{name}: not shimmed (the anchor bench runs bf16 and FP8 blocks only)")
    return refuse


def _their_group_quant(x: torch.Tensor, group_size: int, *_args, **_kwargs):
    """Their per-token-group FP8 quantizer's contract ((R, C) -> E4M3 (R, C), float32 scales (R, C / group))
    on our kernel (one launch on CUDA, the torch reference elsewhere)."""
    assert group_size == GROUP, group_size
    return quantize_activations(x, GROUP)


def install_shims() -> list[str]:
    """sys.modules stand-ins for what the kernel file imports from sglang (module docstring); -> their names."""
    cuda = torch.cuda.is_available()
    hopper = cuda and torch.cuda.get_device_capability() >= (9, 0)
    env_flag = types.SimpleNamespace(get=lambda: False)
    shims = {
        "sglang.kernels.jit.utils": dict(is_arch_support_pdl=lambda: hopper),
        "sglang.kernels.ops.quantization.fp8_kernel": dict(
            per_token_group_quant_fp8=_their_group_quant, sglang_per_token_group_quant_fp8=_their_group_quant,
            scaled_fp8_quant=_unused("scaled_fp8_quant")),
        "sglang.kernels.ops.quantization.int8_kernel": dict(
            per_token_group_quant_int8=_unused("per_token_group_quant_int8"),
            per_token_quant_int8=_unused("per_token_quant_int8"),
            sglang_per_token_group_quant_int8=_unused("sglang_per_token_group_quant_int8")),
        "sglang.srt.batch_invariant_ops": dict(is_batch_invariant_mode_enabled=lambda: False),
        "sglang.srt.environ": dict(envs=types.SimpleNamespace(SGLANG_USE_AITER=env_flag)),
        "sglang.srt.layers.moe.utils": dict(get_moe_padding_size=lambda _use_aiter: 0),
        "sglang.srt.utils": dict(cpu_has_amx_support=lambda: False, is_cpu=lambda: not cuda, is_cuda=lambda: cuda,
                                 is_hip=lambda: False, is_sm90_supported=lambda: hopper),
    }
    for name, attrs in shims.items():
        parts = name.split(".")
        for i in range(1, len(parts)):  # the parent packages, empty
            sys.modules.setdefault(".".join(parts[:i]), _module(".".join(parts[:i]), __path__=[]))
        sys.modules[name] = _module(name, **attrs)
    return list(shims)


def load_anchor() -> types.ModuleType:
    if not KERNEL_FILE.exists():
        sys.exit(f"{KERNEL_FILE} is missing: run benchmarks/kernels/fetch_moe_anchor.sh (and carry .anchors)")
    install_shims()
    spec = importlib.util.spec_from_file_location("sglang_fused_moe_anchor", KERNEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def their_config(table: dict, num_tokens: int) -> dict:
    """Their rule: the tuned entry whose token count is nearest T."""
    return dict(table[min(table, key=lambda m: abs(int(m) - num_tokens))])


def their_moe(anchor, x, topk_weights, topk_ids, gate_up, down, gate_up_scale, down_scale, config: dict):
    """(T, H): their three Triton kernels and sum (module docstring) on our alignment. gate_up (E, 2I, H),
    down (E, H, I), [gate | up] rows as ours; scales (E, N / 128, K / 128) float32 or None (bf16)."""
    import triton.language as tl

    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    fp8 = gate_up_scale is not None
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, config["BLOCK_SIZE_M"])
    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    quant = dict(compute_type=compute_type, use_fp8_w8a8=fp8,
                 use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                 block_shape=[GROUP, GROUP] if fp8 else None)
    gate_up_out = torch.empty(num_tokens * top_k, two_inter, dtype=x.dtype, device=x.device)
    anchor.invoke_fused_moe_kernel(x, gate_up, None, gate_up_out, None, gate_up_scale, None, topk_weights, topk_ids,
                                   sorted_ids, expert_ids, num_padded, False, top_k, config, **quant)
    act = torch.empty(num_tokens * top_k, two_inter // 2, dtype=x.dtype, device=x.device)
    anchor.act_and_mul_triton(gate_up_out, act, config, topk_ids, expert_ids, False, "silu")
    out_k = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    anchor.invoke_fused_moe_kernel(act, down, None, out_k, None, down_scale, None, topk_weights, topk_ids,
                                   sorted_ids, expert_ids, num_padded, True, 1, config, **quant)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    anchor.moe_sum_reduce_triton(out_k, out, 1.0)
    return out


# ---- experts and the two sides ------------------------------------------------------------------

def make_experts(kind: str, shape: dict, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{gate_up, down, gate_up_scale, down_scale (None in bf16), expert_bytes}: random experts ~ unit outputs;
    ``dtype``: the unquantized weights' (float32 for the interpreter)."""
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    gate_up = torch.randn(e, 2 * i, h, device=device, generator=gen) * h**-0.5
    down = torch.randn(e, h, i, device=device, generator=gen) * i**-0.5
    if kind == "bf16":
        made = dict(gate_up=gate_up.to(dtype), down=down.to(dtype), gate_up_scale=None, down_scale=None)
    else:
        (gu, gu_s), (d, d_s) = quantize_blocks(gate_up), quantize_blocks(down)
        made = dict(gate_up=gu, down=d, gate_up_scale=gu_s, down_scale=d_s)
    made["expert_bytes"] = sum(t[0].numel() * t.element_size() for t in made.values() if t is not None)
    return made


def our_moe(kind: str, experts: dict, x, logits, top_k: int, interpreted: bool):
    """Ours from router logits: the engine's entry (moe_forward / moe_forward_fp8) on CUDA; under the CPU
    interpreter those take the torch reference, so there the Triton grouped path itself."""
    gu, d, gu_s, d_s = experts["gate_up"], experts["down"], experts["gate_up_scale"], experts["down_scale"]
    if interpreted:
        weights, ids = route_tokens(logits, top_k, True)
        if kind == "bf16":
            return fused_moe_triton(x, gu, d, weights, ids)
        return fused_moe_fp8_triton(x, gu, gu_s, d, d_s, weights, ids)
    if kind == "bf16":
        return moe_forward(x, logits, gu, d, top_k, True)
    return moe_forward_fp8(x, logits, gu, gu_s, d, d_s, top_k, True)


def reference(kind: str, experts: dict, x, logits, top_k: int):
    weights, ids = route_tokens(logits, top_k, True)
    gu, d, gu_s, d_s = experts["gate_up"], experts["down"], experts["gate_up_scale"], experts["down_scale"]
    if kind == "bf16":
        return fused_moe_ref(x, gu, d, weights, ids)
    return fused_moe_fp8_ref(x, gu, gu_s, d, d_s, weights, ids)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check(anchor, kind: str, shape: dict, tables: dict, device: str, num_tokens: int, interpreted: bool) -> dict:
    """{ours, theirs}: relative error to the reference at one shape (random logits: uneven routing). The
    interpreter computes in float32 (it has no bf16 arithmetic), as tests/kernels/test_fused_moe.py runs it."""
    dtype = torch.float32 if interpreted else torch.bfloat16
    experts = make_experts(kind, shape, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(num_tokens, shape["hidden"], device=device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, shape["experts"], device=device, generator=gen)
    ref = reference(kind, experts, x, logits, shape["top_k"])
    weights, ids = route_tokens(logits, shape["top_k"], True)
    theirs = their_moe(anchor, x, weights, ids, experts["gate_up"], experts["down"], experts["gate_up_scale"],
                       experts["down_scale"], their_config(tables[kind], num_tokens))
    ours = our_moe(kind, experts, x, logits, shape["top_k"], interpreted)
    return dict(tokens=num_tokens, dtype=str(dtype), ours=rel_err(ours, ref), theirs=rel_err(theirs, ref),
                tolerance=TOLERANCE[dtype])


# ---- timing --------------------------------------------------------------------------------------

def eager_call_us(fn, inputs) -> float:
    """Wall microseconds of one eager fn(*inputs[0]) call: the --tiny run's stand-in for graph_call_us, which needs
    CUDA (it exercises the harness; its figures mean nothing)."""
    start = time.perf_counter()
    fn(*inputs[0])
    return (time.perf_counter() - start) * 1e6


def bench(anchor, kind: str, tables: dict, token_counts, shape: dict = QWEN3_30B_A3B, device: str = "cuda",
          timer=None) -> list[dict]:
    """One row per token count (module docstring); ``timer(fn, inputs) -> us``: graph_call_us by default."""
    from benchmarks.common import graph_call_us
    from kernels.moe_gemv import GemvExperts, gemv_tiles
    from kernels.moe_gemv_choice import choose_gemv

    timer = timer or graph_call_us
    interpreted = device == "cpu"
    dtype = torch.float32 if interpreted else torch.bfloat16  # (the interpreter has no bf16 arithmetic)
    experts = make_experts(kind, shape, device, dtype)
    gu, d, gu_s, d_s = experts["gate_up"], experts["down"], experts["gate_up_scale"], experts["down_scale"]
    choice = choose_gemv(GemvExperts(gu, d, shape["top_k"], dtype, gu_s, d_s))  # the engine's load step (CUDA only)
    print(f"[{kind}] load-time GEMV choice: {None if choice is None else choice.get('tiles')}", flush=True)
    rows = []
    top_k, hidden, inter = shape["top_k"], shape["hidden"], shape["inter"]
    for tokens in token_counts:
        sets = routing_sets(tokens, shape["experts"], top_k, device)
        x = torch.randn(tokens, hidden, device=device).to(dtype)
        # which of our paths moe_forward(_fp8) takes here (kernels/fused_moe.py's order; the interpreter: the grouped)
        our_path = ("block-tiled" if interpreted else "gemv" if gemv_tiles(gu, tokens) is not None
                    else "one-token" if tokens == 1 else "block-tiled")
        inputs = [(x, logits) for logits in sets]
        config = their_config(tables[kind], tokens)

        def theirs(x, logits):
            weights, ids = route_tokens(logits, top_k, True)
            return their_moe(anchor, x, weights, ids, gu, d, gu_s, d_s, config)

        def ours(x, logits):
            return our_moe(kind, experts, x, logits, top_k, interpreted)

        touched = sum(route_tokens(logits, top_k, True)[1].unique().numel() for logits in sets) / len(sets)
        weight_bytes = touched * experts["expert_bytes"]
        flops = 6 * tokens * top_k * hidden * inter
        row = dict(kind=kind, tokens=tokens, our_path=our_path, experts_touched=touched, their_config=config,
                   diff_to_ours=rel_err(theirs(*inputs[0]), ours(*inputs[0])))
        for name, fn in (("ours", ours), ("theirs", theirs)):
            us = timer(fn, inputs)
            row[f"{name}_us"] = us
            row[f"{name}_gbs"] = weight_bytes / us / 1e3
            row[f"{name}_tflops"] = flops / us / 1e6
        row["theirs_over_ours"] = row["theirs_us"] / row["ours_us"]
        print(f"[{kind}] T={tokens:5d}: ours ({our_path}) {row['ours_us']:8.1f} us {row['ours_gbs']:7.0f} GB/s "
              f"{row['ours_tflops']:6.1f} TFLOPS | theirs {row['theirs_us']:8.1f} us {row['theirs_gbs']:7.0f} GB/s "
              f"{row['theirs_tflops']:6.1f} TFLOPS | theirs/ours {row['theirs_over_ours']:.2f} "
              f"(rel diff {row['diff_to_ours']:.1e})", flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| kind | tokens | experts touched | our path | ours us | ours GB/s | ours TFLOPS | SGLang us "
             "| SGLang GB/s | SGLang TFLOPS | SGLang / ours |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['tokens']} | {r['experts_touched']:.0f} | {r['our_path']} "
                     f"| {r['ours_us']:.1f} "
                     f"| {r['ours_gbs']:.0f} | {r['ours_tflops']:.1f} | {r['theirs_us']:.1f} | {r['theirs_gbs']:.0f} "
                     f"| {r['theirs_tflops']:.1f} | {r['theirs_over_ours']:.2f} |")
    return "\n".join(lines) + "\n"


def write(out: str | None, checks: list[dict], rows: list[dict]) -> None:
    if out is None:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (folder / "moe_anchor.json").write_text(json.dumps(dict(gpu=gpu, anchor=(ANCHORS / "README").read_text(),
                                                            checks=checks, rows=rows), indent=1))
    (folder / "moe_anchor.md").write_text(markdown(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["bf16", "fp8_block"], choices=["bf16", "fp8_block"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny shape: the checks and the bench once through, eagerly (the CPU smoke check)")
    parser.add_argument("--out", default=None, help="folder for moe_anchor.json and moe_anchor.md")
    args = parser.parse_args()
    interpreted = args.device == "cpu"
    if interpreted and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    anchor = load_anchor()
    print((ANCHORS / "README").read_text().splitlines()[0], flush=True)
    tables = {kind: json.loads(path.read_text()) for kind, path in CONFIG_FILES.items()}
    checks = []
    for kind in args.kinds:
        cases = [(TINY, 5), (TINY, 40)] + ([] if args.tiny else [(QWEN3_30B_A3B, 8)])  # (40: several blocks)
        for shape, tokens in cases:
            result = dict(kind=kind, shape=shape, **check(anchor, kind, shape, tables, args.device, tokens,
                                                           interpreted))
            ok = max(result["ours"], result["theirs"]) < result["tolerance"]
            print(f"[{kind}] correctness {shape} T={tokens}: ours {result['ours']:.2e}, "
                  f"theirs {result['theirs']:.2e} (relative to the reference) {'ok' if ok else 'MISMATCH'}",
                  flush=True)
            checks.append(dict(result, ok=ok))
    rows = []
    write(args.out, checks, rows)
    for kind in args.kinds:
        if args.tiny:  # the harness once through, eager (eager_call_us)
            rows += bench(anchor, kind, tables, [1, 5, 40], TINY, args.device, timer=eager_call_us)
        else:
            rows += bench(anchor, kind, tables, args.tokens)
        write(args.out, checks, rows)  # (after each kind: a run cut by its guard keeps what it measured)
    print(markdown(rows))
    if not all(c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
