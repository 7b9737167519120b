"""docs/INTERFACES.md names every TRITONLLM_* environment variable the product reads, and no other.

An operator reads that page to know what they can set. A static scan: every `TRITONLLM_NAME` written in the
product's source (the packages below; the switch constants such as `FOO_ENV = "TRITONLLM_FOO"` included)
must appear on the page, and every name the page gives must still be written somewhere in that source
(an entry for a switch the code no longer reads is stale). benchmarks/ and tests/ are not the product:
their own switches (TRITONLLM_GPU_SUITE, TRITONLLM_TEST_DEVICE, ...) are documented where they are used.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "kernels", "serving", "all_models", "openai_frontend", "scripts", "tools", "tritonllm", "deploy")
SUFFIXES = {".py", ".sh", ".pbtxt", ".yaml", ".yml"}
INTERFACES = ROOT / "docs" / "INTERFACES.md"
# A full name: a prefix built for concatenation ("TRITONLLM_PP_" + ...) ends in "_" and is not one.
NAME = re.compile(r"\bTRITONLLM_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
# Names the product's source writes that are not settings of the product. Each with why. Empty today.
NOT_SETTINGS: dict[str, str] = {}


def product_names() -> dict[str, str]:
    """{name: the first file (relative to the root) that writes it} over the product's source files."""
    names: dict[str, str] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                for name in NAME.findall(path.read_text(errors="replace")):
                    names.setdefault(name, str(path.relative_to(ROOT)))
    return names


def undocumented(names: dict[str, str], page: str) -> list[str]:
    named = set(NAME.findall(page))
    return sorted(f"{name} ({where})" for name, where in names.items() if name not in named and name not in NOT_SETTINGS)


def stale(names: dict[str, str], page: str) -> list[str]:
    return sorted(set(NAME.findall(page)) - set(names))


def test_interfaces_names_every_variable_the_product_reads():
    names = product_names()
    assert len(names) > 50, "the scan found the product's switches"
    missing = undocumented(names, INTERFACES.read_text())
    assert not missing, ("docs/INTERFACES.md's environment lists lack these variables the code reads "
                         "(add an entry: where read, default, values, what it does):\n" + "\n".join(missing))


def test_interfaces_names_no_variable_the_product_no_longer_reads():
    gone = stale(product_names(), INTERFACES.read_text())
    assert not gone, "docs/INTERFACES.md names variables no product source reads (remove the entries):\n" + "\n".join(gone)


def test_the_checks_catch_a_missing_and_a_stale_name():
    page = "- `$TRITONLLM_A` (read by x.py): `0` turns it off.\n- `$TRITONLLM_OLD_SWITCH`: gone.\n"
    names = {"TRITONLLM_A": "x.py", "TRITONLLM_B_TILES": "kernels/y.py"}
    assert undocumented(names, page) == ["TRITONLLM_B_TILES (kernels/y.py)"]
    assert stale(names, page) == ["TRITONLLM_OLD_SWITCH"]
    assert NAME.findall('PREFIX = "TRITONLLM_PP_"; X_ENV = "TRITONLLM_X_2"') == ["TRITONLLM_X_2"]
