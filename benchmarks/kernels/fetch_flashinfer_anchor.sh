#!/bin/bash
# Issue 51's anchor: FlashInfer's paged decode attention (flashinfer-python from PyPI, JIT-compiled on the GPU
# machine), trimmed to what `import flashinfer` and the batch decode JIT need, into the git-ignored
# .anchors/flashinfer/ (nothing of theirs is committed). benchmarks/kernels/decode_attention_anchor_bench.py
# unpacks it there. The device machines reach nothing outside, so run this here and pass .anchors in the run's carry.
#   bash benchmarks/kernels/fetch_flashinfer_anchor.sh [PYTHON]      (default: .venv/bin/python; needs torch)
# What it writes (.anchors/flashinfer/README says the same, with the versions):
#   flashinfer_python-$VERSION-decode.tar.xz   the wheel's files that benchmarks/kernels/flashinfer_anchor_trim.py
#                                              keeps (the whole wheel is 101 MB, over a device call's 64 MiB carry)
#   apache_tvm_ffi-*.whl, ninja-*.whl          for the GPU machine's Python 3.12 (it has no apache-tvm-ffi; ninja
#                                              runs the JIT's build: carried in case its PATH has none)
# The GPU machine has flashinfer's other imports (einops, tabulate, nvidia-ml-py, requests, click, packaging,
# filelock, jinja2, tqdm, cuda-bindings) and nvcc 13.0. Before writing, it proves the tarball on this machine:
# `import flashinfer` from the unpacked tarball, generates the decode and fa2-prefill JIT sources and build files
# (CPU only: nothing compiles here) and follows their #include lines: every header the whole wheel resolves must
# resolve in the tarball too.
set -euo pipefail
VERSION="${FLASHINFER_VERSION:-0.7.4}"
TVM_FFI="${TVM_FFI_VERSION:-0.1.15.post2}"  # flashinfer 0.7.4 asks >=0.1.11,<0.2; the one xgrammar pins here
NINJA="${NINJA_VERSION:-1.13.0}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${1:-$root/.venv/bin/python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
dest="$root/.anchors/flashinfer"
"$python" -m pip download -q "flashinfer-python==$VERSION" --no-deps --only-binary=:all: -d "$tmp/wheel"
mkdir -p "$tmp/gpu"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$tmp/gpu" "apache-tvm-ffi==$TVM_FFI" "ninja==$NINJA"
# flashinfer's imports this machine may lack, for the import probe only (not carried)
"$python" -m pip install -q --no-deps --target "$tmp/deps" nvidia-ml-py einops tabulate
(cd "$tmp" && "$python" -m zipfile -e wheel/flashinfer_python-*.whl unpacked)
export PYTHONPATH="$tmp/deps${PYTHONPATH:+:$PYTHONPATH}"
"$python" "$root/benchmarks/kernels/flashinfer_anchor_trim.py" "$tmp/unpacked" > "$tmp/files.txt"
tarball="flashinfer_python-$VERSION-decode.tar.xz"
tar cJf "$tmp/$tarball" -C "$tmp/unpacked" -T "$tmp/files.txt"
mkdir -p "$tmp/trimmed" && tar xJf "$tmp/$tarball" -C "$tmp/trimmed"
for tree in unpacked trimmed; do  # the JIT sources each tree generates, and the headers they reach
  (cd "$tmp/$tree" && FLASHINFER_WORKSPACE_BASE="$tmp/ws-$tree" PYTHONPATH="$tmp/$tree:$PYTHONPATH" \
    "$python" "$root/benchmarks/kernels/flashinfer_anchor_trim.py" --generate > "$tmp/specs-$tree.txt")
  generated=$(ls -d "$tmp/ws-$tree"/.cache/flashinfer/*/*/generated)
  "$python" "$root/benchmarks/kernels/flashinfer_anchor_trim.py" --check-includes "$tmp/$tree" "$generated" \
    > "$tmp/includes-$tree.json"
done
if ! cmp -s "$tmp/includes-unpacked.json" "$tmp/includes-trimmed.json"; then
  echo "the trimmed tarball misses headers the JIT sources include:" >&2
  diff <(tr ',' '\n' < "$tmp/includes-unpacked.json") <(tr ',' '\n' < "$tmp/includes-trimmed.json") >&2 || true
  exit 1
fi
rm -rf "$dest" && mkdir -p "$dest"
mv "$tmp/$tarball" "$tmp"/gpu/*.whl "$dest/"
headers=$("$python" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['headers_in_package']))" \
  "$tmp/includes-trimmed.json")
{
  echo "FlashInfer $VERSION (PyPI wheel flashinfer_python-$VERSION-py3-none-any.whl), Apache-2.0; fetched by"
  echo "benchmarks/kernels/fetch_flashinfer_anchor.sh for benchmarks/kernels/decode_attention_anchor_bench.py"
  echo "(issue 51's anchor). Git-ignored: not part of this repository. Files:"
  echo "  $tarball: $(wc -l < "$tmp/files.txt") of the wheel's files (benchmarks/kernels/flashinfer_anchor_trim.py);"
  echo "    checked here: imports, generates these JIT modules' sources, and their $headers headers in the package resolve:"
  sed 's/^/      /' "$tmp/specs-trimmed.txt"
  for wheel in "$dest"/*.whl; do echo "  $(basename "$wheel")"; done
} > "$dest/README"
cat "$dest/README"
du -sh "$dest"
