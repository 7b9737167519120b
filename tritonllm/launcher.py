"""Launch tritonserver on a model repository (tensorrtllm_backend-compatible flags).

    tritonllm launch --model_repo=/path/to/repo [--world_size=1]
        [--http_port=8000 --grpc_port=8001 --metrics_port=8002] [--log --log-file=triton_log.txt]
        [--openai_port=9000 [--lora_modules sql=/adapters/sql ...]]

(in a source checkout also ``python3 scripts/launch_triton_server.py ...``, the path NVIDIA's docs use).

Finds the server binary (`--tritonserver`, else `tritonserver` on PATH, else the one bundled in the
`nvidia-pytriton` wheel), gives the Python-backend stub this project's Python environment, and
starts the server in the background (returns at once, like the reference launcher). With
`--openai_port`, the OpenAI-compatible frontend (`python -m openai_frontend`) starts beside it,
bound to `--host`, forwarding to the server's gRPC port.

Why the environment matters: the Python-backend stub embeds libpython and imports packages from the
environment of the `python3` first on PATH (PYTHONPATH is ignored), so this script puts the
interpreter's own bin directory first on PATH and the matching libpython on LD_LIBRARY_PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from openai_frontend.repository import lora_off_reason
from serving.child_python import child_environment
from tritonllm.paths import model_templates_dir

DEFAULT_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tritonllm"


@dataclass
class ServerInstall:
    """Where a runnable tritonserver lives; backend_dir is None for an install that knows its own."""

    binary: str
    backend_dir: str | None = None
    library_dirs: tuple[str, ...] = ()


def parse_arguments(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--world_size", type=int, default=1,
                        help="number of ranks: the engine's tp_size x pp_size (one rank per GPU)")
    parser.add_argument("--tritonserver", type=str, default=DEFAULT_TRITONSERVER,
                        help="server binary; when it does not exist, PATH and nvidia-pytriton are searched")
    parser.add_argument("--grpc_port", type=str, default="8001")
    parser.add_argument("--http_port", type=str, default="8000")
    parser.add_argument("--metrics_port", type=str, default="8002")
    parser.add_argument("--host", type=str, default=None,
                        help="address for all three endpoints (default: tritonserver's, all interfaces)")
    parser.add_argument("--openai_port", type=str, default=None,
                        help="also serve the OpenAI-compatible API (/v1/...) on this port, bound to --host")
    parser.add_argument("--openai_model_name", type=str, default=None,
                        help="the model name OpenAI clients use (default: the engine directory's name)")
    parser.add_argument("--openai_entry_model", type=str, default=None,
                        help="the model the OpenAI frontend sends requests to: the tensorrt_llm model itself "
                             "(default; the frontend tokenizes and decodes) or tensorrt_llm_bls")
    parser.add_argument("--openai_tool_call_parser", type=str, default=None,
                        help="tool-call format of the model's output for the OpenAI frontend (hermes, llama3_json, "
                             "mistral, openai: gpt-oss's harmony); default: chosen from the chat template")
    parser.add_argument("--openai_reasoning_parser", type=str, default=None,
                        help="reasoning format of the model's output for the OpenAI frontend (deepseek_r1, qwen3, "
                             "gpt_oss, none); default: chosen from the chat template")
    parser.add_argument("--lora_modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters the OpenAI frontend serves as models of their own (with --openai_port): "
                             "each name=path or '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}', path "
                             "a PEFT directory (adapter_config.json + weights); requests naming the adapter run the "
                             "engine with it, loaded on first use")
    parser.add_argument("--openai_workers", type=int, default=None,
                        help="OpenAI frontend processes sharing --openai_port (one is saturated at about 7,000 "
                             "streamed tokens a second); default: default_openai_workers(), one per 4 CPU cores, "
                             "1 to 4")
    parser.add_argument("--force", "-f", action="store_true", help="launch even if tritonserver runs")
    parser.add_argument("--log", action="store_true", help="rank 0 logs verbosely to --log-file")
    parser.add_argument("--log-file", type=str, default="triton_log.txt")
    parser.add_argument("--no-mpi", action="store_true", help="run tritonserver directly (world_size 1)")
    parser.add_argument("--model_repo", type=str, default=str(model_templates_dir()),
                        help="the filled model repository (default: the unfilled templates, all_models)")
    parser.add_argument("--tensorrt_llm_model_name", type=str, default="tensorrt_llm",
                        help="comma list of the models non-zero ranks load")
    parser.add_argument("--multi-model", action="store_true", help="orchestrator mode (not supported)")
    parser.add_argument("--disable-spawn-processes", action="store_true")
    parser.add_argument("--multimodal_gpu0_cuda_mem_pool_bytes", type=int, default=0)
    parser.add_argument("--oversubscribe", action="store_true", help="pass --oversubscribe to mpirun")
    parser.add_argument("--cache_dir", type=str, default=str(DEFAULT_CACHE_DIR),
                        help="where the nvidia-pytriton server bundle is prepared")
    # Leader mode (world_size > 1): rank 0 is tritonserver, ranks 1..N-1 are engine workers.
    parser.add_argument("--engine_dir", type=str, default=None,
                        help="engine the worker ranks load (default: gpt_model_path of the "
                             "tensorrt_llm model's config.pbtxt)")
    parser.add_argument("--hostfile", type=str, default=None,
                        help="OpenMPI hostfile for several nodes (rank 0 runs on its first host)")
    parser.add_argument("--dist_addr", type=str, default=None,
                        help="rank 0's address for the ranks' rendezvous (default: first hostfile "
                             "host, else 127.0.0.1)")
    parser.add_argument("--dist_port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument("--worker_ranks", choices=["engine", "tritonserver"], default="engine",
                        help="what ranks 1..N-1 run: the engine worker alone (python -m engine.tensor_parallel.worker), "
                             "or a tritonserver each, as NVIDIA's Slurm/Kubernetes recipes start every rank (their "
                             "tensorrt_llm model runs the same worker inside initialize() and never serves)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- command shape

def rank_arguments(rank: int, args: argparse.Namespace, install: ServerInstall) -> list[str]:
    """The tritonserver command line of one rank (without mpirun separators)."""
    ports = [f"--grpc-port={args.grpc_port}", f"--http-port={args.http_port}",
             f"--metrics-port={args.metrics_port}"]
    cmd = [install.binary, f"--model-repository={args.model_repo}", *ports]
    if args.host:
        cmd += [f"--http-address={args.host}", f"--grpc-address={args.host}",
                f"--metrics-address={args.host}"]
    if install.backend_dir:
        cmd.append(f"--backend-directory={install.backend_dir}")
    if rank == 0 and args.log:
        cmd += ["--log-verbose=3", f"--log-file={args.log_file}"]
    # Explicit model control, every model still loaded at start: the tensorrt_llm model can then
    # unload and load itself, to restart a dead engine process (not ready meanwhile) or to report
    # a lost rank as not ready. Non-leader ranks load only the LLM model(s); they block inside its
    # initialize.
    cmd.append("--model-control-mode=explicit")
    if rank == 0:
        cmd.append("--load-model=*")
    else:
        cmd += [f"--load-model={name}" for name in args.tensorrt_llm_model_name.split(",")]
    if rank == 0 and args.multimodal_gpu0_cuda_mem_pool_bytes != 0:
        cmd.append(f"--cuda-memory-pool-byte-size=0:{args.multimodal_gpu0_cuda_mem_pool_bytes}")
    # A unique shared-memory prefix per rank keeps the ranks' Python-backend stubs apart.
    cmd += ["--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
    return cmd


def build_command(args: argparse.Namespace, install: ServerInstall) -> list[str]:
    """The full command: one tritonserver (no MPI) or an mpirun job with one app per rank."""
    if args.no_mpi:
        assert args.world_size == 1, "--no-mpi needs --world_size 1"
        return rank_arguments(0, args, install)
    cmd = ["mpirun", "--allow-run-as-root"]
    if args.oversubscribe:
        cmd.append("--oversubscribe")
    if args.world_size > 1:
        return cmd + leader_mode_arguments(args, install)
    for rank in range(args.world_size):
        cmd += ["-n", "1", *rank_arguments(rank, args, install), ":"]
    return cmd


# Variables every rank needs, exported by name to remote nodes (local ranks inherit them anyway);
# the optional ones only when set (mpirun warns about unset names).
RANK_ENV_VARS = ("PATH", "LD_LIBRARY_PATH", "TRITONLLM_DIST_ADDR", "TRITONLLM_DIST_PORT")
MPIRUN_SIGKILL_TIMEOUT_S = 10
# Whole seconds instead of MPIRUN_SIGKILL_TIMEOUT_S: for a job whose ranks stop faster (the tests' tiny ones,
# which would otherwise idle 10 s in every SIGTERM to mpirun).
MPIRUN_SIGKILL_TIMEOUT_ENV = "TRITONLLM_MPIRUN_SIGKILL_TIMEOUT_S"
OPTIONAL_RANK_ENV_VARS = ("TRITONLLM_DIST_TIMEOUT_S", "TRITONLLM_DIST_STARTUP_TIMEOUT_S", "TRITONLLM_DIST_HEARTBEAT_S",
                          "TRITONLLM_PP_MICRO_BATCHES", "TRITONLLM_PP_STEPS_IN_FLIGHT", "TRITONLLM_PP_DEFER_SEND_WAITS",
                          "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES")


def leader_mode_arguments(args: argparse.Namespace, install: ServerInstall) -> list[str]:
    """mpirun arguments after the launcher options for world_size > 1 (leader mode).

    Rank 0 is tritonserver (its tensorrt_llm model is the leader); ranks 1..N-1 are one app,
    ``python -m engine.tensor_parallel.worker``, or with ``--worker_ranks tritonserver`` a
    tritonserver each (its own ``shm-region-prefix-name=prefix{rank}_``) whose tensorrt_llm model
    runs that worker inside initialize() (serving/worker_rank.py), NVIDIA's recipe shape. ``--bind-to none`` because OpenMPI would otherwise pin each rank
    to one core (tritonserver is multi-threaded); ``orte_enable_recovery`` keeps the job (and so
    the server, which then answers with errors and reports not ready) alive when a worker dies.
    On SIGTERM/SIGINT mpirun sends every rank SIGCONT, then SIGTERM after
    ``odls_base_sigkill_timeout`` seconds, then SIGKILL as long again: the default (1 s) would
    kill tritonserver in the middle of its graceful shutdown ($TRITONLLM_MPIRUN_SIGKILL_TIMEOUT_S, else 10).
    """
    if not args.engine_dir:
        raise RuntimeError("--world_size > 1 needs the engine directory: pass --engine_dir or fill "
                           "gpt_model_path in the tensorrt_llm model's config.pbtxt")
    cmd = ["--bind-to", "none", "--mca", "orte_enable_recovery", "1",
           "--mca", "odls_base_sigkill_timeout", str(int(os.environ.get(MPIRUN_SIGKILL_TIMEOUT_ENV,
                                                                       MPIRUN_SIGKILL_TIMEOUT_S)))]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    for name in RANK_ENV_VARS + tuple(n for n in OPTIONAL_RANK_ENV_VARS if n in os.environ):
        cmd += ["-x", name]
    leader = rank_arguments(0, args, install)
    if args.worker_ranks == "tritonserver":  # one app per rank: each its own shm-region prefix
        for rank in range(1, args.world_size):
            leader += [":", "-n", "1", *rank_arguments(rank, args, install)]
        return cmd + ["-n", "1", *leader]
    worker = [sys.executable, "-m", "engine.tensor_parallel.worker", f"--engine_dir={args.engine_dir}"]
    return cmd + ["-n", "1", *leader, ":", "-n", str(args.world_size - 1), *worker]


# ----------------------------------------------------------------------------- finding the server

def pytriton_bundle_dir() -> Path | None:
    """The `tritonserver` folder inside the installed nvidia-pytriton wheel, if any."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundle = Path(spec.submodule_search_locations[0]) / "tritonserver"
    return bundle if (bundle / "bin" / "tritonserver").exists() else None


def prepare_pytriton_backends(bundle: Path, cache_dir: Path) -> Path:
    """Make `<cache_dir>/backends/python` = the bundle's python backend + the stub for this Python.

    The wheel ships one stub per Python version outside the backend folder; the backend expects
    `backends/python/triton_python_backend_stub`. Symlinks keep the bundle's RPATHs working.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python-backend stub for Python {version} ({stub})")
    python_dir = cache_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    links = {p.name: p for p in (bundle / "backends" / "python").iterdir() if p.is_file()}
    links["triton_python_backend_stub"] = stub
    for name, target in links.items():
        link = python_dir / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(target)
    return python_dir.parent


def find_server(requested: str, cache_dir: Path) -> ServerInstall:
    """Resolve the tritonserver binary: the requested one, PATH, then nvidia-pytriton."""
    if requested and Path(requested).is_file():
        return ServerInstall(binary=requested)
    if requested != DEFAULT_TRITONSERVER:
        raise RuntimeError(f"--tritonserver {requested} does not exist")
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerInstall(binary=on_path)
    bundle = pytriton_bundle_dir()
    if bundle is None:
        raise RuntimeError("No tritonserver found: not at --tritonserver, not on PATH, and "
                           "nvidia-pytriton is not installed (pip install nvidia-pytriton)")
    backend_dir = prepare_pytriton_backends(bundle, cache_dir)
    libs = bundle.parent.parent / "nvidia_pytriton.libs"
    return ServerInstall(binary=str(bundle / "bin" / "tritonserver"), backend_dir=str(backend_dir),
                         library_dirs=(str(libs),) if libs.is_dir() else ())


def libpython_dir() -> str | None:
    """The folder holding this interpreter's shared libpython, which the stub must load."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlibrary = sysconfig.get_config_var("LDLIBRARY") or ""
    if libdir and ldlibrary.endswith(".so") and (Path(libdir) / ldlibrary).exists():
        return libdir
    return None


def server_environment(install: ServerInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: this Python's bin first on PATH, its libpython findable."""
    env = dict(os.environ if base is None else base)
    python_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([python_bin, env.get("PATH", "")]).rstrip(os.pathsep)
    lib_dirs = list(install.library_dirs)
    if libpython_dir():
        lib_dirs.insert(0, libpython_dir())
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    env.pop("PYTHONHOME", None)
    return env


# ----------------------------------------------------------------------------- pre-flight checks

def running_tritonserver_pids() -> list[int]:
    """PIDs of tritonserver processes in the running state (as the reference launcher checks)."""
    result = subprocess.run(["pgrep", "-r", "R", "tritonserver"], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split()]


def busy_ports(args: argparse.Namespace) -> list[str]:
    """The requested ports something already listens on, as 'flag=port' strings."""
    busy = []
    host = args.host or "0.0.0.0"
    flags = ("http_port", "grpc_port", "metrics_port") + (("openai_port",) if args.openai_port else ())
    for flag in flags:
        port = int(getattr(args, flag))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(f"--{flag}={port}")
    return busy


def preflight(args: argparse.Namespace) -> None:
    """Refuse to start a second server, or one whose ports are taken, with a message saying why."""
    if args.multi_model:
        raise RuntimeError("--multi-model (orchestrator mode) is not supported by this backend; "
                           "give each model its own launch instead")
    if args.lora_modules and not args.openai_port:
        raise RuntimeError("--lora_modules are served by the OpenAI frontend: pass --openai_port too")
    if args.lora_modules:  # else the adapters would be listed, and every request for one fail
        reason = lora_off_reason(args.model_repo, args.tensorrt_llm_model_name.split(",")[0])
        if reason is not None:
            raise RuntimeError(reason)
    pids = running_tritonserver_pids()
    if pids:
        message = (f"tritonserver is already running (PIDs {pids}); stop it with `kill {pids[0]}` "
                   "or pass --force to launch anyway")
        if not args.force:
            raise RuntimeError(message)
        print(message, file=sys.stderr)
    busy = busy_ports(args)
    if busy:
        raise RuntimeError(f"port(s) already in use: {', '.join(busy)}; is another server running? "
                           "Choose other ports with --http_port/--grpc_port/--metrics_port")
    if not Path(args.model_repo).is_dir():
        raise RuntimeError(f"--model_repo {args.model_repo} is not a directory")


# ----------------------------------------------------------------------------- leader mode

def engine_dir_from_repo(model_repo: str, model_name: str) -> str | None:
    """``gpt_model_path`` of ``<repo>/<model>/config.pbtxt``; None when absent or unfilled."""
    path = Path(model_repo) / model_name / "config.pbtxt"
    if not path.is_file():
        return None
    match = re.search(r'key:\s*"gpt_model_path"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', path.read_text())
    if match is None or not match.group(1) or match.group(1).startswith("${"):
        return None
    return match.group(1)


def engine_dir_from_llmapi(model_repo: str, model_name: str, world_size: int) -> str | None:
    """For an LLM-API repository (all_models/llmapi: ``<model>/1/model.yaml`` names a checkpoint,
    no gpt_model_path): check its tensor_parallel_size against ``world_size`` and build or reuse
    the engine in the cache, so the worker ranks get its directory. The model on rank 0 then finds
    the same cache entry. None when the model has no model.yaml."""
    path = Path(model_repo) / model_name / "1" / os.environ.get("LLM_CONFIG_PATH", "model.yaml")
    if not path.is_file():
        return None
    from serving import engine_cache
    from serving.llmapi_yaml import check_world_size, engine_dir_for, load_llmapi_config

    try:
        config = load_llmapi_config(str(path))
        check_world_size(config, world_size)
    except ValueError as error:
        raise RuntimeError(f"{path}: {error}") from None
    return engine_dir_for(config, _torch_sees_cuda, engine_cache)  # torch only for dtype auto (~1 CPU-s)


def _torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_engine_world_size(engine_dir: str, world_size: int) -> None:
    """The engine must have been sharded for exactly ``world_size`` ranks (tp_size x pp_size)."""
    config_path = Path(engine_dir) / "config.json"
    try:
        build = json.loads(config_path.read_text())["build"]
    except (OSError, ValueError, KeyError) as error:
        raise RuntimeError(f"cannot read the engine's {config_path}: {error}") from None
    ranks = build.get("tp_size", 1) * build.get("pp_size", 1)
    if ranks != world_size:
        raise RuntimeError(
            f"the engine {engine_dir} was built with tp_size {build.get('tp_size', 1)} "
            f"(pp_size {build.get('pp_size', 1)}), which needs --world_size {ranks}, but --world_size is "
            f"{world_size}; launch with --world_size {ranks} or rebuild with "
            f"python -m engine.build --tp_size T --pp_size P, T x P = {world_size}")


def first_hostfile_host(hostfile: str) -> str:
    for line in Path(hostfile).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            return words[0]
    raise RuntimeError(f"hostfile {hostfile} lists no host")


def hostfile_slots(hostfile: str) -> int | None:
    """Slots an OpenMPI hostfile offers (its ``slots=N`` summed), or None when a host line gives
    none (mpirun then counts that host's cores, which this machine cannot see)."""
    total = 0
    for line in Path(hostfile).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        if not slots or not slots[0].isdigit():
            return None
        total += int(slots[0])
    return total


def check_hostfile(args: argparse.Namespace) -> None:
    """Too few slots for --world_size: a named error before any rank starts (mpirun's own comes
    later and names no fix). --oversubscribe allows it, as it does mpirun."""
    if not Path(args.hostfile).is_file():
        raise RuntimeError(f"--hostfile {args.hostfile} does not exist")
    slots = hostfile_slots(args.hostfile)
    if slots is not None and slots < args.world_size and not args.oversubscribe:
        raise RuntimeError(f"--hostfile {args.hostfile} offers {slots} slot(s) but --world_size is {args.world_size} "
                           "(tp_size x pp_size ranks, one per GPU); add hosts or slots, or pass --oversubscribe")


LOWEST_CHOSEN_PORT = 20000


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 unless configured)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "", tries: int = 500) -> int:
    """A port nothing listens on now, chosen at random below the ephemeral range.

    Binding to port 0 would give a port inside that range, where any outgoing connection (a gloo
    or NCCL socket, a client) may take it before rank 0 binds it for the rendezvous; below it only
    explicit listeners compete."""
    highest = min(ephemeral_port_floor(), 32768) - 1
    chooser = random.SystemRandom()  # unaffected by anyone seeding the random module
    for _ in range(tries):
        port = chooser.randint(LOWEST_CHOSEN_PORT, highest)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {LOWEST_CHOSEN_PORT}-{highest}; pass --dist_port")


def prepare_leader_mode(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Resolve the engine dir, check its tp_size x pp_size, and put the rendezvous address into ``env``."""
    names = args.tensorrt_llm_model_name.split(",")
    args.engine_dir = args.engine_dir or engine_dir_from_repo(args.model_repo, names[0])
    if not args.engine_dir and args.world_size > 1:
        args.engine_dir = engine_dir_from_llmapi(args.model_repo, names[0], args.world_size)
    if args.engine_dir:
        args.engine_dir = os.path.abspath(args.engine_dir)  # the workers may start in another directory
        check_engine_world_size(args.engine_dir, args.world_size)
    if args.world_size == 1:
        return
    if len(names) > 1:
        raise RuntimeError("--world_size > 1 serves one tensorrt_llm model; got "
                           f"--tensorrt_llm_model_name={args.tensorrt_llm_model_name}")
    if args.hostfile:
        check_hostfile(args)
    default_addr = first_hostfile_host(args.hostfile) if args.hostfile else "127.0.0.1"
    env["TRITONLLM_DIST_ADDR"] = args.dist_addr or env.get("TRITONLLM_DIST_ADDR") or default_addr
    env["TRITONLLM_DIST_PORT"] = str(args.dist_port or env.get("TRITONLLM_DIST_PORT") or free_port())


def launch(args: argparse.Namespace, **popen_kwargs) -> subprocess.Popen:
    """Check, build the command, and start it in the background; returns the process."""
    preflight(args)
    install = find_server(args.tritonserver, Path(args.cache_dir))
    if not args.no_mpi and args.world_size == 1 and shutil.which("mpirun") is None:
        args.no_mpi = True  # one rank needs no MPI; do not fail where OpenMPI is not installed
    if not args.no_mpi and shutil.which("mpirun") is None:
        raise RuntimeError("--world_size > 1 needs OpenMPI's mpirun on PATH")
    env = server_environment(install)
    prepare_leader_mode(args, env)
    cmd = build_command(args, install)
    return subprocess.Popen(cmd, env=env, **popen_kwargs)


# ----------------------------------------------------------------------------- OpenAI frontend

def openai_frontend_command(args: argparse.Namespace) -> list[str]:
    """`python -m openai_frontend` bound to --host (all interfaces when unset, as tritonserver),
    talking to this server's gRPC port on the same host (loopback when bound to all)."""
    host = args.host or "0.0.0.0"
    grpc_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    cmd = [sys.executable, "-m", "openai_frontend", f"--grpc_url={grpc_host}:{args.grpc_port}",
           f"--model_repo={os.path.abspath(args.model_repo)}", f"--host={host}", f"--port={args.openai_port}",
           f"--llm_model={args.tensorrt_llm_model_name.split(',')[0]}"]
    if args.openai_model_name:
        cmd.append(f"--served_model_name={args.openai_model_name}")
    if args.openai_entry_model:
        cmd.append(f"--triton_model={args.openai_entry_model}")
    workers = default_openai_workers() if args.openai_workers is None else args.openai_workers
    if workers > 1:
        cmd.append(f"--workers={workers}")
    if args.openai_tool_call_parser:
        cmd.append(f"--tool_call_parser={args.openai_tool_call_parser}")
    if args.openai_reasoning_parser:
        cmd.append(f"--reasoning_parser={args.openai_reasoning_parser}")
    if args.lora_modules:
        cmd += ["--lora_modules", *(absolute_lora_module(item) for item in args.lora_modules)]
    return cmd


def default_openai_workers(cpu_count: int | None = None) -> int:
    """Frontend processes when --openai_workers is not given: one per 4 CPU cores, from 1 to 4.
    On an H100 host (16 cores, 8B shape, benchmarks/results/serving.md "OpenAI-compatible frontend") one
    worker served 0.902 of the in-process engine at 64 streams and 0.59 at 256, four 0.948 and
    0.924; a 2-core machine keeps one (the workers would compete with the server for cores)."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))


def absolute_lora_module(item: str) -> str:
    """A --lora_modules item with its path made absolute: the server reads the path it is sent,
    from its own working directory. An item this cannot read goes on unchanged, for the frontend
    to refuse with its own message."""
    if item.lstrip().startswith("{"):
        try:
            fields = json.loads(item)
        except ValueError:
            return item
        if not isinstance(fields, dict) or not isinstance(fields.get("path"), str) or not fields["path"]:
            return item
        return json.dumps({**fields, "path": os.path.abspath(fields["path"])})
    name, equals, path = item.partition("=")
    return f"{name}={os.path.abspath(path)}" if equals and path else item


def launch_openai_frontend(args: argparse.Namespace, **popen_kwargs) -> subprocess.Popen:
    """Start the frontend in the background (finding this project's packages, so a checkout runs
    it uninstalled too). It answers 503 until tritonserver's models are ready."""
    return subprocess.Popen(openai_frontend_command(args), env=child_environment(), **popen_kwargs)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = parse_arguments(argv, prog)
    try:
        process = launch(args)
    except RuntimeError as error:
        sys.exit(f"{prog or 'launch_triton_server'}: {error}")
    print(f"tritonserver started (pid {process.pid}): HTTP {args.http_port}, gRPC {args.grpc_port}, "
          f"metrics {args.metrics_port}")
    if args.openai_port:
        frontend = launch_openai_frontend(args)
        print(f"openai_frontend started (pid {frontend.pid}): http://{args.host or '0.0.0.0'}:{args.openai_port}/v1")


if __name__ == "__main__":
    main()
