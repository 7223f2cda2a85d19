# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install what they need;
# the stamp makes a second run skip the install unless pyproject.toml or this Makefile changed.
PYTHON ?= python3
# p4c and BMv2 built for these machines, where the checkout sits beside ../shared (the P4 compile and BMv2 tests
# use them; without them those tests are skipped, saying so)
P4TOOLS := $(wildcard ../shared/p4tools)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test check clean

$(STAMP): pyproject.toml Makefile
	@# The namespace cluster (tests, bench cluster) needs iproute2 and nftables; as root, install them.
	@if [ "$$(id -u)" = 0 ] && ! command -v nft >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq nftables iproute2 >/dev/null) \
		|| echo "could not install nftables: the namespace cluster tests will be skipped"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e .
	@# Numba compiles the kernels into its cache (tests/support/warm.py, about 80 s of CPU on a fresh clone) while pip
	@# installs the extras: pip keeps one core busy at most, and waits on the disk besides
	cd tests && ../$(PY) -m support.warm & warm=$$!; \
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 \
	&& $(PY) -m pip install -q --disable-pip-version-check -e '.[test,torch,plot,train]' \
	&& if [ -n "$(P4TOOLS)" ] && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && apt-get install -y -qq $$(grep -v '^#' $(P4TOOLS)/runtime-packages.txt) >/dev/null \
		 && $(PY) -m pip install -q --disable-pip-version-check thrift) \
		|| echo "could not install p4tools' runtime packages: the P4 compile and BMv2 tests will be skipped"; fi; \
	installed=$$?; wait $$warm; exit $$installed
	touch $@

demo: $(STAMP)
	$(VENV)/bin/intml-testbed demo

# -n 2 --dist loadfile: two pytest workers, each taking whole files (a file's module fixtures, such as a shared
# aggregator, are made once). Most of the suite waits on sockets, timers and child processes, not on the CPU, so
# two share two cores well; four were faster still but starved the torch ranks' timeouts on a loaded machine.
# --durations: where the suite's time goes, printed at its end
test: $(STAMP)
	PATH="$(if $(P4TOOLS),$(abspath $(P4TOOLS))/bin:)$$PATH" $(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# The fast inner loop: the in-process tests only (docs/testing.md), on two xdist workers. Every test under
# tests/torch and tests/gpu is torch or gpu: not collecting them saves importing torch and numba's CUDA target.
check: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not process and not netns and not torch and not gpu and not slow" \
		--ignore=tests/torch --ignore=tests/gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
