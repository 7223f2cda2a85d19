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
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e .
	@# Three jobs side by side, each mostly waiting on the disk or on one core: as root, apt-get installs what the
	@# namespace cluster (iproute2, nftables) and p4tools' binaries need; Numba compiles the kernels into its cache
	@# (tests/support/warm.py, about 80 s of CPU on a fresh clone); pip installs the extras.
	if [ "$$(id -u)" = 0 ]; then \
		packages="$$(command -v nft >/dev/null || echo nftables iproute2) \
			$$([ -n "$(P4TOOLS)" ] && grep -v '^#' $(P4TOOLS)/runtime-packages.txt)"; \
		if [ -n "$$(echo $$packages)" ]; then (apt-get update -qq && apt-get install -y -qq $$packages >/dev/null) \
			|| echo "could not install $$(echo $$packages): the namespace cluster or P4 tests will be skipped"; fi & \
	fi; \
	cd tests && ../$(PY) -m support.warm & \
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 \
	&& $(PY) -m pip install -q --disable-pip-version-check -e '.[test,torch,plot,train]' \
	&& if [ -n "$(P4TOOLS)" ]; then $(PY) -m pip install -q --disable-pip-version-check thrift; fi; \
	installed=$$?; wait; exit $$installed
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
