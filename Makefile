# Two commands on a fresh machine: `make test` and `make train`.
# Both create .venv and install the project into it first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# `make test` also needs the `test` extra (torch, transformers for tests/test_hf.py);
# `make train` installs only `.[dev]`.
TEST_STAMP := $(VENV)/.installed-test

# A copy of Tiny Shakespeare in ../shared/data, when there is one, so that no
# download is needed; without it the corpus is downloaded once and cached.
SHARED_DATA := $(abspath ../shared/data/tinyshakespeare.txt)
ifneq ($(wildcard $(SHARED_DATA)),)
export JAXATTN_SHAKESPEARE ?= $(SHARED_DATA)
endif

.PHONY: setup test train bench sample clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,test]'
	touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -n 2 tests

train: $(STAMP)
	$(PY) -m train.tiny_lm $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
