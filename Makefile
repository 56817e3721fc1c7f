# Set-up and everyday commands. Each target creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint bench samples clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-cache-dir --upgrade pip
	$(BIN)/python -m pip install --quiet --no-cache-dir -c constraints.txt -e '.[dev,plot,interop,fast]'
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p build/make-demo
	$(BIN)/qtool quantize sample_weights/mlp.safetensors -o build/make-demo/mlp.int8.safetensors --force
	$(BIN)/qtool dequantize build/make-demo/mlp.int8.safetensors -o build/make-demo/mlp.restored.safetensors --force

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q

bench: $(STAMP)
	$(BIN)/python scripts/bench.py

samples: $(STAMP)
	$(BIN)/python scripts/make_sample_weights.py

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis
