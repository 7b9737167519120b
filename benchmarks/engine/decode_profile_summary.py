"""The few lines of engine_bench.py decode entries that a device call's console needs: per JSON file, batch-1 tok/s
(synchronous and overlapped) and the graph replay's ms, the head of its per-kernel graph profile, and for MoE engines
the load-time expert GEMV choice (kernels/moe_gemv_choice.py: the tiles marked per token count, the grouped and GEMV
pair times, the fastest gate_up / down candidates at one token, or at each of ``--tokens``).

    python benchmarks/engine/decode_profile_summary.py OUT/a.json OUT/b.json [--rows 10] [--tokens 1 2 4 8]
"""
from __future__ import annotations

import argparse
import ast
import json


def summary(path: str, rows: int, tokens: tuple = (1,)) -> list[str]:
    try:
        with open(path) as f:
            decode = json.load(f)["decode"]
    except (OSError, KeyError, ValueError) as error:  # (a run cut short by its guard writes nothing)
        return [f"{path}: no decode entry ({type(error).__name__})"]
    figures = {k: round(decode[k], 3) for k in ("tok_s", "overlapped_tok_s", "graph_replay_ms") if k in decode}
    lines = [f"{path.rsplit('/', 1)[-1]} {figures}"]
    lines += (decode.get("graph_step_profile") or "").splitlines()[:rows]
    for key, choice in decode.get("gemm_choices", {}).items():
        if "gemv" not in key:
            continue
        lines.append(f" gemv tiles {choice.get('tiles')} | grouped us {choice.get('grouped_us')} | "
                     f"pair us {choice.get('gemv_us')}")
        for count in tokens:
            for name in ("gate_up_us", "down_us"):
                try:  # (engine_bench records the report's values as their str())
                    timed = ast.literal_eval(choice.get(name, "{}")).get(count, {})
                except (ValueError, SyntaxError):
                    continue
                fastest = sorted(timed.items(), key=lambda item: item[1])[:6]
                lines.append(f"  {name} at {count} token{'s' if count > 1 else ''}: "
                             + ", ".join(f"{tiles} {us:.1f}" for tiles, us in fastest))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--rows", type=int, default=10, help="graph profile lines a file")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1], help="the expert GEMV candidates at these counts")
    args = parser.parse_args()
    for path in args.paths:
        print("\n".join(summary(path, args.rows, tuple(args.tokens))))


if __name__ == "__main__":
    main()
