# The two README commands: `make demo` (set up + main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hapc-installed
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow lint fuzz mutate clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) torch==2.13.0 torchvision==0.28.0
	$(BIN)/pip install -q -e ".[dev,triton,hf]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/hapc demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -q -m "not slow" $(PYTEST_ARGS)

# the long cases (library models trained on gloo processes); CI runs them after `make test`
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -q -m slow $(PYTEST_ARGS)

# the equivalence fuzzer's long profile: 60 batches of 8 random models x clusters, counts printed
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s tests/test_fuzz.py

# mutation testing (issue 16): plants each mutant of benchmarks/mutants.toml in a temporary copy,
# runs the tests named beside it, writes benchmarks/MUTATION.md; MUTATE_ARGS="-k astar" for some
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(BIN)/python benchmarks/mutate.py $(MUTATE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
