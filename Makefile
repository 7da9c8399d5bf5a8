# polar-train: two commands. `make test` and `make demo` set up everything they need first.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.polar-installed

.PHONY: setup test demo vllm harnesses clean

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || "$$(scripts/find-python 3.12)" -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

vllm:
	scripts/install-vllm-cpu

harnesses:
	@if [ -x scripts/install-harnesses ]; then scripts/install-harnesses; fi

setup: $(STAMP) vllm harnesses

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/polar-train demo

clean:
	rm -rf $(VENV) .venv-vllm .harnesses build *.egg-info
