"""FP8 weights on encoder-decoder engines (``engine.build --quantization fp8``: engine/encoder_decoder/build.py,
model.py Fp8Linear): every linear of both stacks' layers stored as E4M3 with per-output-channel float32 scales,
the embeddings, the LM head, Whisper's convolutions and the norms in --dtype; loaded and run through
kernels/fp8.py's fp8_linear (CPU: its plain-torch W8A8 reference; CUDA, marked: the FP8 kernels and the decode
graphs). Tiny random T5 v1.0, T5 v1.1, BART and Whisper made by transformers at the scale of trained checkpoints
(test_encoder_decoder_fp8.py write_trained_scale_checkpoint): the engine directory's tensors, teacher-forced
logits and argmax agreement with the float32 engine, greedy serving through the executor (with an FP8 cross
pool too), and the schemes and options that cannot take FP8 weights refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.build import main
from engine.config import EngineConfig
from engine.encoder_decoder.model import Fp8Linear, product
from engine.encoder_decoder.runner import EncDecRunner
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
from kernels.attention import KV_FP8_DTYPE
from kernels.fp8 import FP8_DTYPE, fp8_linear_ref, quantize_weight
from tests.engine.test_encoder_decoder_fp8 import encoder_input, teacher_forced_logits, write_trained_scale_checkpoint
from tests.executor.executor_testing import collect, final_tokens
from tiny_encdec import INPUTS, WHISPER_PROMPT, build_engine

# Bounds against the float32 engine, teacher-forced over 10 decoder tokens. Relative RMS of the logits: 10%,
# the decoder-only FP8 engine's bound (tests/engine/test_fp8_engine.py: one W8A8 product carries ~3.7% relative
# RMS error; the layers' products add independent errors the residual stream damps); measured here 0.06% (BART,
# whose post-norm residual stream is dominated by its embeddings at this init), 2.5% (Whisper), 5.9% (T5 v1.0),
# 7.1% (T5 v1.1). Argmax agreement >= 80%: at most two of the ten positions may change, because these tiny random
# references hold near-ties that any rounding can flip (T5 v1.0's 5th position: top-2 margin 0.039 against a
# largest logit change of 0.25; BART's 8th: 0.005); measured 90% (T5 v1.0, that position) and 100% elsewhere.
# A wrong scale (a transposed or missing one) or raw codes read as values send both far past these bounds.
RELATIVE_BOUND, AGREEMENT_BOUND = 0.10, 0.8
FAMILIES = ("t5_v1_0", "t5_v1_1", "bart", "whisper")


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request, tmp_path_factory):
    """(family, float32 decoder directory, FP8 decoder directory), both built from one tiny checkpoint."""
    family = request.param
    root = tmp_path_factory.mktemp(f"fp8w_{family}")
    write_trained_scale_checkpoint(family, root / "checkpoint")
    limits = [] if family == "whisper" else ["--max_encoder_input_len", "16", "--max_seq_len", "48"]
    build_engine(root, *limits)
    fp8_root = root / "fp8"
    fp8_root.mkdir()
    (fp8_root / "checkpoint").symlink_to(root / "checkpoint")
    build_engine(fp8_root, *limits, "--quantization", "fp8")
    return family, str(root / "engine" / "decoder"), str(fp8_root / "engine" / "decoder")


def _is_layer_linear(name: str) -> bool:
    """layers.{i}.{attn | self_attn | cross_attn}.{q | k | v | o}.weight, layers.{i}.mlp.{gate | up | down}.weight"""
    parts = name.split(".")
    return len(parts) == 5 and parts[0] == "layers" and parts[2] in ("attn", "self_attn", "cross_attn", "mlp") \
        and parts[4] == "weight"


def test_engine_directory_holds_e4m3_layer_weights_with_row_scales(engines):
    """Both stacks: each layer linear's weight E4M3 with an (out,) float32 scale, the float32 engine's weight
    quantized per output channel (max|row| / 448) exactly; everything else (embeddings, LM head, norms,
    Whisper's convolutions and positions) the float32 engine's tensor as it is. The config records fp8."""
    family, reference_dir, fp8_dir = engines
    assert EngineConfig.load(fp8_dir).build.quantization == "fp8"
    for stack in ("encoder", "decoder"):
        reference = load_file(str(Path(reference_dir).parent / stack / "rank0.safetensors"))
        quantized = load_file(str(Path(fp8_dir).parent / stack / "rank0.safetensors"))
        linears = sorted(name for name in reference if _is_layer_linear(name) and name.endswith(".weight"))
        kinds = {name.rsplit(".", 2)[-2] for name in linears}
        assert kinds >= {"q", "k", "v", "o", "up", "down"}, kinds
        assert set(quantized) == set(reference) | {name + "_scale" for name in linears}
        for name in linears:
            codes, scale = quantize_weight(reference[name])
            assert quantized[name].dtype == FP8_DTYPE and quantized[name + "_scale"].dtype == torch.float32
            assert quantized[name + "_scale"].shape == (reference[name].shape[0],)
            assert torch.equal(quantized[name].view(torch.uint8), codes.view(torch.uint8)), name
            torch.testing.assert_close(quantized[name + "_scale"], scale, rtol=0, atol=0)
        for name in set(reference) - set(linears):
            assert quantized[name].dtype == torch.float32 and torch.equal(quantized[name], reference[name]), name
        if family == "whisper" and stack == "encoder":
            assert {"conv1.weight", "conv2.weight"} <= set(reference) - set(linears)
        if stack == "decoder":
            assert "lm_head.weight" not in linears and "embed_tokens.weight" not in linears


def test_fp8_weights_keep_teacher_forced_logits(engines):
    """The FP8 engine's logits over a fixed decoder sequence stay within RELATIVE_BOUND of the float32 engine's
    and their argmax agrees on at least AGREEMENT_BOUND of the positions (the module's bounds say why); the
    loaded layers are Fp8Linear with E4M3 weights, the cross K/V fused with their row scales."""
    family, reference_dir, fp8_dir = engines
    reference, _ = teacher_forced_logits(EncDecRunner(reference_dir), family, "auto")
    runner = EncDecRunner(fp8_dir)
    quantized, _ = teacher_forced_logits(runner, family, "auto")
    layer = runner.model.layers[0]
    assert isinstance(layer.self_attn.q, Fp8Linear) and isinstance(runner.encoder.layers[0].mlp.down, Fp8Linear)
    assert layer.cross_attn.kv_weight.dtype == FP8_DTYPE and layer.cross_attn.kv_scale.dtype == torch.float32
    assert runner.model.lm_head.weight.dtype == torch.float32
    if family == "t5_v1_1":  # the gated MLP fused: [gate | up] codes with their scales
        assert layer.mlp.gate_up.dtype == FP8_DTYPE and layer.mlp.gate_up_scale.shape == (2 * 48,)
    error = ((quantized - reference).norm() / reference.norm()).item()
    agreement = (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{family}: FP8 weights relative RMS {error:.4f}, argmax agreement {agreement:.0%}")
    assert error < RELATIVE_BOUND, (family, error)
    assert agreement >= AGREEMENT_BOUND, (family, agreement)


def test_fused_products_equal_the_unfused_fp8_products(engines):
    """The fused [k | v] cross product, the decoder self-attention's [q | k | v] product (a zero k bias where k has
    none) and (T5 v1.1) [gate | up] product give the per-projection FP8 products' values: per-row scales
    concatenate exactly."""
    family, _, fp8_dir = engines
    runner = EncDecRunner(fp8_dir)
    rows = torch.randn(5, runner.spec.d_model, generator=torch.Generator().manual_seed(1))
    self_attn = runner.model.layers[1].self_attn
    assert self_attn.qkv_weight.dtype == FP8_DTYPE and self_attn.qkv_scale.shape == (3 * self_attn.q.weight.shape[0],)
    q, k, v = self_attn.qkv_heads(rows)
    for heads, proj in zip((q, k, v), (self_attn.q, self_attn.k, self_attn.v)):
        torch.testing.assert_close(heads.flatten(1), fp8_linear_ref(rows, proj.weight, proj.weight_scale, proj.bias),
                                   rtol=0, atol=0)
    attn = runner.model.layers[1].cross_attn
    fused = product(rows, attn.kv_weight, attn.kv_bias, attn.kv_scale)
    k, v = (fp8_linear_ref(rows, p.weight, p.weight_scale, p.bias) for p in (attn.k, attn.v))
    torch.testing.assert_close(fused, torch.cat([k, v], dim=-1), rtol=0, atol=0)
    mlp = runner.model.layers[0].mlp
    if mlp.gate_up is not None:
        gate, up = (fp8_linear_ref(rows, p.weight, p.weight_scale) for p in (mlp.gate, mlp.up))
        torch.testing.assert_close(product(rows, mlp.gate_up, scale=mlp.gate_up_scale), torch.cat([gate, up], -1),
                                   rtol=0, atol=0)


def test_inputs_quantized_before_the_products_leave_the_logits_unchanged(engines, monkeypatch):
    """Where the W8A8 path runs (CUDA), q, k and v's input is quantized per token once for the three products
    (model.py Attention.qkv_heads), and in a pre-norm decoder step (T5, Whisper) every norm (Norm.add_and_norm)
    hands its products their input quantized in its own kernel with the residual add (rms_norm_quantized,
    layer_norm_quantized), T5 v1.1's gated-GELU the down product's (gelu_tanh_and_mul_quantized). Forced on
    here, on the CPU references: the logits are exactly those of quantizing inside each product; in the
    pre-norm stacks (T5, Whisper) every norm of both stacks quantized (T5 v1.1's gated MLPs' activation too:
    EncoderLayer.pre_norm_step runs the encoder the decoder step's way), in BART (post-norm) every encoder
    self-attention took the shared path and the decoder's q, k and v's input was quantized once in their one
    fused product (Attention.fuse_qkv)."""
    import engine.encoder_decoder.model as model

    family, _, fp8_dir = engines
    runner = EncDecRunner(fp8_dir)
    inside, _ = teacher_forced_logits(runner, family, "auto")
    calls = {name: [] for name in ("as_quantized_rows", "rms_norm_quantized", "layer_norm_quantized",
                                   "gelu_tanh_and_mul_quantized")}
    monkeypatch.setattr(model, "quantizes_activations", lambda device: True)
    for name, made in calls.items():
        original = getattr(model, name)
        monkeypatch.setattr(model, name, lambda *args, made=made, original=original: made.append(1) or original(*args))
    once, _ = teacher_forced_logits(runner, family, "auto")
    assert torch.equal(once, inside)
    encoder_layers, decoder_layers = len(runner.encoder.layers), len(runner.model.layers)
    counts = {name: len(made) for name, made in calls.items()}
    norms = 2 * encoder_layers + 3 * decoder_layers
    assert counts == {"as_quantized_rows": encoder_layers if family == "bart" else 0,
                      "rms_norm_quantized": norms if family.startswith("t5") else 0,
                      "layer_norm_quantized": norms if family == "whisper" else 0,
                      "gelu_tanh_and_mul_quantized": encoder_layers + decoder_layers if family == "t5_v1_1" else 0,
                      }, family


def test_t5_products_deferring_their_scales_to_the_quantizing_readers_keep_the_logits(engines, monkeypatch):
    """A T5 FP8 decode step where the load-time timing chose the tensor-wise product (kernels/fp8.py "Deferred
    scales": choose_fp8_scaling) hands o's, cross o's and down's unscaled products to the next quantizing RMS norm
    and [gate | up]'s to the quantizing gated-GELU, which apply the scales; the last layer's down product, read
    by the final norm, keeps its own. Forced here on the CPU references (W8A8 on, every product deferrable): the
    logits are those of the row-wise products up to float32 rounding, and each reader got its unscaled product."""
    import engine.encoder_decoder.model as model
    import kernels.fp8 as fp8

    family, _, fp8_dir = engines
    if not family.startswith("t5"):
        pytest.skip("T5's RMS norms take deferred scales")
    runner = EncDecRunner(fp8_dir)
    monkeypatch.setattr(model, "quantizes_activations", lambda device: True)
    row_wise, _ = teacher_forced_logits(runner, family, "auto")
    monkeypatch.setattr(fp8, "_defers_scales", lambda x, weight: True)
    monkeypatch.setitem(fp8._UNIT_SCALES, torch.device("cpu"), torch.ones((), dtype=torch.float32))
    unscaled = {"rms_norm_quantized": 0, "gelu_tanh_and_mul_quantized": 0}
    for name in unscaled:
        def counting(*args, name=name, original=getattr(model, name)):
            unscaled[name] += isinstance(args[0], fp8.ScaledProduct)
            return original(*args)
        monkeypatch.setattr(model, name, counting)
    deferred, _ = teacher_forced_logits(runner, family, "auto")
    torch.testing.assert_close(deferred, row_wise, rtol=1e-4, atol=1e-4)
    layers = len(runner.model.layers)
    # (forced here, the encoder's [gate | up] products defer too: on the GPU only row counts timed at load do)
    assert unscaled == {"rms_norm_quantized": 3 * layers - 1,
                        "gelu_tanh_and_mul_quantized": layers + len(runner.encoder.layers) if family == "t5_v1_1"
                        else 0}, family


def _decode_step_weights_by_hand(decoder) -> list[torch.Tensor]:
    """What a decode step multiplies, listed from the layers: self [q | k | v] (fused at load: q, k, v views of it)
    and o, cross q o, the MLP's products ([gate | up] once fused, never its halves), down, the LM head; never
    cross k / v (projected at encode)."""
    weights = []
    for layer in decoder.layers:
        mlp, attn = layer.mlp, layer.self_attn
        assert attn.k.weight.data_ptr() == attn.qkv_weight[attn.q.weight.shape[0]:].data_ptr()
        ups = [mlp.gate_up] if mlp.gate_up is not None else [m.weight for m in (mlp.gate, mlp.up) if m is not None]
        weights += [attn.qkv_weight, attn.o.weight, layer.cross_attn.q.weight, layer.cross_attn.o.weight]
        weights += ups + [mlp.down.weight]
    return weights + [decoder.lm_head.weight]


def test_load_time_choices_cover_every_fp8_weight_of_a_decode_step_at_17_to_128_rows(engines, monkeypatch):
    """EncDecRunner.choose_kernels (run before the decode graphs are captured) hands every weight a decode step
    multiplies to kernels/wide_rows.py's load-time choice at the padded row counts the batch buckets reach (here
    max_batch_size 64: 32 and 64), and the FP8 ones (no cross k / v: projected at encode) to the skinny W8A8
    tilings. Before 2026-11-30 it made no wide-row choice, so every FP8 product of a 17-128-row step ran
    torch._scaled_mm, slower there than the bf16 engine's cuBLAS products, its bias an extra kernel (H200,
    Whisper large-v3 at batch 64: 7.63 ms a step against 6.05 with bf16 weights). The same for the model-dtype
    engine. The timings themselves need CUDA (the CUDA test below runs them): here what each choice is handed
    is recorded."""
    import dataclasses

    import engine.encoder_decoder.runner as runner_module

    family, reference_dir, fp8_dir = engines
    runner = EncDecRunner(fp8_dir)
    runner.build_config = dataclasses.replace(runner.build_config, max_batch_size=64)
    handed = {}
    monkeypatch.setattr(runner_module, "choose_skinny_weights", lambda weights: {})
    monkeypatch.setattr(runner_module, "choose_fp8_skinny_variants", lambda weights: handed.update(fp8=weights) or {})
    monkeypatch.setattr(runner_module, "choose_wide_variants",
                        lambda weights, row_counts: handed.update(wide=weights, rows=row_counts) or {})
    runner.choose_kernels()
    expected = _decode_step_weights_by_hand(runner.model)
    assert [id(w) for w in handed["wide"]] == [id(w) for w in expected]
    assert handed["rows"] == (32, 64)
    assert [id(w) for w in handed["fp8"]] == [id(w) for w in expected[:-1]]  # all but the LM head
    assert all(w.dtype == FP8_DTYPE for w in handed["fp8"]) and runner.model.lm_head.weight.dtype == torch.float32
    if family == "t5_v1_1":
        assert any(w is runner.model.layers[0].mlp.gate_up for w in handed["fp8"])
    # The model-dtype engine: the same weights to the wide-row choice; to the skinny tilings all but the
    # non-gated MLP's up weights (timed with their activation: choose_activated_weights), the fused [q | k | v]
    # and [gate | up] among them (before 2026-11-30 only nn.Linear modules' weights: never the fused ones).
    runner = EncDecRunner(reference_dir)
    runner.build_config = dataclasses.replace(runner.build_config, max_batch_size=64)
    monkeypatch.setattr(runner_module, "choose_skinny_weights", lambda weights: handed.update(skinny=weights) or {})
    monkeypatch.setattr(runner_module, "choose_activated_weights", lambda weights, activation: {})
    runner.choose_kernels()
    expected = _decode_step_weights_by_hand(runner.model)
    ups = {id(layer.mlp.up.weight) for layer in runner.model.layers if layer.mlp.gate is None}
    assert [id(w) for w in handed["wide"]] == [id(w) for w in expected]
    assert [id(w) for w in handed["skinny"]] == [id(w) for w in expected if id(w) not in ups]


def test_executor_serves_fp8_weights_with_an_fp8_cross_pool(engines):
    """Greedy requests through the executor on the FP8 engine answer in full, with the model-dtype pools and
    with an E4M3 cross pool (cross_kv_cache_dtype fp8) alike; T5 v1.0 (its near-tie) is left to the others."""
    family, _, fp8_dir = engines
    if family == "t5_v1_0":
        pytest.skip("T5 v1.1, BART and Whisper exercise the executor")
    out = OutputConfig(exclude_input_from_output=True)
    if family == "whisper":
        requests = lambda: [Request(WHISPER_PROMPT, 6, encoder_input_features=encoder_input(family), output=out)]
    else:
        requests = lambda: [Request([], 6, encoder_input_ids=ids, output=out) for ids in INPUTS]
    answers = []
    for cross in ("auto", "fp8"):
        with Executor(fp8_dir, ExecutorConfig(max_batch_size=4, cross_kv_cache_dtype=cross)) as ex:
            assert ex.runner.cross_pool.dtype == (KV_FP8_DTYPE if cross == "fp8" else torch.float32)
            responses = collect(ex, ex.enqueue_requests(requests()))
            answers.append([final_tokens(responses[i]) for i in responses])
    assert all(len(tokens) == 6 for tokens in answers[0] + answers[1]), answers


def test_schemes_and_options_that_cannot_take_fp8_weights_are_refused_by_name(engines, tmp_path, capsys):
    """fp8_block / int8_sq / int4_wo refused by the build by name (fp8 is the scheme these stacks take); an FP8
    weight without its scale refused by name."""
    family, _, fp8_dir = engines
    if family != "bart":
        pytest.skip("one family exercises the refusals")
    checkpoint = str(Path(fp8_dir).parent.parent / "checkpoint")
    for scheme in ("fp8_block", "int8_sq", "int4_wo"):
        assert main(["--checkpoint", checkpoint, "--output", str(tmp_path / scheme), "--quantization", scheme]) == 2
        err = capsys.readouterr().err
        assert (f"--quantization {scheme}: not supported for BartForConditionalGeneration (encoder-decoder) "
                "engines; allowed: fp8") in err, err
    runner = EncDecRunner(fp8_dir)
    with pytest.raises(ValueError, match=r"an FP8 weight \(4, 32\) needs its per-output-channel scale"):
        product(torch.ones(1, 32), runner.model.layers[0].self_attn.q.weight[:4])


def test_config_only_fp8_engine_gets_e4m3_random_weights(engines, tmp_path):
    """A config-only FP8 engine (benchmarks/engine/encdec_bench.py --quantization fp8: extra.random_weights_seed,
    no rank files) loads with its layer linears E4M3 and positive row scales, and answers through the executor."""
    family, _, fp8_dir = engines
    if family != "t5_v1_1":
        pytest.skip("one family exercises config-only engines")
    for stack in ("encoder", "decoder"):
        config = EngineConfig.load(str(Path(fp8_dir).parent / stack))
        config.extra["random_weights_seed"] = 0
        config.save(str(tmp_path / stack))
    with Executor(str(tmp_path / "decoder"), ExecutorConfig(max_batch_size=4)) as ex:
        linears = [m for stack in (ex.runner.encoder, ex.runner.model) for m in stack.modules()
                   if isinstance(m, Fp8Linear)]
        assert len(linears) == 2 * 7 + 2 * 11  # per layer: encoder q k v o gate up down; decoder + cross q k v o
        assert all(m.weight.dtype == FP8_DTYPE and bool((m.weight_scale > 0).all()) for m in linears)
        out = OutputConfig(exclude_input_from_output=True)
        responses = collect(ex, ex.enqueue_requests([Request([], 4, encoder_input_ids=INPUTS[0], output=out)]))
        assert [len(final_tokens(r)) for r in responses.values()] == [4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_weights_keep_teacher_forced_logits_and_serve_from_graphs(engines, tmp_path, monkeypatch):
    """bfloat16 engines on the GPU (the FP8 kernels: skinny W8A8 for decode rows, cuBLASLt's scaled product for
    the encoder's): the same bounds against the bfloat16 engine, and greedy requests replayed from the decode
    graphs (the skinny FP8 tilings chosen at load) give the eager steps' ids."""
    family, reference_dir, fp8_dir = engines
    checkpoint = str(Path(fp8_dir).parent.parent / "checkpoint")
    limits = [] if family == "whisper" else ["--max_encoder_input_len", "16", "--max_seq_len", "48"]
    dirs = {}
    for name, more in (("bf16", []), ("fp8", ["--quantization", "fp8"])):
        assert main(["--checkpoint", checkpoint, "--output", str(tmp_path / name), "--dtype", "bfloat16",
                     "--tokens_per_block", "4", "--max_batch_size", "4", *limits, *more]) == 0
        dirs[name] = str(tmp_path / name / "decoder")
    reference, _ = teacher_forced_logits(EncDecRunner(dirs["bf16"], device="cuda"), family, "auto")
    quantized, _ = teacher_forced_logits(EncDecRunner(dirs["fp8"], device="cuda"), family, "auto")
    error = ((quantized - reference).norm() / reference.norm()).item()
    agreement = (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{family} CUDA: FP8 weights relative RMS {error:.4f}, argmax agreement {agreement:.0%}")
    assert error < RELATIVE_BOUND and agreement >= AGREEMENT_BOUND, (family, error, agreement)
    out = OutputConfig(exclude_input_from_output=True)
    if family == "whisper":
        requests = lambda: [Request(WHISPER_PROMPT, 6, encoder_input_features=encoder_input(family), output=out)]
    else:
        requests = lambda: [Request([], 6, encoder_input_ids=ids, output=out) for ids in INPUTS]
    results = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("TRITONLLM_ENCDEC_GRAPHS", graphs)
        with Executor(dirs["fp8"], ExecutorConfig(max_batch_size=4), device="cuda") as ex:
            assert (ex.runner.decode_graphs is not None) == (graphs == "1")
            responses = collect(ex, ex.enqueue_requests(requests()))
            results[graphs] = [final_tokens(r) for r in responses.values()]
    assert results["1"] == results["0"] and all(len(t) == 6 for t in results["1"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_decode_weights_get_wide_row_tilings_that_keep_the_products(engines, tmp_path, monkeypatch):
    """On the GPU, choose_kernels leaves every FP8 weight of a decode step with its wide-row tilings (forced onto
    the kernel: TRITONLLM_WIDE_ROWS=1), and a 40-row product through model.py's ``product`` (the wide skinny kernel,
    bias and both scales in its epilogue) gives the W8A8 reference's values up to bf16 rounding."""
    from kernels.linear import WIDE_ATTR
    from kernels.wide_rows import WIDE_ROWS_ENV

    family, _, fp8_dir = engines
    checkpoint = str(Path(fp8_dir).parent.parent / "checkpoint")
    limits = [] if family == "whisper" else ["--max_encoder_input_len", "16", "--max_seq_len", "48"]
    assert main(["--checkpoint", checkpoint, "--output", str(tmp_path / "fp8"), "--dtype", "bfloat16",
                 "--tokens_per_block", "4", "--max_batch_size", "64", *limits, "--quantization", "fp8"]) == 0
    monkeypatch.setenv(WIDE_ROWS_ENV, "1")
    runner = EncDecRunner(str(tmp_path / "fp8" / "decoder"), device="cuda")
    runner.choose_kernels()
    fp8 = [w for w in runner.model.decode_step_weights() if w.dtype == FP8_DTYPE]
    assert fp8 and all(set(getattr(w, WIDE_ATTR, {})) == {32, 64} for w in fp8), family
    layer = runner.model.layers[0]
    generator = torch.Generator("cuda").manual_seed(0)
    for proj in (layer.self_attn.q, layer.mlp.down):
        x = torch.randn(40, proj.weight.shape[1], dtype=torch.bfloat16, device="cuda", generator=generator)
        out = product(x, proj.weight, proj.bias, proj.weight_scale).float()
        reference = fp8_linear_ref(x, proj.weight, proj.weight_scale, proj.bias, out_dtype=torch.float32)
        error = ((out - reference).norm() / reference.norm()).item()
        assert error < 1e-2, (family, tuple(proj.weight.shape), error)  # bf16 rounding of the output: ~2e-3
