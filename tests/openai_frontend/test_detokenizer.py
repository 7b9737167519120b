"""Incremental detokenization of the frontend's direct path: chunks of any size concatenate to
the decode of the whole sequence, a split character is held until complete, special tokens vanish."""
import pytest

from openai_frontend.detokenizer import IncrementalDetokenizer, fast_decode

TEXT = "The capital of France is Paris. Café au lait, 日本語 and emoji 🙂 too."


def streamed(tokenizer, ids, step):
    detokenizer = IncrementalDetokenizer(fast_decode(tokenizer))
    pieces = [detokenizer.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [detokenizer.finish()]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_chunks_concatenate_to_the_whole_decode_and_never_split_a_character(byte_level_tokenizer, step):
    ids = byte_level_tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several tokens here
    pieces = streamed(byte_level_tokenizer, ids, step)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("step", [1, 2])
def test_word_start_spaces_survive_chunking(metaspace_tokenizer, step):
    text = "The capital of France is Paris"
    ids = metaspace_tokenizer.encode(text, add_special_tokens=False)
    assert "".join(streamed(metaspace_tokenizer, ids, step)) == fast_decode(metaspace_tokenizer)(ids) == text


def test_special_tokens_vanish_and_an_unfinished_character_comes_out_at_the_end(byte_level_tokenizer):
    ids = byte_level_tokenizer.encode("Paris 🙂", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(fast_decode(byte_level_tokenizer))
    assert detokenizer.push(ids[:-1] + [byte_level_tokenizer.eos_token_id]) == "Paris "  # the emoji is cut
    assert detokenizer.finish() == "\ufffd"  # its first bytes, reported once the stream ends
