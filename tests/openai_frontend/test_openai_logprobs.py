"""Log-probs in OpenAI's shapes: tokens named with their exact bytes (partial UTF-8 included),
entries released with their text and cut at a stop string, chat and completions layouts."""
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from openai_frontend.generation import LogprobTrack
from openai_frontend.logprobs import MIN_LOGPROB, TokenNamer, chat_logprobs, completion_logprobs
from openai_frontend.responses import ResponseShape
from openai_frontend.triton_client import Chunk

TEXT = "The capital of France is Paris. Café au lait, 日本語 and emoji 🙂 too."


def test_token_bytes_add_up_to_the_text_and_partial_characters_are_escaped(byte_level_tokenizer):
    namer = TokenNamer(byte_level_tokenizer)
    ids = byte_level_tokenizer.encode(TEXT, add_special_tokens=False)
    names = [namer.name(i) for i in ids]
    assert b"".join(raw for _, raw in names) == TEXT.encode("utf-8")
    partial = [(text, raw) for text, raw in names if len(raw) == 1 and raw[0] >= 0x80]
    assert partial and all(text == "\\x" + raw.hex() for text, raw in partial)  # as OpenAI shows them
    assert namer.name(byte_level_tokenizer.eos_token_id) == ("<|end|>", b"<|end|>")


def test_entries_follow_their_text_and_stop_at_a_stop_string(byte_level_tokenizer):
    namer = TokenNamer(byte_level_tokenizer)
    ids = byte_level_tokenizer.encode("The capital of France", add_special_tokens=False)
    texts = [namer.name(i)[0] for i in ids]
    track = LogprobTrack(namer)
    track.push(Chunk("", 0, ids[:2], [-0.5, -0.25], [[(ids[0], -0.5), (7, -3.0)], [(ids[1], -0.25), (9, -1.0)]]))
    first = track.release(texts[0] + texts[1], stopped=False)
    assert [e.token for e in first] == texts[:2] and [a.logprob for a in first[0].top] == [-0.5, -3.0]
    track.push(Chunk("", 0, ids[2:], [-1.0] * len(ids[2:]), None))
    # A stop string starts inside token 2: its entry stays, the tokens after it go.
    kept = track.release(texts[2][:2], stopped=True)
    assert [e.token for e in kept] == [texts[2]] and kept[0].top == []
    assert kept[0].text_offset == len(texts[0] + texts[1])


def test_chat_and_completion_layouts():
    namer = TokenNamer(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}))))
    namer.name = lambda token_id: ("ab"[token_id], "ab"[token_id].encode())
    entries = namer.entries([0, 1], [-0.1, float("-inf")], [[(0, -0.1), (1, -2.4)], [(1, float("-inf"))]], 0)
    chat = chat_logprobs(entries)
    assert chat["content"][0] == {"token": "a", "logprob": -0.1, "bytes": [97],
                                  "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]},
                                                   {"token": "b", "logprob": -2.4, "bytes": [98]}]}
    assert chat["content"][1]["logprob"] == MIN_LOGPROB  # JSON has no -Infinity
    assert completion_logprobs(entries) == {"tokens": ["a", "b"], "token_logprobs": [-0.1, MIN_LOGPROB],
                                            "top_logprobs": [{"a": -0.1, "b": -2.4}, {"b": MIN_LOGPROB}],
                                            "text_offset": [0, 1]}
    body = ResponseShape(chat=False, model="m").completion(["ab"], ["stop"], 1, 2, [entries])
    assert body["choices"][0]["logprobs"]["tokens"] == ["a", "b"]
    chunk = ResponseShape(chat=True, model="m").chunk(0, "ab", logprobs=entries)
    assert [e["token"] for e in chunk["choices"][0]["logprobs"]["content"]] == ["a", "b"]
    assert ResponseShape(chat=True, model="m").chunk(0, "ab")["choices"][0]["logprobs"] is None
