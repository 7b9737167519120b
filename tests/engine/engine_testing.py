"""Tiny random-weight Hugging Face models of every supported family, and a paged-cache driver.

``tiny_hf(family)`` builds a transformers model (fp32, eager attention, every weight random
including norms and biases, so no term of the math can hide behind an init of 0 or 1).
``make_engine(hf, tmp, tokens_per_block=16, dtype="float32", tp_size=1, quantization=None,
group_size=None)`` converts it to an engine directory through the real build path.
``PagedSession`` feeds a ModelRunner step by step from shuffled (non-contiguous) KV blocks, the
way the executor does. ``assert_tp2_matches_tp1``
(or ``assert_tp2_engines_match_tp1`` for engines already built) runs engines on two gloo ranks
(gloo_ranks.py's pair, which the tests of one process share) against their TP 1 logits.
"""
from __future__ import annotations

import os
import random

import torch
import transformers
from safetensors.torch import load_file

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict
from engine.executor.runner import ForwardBatch, ModelRunner

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

# Widths that divide by 32 (intermediate 128: 64 a rank at tp 2), for grouped integer weights.
GROUPABLE = {**_COMMON, "intermediate_size": 128}

_ODD = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=86, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def _factors(n: int, scale: float) -> list[float]:
    """LongRoPE per-frequency factors: n distinct values around ``scale``."""
    return [scale * (1.0 + 0.25 * i) for i in range(n)]


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, rope_theta=10000.0),
    "llama3_rope_scaling": lambda: transformers.LlamaConfig(
        **_COMMON, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, rope_theta=10000.0, sliding_window=None),
    "qwen2_qkv_bias": lambda: transformers.Qwen2Config(**_COMMON, rope_theta=1000000.0),
    "smollm2_tied": lambda: transformers.LlamaConfig(
        **{**_COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},
        tie_word_embeddings=True,
    ),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    # Odd sizes (head_dim 14, hidden 70, intermediate 86), GQA 6/2, 3 layers for the families below.
    "qwen3": lambda: transformers.Qwen3Config(**_ODD, head_dim=14, rope_theta=1000000.0),
    # Engines of max_seq_len <= original_max_position_embeddings take the short factors, as transformers
    # does for such sequences; test_model_families.py covers the long ones.
    "phi3_longrope": lambda: transformers.Phi3Config(
        **{**_ODD, "max_position_embeddings": 1024}, original_max_position_embeddings=256, pad_token_id=0,
        rope_scaling={"rope_type": "longrope", "short_factor": _factors(6, 1), "long_factor": _factors(6, 2)},
    ),
    "phi4_mini_partial_rotary": lambda: transformers.Phi3Config(
        **_ODD, partial_rotary_factor=0.5, tie_word_embeddings=True, pad_token_id=0,  # rotary dims 6 of 12 (hidden 72 / 6 heads)
    ),
    "smollm3_nope": lambda: transformers.SmolLM3Config(**_ODD, no_rope_layers=[1, 0, 1], pad_token_id=0),
    "llama_yarn": lambda: transformers.LlamaConfig(
        **_ODD, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "llama_dynamic_ntk": lambda: transformers.LlamaConfig(
        **_ODD, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    ),
    # 8 experts of width 36, top-2: a decode token leaves at least 6 experts without a token.
    "mixtral": lambda: transformers.MixtralConfig(**{**_COMMON, "intermediate_size": 36}, rope_theta=1000000.0,
                                                  num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    # 10 experts of width 22, top-2 without renormalisation, q/k RMSNorm; layer 1 dense (mlp_only_layers).
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_ODD, head_dim=14, rope_theta=1000000.0, num_experts=10,
                                                     num_experts_per_tok=2, moe_intermediate_size=22,
                                                     norm_topk_prob=False, mlp_only_layers=[1]),
    # 12 experts of width 32, top-4 with biases and a clamp low enough to bite (0.5), sinks, a window of
    # 6 on layer 0 (layer 1 full), yarn without truncation (gpt-oss's rope), q/k/v and o_proj biases.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**_COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=12, num_experts_per_tok=4,
        swiglu_limit=0.5, sliding_window=6, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
}
# Configs beyond the families every family test runs: tiny_hf builds them too.
EXTRA_CONFIGS = {"llama_groupable": lambda: transformers.LlamaConfig(**GROUPABLE, rope_theta=10000.0),
                 # Widths in multiples of 16 (q 64, k/v 32 each): what LoRA's CUDA kernels take.
                 "qwen3_aligned": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16, rope_theta=1000000.0),
                 # Llama 4 text, 4 layers: rope layers 0 and 2 in chunks of 8 positions, NoPE layers 1 and 3
                 # (temperature tuning biting at these lengths) with MoE (4 experts, top-1), dense 0 and 2.
                 "llama4": lambda: transformers.Llama4TextConfig(
                     **{**_COMMON, "num_hidden_layers": 4, "intermediate_size": 32}, intermediate_size_mlp=96,
                     head_dim=16, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                     attention_chunk_size=8, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.1)}
ARCHITECTURES = {"gpt2": transformers.GPT2LMHeadModel, "mistral": transformers.MistralForCausalLM,
                 "qwen2_qkv_bias": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                 "qwen3_aligned": transformers.Qwen3ForCausalLM,
                 "phi3_longrope": transformers.Phi3ForCausalLM, "phi4_mini_partial_rotary": transformers.Phi3ForCausalLM,
                 "smollm3_nope": transformers.SmolLM3ForCausalLM, "mixtral": transformers.MixtralForCausalLM,
                 "qwen3_moe": transformers.Qwen3MoeForCausalLM, "gpt_oss": transformers.GptOssForCausalLM,
                 "llama4": transformers.Llama4ForCausalLM}


# The KV pool of an Executor made by a test. Without a token bound an executor on CUDA takes 90% of
# the free GPU memory, as a served one does: for these tiny models tens of millions of blocks (a
# Python object each in the block manager) and nothing left for a second pytest worker on the GPU.
# On CPU the default would be max_batch_size x max_seq_len (1,024 tokens for make_engine's engines).
EXECUTOR_POOL = {"max_tokens_in_paged_kv_cache": 4096}


def random_tokens(n: int, seed: int) -> list[int]:
    """n token ids below VOCAB, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def tiny_hf(family: str, seed: int = 0) -> torch.nn.Module:
    config = (FAMILIES | EXTRA_CONFIGS)[family]()
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the per-expert loop: grouped_mm needs 16-byte-aligned widths
    torch.manual_seed(seed)
    model = ARCHITECTURES.get(family, transformers.LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights around 1, everything else small: random but well-conditioned logits.
            base = 1.0 if ("norm" in name or "ln_" in name) and name.endswith("weight") else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return model


def make_engine(hf_model, out_dir, *, tokens_per_block=16, dtype="float32", tp_size=1, max_seq_len=256,
                quantization=None, group_size=None, moe_ep_size=1) -> str:
    build = BuildConfig(dtype=dtype, max_batch_size=4, max_input_len=max_seq_len, max_seq_len=max_seq_len,
                        max_num_tokens=1024, tokens_per_block=tokens_per_block, tp_size=tp_size,
                        quantization=quantization, quant_group_size=group_size)
    get = getter_from_state_dict(hf_model.state_dict(), "tiny")
    build_from_hf(hf_model.config, get, None, str(out_dir), build, progress=False, moe_ep_size=moe_ep_size)
    return str(out_dir)


def assert_directory_build_equals(hf_model, memory_engine_dir: str, tmp_path) -> str:
    """``hf_model.save_pretrained`` then `python -m engine.build --checkpoint --output` (its ``main``, float32):
    the engine's tensors equal the in-memory build's at ``memory_engine_dir``. Returns the directory-built engine."""
    from safetensors.torch import load_file

    from engine.build import main

    hf_model.save_pretrained(tmp_path / "ckpt")
    assert main(["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "engine"),
                 "--dtype", "float32"]) == 0
    from_disk = load_file(tmp_path / "engine" / "rank0.safetensors")
    from_memory = load_file(f"{memory_engine_dir}/rank0.safetensors")
    assert set(from_disk) == set(from_memory)
    assert all(torch.equal(from_disk[name], from_memory[name]) for name in from_disk)
    return str(tmp_path / "engine")


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits (len(token_ids), vocab) for one sequence."""
    follow_config_swiglu_limit(hf_model)
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def follow_config_swiglu_limit(hf_model) -> None:
    """Make transformers' gpt-oss experts clamp at ``config.swiglu_limit``, as recent releases do
    (5.24, CI's). Older ones (5.17, the GPU machine's) fix the clamp at gpt-oss's 7.0 and ignore the
    config, so with the tiny config's 0.5 (low enough to bite) they compute another model: every
    gpt-oss comparison failed there by ~1.8 in the logits, with nothing wrong in the engine."""
    limit = getattr(hf_model.config, "swiglu_limit", None)
    if limit is None:
        return
    for module in hf_model.modules():
        if type(module).__name__ == "GptOssExperts" and getattr(module, "limit", limit) != limit:
            module.limit = limit


class PagedSession:
    """Drives a ModelRunner over several sequences with per-sequence block tables.

    Blocks are handed out from a shuffled free list, so a sequence's blocks are scattered
    across the pool and attention must really go through the block table.
    """

    def __init__(self, runner: ModelRunner, num_blocks: int = 64, seed: int = 0):
        self.runner = runner
        runner.allocate_kv_cache(num_blocks)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _reserve(self, seq: int, new_len: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.runner.tokens_per_block < new_len:
            table.append(self.free.pop())
        return table

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one packed forward of (seq_id, new tokens) chunks; logits (len(tokens), vocab) per chunk."""
        token_ids, positions, seq_lens, context_lens, tables = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            token_ids += tokens
            positions += range(start, start + len(tokens))
            seq_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
            tables.append(list(self._reserve(seq, start + len(tokens))))
            self.lengths[seq] = start + len(tokens)
        # Every row requested through logits_indices (not all_logits), so decode-only steps may take
        # the runner's CUDA-graph path when graphs were captured.
        batch = ForwardBatch(token_ids, positions, seq_lens, context_lens, tables, list(range(len(token_ids))))
        logits = self.runner.forward(batch)
        return list(logits.split(seq_lens))




def assert_cuda_steps_equal_transformers(hf_model, engine_dir: str, tolerance: float = 1e-3) -> None:
    """The engine on CUDA with its decode graphs captured: an 11-token prompt, eight decode steps
    (graph replays), then a packed step of a 40-token prompt beside a decode row; every row's
    logits within ``tolerance`` of transformers' (float32 engines: IEEE dots in the Triton kernels)."""
    runner = ModelRunner(engine_dir, device="cuda")
    session = PagedSession(runner, num_blocks=64)
    runner.capture_cuda_graphs()
    sequence, other = random_tokens(11 + 8, seed=4), random_tokens(40, seed=5)
    expected = hf_logits(hf_model, sequence)
    (prefill,) = session.step([(0, sequence[:11])])
    assert (prefill.cpu() - expected[:11]).abs().max().item() <= tolerance
    for pos in range(11, 19):
        (decode,) = session.step([(0, [sequence[pos]])])
        assert (decode.cpu() - expected[pos:pos + 1]).abs().max().item() <= tolerance
    outs = session.step([(1, other), (0, [7])])
    assert (outs[0].cpu() - hf_logits(hf_model, other)).abs().max().item() <= tolerance
    assert (outs[1].cpu() - hf_logits(hf_model, sequence + [7])[-1:]).abs().max().item() <= tolerance


def cuda_graph_steps_logits(engine_dir: str, ids: list[int], prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine on CUDA with its decode graphs captured, as the quantized engines' tests drive it against their
    float32 engine on CPU: ``ids[:prompt]`` as a prompt, the rest of ``ids`` one decode step each (graph replays),
    then a packed step of another sequence's prompt ``ids[:9]`` beside a decode row of token 7. Returns
    (sequence 0's logits (len(ids) + 1, vocab): the all_logits rows of ``ids + [7]``; the packed prompt's (9, vocab)),
    float32 on the CPU."""
    runner = ModelRunner(engine_dir, device="cuda")
    session = PagedSession(runner, num_blocks=32)
    runner.capture_cuda_graphs()
    rows = list(session.step([(0, ids[:prompt])])[0].float().cpu())
    for pos in range(prompt, len(ids)):
        rows.append(session.step([(0, [ids[pos]])])[0][0].float().cpu())
    other = session.step([(1, ids[:9]), (0, [7])])
    rows.append(other[1][0].float().cpu())
    return torch.stack(rows), other[0].float().cpu()


def assert_same_engine_tensors(engine_dir: str, expected_dir: str) -> None:
    """Two engine directories' rank0.safetensors hold the same names, each tensor of the same dtype and shape and
    the same bytes (a comparison that holds for FP8 codes and integer codes alike)."""
    got, expected = (load_file(os.path.join(d, "rank0.safetensors")) for d in (engine_dir, expected_dir))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def tp_rank_logits(rank: int, engine_dirs: dict) -> dict:
    """One rank's job of the gloo tensor-parallel test (gloo_ranks.py's shared pair): each tp 2
    engine's tp_reference_steps logits on this rank, by name."""
    import torch.distributed as dist

    return {name: tp_reference_steps(ModelRunner(engine_dir, rank=rank, tp_group=dist.group.WORLD))
            for name, engine_dir in engine_dirs.items()}


def tp_reference_steps(runner: ModelRunner) -> torch.Tensor:
    """A prefill of two sequences, then a mixed chunk + decode step; all new-token logits, stacked."""
    rng = random.Random(11)
    a, b = [rng.randrange(VOCAB) for _ in range(9)], [rng.randrange(VOCAB) for _ in range(14)]
    session = PagedSession(runner, num_blocks=16)
    first = session.step([(0, a[:6]), (1, b[:13])])
    second = session.step([(0, a[6:]), (1, b[13:])])
    return torch.cat(first + second)


def assert_tp2_matches_tp1(hf_models: dict, tmp_path) -> None:
    """Each model's engine at TP 2 over gloo (two ranks) gives its TP 1 logits within 1e-5
    on both ranks, over tp_reference_steps' prefill and mixed chunk + decode step."""
    engines = {family: (make_engine(hf, tmp_path / f"{family}-tp1"),
                        make_engine(hf, tmp_path / f"{family}-tp2", tp_size=2)) for family, hf in hf_models.items()}
    assert_tp2_engines_match_tp1(engines, tmp_path)


def assert_tp2_engines_match_tp1(engines: dict[str, tuple[str, str]], tmp_path) -> None:
    """name -> (tp 1 engine dir, tp 2 engine dir): the tp 2 engine on two gloo ranks (this test
    process's shared pair, gloo_ranks.py) gives the tp 1 engine's logits within 1e-5 on both ranks,
    over tp_reference_steps."""
    from gloo_ranks import shared_pair

    expected = {name: tp_reference_steps(ModelRunner(tp1)) for name, (tp1, _) in engines.items()}
    tp2_dirs = {name: tp2 for name, (_, tp2) in engines.items()}
    ranks = shared_pair().run(tp_rank_logits, tp2_dirs)
    for name, reference in expected.items():
        for rank in range(2):
            error = (ranks[rank][name] - reference).abs().max().item()
            assert error <= 1e-5, f"{name} rank {rank}: max abs error {error:.3g} vs tp 1"
