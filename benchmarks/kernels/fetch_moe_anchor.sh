#!/bin/bash
# Issue 53's anchor: SGLang's Triton fused-MoE kernel file and its tuned H200 tile tables, extracted from the
# sglang wheel on PyPI into the git-ignored .anchors/ at the repository root (nothing of theirs is committed).
# benchmarks/kernels/moe_anchor_bench.py loads the file from there with importlib. The device machines reach
# nothing outside, so run this here and pass .anchors in the run's `carry`.
#   bash benchmarks/kernels/fetch_moe_anchor.sh [PYTHON]      (default: .venv/bin/python)
# What it writes (.anchors/README says the same, with the version):
#   .anchors/sglang_fused_moe_triton_kernels.py   sglang/kernels/ops/moe/fused_moe_triton_kernels.py
#   .anchors/sglang_config_bf16_h200.json          .../triton_utils/configs/triton_3_6_0/E=128,N=768,device_name=NVIDIA_H200.json
#   .anchors/sglang_config_fp8_block_h200.json     .../triton_3_2_0/E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json
set -euo pipefail
VERSION="${SGLANG_VERSION:-0.5.23}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${1:-$root/.venv/bin/python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download "sglang==$VERSION" --no-deps --only-binary=:all: -d "$tmp" -q
mkdir -p "$root/.anchors"
"$python" - "$tmp" "$root/.anchors" "$VERSION" <<'PY'
import glob, sys, zipfile
from pathlib import Path

tmp, dest, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
wheel = sorted(glob.glob(f"{tmp}/sglang-*.whl"))[0]
configs = "sglang/srt/layers/moe/moe_runner/triton_utils/configs/"
members = {
    "sglang_fused_moe_triton_kernels.py": "sglang/kernels/ops/moe/fused_moe_triton_kernels.py",
    "sglang_config_bf16_h200.json": configs + "triton_3_6_0/E=128,N=768,device_name=NVIDIA_H200.json",
    "sglang_config_fp8_block_h200.json":
        configs + "triton_3_2_0/E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json",
}
with zipfile.ZipFile(wheel) as zf:
    for name, member in members.items():
        (dest / name).write_bytes(zf.read(member))
lines = [f"SGLang {version} (PyPI wheel {Path(wheel).name}), Apache-2.0; fetched by",
         "benchmarks/kernels/fetch_moe_anchor.sh for benchmarks/kernels/moe_anchor_bench.py (issue 53's anchor).",
         "Git-ignored: not part of this repository. Files (ours <- theirs):"]
lines += [f"  {name} <- {member}" for name, member in members.items()]
(dest / "README").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
