"""Who owns the engine that several tensorrt_llm instances share (serving/shared_engine.py)."""
import os

import pytest

from serving.shared_engine import lock_is_held, open_shared_engine, rendezvous_paths


def test_the_first_to_lock_starts_the_engine_and_the_others_attach(tmp_path):
    lock_path, socket_path = str(tmp_path / "e.lock"), str(tmp_path / "e.sock")
    calls = []
    owner = open_shared_engine(lock_path, socket_path, start=lambda path: calls.append(("start", path)) or "engine",
                               attach=lambda path, alive: pytest.fail("the first one must own"))
    assert owner.is_owner and owner.engine == "engine" and calls == [("start", socket_path)]
    seen_alive = []
    other = open_shared_engine(lock_path, socket_path, start=lambda path: pytest.fail("only one owner"),
                               attach=lambda path, alive: seen_alive.append(alive()) or f"client of {path}")
    assert not other.is_owner and other.engine == f"client of {socket_path}" and seen_alive == [True]
    owner.release()
    assert not os.path.exists(lock_path) and not lock_is_held(lock_path)  # attaching ones stop waiting


def test_an_owner_that_fails_to_start_releases_the_lock(tmp_path):
    lock_path = str(tmp_path / "e.lock")

    def failing_start(path):
        raise RuntimeError("no engine here")

    with pytest.raises(RuntimeError, match="no engine here"):
        open_shared_engine(lock_path, str(tmp_path / "e.sock"), start=failing_start, attach=None)
    assert not lock_is_held(lock_path)


def test_rendezvous_paths_name_the_server_model_version_and_load():
    lock_path, socket_path = rendezvous_paths("tensorrt_llm/x y", "1", 2, server_pid=4242)
    assert os.path.basename(lock_path) == "tritonllm-4242-tensorrt_llm_x_y-1-2.lock"
    assert socket_path == lock_path[:-len(".lock")] + ".sock" and len(socket_path) < 100  # AF_UNIX limit


def test_an_owner_removes_the_files_of_servers_that_no_longer_run(tmp_path):
    dead = tmp_path / "tritonllm-999999999-tensorrt_llm-1-0.sock"  # no such pid
    alive = tmp_path / f"tritonllm-{os.getpid()}-other-1-0.lock"
    unrelated = tmp_path / "tritonllm-notes.txt"
    for path in (dead, alive, unrelated):
        path.write_text("")
    lock_path, socket_path = str(tmp_path / f"tritonllm-{os.getpid()}-tensorrt_llm-1-0.lock"), str(tmp_path / "s.sock")
    open_shared_engine(lock_path, socket_path, start=lambda path: "engine", attach=None).release()
    assert not dead.exists() and alive.exists() and unrelated.exists()
