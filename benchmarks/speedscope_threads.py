"""Per-thread summaries of a py-spy profile in speedscope format, for a stall that only some runs show.

``py-spy record --native --threads --idle --format speedscope -o P.json -- python BENCH`` writes one sampled
profile per thread, in time order from the thread's start (with ``--idle`` a blocked thread is sampled too, so
a profile's weights sum to its lifetime). A thread started once per run (the encode queue's worker) thus gives
one profile per run, and the run that stalled is the one whose thread spent longest inside the function that
launches its work. Where that time went is then read from the innermost frames of those samples:
``take_gil`` / ``pthread_cond_*wait`` under the interpreter means waiting for the GIL, a ``libcuda`` frame
(or ``ioctl`` / ``sched_yield`` under it) means the driver held the launch (its queue full), and a Python leaf
means the thread was running Python.

    python benchmarks/speedscope_threads.py P.json --threads image_encode_queue --inside _launch
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter


def leaf_name(frame: dict) -> str:
    """``function (library or file)`` of one speedscope frame; bare addresses keep only their library."""
    where = os.path.basename(frame.get("file") or "") or "?"
    name = frame.get("name") or "?"
    if name.startswith("0x"):
        name = "<address>"
    return f"{name} ({where})"


def innermost(stack: list[int], frames: list[dict]) -> str:
    """``native <- python``: the innermost frame with a name (libc's stripped waits have none, so their caller,
    ``take_gil`` or a libcuda entry, says what the thread waits for) and the innermost Python frame."""
    native = next((leaf_name(frames[i]) for i in reversed(stack)
                   if not (frames[i].get("name") or "0x").startswith("0x")
                   and not (frames[i].get("file") or "").endswith(".py")), "-")
    python = next((leaf_name(frames[i]) for i in reversed(stack) if (frames[i].get("file") or "").endswith(".py")), "-")
    return f"{native} <- {python}"


def summarize(profile: dict, frames: list[dict], inside: str | None, leaves: int) -> dict:
    """One thread's lifetime, time inside ``inside`` (any sample whose stack holds a frame of that name) as
    consecutive stretches, and the innermost frames of those samples (or of all samples without ``inside``)."""
    inside_ids = {i for i, f in enumerate(frames) if inside is not None and f.get("name") == inside}
    stretches, current, leaf_counts, total = [], 0.0, Counter(), 0.0
    for stack, weight in zip(profile["samples"], profile["weights"]):
        total += weight
        hit = inside is None or any(i in inside_ids for i in stack)
        if hit:
            current += weight
            leaf_counts[innermost(stack, frames)] += weight
        elif current:
            stretches.append(current)
            current = 0.0
    if current:
        stretches.append(current)
    inside_total = sum(stretches)
    return {"thread": profile["name"], "lifetime_s": round(total, 3), "inside_s": round(inside_total, 3),
            "longest_stretches_s": sorted((round(s, 3) for s in stretches), reverse=True)[:5],
            "leaves": [(name, round(w, 3), round(w / inside_total, 3) if inside_total else None)
                       for name, w in leaf_counts.most_common(leaves)]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="py-spy's speedscope JSON")
    p.add_argument("--threads", default=".", help="regular expression on the thread's name (default: all)")
    p.add_argument("--inside", default=None, help="function name: summarize only samples under it")
    p.add_argument("--leaves", type=int, default=6, help="innermost-frame pairs listed per thread")
    p.add_argument("--out", default=None, help="also write the summaries here as JSON")
    args = p.parse_args(argv)
    with open(args.profile) as f:
        data = json.load(f)
    frames = data["shared"]["frames"]
    pattern = re.compile(args.threads)
    rows = [summarize(prof, frames, args.inside, args.leaves) for prof in data["profiles"]
            if pattern.search(prof["name"])]
    for row in rows:
        print(f"{row['thread']}: lifetime {row['lifetime_s']} s, inside {args.inside or 'anything'} {row['inside_s']} s "
              f"(longest stretches {row['longest_stretches_s']})")
        for name, seconds, share in row["leaves"]:
            print(f"    {seconds:7.3f} s {'' if share is None else f'{share:5.1%}'}  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
