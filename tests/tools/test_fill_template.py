import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from fill_template import fill_template, parse_substitutions, split  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "fill_template.py"
TEMPLATE = (
    'max_batch_size: ${triton_max_batch_size}\n'
    'queue: ${max_queue_size} delay: ${max_queue_delay_microseconds}\n'
    'key: { string_value: "${gpu_device_ids}" }\n'
    'other: "${tokenizer_dir}" cost: $$5\n'
)


def test_split_plain_and_escaped():
    assert split("a,b,c", ",") == ["a", "b", "c"]
    assert split("a\\,b,c", ",") == ["a,b", "c"]
    assert split("k:v\\:w", ":") == ["k", "v:w"]


def test_escaped_comma_stays_in_value():
    assert parse_substitutions("gpu_device_ids:0\\,1,x:2") == {"gpu_device_ids": "0,1", "x": "2"}


def test_colon_in_value_needs_double_escape():
    assert parse_substitutions("url:http\\\\://x") == {"url": "http://x"}
    with pytest.raises(ValueError):
        parse_substitutions("url:http\\://x")


@pytest.mark.parametrize("bad", ["", "novalue", "a:b:c", "a:b,c"])
def test_malformed_substitutions_raise(bad):
    with pytest.raises(ValueError):
        parse_substitutions(bad)


def test_fill_defaults_and_leaves_unknown_placeholders():
    out = fill_template(TEMPLATE, "triton_max_batch_size:8,gpu_device_ids:0\\,1")
    assert "max_batch_size: 8" in out
    assert "queue: 0 delay: 0" in out
    assert 'string_value: "0,1"' in out
    assert '"${tokenizer_dir}"' in out
    assert "cost: $5" in out


def test_user_overrides_default_and_last_duplicate_wins():
    out = fill_template(TEMPLATE, "max_queue_size:7,max_queue_size:9")
    assert "queue: 9 delay: 0" in out


def test_unknown_key_is_an_assertion_error():
    with pytest.raises(AssertionError, match="key 'nope' does not exist in the file"):
        fill_template(TEMPLATE, "nope:1")


def test_key_check_is_a_substring_check():
    # "batch_size" is not a placeholder, but it occurs in the text, so it is accepted.
    assert fill_template(TEMPLATE, "batch_size:3") == fill_template(TEMPLATE, "max_queue_size:0")


def test_cli_stdout_and_in_place(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(TEMPLATE)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "triton_max_batch_size:4"],
                         capture_output=True, text=True, check=True).stdout
    assert "max_batch_size: 4" in out and path.read_text() == TEMPLATE
    subprocess.run([sys.executable, str(SCRIPT), "-i", str(path), "triton_max_batch_size:4"], check=True)
    assert "max_batch_size: 4" in path.read_text()
