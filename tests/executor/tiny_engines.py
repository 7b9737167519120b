"""The tiny random-weight Llama the executor tests share, built through the real build path. A module
of its own (not conftest.py) so test files can import it by a name no other tests/ folder uses:
`from conftest import ...` found whichever conftest.py came first on sys.path when one pytest command
collected several test folders."""
from __future__ import annotations

import torch
import transformers

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict

VOCAB = 128


def tiny_hf_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A 2-layer GQA Llama with random weights (logits far from ties, so greedy is stable)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_tiny_engine(out_dir, model=None, *, tokens_per_block: int = 4, max_seq_len: int = 128,
                      max_batch_size: int = 16, max_num_tokens: int = 256) -> str:
    model = model if model is not None else tiny_hf_model()
    build = BuildConfig(dtype="float32", max_batch_size=max_batch_size, max_input_len=max_seq_len,
                        max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block)
    build_from_hf(model.config, getter_from_state_dict(model.state_dict(), "tiny"), None, str(out_dir), build,
                  progress=False)
    return str(out_dir)
