# polar-train: two commands. `make test` and `make demo` set up everything they need first.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.polar-installed

.PHONY: help setup test demo vllm harnesses clean

help:  # the default: what each target does
	@echo "make demo       set up .venv and run the demo (capture -> build -> train -> capture again, on CPU)"
	@echo "make test       set up everything (.venv, the vLLM CPU venv, the harness CLIs) and run the tests"
	@echo "make setup      only the set-up of make test"
	@echo "make vllm       the vLLM CPU build in .venv-vllm (its command: .venv-vllm/bin/vllm)"
	@echo "make harnesses  the Codex, Claude Code and Pi CLIs under .harnesses"
	@echo "make clean      remove what the set-up made"
	@echo "The commands (polar-train, mitmdump) are in .venv/bin: source .venv/bin/activate"

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
	rm -rf $(VENV) .harnesses build *.egg-info
	@# .venv-vllm only where scripts/install-vllm-cpu made it (it never deletes a user's own venv either)
	@if [ -f .venv-vllm/.polar-install-started ]; then rm -rf .venv-vllm; \
	elif [ -e .venv-vllm ]; then echo "make clean: .venv-vllm kept (not made by scripts/install-vllm-cpu)"; fi
