"""tests/assertion_cache.py (run by `make test` before pytest): the cache it writes is the one pytest's
import hook reads, holds the rewritten asserts, and is written again only for a changed source."""
import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("assertion_cache", Path(__file__).resolve().parents[1] / "assertion_cache.py")
assertion_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(assertion_cache)

SAMPLE = "def test_sum():\n    total = 1 + 1\n    assert total == 3\n"


def test_the_cache_holds_the_rewritten_asserts_and_is_written_again_only_for_a_changed_source(tmp_path, capsys):
    from _pytest.assertion.rewrite import _read_pyc

    module = tmp_path / "pkg" / "test_sample.py"
    module.parent.mkdir()
    module.write_text(SAMPLE)
    (tmp_path / "pkg" / "helper.py").write_text("x = 1\n")  # not a test module: pytest does not rewrite it
    assert assertion_cache.main(["assertion_cache.py", str(tmp_path)]) == 0
    assert "1 of 1 test modules rewritten" in capsys.readouterr().out
    cached = module.parent / "__pycache__" / f"test_sample.{sys.implementation.cache_tag}-pytest-{pytest.__version__}.pyc"
    code = _read_pyc(module, cached)  # what the hook does before it would rewrite
    assert code is not None
    namespace = {}
    exec(code, namespace)
    with pytest.raises(AssertionError, match=r"assert 2 == 3"):  # the rewritten message, not a bare assert
        namespace["test_sum"]()

    assert assertion_cache.main(["assertion_cache.py", str(tmp_path)]) == 0
    assert "0 of 1 test modules rewritten" in capsys.readouterr().out
    module.write_text(SAMPLE.replace("== 3", "== 4"))
    assert _read_pyc(module, cached) is None  # stale: the hook would rewrite it
    assert assertion_cache.main(["assertion_cache.py", str(tmp_path)]) == 0
    assert "1 of 1 test modules rewritten" in capsys.readouterr().out
    assert _read_pyc(module, cached) is not None
