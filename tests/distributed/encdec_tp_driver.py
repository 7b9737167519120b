"""Both ranks of the encoder-decoder tensor-parallel test: the executor's greedy ids and generation logits.

    python tests/distributed/encdec_tp_driver.py --rank 0 --families t5_v1_1 bart --engine_dirs A/decoder B/decoder \
        --ports 29601 29602 --out result.json
    python tests/distributed/encdec_tp_driver.py --rank 1 --families ... --engine_dirs ... --ports ...

One job per engine, one after the other in the same two processes (a process start costs seconds of
imports on CI's two cores), each on its own rendezvous port (``--ports``). Rank 0 runs
an Executor (make_runner's LeaderRunner) over ``requests(family)``, all in flight together; rank 1 runs the
real worker (engine.tensor_parallel.worker's main). Rank 0 writes JSON: family -> ``tokens`` (generated
ids per request) and ``logits`` (each request's generation logits, one row per token).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny_encdec

FAMILIES = ("t5_v1_1", "bart", "whisper")
MAX_TOKENS = 6


def requests(family: str) -> list[tuple[list[int], list[int] | torch.Tensor]]:
    """(decoder prompt, encoder input) of each request: the three encoder inputs of tiny_encdec after the
    decoder start, or two 1-s Whisper windows of random log-mels after its transcription prompt."""
    from tiny_encdec import INPUTS, WHISPER_PROMPT

    if family != "whisper":
        return [([], ids) for ids in INPUTS]
    generator = torch.Generator().manual_seed(1)
    return [(WHISPER_PROMPT, torch.randn(100, 8, generator=generator)) for _ in range(2)]


def generate(engine_dir: str, family: str) -> dict:
    from engine.executor import Executor, ExecutorConfig, OutputConfig, Request

    output = OutputConfig(exclude_input_from_output=True, return_generation_logits=True)
    batch = []
    for prompt, source in requests(family):
        inputs = {"encoder_input_features": source} if family == "whisper" else {"encoder_input_ids": source}
        batch.append(Request(prompt, MAX_TOKENS, end_id=1, output=output, **inputs))
    with Executor(engine_dir, ExecutorConfig(max_batch_size=4, max_tokens_in_paged_kv_cache=1024)) as ex:
        ids = ex.enqueue_requests(batch)
        finals: dict[int, object] = {}
        while len(finals) < len(ids):
            for response in ex.await_responses(timeout=1.0):
                if response.error is not None:
                    raise RuntimeError(f"request {response.request_id}: {response.error}")
                if response.result.is_final:
                    finals[response.request_id] = response.result
    return {"tokens": [finals[i].output_token_ids[0] for i in ids],
            "logits": [finals[i].generation_logits[0].float().tolist() for i in ids]}


def run_rank(rank: int, families: list[str], engine_dirs: list[str], ports: list[int], out: str | None) -> int:
    """This rank's part of the jobs (module docstring); rank 0 writes ``out``."""
    results = {}
    for family, engine_dir, port in zip(families, engine_dirs, ports, strict=True):
        os.environ["TRITONLLM_DIST_PORT"] = str(port)
        if rank == 0:
            results[family] = generate(engine_dir, family)
        else:
            from engine.tensor_parallel.worker import main as worker

            on_cpu = [] if torch.cuda.is_available() else ["--device", "cpu"]  # (else its GPU, as rank 0's)
            if worker(["--engine_dir", engine_dir, *on_cpu]) != 0:
                return 1
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, choices=(0, 1), required=True)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, required=True)
    parser.add_argument("--engine_dirs", nargs="+", required=True)
    parser.add_argument("--ports", nargs="+", type=int, required=True, help="a rendezvous port per job")
    parser.add_argument("--out", help="rank 0: where the JSON goes")
    args = parser.parse_args()
    return run_rank(args.rank, args.families, args.engine_dirs, args.ports, args.out)


if __name__ == "__main__":
    sys.exit(main())
