# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY        ?= python3
VENV      ?= .venv
PIP       := $(VENV)/bin/pip
PYTHON    := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
# The CPU wheel of torch 2.13.0 lies on this machine's disk; asking for it first keeps pip
# from resolving `torch>=2.3` to a multi-gigabyte CUDA build.
TORCH_PIN ?= torch==2.13.0

WHEELS    := .whl/.fetched

.PHONY: install demo test bench system-deps clean device-wheels

# iproute2 (ip, tc) builds the emulated slow cluster; best effort where apt is absent.
system-deps:
	@if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = "0" ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; \
		else \
			echo "note: iproute2 missing and cannot be installed here; emulated-cluster tests will skip"; \
		fi; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[test,lightning,accelerate]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/advisor demo

# The wheels the lent GPU machine lacks (CPython 3.12), for its device check; the test suite's
# dry run of that check imports them too, so they are fetched here as well.
$(WHEELS): $(STAMP) benchmarks/device_wheels.py benchmarks/device_packages.txt
	$(PYTHON) benchmarks/device_wheels.py fetch
	touch $(WHEELS)

device-wheels: $(WHEELS)

test: $(STAMP) $(WHEELS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PYTHON) -m pytest -q --durations=40

bench: $(STAMP)
	$(PYTHON) benchmarks/compressors.py
	$(PYTHON) benchmarks/hook_overhead.py
	$(PYTHON) benchmarks/fidelity_monitor.py
	$(PYTHON) benchmarks/kernel_model.py
	$(PYTHON) benchmarks/kernel_choices.py
	$(PYTHON) benchmarks/perfmodel_speed.py
	$(PYTHON) benchmarks/policy_speed.py
	$(VENV)/bin/advisor bench --out bench.json --measurements measurements.json
	$(PYTHON) benchmarks/learned_residual.py measurements.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .whl .device-site .device-out
