# make demo: set up and run the main job on its embedded defaults. make test: set up and pass the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0 pinned first, unless one is importable (the CPU build where the index serves it, as on CI; see README).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/energy search search/quickstart.energy --storage runs/demo/optuna.journal

test: $(STAMP)
	$(BIN)/python -m ruff check energydsl tests benchmarks
	$(BIN)/python -m pytest -q -n 2

bench: $(STAMP)
	$(BIN)/python benchmarks/derive_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
