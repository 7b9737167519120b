"""Tiny random T5 (v1.0: ReLU, tied heads; v1.1: gated GELU, untied), BART and Whisper checkpoints
made by transformers, with a word-level tokenizer (T5's ids: <pad> 0, </s> 1, <unk> 2; a T5-style
post-processor appends </s>; Whisper's prompt tokens at 17..20, <|startofprev|> 12 and a second
language <|de|> 15, ids T5's tests send only as ids) and, for Whisper, a feature
extractor of 8 mel bins over 1-s windows (100 frames). No network: everything is made here.
Shared by the engine and integration tests."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import word_level_tokenizer

WORDS = ["<pad>", "</s>", "<unk>", "<s>", "translate", "English", "to", "German:", "This", "is", "good",
         "Summarize:", "<|startofprev|>", "news", "Das", "<|de|>", "gut.", "<|startoftranscript|>", "<|en|>",
         "<|transcribe|>", "<|notimestamps|>"]
VOCAB = 64  # WORDS, then filler words w21 .. w63
FAMILIES = ("t5_v1_0", "t5_v1_1", "bart")  # text-to-text; "whisper" is built apart
WHISPER_PROMPT = [17, 18, 19, 20]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
START_OF_PREV, GERMAN = 12, 15  # <|startofprev|> (OpenAI's previous-text prompt), <|de|>
TIMESTAMP_BEGIN = 21  # <|notimestamps|> + 1: the first timestamp token
MEL_BINS, WINDOW_FRAMES = 8, 100
# Encoder inputs of 8, 4 and 15 tokens (the engine and the served tests)
INPUTS = [[4, 5, 6, 7, 8, 9, 10, 1], [11, 12, 13, 1], list(range(20, 34)) + [1]]


def tokenizer():
    from tokenizers import processors

    return word_level_tokenizer(WORDS, VOCAB, processors.TemplateProcessing(single="$A </s>",
                                                                            special_tokens=[("</s>", 1)]),
                                additional_special_tokens=[WORDS[i] for i in WHISPER_PROMPT + [START_OF_PREV, GERMAN]])


def hf_model(family: str, seed: int | None = None):
    """A transformers model of ``family`` with weights drawn wide enough (std 0.5; norms left at
    1 / 0) that greedy decoding does not settle on one token at once."""
    import transformers

    torch.manual_seed((1 if family == "bart" else 0) if seed is None else seed)  # (seeds whose greedy ids vary)
    if family.startswith("t5"):
        gated = family == "t5_v1_1"
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(config)
    elif family == "whisper":
        config = transformers.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
            max_source_positions=WINDOW_FRAMES // 2, max_target_positions=40, pad_token_id=0, bos_token_id=17,
            eos_token_id=1, decoder_start_token_id=17)
        model = transformers.WhisperForConditionalGeneration(config)
        # Whisper's generation config: timestamp tokens are the ids after <|notimestamps|> (20), 21..63
        # (0.00 .. 0.84 s); the first within 5 steps; nothing suppressed (the defaults name ids of the
        # real 51k vocabulary)
        for name, value in dict(no_timestamps_token_id=20, max_initial_timestamp_index=5, is_multilingual=True,
                                lang_to_id={"<|en|>": 18, "<|de|>": GERMAN}, task_to_id={"transcribe": 19},
                                prev_sot_token_id=START_OF_PREV, suppress_tokens=None,
                                begin_suppress_tokens=None).items():
            setattr(model.generation_config, name, value)  # (update() sets only attributes it already has)
    else:
        config = transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
            forced_eos_token_id=None, pad_token_id=0, eos_token_id=1, bos_token_id=3, decoder_start_token_id=1)
        model = transformers.BartForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(std=0.5)
        if family == "bart":
            model.final_logits_bias.normal_(std=0.5)
    return model.eval()


def feature_extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=16000, hop_length=160, chunk_length=1,
                                   n_fft=400)


def write_checkpoint(family: str, path: Path):
    """Save ``family``'s model and the tokenizer (Whisper: and its feature extractor) to ``path``;
    returns the model."""
    model = hf_model(family)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    if family == "whisper":
        feature_extractor().save_pretrained(path)
    return model


def build_engine(root: Path, *limits: str) -> None:
    """engine.build of ``root``/checkpoint into ``root``/engine (encoder/ and decoder/): float32, pages of 4 tokens,
    batches of 4, plus ``limits`` (e.g. --max_seq_len)."""
    from engine.build import main

    assert main(["--checkpoint", str(root / "checkpoint"), "--output", str(root / "engine"), "--dtype", "float32",
                 "--tokens_per_block", "4", "--max_batch_size", "4", *limits]) == 0


def generate_whisper(model, features: torch.Tensor, max_new_tokens: int, prompt: list[int] = WHISPER_PROMPT,
                     eos: int | None = 1) -> list[int]:
    """transformers' greedy ids after ``prompt`` for (frames, mel bins) ``features``, through the
    generic generate (Whisper's own adds its language and timestamp logic around the same loop)."""
    from transformers import GenerationMixin

    out = GenerationMixin.generate(model, input_features=features.t().unsqueeze(0),
                                   decoder_input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                   do_sample=False, num_beams=1, eos_token_id=eos, min_length=0,
                                   forced_decoder_ids=None, suppress_tokens=None, begin_suppress_tokens=None)
    return out[0, len(prompt):].tolist()


def generate(model, encoder_ids: list[int], max_new_tokens: int, decoder_prompt: list[int] | None = None,
             eos: int | None = 1) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ids (the decoder prompt included) and raw logits per generated token."""
    kwargs = {} if decoder_prompt is None else {"decoder_input_ids": torch.tensor([decoder_prompt])}
    out = model.generate(torch.tensor([encoder_ids]), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                         eos_token_id=eos, min_length=0, forced_bos_token_id=None, forced_eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0].tolist(), torch.stack(out.logits)[:, 0]
