# The commands on a fresh machine: `make train`, `make serve` and `make test`.
# Both create .venv and install the project into it first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# `make test` also needs the `test` extra (torch, transformers for tests/hf/test_hf.py);
# `make train` installs only `.[dev]`.
TEST_STAMP := $(VENV)/.installed-test

# An optional local copy of Tiny Shakespeare: when ../shared/data/tinyshakespeare.txt exists,
# the runs read it instead of downloading; without it the corpus is downloaded once and cached.
SHARED_DATA := $(abspath ../shared/data/tinyshakespeare.txt)
ifneq ($(wildcard $(SHARED_DATA)),)
export JAXATTN_SHAKESPEARE ?= $(SHARED_DATA)
endif

.PHONY: setup test test-fast train serve bench sample clean chromium arm-cross

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,test]'
	touch $(TEST_STAMP)

# The whole suite (what CI runs). Each file's tests run in one worker (--dist loadfile): a module's
# fixtures (a trained run, a server process, an 8-device mesh script) are made once, its compiled
# programs compiled once, and let go when the file is done (tests/conftest.py).
test: $(TEST_STAMP) chromium arm-cross
	$(PY) -m pytest -n 2 --dist loadfile tests

# Everything but the tests marked `slow` (end-to-end runs in a fresh process). Each file's tests
# run in one worker (--dist loadfile), so a file's shared compiled programs are compiled once, and
# every compiled program is kept in TEST_PROGRAMS for the next run (tests/conftest.py says how).
TEST_PROGRAMS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/jaxattn/test-programs
test-fast: $(TEST_STAMP)
	JAXATTN_TEST_PROGRAMS=$(TEST_PROGRAMS) $(PY) -m pytest -n 2 --dist loadfile -m "not slow" tests

# The browser tests (tests/viewer/test_viewer_browser.py) drive Debian's chromium through Playwright
# (tests/browser.py). Installed here when it is missing and the machine allows (root and apt-get);
# otherwise the tests are skipped with the reason, except under CI=true, where it must be installed.
chromium:
	@if [ -n "$$JAXATTN_CHROMIUM" ] || command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's chromium for the browser tests (apt-get install -y chromium)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
	    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }; } \
	  || { echo "could not install chromium: the browser tests will be skipped (under CI=true: an error)"; [ "$$CI" != true ]; }; \
	else \
	  echo "no chromium, and no apt-get as root to install it: the browser tests will be skipped (under CI=true: an error)"; \
	  [ "$$CI" != true ]; \
	fi

# The native kernels' ARM paths (tests/kernels/test_native_paths.py, marked qemu) are cross-compiled with
# Debian's g++-aarch64-linux-gnu and run under qemu-user. Installed here as chromium is; without them
# those tests are skipped with the reason.
arm-cross:
	@if command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing g++-aarch64-linux-gnu and qemu-user for the ARM kernel tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1 \
	    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user >/dev/null; }; } \
	  || echo "could not install them: the ARM kernel tests will be skipped"; \
	else \
	  echo "no aarch64 cross compiler or qemu-aarch64, and no apt-get as root: the ARM kernel tests will be skipped"; \
	fi

train: $(STAMP)
	$(PY) -m train.tiny_lm $(ARGS)

# The OpenAI-compatible server (python -m train.serve) on the run `make train` wrote, or, before there
# is one, on the same config randomly initialised. ARGS="--port 8001 ..." passes flags.
SERVE_RUN ?= runs/shakespeare_char_baby
serve: $(STAMP)
	@if [ -d "$(SERVE_RUN)/checkpoints" ]; then \
	  set -- --checkpoint "$(SERVE_RUN)"; \
	else \
	  echo "no run in $(SERVE_RUN) yet (make train writes it): serving shakespeare_char_baby randomly initialised"; \
	  set -- --random-init shakespeare_char_baby; \
	fi; \
	$(PY) -m train.serve "$$@" $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
