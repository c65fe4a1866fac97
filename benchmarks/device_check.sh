#!/usr/bin/env bash
# One call on a lent GPU box (the `device` tool): the tensor-parallel cost model against the
# card, the runtime tests on CUDA in float32 against transformers, eager vs CUDA graphs on a
# SmolLM2-shaped model, and the collective KV pair. TP_S=0, TESTS_S=0, DTYPES="" or NCCL_S=0
# skip a part.
# The SmolLM2 weights (0.5 GB) cannot travel, so the benchmark uses seeded random weights of
# the same shapes. Prepare .devcarry here (git-ignored), then carry it:
#   python -m benchmarks.random_model --config-only --out .devcarry/smollm2-config \
#       --like ~/.cache/bucketserve/models/SmolLM2-135M-Instruct.Q4_1-*
#   tokenizer files for the tests in .devcarry/tokenizer; in .devcarry/whl the wheels of
#   gguf, llguidance, jsonschema, jsonschema-specifications, referencing and rpds-py
#   (`pip download --no-deps --only-binary=:all: --python-version 3.12 ...`)
# Logs and JSON go to $OUT (default ./device-out).
set -u
OUT=${OUT:-device-out}
CARRY=${CARRY:-.devcarry}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$CARRY"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
    torch.version.cuda, "transformers", transformers.__version__)'
  nproc; } | tee "$OUT/machine.txt"

if [ "${TP_S:-180}" != 0 ]; then
  echo "== tensor-parallel cost model against this GPU (Llama-2-13B shapes, bfloat16)"
  timeout "${TP_S:-180}" python3 -m benchmarks.tp_cost_check --device cuda \
      --out "$OUT/tp_cost_check.json" >"$OUT/tp_cost_check.log" 2>&1
  echo "tp_cost_check exit $?"
  tail -9 "$OUT/tp_cost_check.log"
fi

[ "${TESTS_S:-240}" != 0 ] && echo "== runtime tests on CUDA (float32)" &&
BUCKETSERVE_TEST_TOKENIZER_DIR="$CARRY/tokenizer" timeout "${TESTS_S:-240}" \
    python3 -m pytest -q -p no:cacheprovider -o addopts=-ra --timeout 120 tests/runtime \
    -m "not smollm and not gemma" --ignore tests/runtime/test_weights.py \
    --ignore tests/runtime/test_tensor_parallel.py \
    --ignore tests/runtime/test_tokenizer.py --ignore tests/runtime/test_cpu_kernels.py \
    --ignore tests/runtime/test_host_memory.py --ignore tests/runtime/test_engine_cli.py \
    >"$OUT/pytest_cuda.log" 2>&1
echo "pytest exit $?"
[ -f "$OUT/pytest_cuda.log" ] && grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.log" | tail -25

for dtype in ${DTYPES-bfloat16 float32}; do
  echo "== eager vs CUDA graphs, $dtype"
  timeout "${BENCH_S:-200}" python3 -m benchmarks.graph_modes --device cuda --dtype "$dtype" \
      --model "$CARRY/smollm2-config" --random-weights --ignore-eos --kv-memory-fraction 0.3 \
      --warmup-sample 0 --repeats 3 --out "$OUT/graph_modes_cuda_$dtype.json" \
      >"$OUT/graph_modes_$dtype.log" 2>&1
  echo "graph_modes exit $?"
  grep -v -E "Warning|warn|Writing model|^\s*$" "$OUT/graph_modes_$dtype.log" | tail -14
done

[ "${NCCL_S:-60}" = 0 ] && exit 0
echo "== collective KV pair over NCCL on one GPU (NCCL may refuse two ranks on one GPU)"
NCCL_DEBUG=WARN timeout 60 python3 -m benchmarks.collective_pair --backend nccl \
    --devices cuda:0,cuda:0 --dtype bfloat16 >"$OUT/nccl.log" 2>&1
echo "nccl exit $?"
grep -E "Duplicate|invalid usage|Error|backend=" "$OUT/nccl.log" | head -4
