# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install what they need;
# the stamp makes a second run skip the install unless pyproject.toml or this Makefile changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,torch]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/intml-testbed demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
