# Kakeya runtime. Two commands on a fresh machine:
#   make run    set up everything, pull the default model, start the daemon
#   make test   set up everything, lint (ruff), type-check (mypy) and run the whole suite (Python + TypeScript + buf lint)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
STUBS   := wire/python/kakeya_wire/v1/runtime_pb2.py
PACKAGES := pyproject.toml wire/python/pyproject.toml sdks/python/pyproject.toml
MODEL   ?= smollm2-135m-instruct
ARGS    ?=
PYTEST_ARGS ?=

.PHONY: setup native proto model run test test-python lint-python typecheck test-ts lint-proto bench bench-deps clean proxy cluster validate-k8s

setup: $(STAMP) $(STUBS) native

# The native CPU row step (inference_engine/backends/torch/csrc/row_step.cpp): built once per machine and torch
# version under $(KAKEYA_HOME)/native, loaded from there after; without a C++ compiler it says so and the
# daemon runs its decode steps in Python.
native: $(STAMP)
	$(BIN)/python -m inference_engine.backends.torch.native

# torch is pinned to the CPU build on local disk; any other spec can pull a multi-GB CUDA build.
# Three distributions, installed editable: the wire stubs and shared rules (kakeya-wire), the SDK
# (kakeya, with the kakeya-chat script) and the daemon (kakeya-runtime), which needs only kakeya-wire
# (its dev and chat extras add the SDK). MLX (the `mlx` extra, --backend mlx) is installed
# when the platform has wheels for it; a failure there only warns. The stubs are generated after the install
# (the generator, grpcio-tools, is a dev dependency); the editable wire package picks them up.
$(STAMP): $(PACKAGES)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e wire/python -e sdks/python -e '.[dev]'
	$(BIN)/python -m pip install --quiet -e '.[mlx]' || echo "WARNING: MLX did not install here (extra 'mlx': mlx[cpu] on Linux, mlx on macOS). Everything else works; kakeya serve --backend mlx says what to install, and the MLX tests skip (under CI they fail)."
	touch $@

$(STUBS): $(STAMP) $(wildcard proto/kakeya/v1/*.proto) scripts/gen_proto.py
	$(BIN)/python scripts/gen_proto.py

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

model: setup
	$(BIN)/kakeya models pull $(MODEL)

run: setup model
	$(BIN)/kakeya serve --model $(MODEL) $(ARGS)

test: setup model proxy lint-python typecheck test-python test-ts lint-proto

# two workers (pytest-xdist), a test file per worker at a time: the suite took 12:45 on one process on a 2-core
# AVX2 EPYC, 7:22 on two (both 1068 passed); PYTEST_WORKERS=0 runs it in this process
PYTEST_WORKERS ?= 2
test-python: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Lint only ([tool.ruff] in pyproject.toml); the tree is not reformatted.
lint-python: setup
	$(BIN)/ruff check .

# [tool.mypy] in pyproject.toml: which packages, at what level.
typecheck: setup
	$(BIN)/mypy

TS_DEPS := sdks/typescript/node_modules/.package-lock.json

$(TS_DEPS): sdks/typescript/package-lock.json
	cd sdks/typescript && npm ci --no-audit --no-fund

test-ts: setup $(TS_DEPS)
	cd sdks/typescript && npm test

lint-proto: $(TS_DEPS)
	cd sdks/typescript && npm run buf:lint

# HAProxy, the proxy in front of several daemons (deploy/haproxy, `kakeya cluster`, the cluster tests):
# installed with apt when missing and this is root (CI); elsewhere a message says how, and the cluster
# tests skip (under CI they fail).
proxy:
	@command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null) || { echo "make proxy: apt-get install haproxy failed" >&2; exit 1; }; \
	  else \
	    echo "NOTE: HAProxy is not installed; kakeya cluster and the cluster tests need it: apt-get install haproxy (Debian/Ubuntu, as root), dnf install haproxy, or brew install haproxy. The cluster tests skip without it."; \
	  fi; }

N ?= 3

# N daemons sharing a state directory behind HAProxy on 127.0.0.1:50051 (deploy/haproxy); Ctrl-C stops them.
cluster: setup model proxy
	$(BIN)/kakeya cluster up $(N) --model $(MODEL) --serve-args="$(ARGS)"

# The Kubernetes example's manifests against the API schemas (deploy/k8s; not part of setup: ~110 MB).
validate-k8s: setup
	$(BIN)/python -m pip install --quiet kubernetes-validate==1.37.0
	$(BIN)/kubernetes-validate --strict deploy/k8s/kakeya.yaml
	$(BIN)/kubernetes-validate --strict -k 1.30.0 deploy/k8s/kakeya.yaml

KAKEYA_HOME ?= $(HOME)/.cache/kakeya
WHEELS := $(KAKEYA_HOME)/wheels
LLAMA_CPP := llama-cpp-python==0.3.36

bench-deps: setup
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || $(BIN)/python -m pip wheel --no-deps -w $(WHEELS) $(LLAMA_CPP)
	$(BIN)/python -m pip install --quiet --find-links $(WHEELS) $(LLAMA_CPP)

bench: setup model
	$(BIN)/python scripts/bench_agentic/bench_turns.py

clean:
	rm -rf $(VENV) wire/python/kakeya_wire/v1 sdks/typescript/node_modules sdks/typescript/src/gen sdks/typescript/dist
