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

.PHONY: venv demo test coverage clean

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

# The lines of kvtrain/ and data_tools/ that no test runs, subprocesses (trainer
# ranks, CLIs, workers) included: every path is tested or refused in one line,
# and this finds the ones that are neither. Not part of `make test` (coverage
# slows the suite ~1.6x); the coverage package is installed here only.
COVERAGE_DATA ?= $(CURDIR)/.coverage
coverage: $(STAMP)
	$(PY) -m pip install -q "coverage>=7.10"
	rm -f $(COVERAGE_DATA) $(COVERAGE_DATA).*
	-KVTRAIN_COVERAGE_DATA=$(COVERAGE_DATA) COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml \
	  $(PY) -m coverage run --rcfile=pyproject.toml -m pytest -q -n $(TEST_WORKERS) \
	  --dist loadfile tests $(PYTEST_ARGS)
	KVTRAIN_COVERAGE_DATA=$(COVERAGE_DATA) $(PY) -m coverage combine -q --rcfile=pyproject.toml
	KVTRAIN_COVERAGE_DATA=$(COVERAGE_DATA) $(PY) -m coverage report --rcfile=pyproject.toml \
	  --sort=-miss --skip-covered -m

clean:
	rm -rf $(VENV) runs .pytest_cache .coverage .coverage.*
