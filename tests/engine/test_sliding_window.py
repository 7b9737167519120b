"""Sliding-window attention and the Gemma 2 / Gemma 3 text models against transformers.

Tiny random models made with transformers (fp32, eager attention; odd sizes, GQA, head_dim 24,
a window of 8 tokens so every prompt outgrows it), converted through the real build path:
logits equal transformers' within 1e-4 on CPU for a full prompt, 16 decode steps, a packed batch
of four sequences and a prompt prefilled in three chunks (bf16 within 0.15, on CPU and, marked
gpu, on CUDA); two gloo ranks equal one; Gemma through the executor generates transformers'
greedy tokens; Gemma 3 multimodal checkpoints build their language model. Block freeing with a
window on every layer: tests/executor/test_sliding_window_executor.py.
"""
from __future__ import annotations


import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine_testing import (EXECUTOR_POOL, PagedSession, VOCAB, assert_tp2_matches_tp1, hf_logits, make_engine,
                            random_tokens)

WINDOW = 8
_SHAPE = dict(vocab_size=VOCAB, hidden_size=60, intermediate_size=88, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6)

FAMILIES = {
    # Alternating sliding / global layers, attention and final soft-caps small enough to bend the
    # scores, and a query_pre_attn_scalar that is not head_dim.
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_SHAPE, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=20,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, two sliding layers per global one, a linear-scaled global rope and a
    # local rope base of its own.
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **_SHAPE, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=20,
        final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # Every layer windowed: blocks out of the window can be freed.
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **{**_SHAPE, "hidden_size": 64, "head_dim": 16}, num_hidden_layers=2, sliding_window=WINDOW)),
    # use_sliding_window from layer max_window_layers (1) on: layer 0 global, layer 1 windowed.
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**_SHAPE, "hidden_size": 64, "head_dim": 16}, num_hidden_layers=2, use_sliding_window=True,
        sliding_window=WINDOW, max_window_layers=1)),
}


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Llama-style norms scale by w (around 1); Gemma's by 1 + w (w around 0).
            base = 1.0 if "norm" in name and not family.startswith("gemma") else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def hf_models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny(family)
        return cache[family]

    return get


@pytest.fixture
def runner_for(hf_models, tmp_path):
    def make(family, tokens_per_block, device="cpu", dtype="float32"):
        engine_dir = make_engine(hf_models(family), tmp_path / f"{family}-{tokens_per_block}-{dtype}",
                                 tokens_per_block=tokens_per_block, dtype=dtype)
        return ModelRunner(engine_dir, device=device)

    return make


# As tests/engine/test_equivalence.py: fp32 on CPU within 1e-4; bf16 (CPU, and CUDA with the
# Triton kernels and decode CUDA graphs) within 0.15, far below what a wrong window or cap costs.
TOLERANCES = {("cpu", "float32"): 1e-4, ("cpu", "bfloat16"): 0.15, ("cuda", "bfloat16"): 0.15}
DEVICES = [
    pytest.param("cpu", "float32", id="cpu-fp32"),
    pytest.param("cpu", "bfloat16", id="cpu-bf16"),
    pytest.param("cuda", "bfloat16", id="cuda-bf16",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, device: str = "cpu", dtype: str = "float32") -> None:
    error = (actual.cpu().float() - expected).abs().max().item()
    assert error <= TOLERANCES[(device, dtype)], f"max abs error {error:.3g}"


FAMILY_NAMES = list(FAMILIES)
BLOCK_SIZES = [3, 16]  # a page smaller than the window (3 does not divide 8) and one larger


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_config_records_windows_and_caps(family, hf_models, tmp_path):
    config = EngineConfig.load(make_engine(hf_models(family), tmp_path / "e")).model
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    expected = {"gemma2": [WINDOW, None, WINDOW, None], "gemma3": [WINDOW, WINDOW, None, WINDOW],
                "mistral": [WINDOW, WINDOW], "qwen2": [None, WINDOW]}[family]
    assert windows == expected
    assert config.kv_window == (WINDOW if family == "mistral" else None)
    if family == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)
    if family == "gemma3":
        assert config.rope_local_theta == 10_000.0 and config.rope_scaling["rope_type"] == "linear"


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("tokens_per_block", BLOCK_SIZES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_full_prompt(family, tokens_per_block, device, dtype, hf_models, runner_for):
    prompt = random_tokens(21, seed=1)
    session = PagedSession(runner_for(family, tokens_per_block, device, dtype), num_blocks=64)
    (logits,) = session.step([(0, prompt)])
    _assert_close(logits, hf_logits(hf_models(family), prompt), device, dtype)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("tokens_per_block", BLOCK_SIZES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prompt_then_16_decode_steps(family, tokens_per_block, device, dtype, hf_models, runner_for):
    sequence = random_tokens(11 + 16, seed=2)
    expected = hf_logits(hf_models(family), sequence)
    session = PagedSession(runner_for(family, tokens_per_block, device, dtype), num_blocks=64)
    session.runner.capture_cuda_graphs()  # no-op on CPU
    (prefill,) = session.step([(0, sequence[:11])])
    _assert_close(prefill, expected[:11], device, dtype)
    for pos in range(11, 27):
        (decode,) = session.step([(0, [sequence[pos]])])
        _assert_close(decode, expected[pos:pos + 1], device, dtype)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("tokens_per_block", BLOCK_SIZES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_batch_of_four_sequences(family, tokens_per_block, device, dtype, hf_models, runner_for):
    """A fresh prefill, a decode token, a mid-sequence chunk and a 1-token prompt in one forward."""
    hf = hf_models(family)
    seqs = {0: random_tokens(7, 3), 1: random_tokens(13, 4), 2: random_tokens(15, 5), 3: random_tokens(1, 6)}
    session = PagedSession(runner_for(family, tokens_per_block, device, dtype), num_blocks=96)
    session.step([(1, seqs[1][:12]), (2, seqs[2][:10])])
    outs = session.step([(0, seqs[0]), (1, seqs[1][12:]), (2, seqs[2][10:]), (3, seqs[3])])
    expected = [hf_logits(hf, seqs[0]), hf_logits(hf, seqs[1])[12:], hf_logits(hf, seqs[2])[10:],
                hf_logits(hf, seqs[3])]
    for actual, rows in zip(outs, expected):
        _assert_close(actual, rows, device, dtype)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("tokens_per_block", BLOCK_SIZES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prompt_prefilled_in_three_chunks(family, tokens_per_block, device, dtype, hf_models, runner_for):
    prompt = random_tokens(40, seed=7)
    expected = hf_logits(hf_models(family), prompt)
    session = PagedSession(runner_for(family, tokens_per_block, device, dtype), num_blocks=64)
    for start, end in [(0, 17), (17, 33), (33, 40)]:
        (chunk,) = session.step([(0, prompt[start:end])])
        _assert_close(chunk, expected[start:end], device, dtype)


def test_two_gloo_ranks_compute_tp1_logits(hf_models, tmp_path):
    assert_tp2_matches_tp1({family: hf_models(family) for family in ("gemma2", "gemma3", "mistral")}, tmp_path)


@torch.no_grad()
def _greedy_reference(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward over the whole sequence (no cache)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_executor_greedy_equals_transformers(family, hf_models, tmp_path):
    """Through the in-flight-batching executor (overlapped steps, chunked context, KV reuse), three
    requests at once generate transformers' greedy tokens, past the window; every block comes back."""
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request

    hf = hf_models(family)
    engine_dir = make_engine(hf, tmp_path / "e", tokens_per_block=4)
    prompts = [random_tokens(19, 20), random_tokens(5, 21), random_tokens(19, 20)[:12] + random_tokens(3, 22)]
    config = ExecutorConfig(enable_chunked_context=True, max_num_tokens=16, **EXECUTOR_POOL)
    with Executor(engine_dir, config) as executor:
        ids = executor.enqueue_requests(
            [Request(p, 12, output=OutputConfig(exclude_input_from_output=True)) for p in prompts])
        got, finished = {i: [] for i in ids}, set()
        while len(finished) < len(ids):
            for response in executor.await_responses(timeout=1.0):
                assert response.error is None, response.error
                got[response.request_id] += response.result.output_token_ids[0]
                if response.result.is_final:
                    finished.add(response.request_id)
        stats = executor.get_latest_iteration_stats().kv_cache_stats
    assert [got[i] for i in ids] == [_greedy_reference(hf, p, 12) for p in prompts]
    assert stats.free_num_blocks == stats.max_num_blocks


def test_build_from_a_saved_gemma3_directory(hf_models, tmp_path):
    """python -m engine.build over save_pretrained's safetensors (tied lm_head not stored)."""
    from engine.build import main

    hf = hf_models("gemma3")
    hf.save_pretrained(tmp_path / "ckpt")
    assert main(["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "engine"), "--dtype", "float32",
                 "--max_seq_len", "256", "--max_input_len", "256", "--tokens_per_block", "4"]) == 0
    prompt = random_tokens(21, seed=9)
    (logits,) = PagedSession(ModelRunner(str(tmp_path / "engine"))).step([(0, prompt)])
    _assert_close(logits, hf_logits(hf, prompt))


@pytest.mark.parametrize("layout", ["transformers5", "transformers4"])
def test_gemma3_multimodal_checkpoint_builds_its_language_model(layout, tmp_path):
    """Gemma3ForConditionalGeneration (Gemma 3 4B and up): the engine serves its text model; the
    logits of a text-only prompt equal the multimodal model's. transformers 4 checkpoints name the
    text model's tensors language_model.model.*, transformers 5 model.language_model.*."""
    from engine.build import build_from_hf
    from engine.config import BuildConfig
    from engine.convert import getter_from_state_dict

    text = dict(_SHAPE, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=20)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.copy_(0.1 * torch.randn_like(p))
    state = hf.state_dict()
    if layout == "transformers4":
        state = {k.replace("model.language_model.", "language_model.model."): v for k, v in state.items()}
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=256, max_seq_len=256, max_num_tokens=1024,
                        tokens_per_block=4)
    build_from_hf(config, getter_from_state_dict(state, "tiny"), None, str(tmp_path / "e"), build, progress=False)
    assert EngineConfig.load(str(tmp_path / "e")).model.architecture == "Gemma3ForCausalLM"
    prompt = random_tokens(21, seed=10)
    (logits,) = PagedSession(ModelRunner(str(tmp_path / "e"))).step([(0, prompt)])
    _assert_close(logits, hf_logits(hf, prompt))


def test_bad_window_fields_and_fp8_gemma_are_refused_by_name(hf_models, tmp_path):
    from engine.config import ConfigError, ModelConfig

    base = dict(architecture="Gemma2ForCausalLM", vocab_size=96, hidden_size=60, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=24, intermediate_size=88, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ConfigError, match="layer_types must list one of sliding_attention, full_attention per layer"):
        ModelConfig(**base, sliding_window=8, layer_types=["sliding_attention"]).validate()
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer, got 0"):
        ModelConfig(**base, sliding_window=0).validate()
    with pytest.raises(ConfigError, match="attn_logit_softcapping must be a positive number or null, got -1"):
        ModelConfig(**base, attn_logit_softcapping=-1).validate()
    with pytest.raises(ConfigError, match="Gemma2ForCausalLM needs hidden_act 'gelu_pytorch_tanh' or 'gelu'"):
        ModelConfig(**{**base, "hidden_act": "silu"}).validate()
    from engine.build import build_from_hf
    from engine.config import BuildConfig
    from engine.convert import getter_from_state_dict

    hf = hf_models("gemma2")
    build = BuildConfig(dtype="float32", max_seq_len=256, max_input_len=256, quantization="fp8")
    with pytest.raises(ConfigError, match="quantization fp8 is not supported for Gemma2ForCausalLM"):
        build_from_hf(hf.config, getter_from_state_dict(hf.state_dict(), "tiny"), None, str(tmp_path / "e"), build,
                      progress=False)
