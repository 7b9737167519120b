"""The documentation: the MkDocs site builds with no warning, and the README's links resolve.

`mkdocs build --strict` fails on any warning; mkdocs.yml's `validation:` makes a link to a missing
page, a missing anchor, an absolute link or a link MkDocs cannot resolve a warning, and
docs/hooks.py warns when a template placeholder has no description (or a description names no
placeholder). The README is read on GitHub, not built, so its relative links are checked here.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def mkdocs_build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    assert importlib.util.find_spec("material") is not None, (
        "mkdocs-material is missing (pyproject.toml's test extra): run scripts/setup_env.sh")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site_dir)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=120)


def warnings_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if "WARNING" in line or "ERROR" in line]


def test_site_builds_strictly(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0 and not warnings_of(result), (
        "mkdocs build --strict failed:\n" + (result.stdout + result.stderr)[-4000:])
    assert (tmp_path / "site" / "index.html").is_file()
    # the generated parts are there: the parameters of every template, the registry's table
    parameters = (tmp_path / "site" / "model-repository" / "index.html").read_text()
    for placeholder in ("engine_dir", "kv_cache_free_gpu_mem_fraction", "bls_instance_count", "tokenizer_dir"):
        assert f"<code>{placeholder}</code>" in parameters
    assert "<!-- generated:" not in parameters
    assert "GptOssForCausalLM" in (tmp_path / "site" / "models" / "index.html").read_text()


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: its `!!python/...` tags (the toc's slugify) read as None."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The site's validation settings, on a page with a missing target and a missing anchor."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_ConfigLoader)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Real heading\n\n[gone](missing.md), [no such anchor](#nowhere), "
                                   "[fine](#real-heading)\n")
    probe = {"site_name": "probe", "docs_dir": str(docs), "validation": config["validation"],
             "markdown_extensions": [{"toc": {"permalink": True}}]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(probe))
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    text = "\n".join(warnings_of(result))
    assert "missing.md" in text and "nowhere" in text and "real-heading" not in text


def github_anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub makes for a Markdown file (lowercase; punctuation but `-` and `_`
    dropped; spaces to `-`; repeats get -1, -2, ...)."""
    anchors: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", markdown).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"[`*]|<[^>]+>", "", heading.group(1)).lower()
        slug = "".join(ch for ch in text if ch in "-_ " or unicodedata.category(ch)[0] in "LN").replace(" ", "-")
        count = anchors.get(slug, 0)
        anchors[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(markdown: str) -> list[str]:
    targets = LINK.findall(FENCE.sub("", markdown))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_readme_links_point_to_existing_files():
    readme = (ROOT / "README.md").read_text()
    links = relative_links(readme)
    assert links, "the README links to the docs"
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else ROOT / "README.md"
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)


def test_readme_link_check_catches_a_broken_link():
    links = relative_links("See [a](docs/nope.md), [b](https://example.com), [c](#top).\n```\n[d](x.md)\n```\n")
    assert links == ["docs/nope.md", "#top"]
    assert "every-placeholder" in github_anchors((ROOT / "docs" / "model-repository.md").read_text())
