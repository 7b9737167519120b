"""A model whose every layer has a sliding window (Mistral) through the executor: its outputs equal
transformers', and the KV blocks that fall out of the window go back to the pool while it runs.

Window 8 tokens, blocks of 4: a sequence needs at most 3 blocks inside its window (plus the one
the step in flight still has to register), however long it grows. Prefix reuse, chunked context,
preemption and multi-sequence requests (which keep their blocks) must stay correct beside it.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers
from executor_testing import collect, final_tokens

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict
from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import OutputConfig, Request, SamplingConfig

VOCAB, WINDOW, BLOCK = 128, 8, 4


@pytest.fixture(scope="module")
def mistral() -> transformers.MistralForCausalLM:
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        sliding_window=WINDOW)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def engine_dir(mistral, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("mistral_window")
    build = BuildConfig(dtype="float32", max_batch_size=8, max_input_len=128, max_seq_len=128, max_num_tokens=128,
                        tokens_per_block=BLOCK)
    build_from_hf(mistral.config, getter_from_state_dict(mistral.state_dict(), "tiny"), None, str(out), build,
                  progress=False)
    return str(out)


@torch.no_grad()
def greedy_reference(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward over the whole sequence (no cache)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def _request(prompt, max_tokens, **sampling) -> Request:
    return Request(prompt, max_tokens, output=OutputConfig(exclude_input_from_output=True),
                   sampling=SamplingConfig(**sampling))


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(9, 30))] for _ in range(count)]


def test_long_sequence_equals_transformers_and_holds_only_its_window(mistral, engine_dir):
    prompt = _prompts(1, 1)[0] + [5] * 10  # 30+ tokens, then 24 generated: far past the window
    with Executor(engine_dir, ExecutorConfig(enable_kv_cache_reuse=False)) as executor:
        [request_id] = executor.enqueue_requests([_request(prompt, 24)])
        tokens = final_tokens(collect(executor, [request_id])[request_id])
        history = executor.get_iteration_stats_history()
        freed = executor.scheduler.num_window_freed_blocks
        final = executor.get_latest_iteration_stats().kv_cache_stats
    assert tokens == greedy_reference(mistral, prompt, 24)
    total_blocks = -(-(len(prompt) + 24) // BLOCK)
    assert freed >= total_blocks - 4
    # Decode steps after the prefill hold the window's 3 blocks, plus 1 not yet registered... at
    # most 4, never the sequence's whole length.
    decode_steps = [s for s in history if s.num_gen_requests and not s.num_context_requests]
    assert decode_steps and max(s.kv_cache_stats.used_num_blocks for s in decode_steps[1:]) <= 4
    assert final.free_num_blocks == final.max_num_blocks  # everything back at the end


def _batched_prompts() -> list[list[int]]:
    """12 prompts, every other one after a shared 12-token prefix."""
    shared = _prompts(2, 1)[0][:12]
    return [(shared if i % 2 else []) + p for i, p in enumerate(_prompts(3, 12))]


@pytest.fixture(scope="module")
def batched_references(mistral) -> list[list[int]]:
    """transformers' 12 greedy tokens of each batched prompt, once for the four cases below (each case
    computed them again until 2026-11-30: 144 uncached forwards of growing length a case)."""
    return [greedy_reference(mistral, p, 12) for p in _batched_prompts()]


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize("reuse", [False, True])
def test_batched_with_reuse_chunks_and_preemption_equals_transformers(batched_references, engine_dir, policy, reuse):
    """12 requests (some sharing a 12-token prefix) in a pool of 12 blocks with chunked context:
    reuse hits, preemption (max_utilization) and window freeing all happen, outputs stay exact."""
    prompts = _batched_prompts()
    config = ExecutorConfig(batch_scheduler_policy=policy, enable_kv_cache_reuse=reuse, enable_chunked_context=True,
                            max_num_tokens=16, max_tokens_in_paged_kv_cache=12 * BLOCK)
    with Executor(engine_dir, config) as executor:
        ids = executor.enqueue_requests([_request(p, 12) for p in prompts])
        responses = collect(executor, ids)
        stats = executor.get_latest_iteration_stats()
        freed = executor.scheduler.num_window_freed_blocks
    assert [final_tokens(responses[i]) for i in ids] == batched_references
    assert freed > 0
    assert stats.kv_cache_stats.free_num_blocks == stats.kv_cache_stats.max_num_blocks
    if reuse:
        assert stats.kv_cache_stats.reused_blocks > 0


def test_multi_sequence_requests_keep_their_blocks_and_stay_correct(mistral, engine_dir):
    """num_return_sequences 2 shares the prompt blocks between the two sequences: no freeing there."""
    prompt = _prompts(4, 1)[0] + [9] * 12
    with Executor(engine_dir, ExecutorConfig()) as executor:
        [request_id] = executor.enqueue_requests([_request(prompt, 10, num_return_sequences=2)])
        responses = collect(executor, [request_id], streams={request_id: 2})[request_id]
        freed = executor.scheduler.num_window_freed_blocks
        final = executor.get_latest_iteration_stats().kv_cache_stats
    expected = greedy_reference(mistral, prompt, 10)
    outputs = {r.result.sequence_index: r.result.output_token_ids[0] for r in responses if r.result.is_final}
    assert outputs == {0: expected, 1: expected}
    assert freed == 0
    assert final.free_num_blocks == final.max_num_blocks
