"""Tokenizers built here (no download) for the frontend's token-level tests."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Characters outside these merges (CJK, emoji) fall apart into single-byte tokens.
TRAINING_TEXT = "The capital of France is Paris. Café au lait, "


@pytest.fixture(scope="session")
def byte_level_tokenizer():
    """A small byte-level BPE (as GPT-2, Llama 3, SmolLM2): characters outside its merges are
    split into single-byte tokens, so multi-byte characters span several tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([TRAINING_TEXT] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


@pytest.fixture(scope="session")
def metaspace_tokenizer():
    """A SentencePiece-style BPE ("▁" marks a word start; the decoder drops the sequence's first
    space), with byte fallback off: what Llama 2 / Mistral tokenizers decode like."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    core.train_from_iterator([TRAINING_TEXT + "and a few more words"] * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
