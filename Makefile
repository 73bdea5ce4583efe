# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/python examples/offline_inference.py

test: install
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
