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
        if key.startswith("fp8_block_skinny"):
            lines += block_fp8_lines(key, choice)
        if "gemv" not in key:
            continue
        lines.append(f" gemv tiles {choice.get('tiles')} | grouped us {choice.get('grouped_us')} | "
                     f"pair us {choice.get('gemv_us')} | {_seconds(choice)}")
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


def block_fp8_lines(key: str, choice: dict) -> list[str]:
    """A block-FP8 dense product's choice (kernels/fp8_block_choice.py): the tiling marked, the block GEMM's and the
    best tiling's us at 1 and 8 rows, and the six fastest candidates at one row (reports that list them)."""
    lines = [f" {key}: variant {choice.get('variant')} | block GEMM us {choice.get('block_gemm_us')} | "
             f"best {choice.get('best_us')} | {_seconds(choice)}"]
    try:
        timed = ast.literal_eval(choice.get("variant_us", "{}"))
    except (ValueError, SyntaxError):
        return lines
    fastest = sorted(((v, us[1]) for v, us in timed.items() if 1 in us), key=lambda item: item[1])[:6]
    if fastest:
        lines.append("  at 1 row: " + ", ".join(f"{v} {us:.2f}" for v, us in fastest))
    return lines


def _seconds(choice: dict) -> str:
    """The choice's wall time at this load (compiles included), or that it came from the choice cache."""
    if str(choice.get("cached")) == "True":
        return "cached"
    seconds = choice.get("seconds")
    return f"{float(seconds):.1f} s" if seconds is not None else "s ?"


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
