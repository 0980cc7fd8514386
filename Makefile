# The two commands of the README: `make demo` and `make test`.
# Both create .venv when missing; torch is installed first from the pinned
# CPU wheel (an unpinned torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# pytest workers of make test: 2 (our machines' cores). Most tests wait on
# subprocesses (trainer ranks, SLURM, launchers), so two keep both cores busy;
# each takes whole files (--dist loadfile: a module's fixtures run once).
TEST_WORKERS ?= 2
STAMP  := $(VENV)/.kvtrain-installed

.PHONY: venv demo test clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvtrain demo

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
