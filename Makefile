# slatrace: `make run` starts the agent on this host, `make test` runs the whole
# suite. Both do the set-up first (scripts/setup.sh, idempotent).
VENV ?= .venv
PYTEST_ARGS ?=
ARGS ?=

.PHONY: setup setup-test run test test-unit test-kernels test-reliability bench bench-footprint clean

setup:
	scripts/setup.sh

setup-test:
	SLATRACE_SETUP_TEST=1 scripts/setup.sh

run: setup
	$(VENV)/bin/slatrace run $(ARGS)

test: setup-test
	$(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS) tests

# The reliability tier at full size: the fast attacks also run in `make test`;
# this adds the long ones against the real daemon (a few minutes, root).
test-reliability: setup-test
	SLATRACE_LONG=1 SLATRACE_REQUIRE_KERNEL=1 $(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS) tests/reliability

# The kernel matrix alone: this host, then Debian's 5.10, 6.1 and 6.12 in qemu
# (also part of `make test`).
test-kernels: setup-test
	SLATRACE_REQUIRE_KERNEL=1 $(VENV)/bin/python -m pytest -ra -s $(PYTEST_ARGS) tests/qemu

test-unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

bench: setup-test
	$(VENV)/bin/python -m bench.run $(ARGS)

bench-footprint: setup
	$(VENV)/bin/python -m bench.footprint $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
