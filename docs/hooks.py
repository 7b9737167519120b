"""MkDocs hooks (mkdocs.yml `hooks:`): the pages that are written from the code, so they cannot drift.

- `<!-- generated: parameters -->` in a page becomes, for each model of `all_models/`, the table of
  its config.pbtxt template's placeholders (what `tools/fill_template.py` fills), where each one
  lands in the config, and its description from `docs/parameters.yml` (else the comment written
  above the parameter in the template); then the model's inputs and outputs. A placeholder with
  neither, or a description of a placeholder no template has, is a warning, which fails
  `mkdocs build --strict` (`make docs` and tests/tools/test_docs.py).
- `<!-- generated: supported-models -->` becomes `engine.models.supported_models_markdown()`, the
  table the README carries too (tests/engine/test_model_families.py keeps that one equal).
- `<!-- generated: file PATH -->` becomes the file at PATH (relative to the repository root) in a
  code block.
- `<!-- generated: results-index -->` becomes the table of `benchmarks/RESULTS.md`: one row per
  results page with its newest headline figures.
- The benchmark results pages (`benchmarks/results/*.md`, outside docs/) join the site as
  generated pages under `results/`; their links to files outside the site become plain code.
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "all_models"
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS_URI = "results"
DESCRIPTIONS = Path(__file__).resolve().parent / "parameters.yml"

log = logging.getLogger("mkdocs.hooks.tritonllm")

# ---------------------------------------------------------------------------------------------
# config.pbtxt: a small reader of protobuf text format, enough for Triton model configs.

_TOKEN = re.compile(r'\s+|#[^\n]*|"((?:[^"\\]|\\.)*)"|(\$\{\w+\})|([A-Za-z0-9_.+\-]+)|([{}\[\]:,;])')


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"cannot read config text at {text[pos:pos + 40]!r}")
        pos = match.end()
        string, placeholder, word, punct = match.groups()
        if string is not None:
            out.append(("str", string))
        elif placeholder is not None:
            out.append(("word", placeholder))
        elif word is not None:
            out.append(("word", word))
        elif punct is not None:
            out.append(("punct", punct))
    return out


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def take(self, value=None):
        token = self.peek()
        if value is not None and token[1] != value:
            raise ValueError(f"expected {value!r}, got {token[1]!r}")
        self.pos += 1
        return token

    def message(self, end=None) -> list[tuple[str, object]]:
        fields = []
        while self.peek()[1] != end:
            kind, key = self.take()
            if kind != "word":
                raise ValueError(f"expected a field name, got {key!r}")
            if self.peek()[1] == ":":
                self.take(":")
            fields.append((key, self.value()))
            while self.peek()[1] in (",", ";"):
                self.take()
        if end is not None:
            self.take(end)
        return fields

    def value(self):
        kind, token = self.peek()
        if token == "{":
            self.take("{")
            return self.message("}")
        if token == "[":
            self.take("[")
            items = []
            while self.peek()[1] != "]":
                items.append(self.value())
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("]")
            return items
        self.take()
        return token


def read_config(path: Path) -> list[tuple[str, object]]:
    return _Parser(path.read_text()).message()


def _field(message, name, default=None):
    for key, value in message:
        if key == name:
            return value
    return default


def placeholder_sites(config) -> dict[str, list[str]]:
    """placeholder name -> where it lands: `max_batch_size`, `parameters.gpt_model_path`,
    `input draft_logits: data_type`, `instance_group: count`, ... in template order."""
    sites: dict[str, list[str]] = {}

    def note(value, site):
        for name in re.findall(r"\$\{(\w+)\}", value):
            if site not in sites.setdefault(name, []):
                sites[name].append(site)

    def walk(message, path, tensor):
        for key, value in message:
            if key == "parameters" and isinstance(value, list):
                string = _field(_field(value, "value", []), "string_value", "")
                note(string, f"parameter `{_field(value, 'key')}`")
                continue
            items = value if isinstance(value, list) and value and not isinstance(value[0], tuple) else [value]
            for item in items:
                if isinstance(item, list):  # a message
                    name = _field(item, "name")
                    if key in ("input", "output") and name:
                        walk(item, "", f"{key} `{name}`")
                    else:
                        walk(item, f"{path}{key}.", tensor)
                else:
                    note(item, f"`{path}{key}`" + (f" of {tensor}" if tensor else ""))

    walk(config, "", "")
    return sites


def parameter_comments(text: str) -> dict[str, str]:
    """parameter key -> the comment block written above it in the template: a block of top-level
    `#` lines covers the `parameters` entries that follow it, up to a blank line, another top-level
    field or the next block."""
    comments: dict[str, str] = {}
    block: list[str] = []
    previous_was_comment = False
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line.startswith("#"):
            if not previous_was_comment:
                block = []
            block.append(line.lstrip("#").strip())
            previous_was_comment = True
            continue
        previous_was_comment = False
        if not line.strip():
            block = []
        elif line.startswith("parameters"):
            key = next((re.search(r'key:\s*"([^"]+)"', later) for later in lines[number:number + 4]
                        if "key:" in later), None)
            if key and block:
                comments[key.group(1)] = " ".join(block)
        elif not line.startswith((" ", "}")):
            block = []
    return comments


def fixed_parameters(config) -> list[tuple[str, str]]:
    """Parameters whose value is no placeholder: (key, value)."""
    out = []
    for key, value in config:
        if key == "parameters":
            string = _field(_field(value, "value", []), "string_value", "")
            if not re.search(r"\$\{\w+\}", string):
                out.append((_field(value, "key"), string))
    return out


def tensors(config, kind: str) -> list[dict]:
    out = []
    for key, value in config:
        if key == kind:
            for item in value:
                dims = _field(item, "dims", [])
                out.append({"name": _field(item, "name"), "data_type": _field(item, "data_type"),
                            "dims": "[ " + ", ".join(dims) + " ]",
                            "optional": _field(item, "optional", "false") == "true"})
    return out


# ---------------------------------------------------------------------------------------------
# The parameters page.

MODEL_ORDER = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def parameters_markdown() -> str:
    descriptions = yaml.safe_load(DESCRIPTIONS.read_text())
    shared = descriptions.get("shared", {})
    used_shared: set[str] = set()
    templates = sorted(p.parent.name for p in MODELS_DIR.glob("*/config.pbtxt"))
    order = [m for m in MODEL_ORDER if m in templates] + [m for m in templates if m not in MODEL_ORDER]
    for model in descriptions:
        if model != "shared" and model not in templates:
            log.warning(f"docs/parameters.yml describes model '{model}', which all_models/ does not have")
    parts = []
    for model in order:
        path = MODELS_DIR / model / "config.pbtxt"
        config = read_config(path)
        own = descriptions.get(model) or {}
        sites = placeholder_sites(config)
        fixed = fixed_parameters(config)
        comments = parameter_comments(path.read_text())
        rows = []
        for name, where in sites.items():
            text = own.get(name)
            if text is None and name in shared:
                text = shared[name]
                used_shared.add(name)
            keys = [site.split("`")[1] for site in where if site.startswith("parameter `")]
            if text is None and keys and keys[0] in comments:  # the template's own words
                text = comments[keys[0]]
            if text is None:
                log.warning(f"all_models/{model}/config.pbtxt: placeholder ${{{name}}} has no description "
                            f"in docs/parameters.yml (under '{model}:' or 'shared:')")
                text = ""
            rows.append(f"| `{name}` | {'<br>'.join(where)} | {_cell(text)} |")
        for key, value in fixed:
            text = own.get(key)
            if text is None:
                log.warning(f"all_models/{model}/config.pbtxt: fixed parameter '{key}' has no description "
                            f"in docs/parameters.yml (under '{model}:')")
                text = ""
            rows.append(f"| (fixed: `{value}`) | parameter `{key}` | {_cell(text)} |")
        known = set(sites) | {key for key, _ in fixed}
        for name in own:
            if name not in known and not name.startswith("_"):
                log.warning(f"docs/parameters.yml: '{model}: {name}' is in no placeholder or parameter of "
                            f"all_models/{model}/config.pbtxt")
        parts.append(f"### `{model}`\n")
        if own.get("_about"):
            parts.append(own["_about"].strip() + "\n")
        parts.append("| placeholder | sets | description |\n|---|---|---|")
        parts.append("\n".join(rows) + "\n")
        extra = own.get("_extra") or {}
        if extra:
            parts.append("Read when present, though not in the template (add a `parameters` entry by hand):\n")
            parts.append("\n".join(f"- `{key}`: {_cell(text)}" for key, text in extra.items()) + "\n")
        for kind in ("input", "output"):
            items = tensors(config, kind)
            if not items:
                continue
            parts.append(f'??? info "`{model}` {kind}s ({len(items)})"\n')
            parts.append("    | name | type | dims | optional |\n    |---|---|---|---|")
            parts.append("\n".join(f"    | `{t['name']}` | `{t['data_type']}` | `{t['dims']}` | "
                                   f"{'yes' if t['optional'] else ''} |" for t in items) + "\n")
    for name in shared:
        if name not in used_shared:
            log.warning(f"docs/parameters.yml: shared '{name}' is used by no template of all_models/")
    return "\n".join(parts)


def supported_models() -> str:
    sys.path.insert(0, str(ROOT))  # this checkout's engine/, whatever else is installed
    from engine.models import supported_models_markdown

    return supported_models_markdown()


def include_file(relative: str) -> str:
    path = ROOT / relative
    if not path.is_file():
        log.warning(f"generated: file {relative} does not exist")
        return ""
    language = {".yaml": "yaml", ".yml": "yaml", ".py": "python", ".pbtxt": "protobuf"}.get(path.suffix, "text")
    return f"```{language}\n{path.read_text().rstrip()}\n```"


RESULTS_INDEX = ROOT / "benchmarks" / "RESULTS.md"


def results_index() -> str:
    """The table of benchmarks/RESULTS.md (one row per results page, with its newest headline
    figures); its `results/<topic>.md` links resolve from a page at the site's root."""
    if not RESULTS_INDEX.is_file():
        log.warning("generated: results-index: benchmarks/RESULTS.md does not exist")
        return ""
    rows = [line for line in RESULTS_INDEX.read_text().splitlines() if line.startswith("|")]
    if not rows:
        log.warning("generated: results-index: benchmarks/RESULTS.md has no table")
    return "\n".join(rows)


GENERATED = re.compile(r"<!-- generated: ([\w-]+)(?: ([^ ]+))? -->")


def on_page_markdown(markdown, page, config, files):
    def replace(match):
        kind, argument = match.groups()
        if kind == "parameters":
            return parameters_markdown()
        if kind == "supported-models":
            return supported_models()
        if kind == "file":
            return include_file(argument)
        if kind == "results-index":
            if page.file.src_uri.count("/"):
                log.warning(f"{page.file.src_uri}: the results index belongs on a page at the site's root")
            return results_index()
        log.warning(f"{page.file.src_uri}: unknown generated block '{kind}'")
        return match.group(0)

    return GENERATED.sub(replace, markdown)


# ---------------------------------------------------------------------------------------------
# Benchmark results pages, brought in from benchmarks/results/ without a copy in docs/.

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _results_markdown(source: Path, site_names: set[str]) -> str:
    """The page's text with its relative links to anything but another results page made plain:
    the site holds only the results pages, not the scripts and data beside them."""
    def replace(match):
        bang, text, target = match.groups()
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        path = target.split("#", 1)[0]
        if not bang and "/" not in path and path in site_names:
            return match.group(0)
        return f"`{text}`" if not text.startswith("`") else text

    return _LINK.sub(replace, source.read_text())


def on_files(files, config):
    from mkdocs.structure.files import File

    if not RESULTS_DIR.is_dir():
        return files
    pages = sorted(RESULTS_DIR.glob("*.md"))
    names = {p.name for p in pages}
    for source in pages:
        files.append(File.generated(config, f"{RESULTS_URI}/{source.name}",
                                    content=_results_markdown(source, names)))
    return files
