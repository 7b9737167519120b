"""Chat prompts: rendered with the tokenizer's own template, counted as preprocessing encodes them,
never with a doubled BOS, and checked against the engine's limits (400 naming the field)."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from openai_frontend.chat_template import PromptBuilder
from openai_frontend.errors import APIError

# A Llama-3-like template: it writes the BOS itself.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


@pytest.fixture
def engine_dir(tmp_path):
    """A word-level tokenizer whose encoding adds <s>, and a config.json with the engine's limits."""
    words = ["<s>", "</s>", "<unk>", "<system>", "<user>", "<assistant>", "hello", "there", "be", "brief"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"build": {"max_input_len": 8, "max_seq_len": 12}}))
    return str(tmp_path)


def test_template_bos_is_left_to_preprocessing(engine_dir):
    builder = PromptBuilder(engine_dir, add_special_tokens=True)
    text = builder.render_chat([{"role": "user", "content": "hello there"}])
    assert text == "<user> hello there <assistant> "
    ids = builder.tokenizer.encode(text, add_special_tokens=True)
    assert ids.count(0) == 1 and ids[0] == 0  # one BOS, from the encoding
    assert len(builder.encode(text)) == len(ids) == 5


def test_template_bos_kept_when_encoding_adds_none(engine_dir):
    builder = PromptBuilder(engine_dir, add_special_tokens=False)
    text = builder.render_chat([{"role": "user", "content": "hello"}])
    assert text.startswith("<s>") and len(builder.encode(text)) == 4


def test_limits_name_the_field(engine_dir):
    builder = PromptBuilder(engine_dir)
    assert builder.max_tokens_for(5, None, "messages", "max_tokens") == 7  # all the room there is
    assert builder.max_tokens_for(5, 3, "messages", "max_tokens") == 3
    with pytest.raises(APIError) as raised:
        builder.max_tokens_for(5, 8, "messages", "max_completion_tokens")
    assert raised.value.param == "max_completion_tokens" and "at most 7" in raised.value.message
    with pytest.raises(APIError) as raised:
        builder.max_tokens_for(9, 1, "prompt", "max_tokens")
    assert raised.value.param == "prompt" and "at most 8 prompt tokens" in raised.value.message


IMAGE_MESSAGE = {"role": "user", "content": [{"type": "image", "url": "data:,", "field": "f"},
                                             {"type": "text", "text": "hello"}]}


def test_image_parts_as_a_string_template_reads_them(engine_dir):
    """A template that writes content as a string: each image becomes the placeholder and a newline."""
    builder = PromptBuilder(engine_dir)
    assert not builder.template_renders_parts and builder.template_renders_strings
    text = builder.render_chat([IMAGE_MESSAGE, {"role": "assistant", "content": "there"}],
                               image_placeholder="<image>")
    assert text == "<user> <image>\nhello <assistant> there <assistant> "


def test_image_parts_as_a_parts_template_reads_them(engine_dir):
    """A template that iterates over content parts (LLaVA's on the Hub): images as {"type": "image"},
    plain strings as one text part, since it writes no strings."""
    builder = PromptBuilder(engine_dir)
    builder.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
        "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endfor %}<assistant> ")
    assert builder.template_renders_parts and not builder.template_renders_strings
    text = builder.render_chat([IMAGE_MESSAGE, {"role": "assistant", "content": "there"}],
                               image_placeholder="<image>")
    assert text == "<user> <image> hello <assistant> there <assistant> "
