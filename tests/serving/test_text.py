import numpy as np

from serving.word_lists import decode_word_list
from serving.text import decode_batch, embedding_bias_tensor, encode_queries, string_rows, word_list_tensor


def test_queries_are_right_padded_with_true_lengths(smollm2_tokenizer):
    queries = np.array([[b"Hello there, how are you?"], ["\u4e2d\u6587".encode()]], dtype=object)
    ids, lengths = encode_queries(smollm2_tokenizer, queries, add_special_tokens=True, pad_id=2)
    assert ids.dtype == np.int32 and lengths.shape == (2, 1)
    assert ids.shape[1] == lengths.max() and (ids[1, lengths[1, 0]:] == 2).all()


def test_decode_batch_cuts_each_beam_and_handles_empty_chunks(smollm2_tokenizer):
    hello = smollm2_tokenizer.encode("Hello world", add_special_tokens=False)
    tokens = np.array([[hello + [-1, -1]]], dtype=np.int32)
    out = decode_batch(smollm2_tokenizer, tokens, np.array([[len(hello)]]), skip_special_tokens=True)
    assert out.tolist() == [b"Hello world"]
    empty = decode_batch(smollm2_tokenizer, np.zeros((1, 1, 0), np.int32), np.zeros((1, 1), np.int32), True)
    assert empty.tolist() == [b""]


def test_word_lists_and_bias_from_strings(smollm2_tokenizer):
    words = np.array([[b"Paris", b" and more"]], dtype=object)
    lists = word_list_tensor(smollm2_tokenizer, words, 1)
    expected = [smollm2_tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " and more")]
    assert decode_word_list(lists[0:1]) == expected
    assert word_list_tensor(smollm2_tokenizer, None, 3).shape == (3, 2, 0)
    bias = embedding_bias_tensor(smollm2_tokenizer, np.array([[b"Paris"]], object),
                                 np.array([[2.5]], np.float32), 1)
    assert bias.shape == (1, len(smollm2_tokenizer)) and bias.max() == 2.5
    assert embedding_bias_tensor(smollm2_tokenizer, None, None, 2).shape == (2, 0)
    assert string_rows(np.array([b"a", b"b"], dtype=object)) == [["a"], ["b"]]
