# The two commands of the README: `make run` (the main job) and `make test`.  Both set up .venv first.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# A working interpreter of the given version: on PATH, or under pyenv.
find_python = $(firstword $(foreach c,python$(1) $(wildcard $(HOME)/.pyenv/versions/$(1)*/bin/python$(1)) $(wildcard /usr/bin/python$(1)),$(shell $(c) -c 'import sys; print(sys.executable)' 2>/dev/null)))
PYTHON ?= $(call find_python,3.12)
PYTHON_COMPAT ?= $(call find_python,3.11)

VENV := .venv
VENV_COMPAT := .venv-compat
VENV_BRIDGE := .venv-bridge
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: help setup setup-compat setup-bridge run test test-compat test-bridge bench clean

help:
	@echo "make run          the main job (see README)"
	@echo "make test         set up .venv if needed and run the CPU test suite"
	@echo "make test-compat  the Megatron-facing tests on python3.11 + megatron-core 0.16.1 + torch 2.13.0"
	@echo "make test-bridge  tests/bridge against Megatron-Bridge 0.6.2 (its own .venv-bridge, scripts/install_bridge.sh)"
	@echo "make bench        the regression benchmark against baseline Megatron"

# $(call new_venv,PYTHON,EXTRAS) in a rule for DIR/.installed: DIR made with PYTHON, the project in it
# (editable, pinned by constraints.txt) with EXTRAS, then the marker.
define new_venv
	$(1) -m venv $(@D)
	scripts/pip_install.sh $(@D) --upgrade pip
	scripts/pip_install.sh $(@D) -c constraints.txt -e '.[$(2)]'
	touch $@
endef
comma := ,

$(VENV)/.installed: setup.py constraints.txt
	@test -n "$(PYTHON)" || { echo "python3.12 not found: install it (e.g. pyenv install 3.12) or pass PYTHON=/path/to/python3.12"; exit 1; }
	$(call new_venv,$(PYTHON),test$(comma)bench)

$(VENV_COMPAT)/.installed: setup.py constraints.txt
	@test -n "$(PYTHON_COMPAT)" || { echo "python3.11 not found: pass PYTHON_COMPAT=/path/to/python3.11"; exit 1; }
	$(call new_venv,$(PYTHON_COMPAT),test)

setup: $(VENV)/.installed
setup-compat: $(VENV_COMPAT)/.installed
setup-bridge: $(VENV_BRIDGE)/.installed

$(VENV_BRIDGE)/.installed: setup.py constraints.txt scripts/install_bridge.sh
	@test -n "$(PYTHON)" || { echo "python3.12 not found: pass PYTHON=/path/to/python3.12"; exit 1; }
	scripts/install_bridge.sh $(PYTHON) $(VENV_BRIDGE)

run: setup
	$(VENV)/bin/megatron-longctx run $(RUN_ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests

test-compat: setup-compat
	$(VENV_COMPAT)/bin/python -m pytest -q --megatron-facing $(PYTEST_ARGS) tests

# The model-build test of tests/bridge needs no Bridge and runs in `make test` already.
test-bridge: setup-bridge
	$(VENV_BRIDGE)/bin/python -m pytest -q $(PYTEST_ARGS) tests/bridge \
		--deselect tests/bridge/test_configure.py::test_built_model_holds_our_attention_and_the_hook_catches_the_in_place_overwrite

bench: setup
	$(VENV)/bin/megatron-longctx bench

clean:
	rm -rf $(VENV) $(VENV_COMPAT) $(VENV_BRIDGE) *.egg-info .pytest_cache
