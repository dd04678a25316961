# Two commands matter: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
# mkdocs-material prints an end-of-life notice on every build; the build itself is what counts.
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test test-slow lint format docs proto clean chromium etcd

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: the project's range would otherwise pull a multi-GB CUDA build.
$(VENV)/.torch: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e '.[examples]'
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[dev,examples,flower,s3,ha,docs]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/coordinator local --sites 3 --nproc-per-node 2 --config examples/gpt_diloco/job.toml \
		--run-dir runs/gpt_diloco --fresh -- examples/gpt_diloco/train.py

# The status page test drives Debian's chromium with playwright (never `playwright install`):
# installed here when no chromium is on PATH (CI runs as root on Debian).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq chromium >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }; }

# The standby-coordinator tests start a real etcd (Debian's etcd-server 3.4; no systemd here:
# the tests run the binary themselves): installed when no etcd is on PATH.
etcd:
	@command -v etcd >/dev/null 2>&1 || \
		{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq etcd-server >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null; }; }

test: $(VENV)/.dev chromium etcd
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m pytest -q -m "not slow" -n 2

# The docs site, into site/: two reference pages are generated from the code (docs/hooks.py);
# a broken link or anchor fails the build.
docs: $(VENV)/.dev
	$(BIN)/mkdocs build --strict

# The slow tests: the whole fault matrix and more (71 tests, 26-30 minutes on 2 cores); `python -m bench.chaos` runs
# the same scenarios and prints the summary figures.
test-slow: $(VENV)/.dev etcd
	$(BIN)/python -m pytest -q -m slow

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Regenerate the committed gRPC stubs (grpcio-tools is pinned: newer stubs need protobuf 7).
proto: $(VENV)/.dev
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		wire/proto/isthmus.proto

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache
