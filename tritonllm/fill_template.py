"""Fill `${name}` placeholders of a model-repository config.pbtxt.

    tritonllm fill-template [-i] <file_path> key1:value1,key2:value2,...

(in a source checkout also ``python3 tools/fill_template.py ...``, the path NVIDIA's docs use).

Semantics (kept identical to tensorrtllm_backend so existing scripts work unchanged):
- a backslash escapes the next character and is removed (`gpu_device_ids:0\\,1` gives `0,1`);
  the comma split consumes one level of escapes, so a literal `:` in a value needs two;
- every key must occur as a substring of the file text;
- `max_queue_size` and `max_queue_delay_microseconds` default to 0; the last duplicate key wins;
- substitution is `string.Template.safe_substitute`: unknown placeholders stay `${name}`.
"""
import argparse
from string import Template

DEFAULT_SUBSTITUTIONS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}


def split(text: str, delimiter: str) -> list[str]:
    """Split on `delimiter`, honouring backslash escapes (the backslash is dropped)."""
    parts, current, escaped = [], [], False
    for char in text:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == delimiter:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def parse_substitutions(substitutions: str) -> dict[str, str]:
    """`k1:v1,k2:v2` -> {k1: v1, k2: v2}; each piece must have exactly one key and one value."""
    values = {}
    for piece in split(substitutions, ","):
        key_value = split(piece, ":")
        if len(key_value) != 2:
            raise ValueError(f"Invalid substitution '{piece}': expected key:value")
        key, value = key_value
        values[key] = value
    return values


def fill_template(text: str, substitutions: str, file_path: str = "<text>") -> str:
    """Return `text` with the given substitutions (plus the defaults) applied."""
    values = parse_substitutions(substitutions)
    for key in values:
        assert key in text, f"key '{key}' does not exist in the file {file_path}."
    return Template(text).safe_substitute({**DEFAULT_SUBSTITUTIONS, **values})


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("file_path", help="path of the config.pbtxt template")
    parser.add_argument("substitutions", help="key1:value1,key2:value2,...")
    parser.add_argument("-i", "--in_place", action="store_true", help="rewrite the file in place")
    args = parser.parse_args(argv)
    with open(args.file_path) as f:
        filled = fill_template(f.read(), args.substitutions, args.file_path)
    if args.in_place:
        with open(args.file_path, "w") as f:
            f.write(filled)
    else:
        print(filled)


if __name__ == "__main__":
    main()
