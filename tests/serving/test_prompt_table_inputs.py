"""tensorrt_llm's prompt-table inputs become the executor request's PromptTable (the engine checks the
values: tests/executor/test_prompt_tables.py)."""
import numpy as np
import pytest

from serving.requests import convert_request, to_executor_request


def tensors(**extra):
    return {"input_ids": np.array([[5, 100, 101, 7, 0]], np.int32), "input_lengths": np.array([[4]], np.int32),
            "request_output_len": np.array([[4]], np.int32), **extra}


def test_the_table_and_extra_ids_reach_the_request_cut_to_the_input_length():
    table = np.arange(16, dtype=np.float16).reshape(1, 2, 8)
    extra = np.array([[0, 3, 3, 0, 0]], np.uint64)  # padded like input_ids
    [spec] = convert_request(tensors(prompt_embedding_table=table, prompt_table_extra_ids=extra,
                                     prompt_vocab_size=np.array([[2]], np.int32)), decoupled=False)
    request = to_executor_request(spec)
    assert request.input_token_ids == [5, 100, 101, 7]
    np.testing.assert_array_equal(request.prompt_table.embeddings, table[0])
    assert request.prompt_table.extra_ids == [0, 3, 3, 0]


def test_extra_ids_zero_mean_none_and_without_a_table_are_refused():
    [spec] = convert_request(tensors(prompt_table_extra_ids=np.zeros((1, 5), np.uint64)), decoupled=False)
    assert spec.prompt_table is None
    with pytest.raises(ValueError, match="^prompt_table_extra_ids was sent without prompt_embedding_table"):
        convert_request(tensors(prompt_table_extra_ids=np.array([[0, 1, 1, 0, 0]], np.uint64)), decoupled=False)
