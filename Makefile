# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install demo test sanitize clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test,ray]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/python examples/offline_inference.py

test: install
	$(VENV)/bin/python -m pytest -q tests

# The op, compiled-step and shape-sweep tests against the custom ops built with AddressSanitizer and
# UndefinedBehaviorSanitizer (tools/sanitize.py; custom_ops/README.md): the first report fails the run.
SANITIZE_TESTS := tests/test_ops.py tests/test_moe_op.py tests/test_pack_op.py tests/test_sampling_op.py \
	tests/test_compiled_step.py tests/test_shape_sweep.py tests/test_mtp.py

sanitize: install
	$(VENV)/bin/python tools/sanitize.py $(SANITIZE_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info
