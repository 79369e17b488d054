# make serve / make test: idempotent; they create .venv and install into it when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
MODEL ?= smollm2-135m-instruct

.PHONY: install serve test test-all fetch clean proto

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

fetch: $(STAMP)
	$(VENV)/bin/tandem models fetch $(MODEL)

serve: $(STAMP)
	$(VENV)/bin/tandem serve --model $(MODEL)

test: $(STAMP)
	$(VENV)/bin/tandem models fetch $(MODEL)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

clean:
	rm -rf $(VENV) .pytest_cache

# Regenerate the Python code of proto/*.proto (committed; a test fails when it is stale).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. proto/*.proto
