import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launch_triton_server.py"
spec = importlib.util.spec_from_file_location("launch_triton_server", SCRIPT)
launcher = importlib.util.module_from_spec(spec)
sys.modules["launch_triton_server"] = launcher  # dataclasses look their module up
spec.loader.exec_module(launcher)

INSTALL = launcher.ServerInstall(binary="/opt/ts/bin/tritonserver")


def args_for(*flags):
    return launcher.parse_arguments(["--model_repo=/repo", *flags])


def test_single_rank_without_mpi():
    cmd = launcher.build_command(args_for("--no-mpi", "--http_port=9000"), INSTALL)
    assert cmd[:2] == ["/opt/ts/bin/tritonserver", "--model-repository=/repo"]
    assert "--http-port=9000" in cmd and "--grpc-port=8001" in cmd and "--metrics-port=8002" in cmd
    assert cmd[-2:] == ["--disable-auto-complete-config",
                        "--backend-config=python,shm-region-prefix-name=prefix0_"]
    assert ":" not in cmd and "mpirun" not in cmd
    assert not any(c.startswith("--log") for c in cmd)
    # every model loads at start; explicit control lets tensorrt_llm reload itself after an engine death
    assert "--model-control-mode=explicit" in cmd and "--load-model=*" in cmd


def test_no_mpi_requires_world_size_one():
    with pytest.raises(AssertionError):
        launcher.build_command(args_for("--no-mpi", "--world_size=2"), INSTALL)


def test_mpirun_shape_for_three_ranks():
    # Leader mode: rank 0 is tritonserver, ranks 1..2 are one engine-worker app.
    args = args_for("--world_size=3", "--log", "--log-file=x.log", "--oversubscribe",
                    "--engine_dir=/engines/tp3", "--hostfile=hosts.txt")
    cmd = launcher.build_command(args, INSTALL)
    assert cmd[:3] == ["mpirun", "--allow-run-as-root", "--oversubscribe"]
    assert "--bind-to none" in " ".join(cmd) and "--hostfile hosts.txt" in " ".join(cmd)
    assert "-x TRITONLLM_DIST_ADDR" in " ".join(cmd) and "-x TRITONLLM_DIST_PORT" in " ".join(cmd)
    leader, workers = " ".join(cmd).split(" -n ")[1:]
    leader_words = leader.split()
    assert leader_words[:2] == ["1", "/opt/ts/bin/tritonserver"] and leader_words[-1] == ":"
    assert "--log-verbose=3" in leader_words and "--log-file=x.log" in leader_words
    assert "--backend-config=python,shm-region-prefix-name=prefix0_" in leader_words
    # Explicit control with every model loaded: the leader may unload itself after a rank failure.
    assert "--model-control-mode=explicit" in leader_words and "--load-model=*" in leader_words
    assert workers.split() == ["2", sys.executable, "-m", "engine.tensor_parallel.worker", "--engine_dir=/engines/tp3"]


def test_pipeline_settings_reach_every_rank_only_when_set(monkeypatch):
    # Remote ranks see only what mpirun exports by name; an unset name would make mpirun warn.
    for name in ("TRITONLLM_PP_MICRO_BATCHES", "TRITONLLM_PP_STEPS_IN_FLIGHT", "TRITONLLM_PP_DEFER_SEND_WAITS"):
        monkeypatch.delenv(name, raising=False)
    unset = " ".join(launcher.build_command(args_for("--world_size=2", "--engine_dir=/e"), INSTALL))
    assert "TRITONLLM_PP_" not in unset
    monkeypatch.setenv("TRITONLLM_PP_STEPS_IN_FLIGHT", "1")
    monkeypatch.setenv("TRITONLLM_PP_DEFER_SEND_WAITS", "0")
    exported = " ".join(launcher.build_command(args_for("--world_size=2", "--engine_dir=/e"), INSTALL))
    assert "-x TRITONLLM_PP_STEPS_IN_FLIGHT" in exported and "-x TRITONLLM_PP_DEFER_SEND_WAITS" in exported
    assert "TRITONLLM_PP_MICRO_BATCHES" not in exported


def test_every_rank_a_tritonserver_as_nvidia_recipes_start_them():
    # --worker_ranks tritonserver: one app per rank, each its own shared-memory prefix; ranks != 0
    # load only tensorrt_llm, whose initialize() runs the rank's worker (serving/worker_rank.py).
    cmd = launcher.build_command(args_for("--world_size=4", "--engine_dir=/engines/tp2pp2", "--worker_ranks=tritonserver"),
                                 INSTALL)
    apps = " ".join(cmd).split(" -n ")[1:]
    assert len(apps) == 4 and all(app.split()[:2] == ["1", "/opt/ts/bin/tritonserver"] for app in apps)
    for rank, app in enumerate(apps):
        words = app.split()
        assert f"--backend-config=python,shm-region-prefix-name=prefix{rank}_" in words
        assert ("--load-model=*" if rank == 0 else "--load-model=tensorrt_llm") in words
    assert "engine.tensor_parallel.worker" not in " ".join(cmd)


def test_a_hostfile_with_too_few_slots_is_refused_by_name(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two nodes\nnode1 slots=2\nnode2 slots=1 max_slots=4\n")
    assert launcher.hostfile_slots(str(hostfile)) == 3
    with pytest.raises(RuntimeError, match=r"offers 3 slot\(s\) but --world_size is 4 .*or pass --oversubscribe"):
        launcher.check_hostfile(args_for("--world_size=4", f"--hostfile={hostfile}"))
    launcher.check_hostfile(args_for("--world_size=4", f"--hostfile={hostfile}", "--oversubscribe"))
    launcher.check_hostfile(args_for("--world_size=3", f"--hostfile={hostfile}"))
    hostfile.write_text("node1\nnode2 slots=1\n")  # node1's slots are its cores: not known here
    assert launcher.hostfile_slots(str(hostfile)) is None
    launcher.check_hostfile(args_for("--world_size=16", f"--hostfile={hostfile}"))


def test_leader_mode_needs_an_engine_dir():
    with pytest.raises(RuntimeError, match="--engine_dir"):
        launcher.build_command(args_for("--world_size=2"), INSTALL)


def test_backend_dir_host_and_mem_pool_are_passed():
    install = launcher.ServerInstall(binary="ts", backend_dir="/cache/backends")
    args = args_for("--no-mpi", "--host=127.0.0.1", "--multimodal_gpu0_cuda_mem_pool_bytes=5")
    cmd = launcher.build_command(args, install)
    for option in ["--backend-directory=/cache/backends", "--http-address=127.0.0.1",
                   "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                   "--cuda-memory-pool-byte-size=0:5"]:
        assert option in cmd


def test_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        args = launcher.parse_arguments([f"--model_repo={tmp_path}", "--host=127.0.0.1",
                                         f"--http_port={port}", "--grpc_port=0", "--metrics_port=0"])
        with pytest.raises(RuntimeError, match=f"already in use: --http_port={port}"):
            launcher.preflight(args)


def test_missing_repo_and_multi_model_are_refused(tmp_path):
    with pytest.raises(RuntimeError, match="not a directory"):
        launcher.preflight(launcher.parse_arguments(
            [f"--model_repo={tmp_path}/nope", "--http_port=0", "--grpc_port=0", "--metrics_port=0"]))
    with pytest.raises(RuntimeError, match="not supported"):
        launcher.preflight(launcher.parse_arguments([f"--model_repo={tmp_path}", "--multi-model"]))


def test_pytriton_bundle_is_prepared_with_the_stub(tmp_path):
    bundle = launcher.pytriton_bundle_dir()
    if bundle is None:
        pytest.skip("nvidia-pytriton is not installed")
    backend_dir = launcher.prepare_pytriton_backends(bundle, tmp_path)
    stub = backend_dir / "python" / "triton_python_backend_stub"
    assert stub.resolve().is_file() and (backend_dir / "python" / "libtriton_python.so").exists()
    assert launcher.prepare_pytriton_backends(bundle, tmp_path) == backend_dir  # idempotent


def test_environment_puts_this_python_first():
    env = launcher.server_environment(INSTALL, base={"PATH": "/usr/bin", "PYTHONHOME": "/x"})
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert "PYTHONHOME" not in env
    libdir = launcher.libpython_dir()
    if libdir:
        assert env["LD_LIBRARY_PATH"].split(":")[0] == libdir


def test_openai_frontend_is_bound_to_host_and_talks_to_the_grpc_port():
    args = args_for("--host=10.1.2.3", "--grpc_port=7001", "--openai_port=9100", "--openai_model_name=llama")
    cmd = launcher.openai_frontend_command(args)
    assert cmd[:3] == [sys.executable, "-m", "openai_frontend"]
    assert {"--grpc_url=10.1.2.3:7001", "--host=10.1.2.3", "--port=9100", "--model_repo=/repo",
            "--served_model_name=llama", "--llm_model=tensorrt_llm"} <= set(cmd)
    # Bound to every interface (no --host), it reaches Triton over loopback.
    cmd = launcher.openai_frontend_command(args_for("--openai_port=9100"))
    assert "--host=0.0.0.0" in cmd and "--grpc_url=127.0.0.1:8001" in cmd
    assert not any(part.startswith("--tool_call_parser") for part in cmd)  # the template decides
    assert not any(part.startswith("--reasoning_parser") for part in cmd)
    cmd = launcher.openai_frontend_command(args_for("--openai_port=9100", "--openai_tool_call_parser=mistral",
                                                    "--openai_reasoning_parser=qwen3"))
    assert "--tool_call_parser=mistral" in cmd and "--reasoning_parser=qwen3" in cmd


def test_lora_modules_go_to_the_frontend_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    json_item = json.dumps({"name": "chat", "path": "adapters/chat", "base_model_name": "llama"})
    args = args_for("--openai_port=9100", "--lora_modules", "sql=/adapters/sql", "rel=adapters/rel", json_item)
    cmd = launcher.openai_frontend_command(args)
    at = cmd.index("--lora_modules")
    assert cmd[at + 1:at + 3] == ["sql=/adapters/sql", f"rel={tmp_path}/adapters/rel"]
    assert json.loads(cmd[at + 3]) == {"name": "chat", "path": f"{tmp_path}/adapters/chat", "base_model_name": "llama"}
    assert len(cmd) == at + 4
    # What the launcher cannot read goes on unchanged: the frontend refuses it with its own message.
    assert launcher.absolute_lora_module("no-equals") == "no-equals"
    assert launcher.absolute_lora_module('{"name": "x"') == '{"name": "x"'
    assert "--lora_modules" not in launcher.openai_frontend_command(args_for("--openai_port=9100"))


def test_lora_modules_need_the_openai_frontend(tmp_path):
    with pytest.raises(RuntimeError, match="--openai_port"):
        launcher.preflight(launcher.parse_arguments([f"--model_repo={tmp_path}", "--lora_modules", "a=/x"]))


def test_busy_openai_port_is_a_clear_error(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        args = launcher.parse_arguments([f"--model_repo={tmp_path}", "--host=127.0.0.1", "--http_port=0",
                                         "--grpc_port=0", "--metrics_port=0", f"--openai_port={port}"])
        with pytest.raises(RuntimeError, match=f"already in use: --openai_port={port}"):
            launcher.preflight(args)


def test_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """Leader mode's default --dist_port: a port from binding to 0 lies in the ephemeral range, where
    an outgoing connection can take it before rank 0 binds it; the launcher chooses below it."""
    floor = launcher.ephemeral_port_floor()
    ports = {launcher.free_port() for _ in range(20)}
    assert all(launcher.LOWEST_CHOSEN_PORT <= port < min(floor, 32768) for port in ports)
    assert len(ports) > 1  # chosen at random, not the same port every time
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))  # free when chosen (nothing else binds in this test)


def test_openai_workers_default_to_one_per_four_cores(monkeypatch):
    assert [launcher.default_openai_workers(cores) for cores in (1, 2, 7, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    assert "--workers=4" in launcher.openai_frontend_command(args_for("--openai_port=9100"))
    assert not any(part.startswith("--workers") for part in launcher.openai_frontend_command(
        args_for("--openai_port=9100", "--openai_workers=1")))
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    assert not any(part.startswith("--workers") for part in launcher.openai_frontend_command(
        args_for("--openai_port=9100")))
