# limit 120
# Session 32 helper split51 (issue 51, 20000/2000 at 0.66-0.74x TensorRT-LLM): decode key splits of any count. At the
# plateau (~91 sequences x ~21k keys, 8 KV heads, FP8 pool, keys-major 64 x 2 x 5: 4 programs an SM, 528 at once) the
# default policy "h200" takes 2 splits (1,456 programs: 2.76 waves, 92% of the slots used); "h200-any" (opt-in,
# $TRITONLLM_DECODE_SPLIT_POLICY) takes 5 (3,640: 6.89 waves, 98.5%), at 85 / 100 sequences 3 / 7 where "h200" takes 16
# (a graph clamps it to 4). One attention_kernel_bench --grid run (FP8 head-major pool, keys-major by default):
# 91 / 85 / 100 x 21,000 and 64 / 128 x 20,480, each with forced splits 1..8, both policies eager and as a decode
# graph's replay in the served form (rotary), and the 64 x 2 x 4 tiling (fewer stages: 5 an SM?) at 1 / 2 / 4 / 5.
# Prints us a layer, % of copy bandwidth, programs an SM, waves; then the decision (split51.md in /tmp/notes):
# h200-any becomes the default if at 91 x 21k 5 splits (or h200-any) beat 2 splits (h200) by >= 3% and h200-any loses
# nowhere by more than 1%. Expected ~60-90 s (mostly ~20 Triton compiles). DRY=1: CPU dry run (TRITON_INTERPRET=1,
# a tiny case, meaningless figures) to check the command line.
OUT=${1:?usage: split51.sh OUT}
export PYTHONPATH=$PWD COLUMNS=400
P=${PYTHON:-/opt/torch/.venv/bin/python3}
B=benchmarks/kernels/attention_kernel_bench.py
CASES="decode 91x21000,decode 85x21000,decode 100x21000,decode 64x20480,decode 128x20480"
MORE="policy=h200;policy=h200-any;policy=h200 replay rotary;policy=h200-any replay rotary;splits=2;splits=5"
MORE="$MORE;splits=1;splits=3;splits=4;splits=6;splits=7;splits=8"
MORE="$MORE;tile=64:2:4 splits=1;tile=64:2:4 splits=2;tile=64:2:4 splits=4;tile=64:2:4 splits=5"
EXTRA=""
if [ "${DRY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1; CASES="decode 3x300"; EXTRA="--dry_run_cpu"
else
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt 2>&1
fi
timeout -s INT -k 5 108 $P $B --grid --pool fp8 --pool_layout head_major --grid_no_standard --grid_cases "$CASES" \
  --grid_more "$MORE" --json $OUT/split51.json --markdown $OUT/split51.md $EXTRA > $OUT/split51.log 2>&1
rc=$?
echo "bench rc $rc (0: every row; else the rows printed before it stopped)"
grep -h "copy of 2 GiB\|programs an SM holds" $OUT/split51.log | cut -c1-300
timeout 20 $P - "$OUT/split51.log" <<'PY' | tee $OUT/summary.txt
import sys
from collections import defaultdict

rows = defaultdict(dict)  # case -> label -> (us, % of copy, config, waves text)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(" | ")]
    if len(parts) >= 8 and parts[0].startswith("decode ") and parts[3].endswith(" us"):
        rows[parts[0]][parts[2]] = (float(parts[3][:-3]), parts[5], parts[6], parts[7])
if not rows:
    sys.exit("no bench rows: see split51.log")
print("case | variant | us/layer | % copy | tiling, splits | programs an SM, programs (p), waves (w), slot use")
for case, by_label in rows.items():
    for label, (us, pct, config, waves) in by_label.items():
        waves = waves.replace(" programs", "p").replace(" waves", "w").replace(" of their slots", "")
        print(f"{case[7:]} | {label.replace('policy=', '')} | {us:.1f} | {pct} | {config} | {waves}")
print()
print("(+x%: the h200-any / 5-split / 64x2x4 side faster; a 'replay rotary' pair is the served decode graph's form)")
verdict_gain, losses = None, []
for case, r in rows.items():
    us = {label: v[0] for label, v in r.items()}
    forced = {int(l.split("=")[1]): u for l, u in us.items() if l.startswith("splits=")}
    best = min(forced, key=forced.get) if forced else None
    notes = [f"fastest forced count {best} ({forced[best]:.1f} us)"] if forced else []
    for a, b in (("policy=h200", "policy=h200-any"), ("policy=h200 replay rotary", "policy=h200-any replay rotary")):
        if a in us and b in us:
            ratio = us[a] / us[b]
            notes.append(f"{b} {us[b]:.1f} vs {a} {us[a]:.1f} us: {100 * (ratio - 1):+.1f}%")
            if ratio < 0.99:
                losses.append(f"{case} {b} {100 * (1 / ratio - 1):.1f}% slower")
    if "splits=2" in us and "splits=5" in us:
        notes.append(f"5 splits vs 2: {100 * (us['splits=2'] / us['splits=5'] - 1):+.1f}%")
    if "tile=64:2:4 splits=5" in us and "splits=5" in us:
        notes.append(f"64x2x4 vs 64x2x5 at 5 splits: {100 * (us['splits=5'] / us['tile=64:2:4 splits=5'] - 1):+.1f}%")
    print(f"{case}: " + "; ".join(notes))
    if case == "decode 91x21000":
        gains = [us["splits=2"] / us["splits=5"] - 1] if "splits=2" in us and "splits=5" in us else []
        gains += [us[a] / us[b] - 1 for a, b in (("policy=h200", "policy=h200-any"),
                                                 ("policy=h200 replay rotary", "policy=h200-any replay rotary"))
                  if a in us and b in us]
        verdict_gain = max(gains) if gains else None
print()
if verdict_gain is None:
    print("VERDICT: incomplete (no 91x21000 comparison)")
elif verdict_gain >= 0.03 and not losses:
    print(f"VERDICT: make h200-any the default (91x21k gains {100 * verdict_gain:.1f}% >= 3%, no loss > 1%)")
else:
    print(f"VERDICT: keep h200 (91x21k best gain {100 * verdict_gain:.1f}%; losses: {'; '.join(losses) or 'none'})")
PY
[ $rc -eq 0 ] || { echo "FAILED: bench rc $rc"; grep -v -i warn $OUT/split51.log | tail -15 | cut -c1-300; exit 1; }
