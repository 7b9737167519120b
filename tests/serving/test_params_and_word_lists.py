import numpy as np
import pytest

from serving.params import get_parameter, is_unset, model_parameters, parse_bool, parse_int_list
from serving.word_lists import decode_word_list, encode_word_lists


@pytest.mark.parametrize("value", [None, "", "  ", "${tokenizer_dir}", "${x}"])
def test_unset_values_are_none_for_every_type(value):
    assert is_unset(value)
    for kind in (bool, int, float, str):
        assert get_parameter({"p": value} if value is not None else {}, "p", kind) is None


def test_typed_parsing():
    params = model_parameters('{"parameters": {"a": {"string_value": "12"}, '
                              '"b": {"string_value": "0.5"}, "c": {"string_value": "abc"}}}')
    assert get_parameter(params, "a", int) == 12
    assert get_parameter(params, "b", float) == 0.5
    assert get_parameter(params, "c", str) == "abc"
    assert get_parameter(params, "c", int) is None  # non-numeric int
    assert get_parameter(params, "missing", str) is None


@pytest.mark.parametrize("text,value", [("1", True), ("true", True), ("True", True), ("yes", True),
                                        ("0", False), ("false", False), ("False", False),
                                        ("n", False), ("maybe", None)])
def test_bool_parsing(text, value):
    assert parse_bool(text) is value


def test_int_list():
    assert parse_int_list("1, 2,3") == [1, 2, 3]
    assert parse_int_list("${max_attention_window_size}") is None
    with pytest.raises(ValueError):
        parse_int_list("1,x")


def test_word_list_examples_decode():
    assert decode_word_list(np.array([[[24044, 76, 1230], [2, 3, -1]]])) == [[24044, 76], [1230]]
    assert decode_word_list(np.array([[[326, 262, 1230], [3, -1, -1]]])) == [[326, 262, 1230]]
    assert decode_word_list(np.zeros((1, 2, 0), dtype=np.int32)) == []
    assert decode_word_list(None) is None


@pytest.mark.parametrize("bad", [np.array([]), np.array([1, 2]), np.array([[1, 2], [1, -1]]),
                                 np.zeros((1, 3, 2)), np.array([[[1, 2], [3, -1]]])])
def test_malformed_word_lists_raise(bad):
    with pytest.raises(ValueError, match="Invalid format for word list"):
        decode_word_list(bad)


def test_encode_matches_reference_layout_and_round_trips():
    vocab = {"Hello": [14480], " world peace": [326, 262, 1171], "": []}
    out = encode_word_lists([["Hello", " world peace"], ["Hello"]], vocab.__getitem__, 2)
    assert out.dtype == np.int32 and out.shape == (2, 2, 4)
    assert out[0].tolist() == [[14480, 326, 262, 1171], [1, 4, -1, -1]]
    assert out[1].tolist() == [[14480, 0, 0, 0], [1, -1, -1, -1]]
    assert decode_word_list(out[0:1]) == [[14480], [326, 262, 1171]]
    assert encode_word_lists(None, vocab.__getitem__, 3).shape == (3, 2, 0)
    assert encode_word_lists([[""], [""]], vocab.__getitem__, 2).tolist() == [[[0], [-1]]] * 2
