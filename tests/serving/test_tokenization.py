import os

import pytest

from serving.tokenization import (REPLACEMENT_CHAR, DecodeWindow, TextDeltas, Utf8Holdback, decode_tokens,
                                  first_token_id)

TEXTS = ["中文 emoji 😀 ok", "Paris 🇫🇷 is the capital. 東京は日本の首都です。", "plain ascii, no surprises",
         "👩‍👩‍👧 family; naïve café"]


def stream_in_chunks(tokenizer, ids, chunk):
    holdback = Utf8Holdback(lambda t: tokenizer.decode(t, skip_special_tokens=False))
    pieces = []
    for start in range(0, len(ids), chunk):
        ready = holdback.push(ids[start:start + chunk])
        if ready:
            pieces.append(decode_tokens(tokenizer, ready))
    pieces.append(decode_tokens(tokenizer, holdback.flush()))
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_holdback_chunks_never_break_or_drop_characters(smollm2_tokenizer, text, chunk):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    pieces = stream_in_chunks(smollm2_tokenizer, ids, chunk)
    assert "".join(pieces) == decode_tokens(smollm2_tokenizer, ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_plain_per_token_decoding_would_break_the_emoji(smollm2_tokenizer):
    # The reason for the holdback: the emoji spans two byte-level tokens.
    ids = smollm2_tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2
    assert all(REPLACEMENT_CHAR in smollm2_tokenizer.decode([i]) for i in ids)


def test_holdback_releases_invalid_bytes_instead_of_stalling():
    holdback = Utf8Holdback(lambda ids: REPLACEMENT_CHAR)
    assert holdback.push([1, 2]) == []
    assert holdback.push(list(range(3, 12))) == list(range(1, 12))
    assert holdback.flush() == []


def test_text_deltas_hold_back_unfinished_characters():
    deltas = TextDeltas()
    assert deltas.update("Hi") == "Hi"
    assert deltas.update("Hi " + REPLACEMENT_CHAR) == " "
    assert deltas.update("Hi 😀!") == "😀!"
    assert deltas.update("Hi 😀!" + REPLACEMENT_CHAR, is_final=True) == REPLACEMENT_CHAR
    assert deltas.emitted_chars == len("Hi 😀!" + REPLACEMENT_CHAR)


def test_special_token_ids(smollm2_tokenizer):
    assert first_token_id(smollm2_tokenizer, smollm2_tokenizer.eos_token) == 2
    assert first_token_id(smollm2_tokenizer, smollm2_tokenizer.pad_token) is not None
    ids = smollm2_tokenizer.encode("Paris", add_special_tokens=False) + [2]
    assert decode_tokens(smollm2_tokenizer, ids) == "Paris"
    assert decode_tokens(smollm2_tokenizer, ids, skip_special_tokens=False).endswith("<|im_end|>")


from hypothesis import assume, example, given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
       chunk=st.integers(min_value=1, max_value=4))
@example(text="a \ufffd b", chunk=1)  # U+FFFD in the text itself: it round-trips and streams back
def test_any_text_streams_back_exactly(smollm2_tokenizer, text, chunk):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    whole = decode_tokens(smollm2_tokenizer, ids)
    # Text the tokenizer itself cannot round-trip decodes to invalid bytes; no chunking can
    # promise anything there, so the property covers every text that round-trips.
    assume(whole == text)
    pieces = stream_in_chunks(smollm2_tokenizer, ids, chunk)
    assert "".join(pieces) == text
    # no piece ends inside a character: every U+FFFD sent is one of the text's own (hypothesis draws it too)
    assert sum(piece.count(REPLACEMENT_CHAR) for piece in pieces) == text.count(REPLACEMENT_CHAR)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_window_adds_up_to_the_whole_decode_and_stays_short(smollm2_tokenizer, text):
    """Token by token through DecodeWindow (what the BLS and the OpenAI frontend stream with): the
    pieces add up to the whole decode, no piece holds a broken character, and no step decodes more
    than a few ids however long the sequence grows."""
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False) * 8
    window, pieces, longest = DecodeWindow(), [], 0
    for token in ids:
        window.extend([token])
        head, current = window.windows()
        longest = max(longest, len(current))
        pieces.append(window.advance(decode_tokens(smollm2_tokenizer, head), decode_tokens(smollm2_tokenizer, current)))
    assert "".join(pieces) == decode_tokens(smollm2_tokenizer, ids)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert longest <= 8 < len(ids)  # a split character's few pieces plus one id of context


def test_a_plain_fast_tokenizer_loads_as_auto_tokenizer_would_and_without_torch(smollm2_tokenizer_dir, tmp_path):
    """load_tokenizer's shortcut for a folder whose tokenizer_config.json names TokenizersBackend (the
    default engine's): AutoTokenizer's class, settings and ids; a config.json with a model type takes
    AutoTokenizer's path; and the stubs import no torch (2-3 s of CPU each at every server start):
    preprocessing and postprocessing only tokenize, the BLS only routes, and tensorrt_llm's executor
    runs in its engine process; nor does the OpenAI frontend's start (its vision-encoder lookup)."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from serving.tokenization import _plain_fast_tokenizer, load_tokenizer

    assert _plain_fast_tokenizer(smollm2_tokenizer_dir)
    fast = load_tokenizer(smollm2_tokenizer_dir)
    auto = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir, legacy=False, padding_side="left",
                                         trust_remote_code=True)
    auto.pad_token = auto.pad_token or auto.eos_token
    assert type(fast) is type(auto) and fast.init_kwargs == auto.init_kwargs
    assert (fast.special_tokens_map, fast.pad_token_id, fast.padding_side) == \
        (auto.special_tokens_map, auto.pad_token_id, auto.padding_side)
    for text in TEXTS + ["<|im_start|>user\nHi<|im_end|>\n", "  two  spaces\tand a tab"]:
        ids = auto.encode(text)
        assert fast.encode(text) == ids and fast.decode(ids) == auto.decode(ids)
        assert fast.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    checkpoint = Path(shutil.copytree(smollm2_tokenizer_dir, tmp_path / "checkpoint"))
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not _plain_fast_tokenizer(str(checkpoint))  # AutoTokenizer may pick the model type's class

    root = Path(__file__).resolve().parents[2]
    check = ("import sys; from serving.tokenization import load_tokenizer; "
             f"load_tokenizer({smollm2_tokenizer_dir!r}); import serving.bls, serving.responses, serving.text, "
             "serving.cancellation, serving.params, serving.multimodal, serving.inflight, serving.metrics, "
             "serving.executor_config, serving.server_stop, serving.shared_engine, engine.executor.engine_process, "
             "engine.executor.executor_config, engine.tensor_parallel.rank_info; "
             f"from openai_frontend.repository import vision_settings; vision_settings(None, {smollm2_tokenizer_dir!r}); "
             "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_tensorrt_llm_stubs_holdback_decoder_needs_no_transformers(smollm2_tokenizer_dir, smollm2_tokenizer, tmp_path):
    """holdback_decoder_for: a plain fast tokenizer's folder decodes with the tokenizers library alone, the
    same text as holdback_decoder(load_tokenizer(...)) (transformers' import is ~0.5 CPU-s of every
    tensorrt_llm stub's start); a tokenizer_config.json adding a token tokenizer.json lacks loads as before."""
    import json
    import random
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from serving.tokenization import holdback_decoder, holdback_decoder_for

    fast, ref = holdback_decoder_for(smollm2_tokenizer_dir), holdback_decoder(smollm2_tokenizer)
    rng = random.Random(0)
    cases = [smollm2_tokenizer.encode(text) for text in TEXTS] + [
        [rng.randrange(len(smollm2_tokenizer)) for _ in range(rng.randint(1, 6))] for _ in range(300)]
    for ids in cases + [ids[:cut] for ids in cases[:len(TEXTS)] for cut in range(1, len(ids))]:
        assert fast(ids) == ref(ids), ids

    extra = Path(shutil.copytree(smollm2_tokenizer_dir, tmp_path / "extra"))
    config = json.loads((extra / "tokenizer_config.json").read_text())
    new_id = len(smollm2_tokenizer)
    config["added_tokens_decoder"] = {str(new_id): {"content": "<extra_tok>", "special": False}}
    (extra / "tokenizer_config.json").write_text(json.dumps(config))
    assert "<extra_tok>" in holdback_decoder_for(str(extra))([new_id])

    root = Path(__file__).resolve().parents[2]
    check = (f"import sys; from serving.tokenization import holdback_decoder_for; holdback_decoder_for({smollm2_tokenizer_dir!r}); "
             "assert 'transformers' not in sys.modules, 'transformers was imported'")
    run = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]


def _eligible_copy(smollm2_tokenizer_dir, folder, **settings):
    """A copy of the default model's tokenizer folder with ``settings`` written into tokenizer_config.json."""
    import json
    import shutil
    from pathlib import Path

    folder = Path(shutil.copytree(smollm2_tokenizer_dir, folder))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **settings}, ensure_ascii=False), encoding="utf-8")
    return str(folder)


def test_the_text_models_tokenizer_answers_as_load_tokenizers_without_transformers(smollm2_tokenizer_dir, tmp_path):
    """load_text_tokenizer (the preprocessing and postprocessing stubs'): for a folder whose tokenizer.json
    TokenizersBackend runs unchanged (the default engine's, also with tokenizer.json's own added tokens
    listed in added_tokens_decoder as save_pretrained writes them and two of its special tokens as
    extra_special_tokens, as the tiny LLaVA, T5 and Whisper folders list theirs), the tokenizers library alone gives
    load_tokenizer's ids, texts, tokens, special tokens and vocabulary sizes, through the serving.text
    functions those stubs call, and imports no transformers (~1 CPU-s of each of those stubs' starts); a
    folder TokenizersBackend would change (add_bos_token, a special token, an extra special token or an
    added token tokenizer.json lacks) gets load_tokenizer's tokenizer."""
    import json
    import random
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from serving.plain_tokenizer import PlainTokenizer
    from serving.text import decode_batch, embedding_bias_tensor, encode_queries, word_list_tensor
    from serving.tokenization import load_text_tokenizer, load_tokenizer

    saved = json.loads((Path(smollm2_tokenizer_dir) / "tokenizer.json").read_text())["added_tokens"]
    listed = _eligible_copy(smollm2_tokenizer_dir, tmp_path / "listed", added_tokens_decoder={
        str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in saved},
        extra_special_tokens=[saved[3]["content"], saved[4]["content"]], processor_class="LlavaProcessor")
    texts = TEXTS + ["<|im_start|>user\nHi<|im_end|>\n", "  two  spaces\tand a tab", "", "<|endoftext|>x<|im_end|>"]
    rng = random.Random(0)
    for folder in (smollm2_tokenizer_dir, listed):
        plain, ref = load_text_tokenizer(folder), load_tokenizer(folder)
        assert type(plain) is PlainTokenizer
        assert [getattr(plain, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")] == \
            [getattr(ref, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")]
        assert (plain.vocab_size, len(plain)) == (ref.vocab_size, len(ref))
        for text in texts:
            for special in (True, False):
                assert plain.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
        cases = [ref.encode(text) for text in texts] + [
            [rng.randrange(len(ref)) for _ in range(rng.randint(1, 6))] for _ in range(200)] + [[0, 1, 2, 5, 2]]
        for ids in cases:
            for skip in (True, False):
                assert decode_tokens(plain, ids, skip) == decode_tokens(ref, ids, skip), ids
            assert plain.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
        queries = np.array([[text.encode()] for text in texts], dtype=object)
        for got, want in zip(encode_queries(plain, queries, True, 2), encode_queries(ref, queries, True, 2)):
            np.testing.assert_array_equal(got, want)
        words = np.array([[b"Paris", b"<|im_end|>"], [b"\xf0\x9f\x98\x80", b""]], dtype=object)
        np.testing.assert_array_equal(word_list_tensor(plain, words, 2), word_list_tensor(ref, words, 2))
        weights = np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32)
        np.testing.assert_array_equal(embedding_bias_tensor(plain, words, weights, 2),
                                      embedding_bias_tensor(ref, words, weights, 2))
        width = len(cases[0]) + 2  # (B, beams, T) with -1 padding, as tensorrt_llm sends them
        tokens = np.array([[cases[0] + [2, -1]], [(cases[1][:3] + [-1] * width)[:width]]], dtype=np.int32)
        lengths = np.array([[width - 1], [3]], dtype=np.int32)
        for skip in (True, False):
            np.testing.assert_array_equal(decode_batch(plain, tokens, lengths, skip), decode_batch(ref, tokens, lengths, skip))

    changed = {"add_bos_token": True, "pad_token": "<pad>", "extra_special_tokens": ["<image>"],
               "added_tokens_decoder": {str(len(saved) + 49152): {"content": "<extra>", "special": True}}}
    for name, value in changed.items():
        folder = _eligible_copy(smollm2_tokenizer_dir, tmp_path / name, **{name: value})
        assert type(load_text_tokenizer(folder)) is type(load_tokenizer(folder)), name

    root = Path(__file__).resolve().parents[2]
    # tokenizer_config.json is UTF-8 too: a chat template in it with a non-ASCII character (Qwen's have some)
    accented = _eligible_copy(smollm2_tokenizer_dir, tmp_path / "accented", chat_template="¿{{ messages }}?")
    check = ("import sys; import serving.params, serving.text, serving.stub_watchdog, serving.multimodal, serving.videos, "
             "serving.cancellation; from serving.tokenization import load_text_tokenizer; "
             f"assert type(load_text_tokenizer({smollm2_tokenizer_dir!r})).__name__ == 'PlainTokenizer'; "
             f"assert type(load_text_tokenizer({accented!r})).__name__ == 'PlainTokenizer'; "
             "assert 'transformers' not in sys.modules, 'transformers'")
    # In the C locale, as a stub may run (tokenizer.json is UTF-8 whatever the locale's encoding)
    c_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    run = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(root), **c_locale})
    assert run.returncode == 0, run.stderr[-2000:]
