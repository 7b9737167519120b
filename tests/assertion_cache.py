"""Rewrites the asserts of the test modules once, into pytest's own cache, before `make test` starts
its pytest-xdist workers.

pytest rewrites the asserts of every test module and conftest.py it imports (parse, rewrite, compile:
the source of its assertion messages) and keeps the result beside the module
(``__pycache__/<name>.cpython-311-pytest-<version>.pyc``), but writes that cache only when
PYTHONDONTWRITEBYTECODE is unset, and CI's machine sets it. So each of the two workers rewrote all
~215 files of tests/ while collecting, on a fresh clone and on every later run alike: ~9 CPU-s per
worker (collecting the suite took 37 CPU-s with rewriting, 19 with ``--assert=plain``). pytest reads
the cache whatever PYTHONDONTWRITEBYTECODE says, so this writes it, the files spread over the cores;
the workers load the rewritten code instead of making it again. A file whose cached copy is current
(same source hash) is skipped.

What it writes is exactly what pytest's import hook would write (the same internal functions, the
same file name); with a pytest whose internals differ it writes nothing and says so, and the workers
rewrite as before (slower, same results).

    python tests/assertion_cache.py [ROOT]    # ROOT: the tests folder, tests/ beside this file by default
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

try:
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc_fp, get_cache_dir
except ImportError as error:  # another pytest: its workers rewrite as they always did
    PYC_TAIL = None
    MISSING = f"pytest's rewrite internals moved ({error}); the workers will rewrite the test modules themselves"


def rewritten_modules(root: Path) -> list[Path]:
    """The files pytest's hook rewrites under ``root``: test modules (its default ``python_files``,
    test_*.py and *_test.py; pyproject.toml keeps the default) and conftest.py files."""
    return sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts
                  and (path.name.startswith("test_") or path.name.endswith("_test.py") or path.name == "conftest.py"))


def cache_file(module: Path) -> Path:
    return get_cache_dir(module) / (module.name[:-3] + PYC_TAIL)


def write_cached_rewrite(module: Path) -> bool:
    """Rewrites ``module`` into its cache file unless that is current; True when it wrote one.
    Written to a file of this process's own, then renamed over the cache file, as pytest does: a
    reader never sees half a file."""
    target = cache_file(module)
    if _read_pyc(module, target) is not None:
        return False
    source_key, code = _rewrite_test(module, None)  # config None: no assertion-pass hook, pytest's default
    target.parent.mkdir(exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    with open(partial, "wb") as out:
        _write_pyc_fp(out, source_key, code)  # its layout: magic, flags, the source's hash, the code
    os.replace(partial, target)
    return True


def main(argv: list[str]) -> int:
    if PYC_TAIL is None:
        print(f"assertion_cache: {MISSING}", file=sys.stderr)
        return 0
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).parent).resolve()
    modules = rewritten_modules(root)
    workers = max(1, len(os.sched_getaffinity(0)))
    try:
        if len(modules) < 16 or workers == 1:  # a pool's start-up would cost more than it spreads
            written = sum(map(write_cached_rewrite, modules))
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                written = sum(pool.map(write_cached_rewrite, modules, chunksize=8))
    except Exception as error:  # a pytest whose internals differ: the workers rewrite as before
        print(f"assertion_cache: nothing cached ({error!r}); the workers will rewrite the test modules",
              file=sys.stderr)
        return 0
    print(f"assertion_cache: {written} of {len(modules)} test modules rewritten into pytest's cache")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
