"""Stream stress: many concurrent gRPC streams into each entry model, over several server
lifetimes; reports whether tritonserver survived (its heap, its process) and what each process of
the server spends per response.

    python benchmarks/reliability/stream_stress.py --model tiny --entries ensemble,tensorrt_llm_bls,tensorrt_llm \
        --clients 64 --requests_per_client 4 --output_len 128 --servers 8

Why it exists: at 64 streams on a 2-core CPU machine, Triton 2.51 (nvidia-pytriton 0.7.0) aborted
with "malloc(): unaligned tcache chunk detected" in about a third of server lifetimes that served the
`ensemble`, mid-run or at shutdown, while the same load straight into `tensorrt_llm` never broke it
(benchmarks/results/reliability.md, "Stream stress"). A crash is a lost stream for every client connected, so
this is the check to run on a new Triton build, a new machine or a change to a model's stub.

Each server lifetime: start the repository with the project's launcher (as serving_bench does),
run `clients` threads, each one gRPC stream sending `requests_per_client` streamed requests one
after another (each until its final response), stop the server, then read its log for a fatal
signal or a glibc heap check. CPU per response: /proc times of every process of the server tree,
before and after the load, over the responses the clients received. Engine: random weights of a
benchmarks/common.py MODELS shape with a synthetic tokenizer (one word per id), max batch = clients.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import benchmarks.serving.serving_bench as serving_bench  # noqa: E402  (ServedEnsemble, engines, the repository)
from benchmarks.common import (REPO_ROOT, command_line, cpu_seconds, descendant_pids, git_commit,  # noqa: E402
                               is_final_response, load_script, machine_description, utc_now)

# What a dying tritonserver writes to its log: a fatal signal (6 abort, 11 segfault, 7 bus error)
# or glibc's heap consistency messages.
FATAL_LOG = re.compile(r"Signal \((?:6|7|11)\) received|malloc|free\(\)|corrupted|double free")
ENTRIES = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")
CLIENT_TIMEOUT_S = 120.0


@dataclass
class Lifetime:
    """One server lifetime under load."""

    entry: str
    responses: int = 0
    seconds: float = 0.0
    client_errors: list[str] = field(default_factory=list)
    fatal_lines: list[str] = field(default_factory=list)
    crashed_during_load: bool = False
    cpu_us_per_response: dict[str, float] = field(default_factory=dict)

    @property
    def crashed(self) -> bool:
        return bool(self.fatal_lines)


def request_inputs(entry: str, index: int, input_len: int, output_len: int) -> list:
    """A streamed greedy request of exactly output_len tokens (end_id -1) for this entry model."""
    ids = [(index * 7 + j) % 90 + 3 for j in range(input_len)]
    if entry == "tensorrt_llm":
        arrays = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[input_len]], np.int32),
                  "request_output_len": np.array([[output_len]], np.int32),
                  "streaming": np.array([[True]], np.bool_), "end_id": np.array([[-1]], np.int32)}
    else:  # the ensemble and the BLS take the same text inputs; synthetic token i is the word "w<i>"
        text = " ".join(f"w{i}" for i in ids)
        arrays = {"text_input": np.array([[text.encode()]], dtype=object),
                  "max_tokens": np.array([[output_len]], np.int32), "stream": np.array([[True]], np.bool_),
                  "end_id": np.array([[-1]], np.int32)}
    return serving_bench.grpc_tensors(arrays)


def stream_client(url: str, entry: str, args: argparse.Namespace, received: list, errors: list) -> None:
    """One gRPC stream: requests one after another, each until its final response."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    arrivals: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrivals.put((result, error)))
    try:
        for index in range(args.requests_per_client):
            client.async_stream_infer(entry, request_inputs(entry, index, args.input_len, args.output_len),
                                      request_id=str(index), enable_empty_final_response=True)
            while True:
                result, error = arrivals.get(timeout=CLIENT_TIMEOUT_S)
                if error is not None:
                    raise RuntimeError(str(error))
                received.append(1)
                if is_final_response(result):
                    break
    except Exception as error:  # noqa: BLE001 - reported per lifetime
        errors.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    finally:
        client.stop_stream()
        client.close()


def process_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server and each process below it, summed by role:
    tritonserver, stub:<model>, engine_process, other."""
    totals: dict[str, float] = {}
    for pid in [root, *descendant_pids(root)]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        seconds = cpu_seconds(pid)
        if seconds is None:
            continue
        program = os.path.basename(argv[0].decode(errors="replace"))
        if "stub" in program:  # the stub's arguments name its model.py: .../<model>/<version>/model.py
            model_py = next((a.decode() for a in argv if a.endswith(b"model.py")), "?/?/?")
            role = "stub:" + model_py.split("/")[-3]
        elif any(b"engine_process" in a for a in argv):
            role = "engine_process"
        elif program == "tritonserver":
            role = "tritonserver"
        else:
            role = "other"
        totals[role] = totals.get(role, 0.0) + seconds
    return totals


def run_lifetime(repo: str, work: Path, entry: str, args: argparse.Namespace) -> Lifetime:
    lifetime = Lifetime(entry)
    received: list = []
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with serving_bench.ServedEnsemble(repo, work, args.ready_timeout) as server:
        before = process_cpu_seconds(server.process.pid)
        threads = [threading.Thread(target=stream_client, args=(server.grpc_url, entry, args, received,
                                                                lifetime.client_errors))
                   for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        lifetime.crashed_during_load = server.process.poll() is not None
        after = process_cpu_seconds(server.process.pid)
    lifetime.seconds = time.perf_counter() - started
    lifetime.responses = len(received)
    lifetime.cpu_us_per_response = {role: (after[role] - before.get(role, 0.0)) / max(len(received), 1) * 1e6
                                    for role in after if role != "other"}
    log = server.log_path.read_text(errors="replace")
    lifetime.fatal_lines = [line.strip() for line in log.splitlines() if FATAL_LOG.search(line)]
    return lifetime


def prepare_repo(args: argparse.Namespace, work: Path) -> str:
    """A random-weight engine and a filled repository with --bls_instances BLS instances (each
    serves many requests at once)."""
    engine_dir = work / "engine"
    engine_dir.mkdir(parents=True, exist_ok=True)
    seq_len = args.input_len + args.output_len
    serving_bench.write_random_engine(engine_dir, args.model, "bfloat16", max_batch_size=args.clients,
                                      max_seq_len=seq_len, max_num_tokens=max(8192, seq_len), tokens_per_block=32)
    from benchmarks.common import MODELS  # made on first use: the engine's shapes import torch

    serving_bench.write_synthetic_tokenizer(engine_dir, MODELS[args.model]["vocab_size"])
    tokens_per_sequence = -(-seq_len // 32) * 32 + 32
    overrides = serving_bench.repo_overrides(
        {"engine_process": "true", "preprocessing_instances": "1", "postprocessing_instances": "1",
         "stream_interval": "1"},  # every token its own response: the most responses per stream
        kv_tokens=args.clients * tokens_per_sequence)
    return load_script("serve_default").prepare_model_repo(
        str(engine_dir), str(work / "repo"), overrides=overrides, max_batch_size=args.clients, decoupled=True,
        bls_instances=args.bls_instances)


def markdown(args: argparse.Namespace, lifetimes: list[Lifetime], date: str) -> str:
    lines = [f"### Stream stress, {args.model}: {date}, {machine_description()['device']}, "
             f"commit {git_commit()}", "",
             f"`{command_line(__file__)}`  ",
             f"{args.clients} gRPC streams, {args.requests_per_client} streamed requests each of "
             f"{args.input_len} + {args.output_len} tokens, per server lifetime; {args.bls_instances} "
             "tensorrt_llm_bls instances.", "",
             "| entry | lifetimes | crashed (during load / at shutdown) | client errors | responses per lifetime "
             "| CPU us per response: tritonserver / tensorrt_llm stub / BLS stub / postprocessing stub |",
             "|---|---|---|---|---|---|"]
    for entry in args.entries:
        runs = [run for run in lifetimes if run.entry == entry]
        during = sum(run.crashed and run.crashed_during_load for run in runs)
        at_exit = sum(run.crashed and not run.crashed_during_load for run in runs)
        healthy = [run for run in runs if not run.crashed] or runs

        def cpu(role: str) -> str:
            values = [run.cpu_us_per_response.get(role) for run in healthy if role in run.cpu_us_per_response]
            return f"{sum(values) / len(values):.0f}" if values else "-"

        lines.append(f"| {entry} | {len(runs)} | {during + at_exit} ({during} / {at_exit}) "
                     f"| {sum(bool(run.client_errors) for run in runs)} "
                     f"| {sum(run.responses for run in runs) / max(len(runs), 1):.0f} "
                     f"| {cpu('tritonserver')} / {cpu('stub:tensorrt_llm')} / {cpu('stub:tensorrt_llm_bls')} "
                     f"/ {cpu('stub:postprocessing')} |")
    first_fatal = next((run.fatal_lines[:2] for run in lifetimes if run.crashed), None)
    if first_fatal:
        lines += ["", f"First fatal log lines: `{' / '.join(first_fatal)}`"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a shape of benchmarks/common.py MODELS")
    parser.add_argument("--entries", default=",".join(ENTRIES), help=f"comma-separated, of {', '.join(ENTRIES)}")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests_per_client", type=int, default=4)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--servers", type=int, default=4, help="server lifetimes per entry")
    parser.add_argument("--bls_instances", type=int, default=2, help="tensorrt_llm_bls instances (make serve: 2)")
    parser.add_argument("--ready_timeout", type=float, default=300.0)
    parser.add_argument("--work_dir")
    parser.add_argument("--results_md", help="append the table here")
    args = parser.parse_args(argv)
    args.entries = [entry for entry in args.entries.split(",") if entry]
    unknown = set(args.entries) - set(ENTRIES)
    if unknown:
        parser.error(f"--entries: unknown {sorted(unknown)}; allowed: {', '.join(ENTRIES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="stream-stress-"))
    os.environ.setdefault("TRITONLLM_ROOT", str(REPO_ROOT))
    repo = prepare_repo(args, work)
    date = utc_now()
    lifetimes = []
    for entry in args.entries:
        for index in range(args.servers):
            lifetime = run_lifetime(repo, work / f"{entry}-{index}", entry, args)
            lifetimes.append(lifetime)
            state = ("CRASHED " + ("during load" if lifetime.crashed_during_load else "at shutdown")
                     if lifetime.crashed else "ok")
            print(f"{entry:17s} lifetime {index}: {state:22s} {lifetime.responses:6d} responses in "
                  f"{lifetime.seconds:5.1f} s; client errors: {lifetime.client_errors[:1] or 'none'}", flush=True)
    table = markdown(args, lifetimes, date)
    print(table)
    if args.results_md:
        with open(args.results_md, "a") as results:
            results.write("\n" + table)
    return 1 if any(lifetime.crashed for lifetime in lifetimes) else 0


if __name__ == "__main__":
    sys.exit(main())
