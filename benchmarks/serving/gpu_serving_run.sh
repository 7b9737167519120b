#!/usr/bin/env bash
# The serving benchmark (benchmarks/serving/serving_bench.py) on the GPU machine: a real tritonserver
# serving the ensemble, HTTP generate_stream and gRPC streaming, beside the in-process engine,
# for the SmolLM2 shape and the Llama-3.1-8B shape (random weights made on the GPU).
#
#   bash benchmarks/serving/gpu_serving_run.sh --make-carry   # here: builds .carry/ (about 44 MB)
#   bash benchmarks/serving/gpu_serving_run.sh                # there, from the repo root, .carry carried
#
# What .carry holds, and why (the GPU machine has no network; see ../shared/gpu/README.md):
#   tritonserver.tar.xz   the tritonserver 2.51 of the nvidia-pytriton wheel with its Python 3.12
#                         stub (made by ../shared/gpu/pack_tritonserver.sh); unpacked into the
#                         stub venv's site-packages it is found exactly as an installed
#                         nvidia-pytriton (`pytriton/tritonserver` + `nvidia_pytriton.libs`), so
#                         scripts/launch_triton_server.py needs no flag or change;
#   stub_site.tar.xz      numpy 1.26.4 (the 2.51 stub reads tensors through the numpy 1 ABI; the
#                         torch venv there has numpy 2.5) and the gRPC client: tritonclient 2.73,
#                         grpcio 1.85.1 and protobuf 6.33.6 (its generated code refuses older
#                         ones), python-rapidjson, ml-dtypes 0.5.4 (numpy-1 compatible), xgrammar 0.2.8
#                         with apache-tvm-ffi and pydantic (the served repository turns guided decoding
#                         on; the torch venv there has transformers and triton, its other needs);
#   smollm2_tokenizer.tar.xz  SmolLM2's tokenizer files (the GGUF itself is too big to carry).
#
# The stub venv (Python 3.12, no pip) puts those packages first and the torch venv's
# site-packages after them through a .pth file; the whole benchmark runs on its python3, so the
# launcher (which puts sys.executable's folder first on PATH) gives the stub the same environment.
#
# The 8B shape's random weights emit any id below 128,256, which SmolLM2's tokenizer (49,152
# ids) cannot decode; it is served with a synthetic word-level tokenizer of exactly 128,256
# words (serving_bench.py --synthetic_tokenizer), so the full ensemble (tokenize -> generate ->
# detokenize) is measured for both models.
#
# Outputs (in $OUT, which the device tool brings back; else $WORK/out): serving_<model>.json,
# serving_results.md (the dated tables to append to benchmarks/results/serving.md), console.log, and
# the tritonserver log of a model whose run failed.
#
# Knobs (environment; defaults are for the GPU machine, the small values were used on CPU):
#   BASE_PYTHON=(the torch venv's base)  TORCH_PYTHON=/opt/torch/.venv/bin/python3 (or TORCH_SITE)  CARRY=.carry
#   WORK=/tmp/serving_bench  MODELS="smollm2 llama8b"  CLIENTS=1,16,64  INPUT_LEN=128
#   OUTPUT_LEN=128  RPC=2  MIN_REQUESTS=8  ROUNDS=1  DTYPE=bfloat16  BUDGET_S="190 320" (seconds per model)
#   ENGINE_PROCESS=true (the served model's engine_process parameter; false: the executor in the stub)
#   PREPROCESSING_INSTANCES=1  POSTPROCESSING_INSTANCES=1 (the tokenizer models' instance counts)
#   TENSORRT_LLM_INSTANCES=1 (tensorrt_llm instances relaying one engine process)
#   VARIANTS="" (several servers in one run beside one in-process engine, e.g. the relay before and
#     after issue 14: "before:tensorrt_llm_instances=1 after:tensorrt_llm_instances=4,postprocessing_instances=4")
#   STALL_TIMEOUT_S=120 (a served stream silent this long fails the run as stalled; the stubs' Python
#     stacks then go to the tritonserver log, which is copied to $OUT)
#   CLIENT_PROCESSES=0 (processes the benchmark's clients run in; 0: one per 32 streams, up to cores/4)
#   PATHS=http,grpc,engine (serving_bench.py --paths; add grpc_bls,openai for the OpenAI frontend,
#   which runs from this checkout on the same python3; OPENAI_API=completions|chat; OPENAI_WORKERS: its processes, default the launcher's: one per 4 cores)
set -uo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root
CARRY=${CARRY:-.carry}

make_carry() {
  # Here (x86-64, network): wheels for CPython ${PYVER}, unpacked and stripped of tests.
  set -e
  local pyver=${PYVER:-3.12} tmp wheels site tag
  tag=${pyver/./}
  tmp=$(mktemp -d); wheels=$tmp/wheels; site=$tmp/site
  mkdir -p "$CARRY" "$wheels" "$site"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" \
    numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25 grpcio==1.85.1 protobuf==6.33.6 ml-dtypes==0.5.4 \
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0
  for w in "$wheels"/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  rm -rf "$site"/numpy/*/tests "$site"/numpy/tests "$site"/numpy/f2py "$site"/numpy/distutils "$site"/ml_dtypes/tests
  find "$site" -name __pycache__ -prune -exec rm -rf {} +
  ls "$site"/numpy/core/_multiarray_umath.cpython-"$tag"-* >/dev/null  # the wheels match the Python
  tar cf - -C "$site" . | ${COMPRESS:-xz -T0 -9} > "$CARRY/stub_site.tar.xz"
  if [ "$pyver" = 3.12 ]; then
    bash ../shared/gpu/pack_tritonserver.sh "$CARRY/tritonserver.tar.xz" python3
  else  # a local test with another Python: the same selection as pack_tritonserver.sh, that stub
    local pysite
    pysite=$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec("pytriton").origin)))')
    (cd "$pysite" && tar cf - pytriton/tritonserver/bin pytriton/tritonserver/backends pytriton/tritonserver/caches \
      "pytriton/tritonserver/python_backend_stubs/$pyver" $(ls -d nvidia_pytriton.libs/* | grep -v libpython)) \
      | ${COMPRESS:-xz -T0 -9} > "$CARRY/tritonserver.tar.xz"
  fi
  local engine=${SMOL_ENGINE:-engines/smollm2}
  [ -f "$engine/tokenizer.json" ] || python3 -c "import sys; sys.path.insert(0, 'scripts'); import serve_default; serve_default.ensure_engine('$engine')"
  tar cJf "$CARRY/smollm2_tokenizer.tar.xz" -C "$engine" tokenizer.json tokenizer_config.json chat_template.jinja
  rm -rf "$tmp"
  ls -la "$CARRY"; du -sh "$CARRY"
}

if [ "${1:-}" = "--make-carry" ]; then
  make_carry
  exit $?
fi

TORCH_PYTHON=${TORCH_PYTHON:-/opt/torch/.venv/bin/python3}
# The torch venv's own interpreter (so Triton's JIT finds the same Python headers); else the system's.
BASE_PYTHON=${BASE_PYTHON:-$("$TORCH_PYTHON" -c 'import sys; print(sys._base_executable)' 2>/dev/null || echo /usr/bin/python3.12)}
WORK=${WORK:-/tmp/serving_bench}
RESULTS=${OUT:-$WORK/out}
MODELS=${MODELS:-smollm2 llama8b}
CLIENTS=${CLIENTS:-1,16,64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
RPC=${RPC:-2}
MIN_REQUESTS=${MIN_REQUESTS:-8}
ROUNDS=${ROUNDS:-1}
DTYPE=${DTYPE:-bfloat16}
read -r -a BUDGETS <<< "${BUDGET_S:-190 320}"
mkdir -p "$WORK" "$RESULTS"
exec > >(tee -a "$RESULTS/console.log") 2>&1
export TRITONLLM_ROOT=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

fail() { echo "gpu_serving_run: $*" >&2; exit 1; }
for f in tritonserver.tar.xz stub_site.tar.xz smollm2_tokenizer.tar.xz; do
  [ -f "$CARRY/$f" ] || fail "$CARRY/$f is missing: carry .carry (made here by: bash benchmarks/serving/gpu_serving_run.sh --make-carry)"
done

# 1. The stub venv: carried packages first, the torch venv's site-packages after them.
t0=$(date +%s)
STUBENV=$WORK/stubenv
rm -rf "$STUBENV"
"$BASE_PYTHON" -m venv --without-pip "$STUBENV" || fail "could not make a venv with $BASE_PYTHON"
PY=$STUBENV/bin/python3
SSP=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
tar xf "$CARRY/stub_site.tar.xz" -C "$SSP" || fail "could not unpack stub_site.tar.xz"
tar xf "$CARRY/tritonserver.tar.xz" -C "$SSP" || fail "could not unpack tritonserver.tar.xz"
TORCH_SITE=${TORCH_SITE:-$("$TORCH_PYTHON" -c 'import site; print(site.getsitepackages()[0])')} || fail "no $TORCH_PYTHON"
echo "$TORCH_SITE" > "$SSP/zz_torch_venv.pth"
# The torch venv's scipy and scikit-learn are built for numpy 2 and fail to import under the
# stub's numpy 1; transformers imports scikit-learn (and it scipy) whenever it finds it, for
# AutoTokenizer too. Marking both absent (None in sys.modules: find_spec answers None, import
# raises ImportError) makes transformers skip them; nothing served here needs them.
echo 'import sys; sys.modules.update(dict.fromkeys(("sklearn", "scipy")))' > "$SSP/aa_hide_numpy2_builds.pth"
mkdir -p "$WORK/smollm2_tokenizer" && tar xf "$CARRY/smollm2_tokenizer.tar.xz" -C "$WORK/smollm2_tokenizer"
echo "stub venv (base $BASE_PYTHON, torch site $TORCH_SITE) ready in $(( $(date +%s) - t0 )) s: $SSP"

# 2. Check the environment before spending device time on engine loads.
# (From a file: OpenAI Triton's @jit reads the kernel's source, which a script on stdin has not.)
cat > "$WORK/check_env.py" <<'EOF'
import importlib.util, os, shutil, sys
import numpy, torch, transformers, aiohttp
import prometheus_client  # noqa: F401  (the OpenAI frontend's metrics)
from transformers import AutoTokenizer, GenerationMixin  # noqa: F401  (pulls in what transformers finds)
import tritonclient.grpc
assert numpy.__version__.startswith("1."), f"numpy {numpy.__version__} first on sys.path; the stub needs numpy 1"
spec = importlib.util.find_spec("pytriton")
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__} ({os.path.dirname(numpy.__file__)}), torch "
      f"{torch.__version__} (cuda {torch.cuda.is_available()}), transformers {transformers.__version__}, "
      f"aiohttp {aiohttp.__version__}, tritonclient ok; tritonserver bundle {list(spec.submodule_search_locations)}; "
      f"tritonserver on PATH: {shutil.which('tritonserver')}")
if torch.cuda.is_available():  # OpenAI Triton's JIT under this interpreter (the engine's kernels need it)
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    x = torch.zeros(1000, device="cuda")
    add_one[(4,)](x, 1000, BLOCK=256)
    assert float(x.sum()) == 1000.0
    print(f"{torch.cuda.get_device_name()}: a Triton {triton.__version__} kernel compiled and ran")
EOF
"$PY" "$WORK/check_env.py" || fail "the stub venv is not usable (see above)"

# 3. One bench per model, each under its own time limit (a stuck run must not eat the other's).
status=0
i=0
for model in $MODELS; do
  budget=${BUDGETS[$i]:-300}; i=$((i + 1))
  case $model in
    llama8b|tiny) tokenizer=(--synthetic_tokenizer) ;;
    *) tokenizer=(--tokenizer_dir "$WORK/smollm2_tokenizer") ;;
  esac
  echo "=== $model (limit ${budget} s) ==="
  timeout -k 30 "$budget" "$PY" benchmarks/serving/serving_bench.py --model "$model" --dtype "$DTYPE" "${tokenizer[@]}" \
    --clients "$CLIENTS" --input_len "$INPUT_LEN" --output_len "$OUTPUT_LEN" --requests_per_client "$RPC" \
    --min_requests "$MIN_REQUESTS" --rounds "$ROUNDS" --work_dir "$WORK/$model" --out "$RESULTS/serving_$model.json" \
    --results_md "$RESULTS/serving_results.md" --engine_process "${ENGINE_PROCESS:-true}" \
    --postprocessing_instances "${POSTPROCESSING_INSTANCES:-1}" --preprocessing_instances "${PREPROCESSING_INSTANCES:-1}" \
    --tensorrt_llm_instances "${TENSORRT_LLM_INSTANCES:-1}" --client_processes "${CLIENT_PROCESSES:-0}" \
    --stall_timeout "${STALL_TIMEOUT_S:-120}" \
    --paths "${PATHS:-http,grpc,engine}" --openai_api "${OPENAI_API:-completions}" \
    ${OPENAI_WORKERS:+--openai_workers "$OPENAI_WORKERS"} \
    ${VARIANTS:+--variants "$VARIANTS"}
  rc=$?
  if [ $rc -ne 0 ]; then
    status=$rc
    echo "gpu_serving_run: $model exited with $rc"
    for log in "$WORK/$model"/server*/tritonserver.log; do  # one folder per server (variant)
      [ -f "$log" ] && tail -c 2000000 "$log" > "$RESULTS/tritonserver_${model}_$(basename "$(dirname "$log")").log"
    done
    for log in "$WORK/$model"/server*/openai_frontend.log; do
      [ -f "$log" ] && tail -c 200000 "$log" > "$RESULTS/openai_frontend_${model}_$(basename "$(dirname "$log")").log"
    done
  fi
done
echo "done in $(( $(date +%s) - t0 )) s; results in $RESULTS"
sleep 1  # let tee flush console.log
exit $status
