"""The configurable-decoder families (engine/models/decoder.py) against transformers, through the
paged KV cache: float32 logits of a packed, chunked prefill and decode steps within 1e-4, and greedy
ids equal to transformers' ``generate`` at prompts of 5, 40 and 150 tokens. Then what a user meets
with a bad checkpoint. The served path (the `tensorrt_llm` model) is
tests/integration/test_model_families_served.py.
"""
from __future__ import annotations

import pytest
import torch

from decoder_testing import DECODER_FAMILIES, tiny_decoder, write_baichuan2_checkpoint, write_qwen1_checkpoint
from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import CheckpointError, getter_from_state_dict
from engine.executor.runner import ModelRunner
from engine.models import UnsupportedArchitectureError
from engine_testing import PagedSession, assert_directory_build_equals, hf_logits, make_engine, random_tokens

TOLERANCE = 1e-4  # float32 on both sides, the math in another order (observed ~1e-6)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (transformers model, engine dir), each built once for the module."""
    cache = {}

    def get(family: str):
        if family not in cache:
            hf = tiny_decoder(family)
            cache[family] = hf, make_engine(hf, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_chunked_packed_prefill_and_decode_match_transformers(family, built):
    """Sequence 0 in two prompt chunks (the second beside sequence 1's whole prompt), then 8
    decode steps; every new token's logits against transformers' over the whole sequence."""
    hf, engine_dir = built(family)
    first, second = random_tokens(48, seed=1), random_tokens(30, seed=2)
    session = PagedSession(ModelRunner(engine_dir), num_blocks=64)
    (chunk_a,) = session.step([(0, first[:19])])
    chunk_b, whole_second = session.step([(0, first[19:40]), (1, second)])
    decoded = [session.step([(0, [token])])[0] for token in first[40:]]
    for actual, expected in ((torch.cat([chunk_a, chunk_b, *decoded]), hf_logits(hf, first)),
                             (whole_second, hf_logits(hf, second))):
        error = (actual - expected).abs().max().item()
        assert error <= TOLERANCE, f"max abs error {error:.3g}"


def greedy_ids(engine_dir: str, prompt: list[int], new_tokens: int) -> list[int]:
    session = PagedSession(ModelRunner(engine_dir), num_blocks=64)
    (logits,) = session.step([(0, prompt)])
    ids = [int(logits[-1].argmax())]
    while len(ids) < new_tokens:
        (logits,) = session.step([(0, ids[-1:])])
        ids.append(int(logits[-1].argmax()))
    return ids


@pytest.mark.parametrize("prompt_len", [5, 40, 150])
@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_greedy_ids_equal_transformers_generate(family, prompt_len, built):
    hf, engine_dir = built(family)
    prompt = random_tokens(prompt_len, seed=prompt_len)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, prompt_len:].tolist()
    assert greedy_ids(engine_dir, prompt, NEW_TOKENS) == expected


def test_bloom_checkpoint_directory_builds_the_engine_held_to_transformers(built, tmp_path):
    """save_pretrained's BLOOM directory (the tied lm_head not stored) through `python -m engine.build`'s
    `main` with no length flag writes the tensors of the in-memory build the tests above hold to
    transformers (BLOOM is no longer served by tests/integration/test_model_families_served.py,
    which built it so; its ALiBi through the in-flight executor: the last test of this file)."""
    hf, engine_dir = built("bloom")
    assert_directory_build_equals(hf, engine_dir, tmp_path)


# ---- bad checkpoints ------------------------------------------------------------------------

def _build(hf_config, state_dict, out_dir) -> None:
    build = BuildConfig(dtype="float32", max_batch_size=2, max_seq_len=64, max_num_tokens=128)
    build_from_hf(hf_config, getter_from_state_dict(state_dict, "ckpt"), None, str(out_dir), build, progress=False)


@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_a_missing_tensor_is_named(family, tmp_path):
    hf = tiny_decoder(family)
    state = dict(hf.state_dict())
    victim = sorted(name for name in state if ".1." in name)[-1]  # a tensor of the last layer
    del state[victim]
    with pytest.raises(CheckpointError, match=f"lacks the tensor '{victim}'"):
        _build(hf.config, state, tmp_path / "engine")


def test_an_unknown_model_type_is_named(tmp_path):
    hf = tiny_decoder("gpt_neox_parallel")
    hf.config.architectures = None
    hf.config.model_type = "gpt_neo_x_custom"
    with pytest.raises(UnsupportedArchitectureError, match="unsupported model_type 'gpt_neo_x_custom'"):
        _build(hf.config, hf.state_dict(), tmp_path / "engine")


def test_baichuan_v1_is_refused_by_name(tmp_path):
    hf = tiny_decoder("gpt_neox_parallel")
    hf.config.architectures = ["BaiChuanForCausalLM"]
    with pytest.raises(UnsupportedArchitectureError, match="Baichuan \\(v1\\) 7B .* has no converter"):
        _build(hf.config, hf.state_dict(), tmp_path / "engine")


# ---- remote-code checkpoints: Baichuan 2, Qwen (v1) -----------------------------------------

@pytest.mark.parametrize("write", [write_baichuan2_checkpoint, write_qwen1_checkpoint])
def test_remote_code_checkpoint_builds_from_its_directory_and_equals_transformers(write, tmp_path):
    """The directory as the hub ships it (config.json naming remote code that is not there,
    safetensors in the checkpoint's own names): `engine.build` reads the config as data; logits of a
    chunked prompt and greedy ids at 5, 40 and 150 tokens equal the transformers model it means."""
    from engine.build import main

    reference = write(tmp_path / "ckpt")
    assert main(["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "engine"),
                 "--dtype", "float32"]) == 0
    vocab = reference.config.vocab_size
    sequence = [t % vocab for t in random_tokens(48, seed=3)]
    session = PagedSession(ModelRunner(str(tmp_path / "engine")), num_blocks=64)
    logits = torch.cat(session.step([(0, sequence[:30])]) + session.step([(0, sequence[30:])]))
    error = (logits - hf_logits(reference, sequence)).abs().max().item()
    assert error <= TOLERANCE, f"max abs error {error:.3g}"
    for prompt_len in (5, 40, 150):
        prompt = random_tokens(prompt_len, seed=prompt_len)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt_len:].tolist()
        assert greedy_ids(str(tmp_path / "engine"), prompt, NEW_TOKENS) == expected, prompt_len


def test_baichuan2_13b_alibi_checkpoint_equals_transformers_llama_with_the_alibi_mask(tmp_path):
    """Baichuan 2 13B's form (ALiBi on the Llama block, 5 heads): against transformers' Llama run with
    rope at angle 0 and the ALiBi bias as its 4-D additive mask; logits of a chunked prompt, and greedy
    ids (one full forward per token) at 5, 40 and 150 tokens."""
    from decoder_testing import alibi_llama_logits, write_baichuan2_13b_checkpoint
    from engine.build import main

    reference = write_baichuan2_13b_checkpoint(tmp_path / "ckpt")
    assert main(["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "engine"),
                 "--dtype", "float32"]) == 0
    sequence = random_tokens(48, seed=3)
    session = PagedSession(ModelRunner(str(tmp_path / "engine")), num_blocks=64)
    logits = torch.cat(session.step([(0, sequence[:30])]) + session.step([(0, sequence[30:])]))
    error = (logits - alibi_llama_logits(reference, sequence)).abs().max().item()
    assert error <= TOLERANCE, f"max abs error {error:.3g}"
    for prompt_len in (5, 40, 150):
        tokens = random_tokens(prompt_len, seed=prompt_len)
        for _ in range(NEW_TOKENS):
            tokens.append(int(alibi_llama_logits(reference, tokens, last_only=True)[-1].argmax()))
        assert greedy_ids(str(tmp_path / "engine"), tokens[:prompt_len], NEW_TOKENS) == tokens[prompt_len:]


# ---- tensor parallelism and quantized weights -----------------------------------------------

# One family of each kind whose split needs care: a parallel residual (two all-reduces per block
# summed into one stream) and ALiBi (each rank's slice of the slopes). TP 2 equals TP 1 for them in
# test_model_families.py's test_two_gloo_ranks_compute_tp1_logits (one job of the shared gloo ranks,
# gloo_ranks.py, for every family it holds).
TP_FAMILIES = ["gpt_neox_parallel", "bloom"]


def test_a_multi_query_falcon_refuses_a_tp_that_would_split_its_one_kv_head(tmp_path):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"tp_size 2 does not divide num_kv_heads \(1\)"):
        make_engine(tiny_decoder("falcon_7b_multi_query"), tmp_path / "tp2", tp_size=2)


def test_alibi_with_rope_scaling_is_refused_by_name():
    from engine.config import ConfigError, ModelConfig

    config = ModelConfig(architecture="BloomForCausalLM", vocab_size=96, hidden_size=72, num_layers=2, num_heads=6,
                         num_kv_heads=6, head_dim=12, intermediate_size=288, norm_kind="layernorm", norm_bias=True,
                         mlp_gated=False, hidden_act="gelu", positions="alibi", alibi_slopes="bloom",
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="ALiBi positions with rope_scaling .* cannot work"):
        config.validate()


# Every form takes FP8 and per-channel INT8 (the registry's flags); INT4 in groups of 32 on one (the
# other tiny widths are not multiples of 32; the linears' code is the same).
QUANTIZED_CASES = [(family, quantization, None, bound) for family in DECODER_FAMILIES
                   for quantization, bound in (("fp8", 0.10), ("int8_wo", 0.05))]
QUANTIZED_CASES.append(("gpt_neox_parallel", "int4_wo", 32, 0.25))


@pytest.mark.parametrize("family,quantization,group_size,bound", QUANTIZED_CASES)
def test_quantized_engine_stays_within_the_rounding_bound(family, quantization, group_size, bound, tmp_path):
    """Weights at a trained scale, N(0, 0.02); the engine's logits within ``bound`` (relative) of its
    float32 build and the same argmax at >= 80% of positions: the quantized linears are wired in."""
    from test_fp8_engine import all_logits, build

    hf = tiny_decoder(family)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            is_norm_weight = ("norm" in name or "ln_" in name) and name.endswith("weight")
            p.copy_((1.0 if is_norm_weight else 0.0) + 0.02 * torch.randn_like(p))
    ids = random_tokens(16, seed=5)
    reference = all_logits(build(hf, str(tmp_path / "fp32"), None), ids)
    quantized = all_logits(build(hf, str(tmp_path / quantization), quantization, quant_group_size=group_size), ids)
    error = ((quantized - reference).norm() / reference.norm()).item()
    assert 0 < error < bound, error
    assert (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.8


# ---- ALiBi through the executor: chunked context, prefix reuse, preemption -------------------

@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_batch_with_prefix_reuse_chunks_and_preemption_equals_transformers(family, tmp_path):
    """10 requests, half sharing a 12-token prefix, in a pool of 14 blocks of 4 with 16-token steps:
    prompts are chunked, cached prefixes are reused (their K/V computed under other requests), and the
    pool (room for about one whole sequence) makes max_utilization preempt and recompute; every output
    equals transformers' greedy ids, as the bias depends only on absolute positions."""
    import random
    import sys
    from pathlib import Path

    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "executor"))
    from executor_testing import collect, final_tokens

    hf = tiny_decoder(family)
    engine_dir = make_engine(hf, tmp_path / "engine", tokens_per_block=4, max_seq_len=128)
    rng = random.Random(7)
    shared = [rng.randrange(96) for _ in range(12)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(96) for _ in range(rng.randrange(9, 24))] for i in range(10)]
    config = ExecutorConfig(batch_scheduler_policy="max_utilization", enable_kv_cache_reuse=True,
                            enable_chunked_context=True, max_num_tokens=16, max_tokens_in_paged_kv_cache=14 * 4)
    with Executor(engine_dir, config) as executor:
        ids = executor.enqueue_requests([Request(p, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True))
                                         for p in prompts])
        responses = collect(executor, ids)
        stats = executor.get_latest_iteration_stats()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert [final_tokens(responses[i]) for i in ids] == expected
    assert stats.kv_cache_stats.reused_blocks > 0


# ---- CUDA (the H200 run; skipped here) ----------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_cuda_bf16_prefill_and_graphed_batched_decode_within_the_bf16_bound(family, built, tmp_path):
    """bf16 on CUDA: the Triton kernels (rotary with partial/reordered dims, ALiBi in prefill and in
    the split decode kernel, windows) against transformers' float32 logits within
    test_equivalence.py's bf16 bound, two sequences decoded together through captured CUDA graphs."""
    hf, _ = built(family)
    runner = ModelRunner(make_engine(hf, tmp_path / "bf16", dtype="bfloat16"), device="cuda")
    first, second = random_tokens(48, seed=1), random_tokens(30, seed=2)
    session = PagedSession(runner, num_blocks=64)
    prefill_first, prefill_second = session.step([(0, first[:40]), (1, second[:22])])
    runner.capture_cuda_graphs()
    decoded = [session.step([(0, [first[p]]), (1, [second[p - 18]])]) for p in range(40, 48)]
    actual_first = torch.cat([prefill_first] + [step[0] for step in decoded]).float().cpu()
    actual_second = torch.cat([prefill_second] + [step[1] for step in decoded]).float().cpu()
    for actual, expected in ((actual_first, hf_logits(hf, first)), (actual_second, hf_logits(hf, second))):
        error = (actual - expected).abs().max().item()
        assert error <= 0.15, f"max abs error {error:.3g}"
