"""The embedded default model end to end: GGUF -> engine directory -> greedy tokens equal transformers'."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from engine.executor.runner import ForwardBatch, ModelRunner

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
# The 37-token chat prompt fills 2 of the 16-token blocks and part of the third; token 13 is the first
# computed at a position of a fourth block (48), token 14 the first that attends through it. 20 until
# 2026-11-30: six more steps of each side (~0.1 s each), every one inside blocks already covered.
NUM_TOKENS = 14


def _chat_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _engine_greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    """Greedy decode through the paged cache, one sequence, blocks 0..n-1 in a scrambled order."""
    size = runner.tokens_per_block
    num_blocks = -(-(len(prompt) + steps) // size)
    runner.allocate_kv_cache(num_blocks + 3)
    table = list(reversed(range(3, num_blocks + 3)))
    n = len(prompt)
    logits = runner.forward(ForwardBatch(prompt, list(range(n)), [n], [n], [table[: -(-n // size)]], [n - 1]))
    out = [int(logits[0].argmax())]
    while len(out) < steps:  # (no step after the last token: its logits would be read by nothing)
        n += 1
        logits = runner.forward(ForwardBatch([out[-1]], [n - 1], [1], [n], [table[: -(-n // size)]], [0]))
        out.append(int(logits[0].argmax()))
    return out


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decode with transformers' own KV cache; ignores EOS so both sides run `steps` steps."""
    cache, inputs, out = DynamicCache(), torch.tensor([prompt]), []
    for _ in range(steps):
        logits = model(inputs, past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        inputs = torch.tensor([[out[-1]]])
    return out


def test_engine_directory_has_a_working_tokenizer(smollm2_engine_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_engine_dir)
    ids = _chat_ids(tokenizer)
    assert tokenizer.decode(ids).startswith("<|im_start|>")  # the chat template survived the build
    assert "What is the capital of France?" in tokenizer.decode(ids)
    assert tokenizer.eos_token == "<|im_end|>"


def test_greedy_generation_matches_transformers(smollm2_engine_dir, smollm2_hf):
    hf_model, _ = smollm2_hf
    tokenizer = AutoTokenizer.from_pretrained(smollm2_engine_dir)
    prompt = _chat_ids(tokenizer)
    engine_tokens = _engine_greedy(ModelRunner(smollm2_engine_dir), prompt, NUM_TOKENS)
    assert engine_tokens == _hf_greedy(hf_model, prompt, NUM_TOKENS)
    assert tokenizer.decode(engine_tokens).startswith("The capital of France is Paris.")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_engine_on_cuda_answers_the_question(smollm2_hf, smollm2_gguf, tmp_path):
    """bf16 rounding may change late tokens vs fp32 transformers, so this checks the answer text."""
    from engine.build import build_from_hf
    from engine.config import BuildConfig
    from engine.convert import getter_from_state_dict

    hf_model, tokenizer = smollm2_hf
    build = BuildConfig(dtype="bfloat16", max_seq_len=512, max_input_len=256, tokens_per_block=16)
    get = getter_from_state_dict(hf_model.state_dict(), smollm2_gguf)
    build_from_hf(hf_model.config, get, tokenizer, str(tmp_path), build, progress=False)
    runner = ModelRunner(str(tmp_path), device="cuda")
    prompt = _chat_ids(AutoTokenizer.from_pretrained(str(tmp_path)))
    text = tokenizer.decode(_engine_greedy(runner, prompt, 8))
    assert text.startswith("The capital of France is Paris"), text
