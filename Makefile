# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
# The CPU build of torch lies in /opt/wheels on the build machines.
WHEELS := $(wildcard /opt/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: install test test-fast demo bench bench-quick lint clean images test-deploy

install: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) "torch==2.13.0"
	$(PY) -m pip install --quiet $(FIND_LINKS) -e ".[test]"
	touch $(STAMP)

# numba compiles a kernel on first use (minutes for all of them on two cores) and caches
# it beside its source: compile them here, not in the first deletion a worker applies.
$(KERNELS): $(STAMP) jobs/learners/dare/search_kernels.py jobs/learners/dare/build_kernels.py \
            jobs/learners/dare/delete_kernels.py jobs/learners/dare/view.py \
            jobs/guard/forest/fragility.py jobs/guard/forest/routing_kernels.py \
            jobs/learners/networks/mlp_kernels.py
	$(PY) -m jobs.orchestration.warm_kernels
	touch $(KERNELS)

# Debian's chromium and its driver, for the audit page's browser test (not fetched by
# Selenium: tests/test_audit_page.py points it at /usr/bin/chromium{,driver}).
BROWSER := $(VENV)/.browser

$(BROWSER): $(STAMP)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver)
	touch $(BROWSER)

# pytest-xdist: TEST_WORKERS processes share the tests (each its own broker, PostgreSQL
# schemas per test); the suite waits on the processes it starts a good part of the time.
TEST_WORKERS ?= 2

test: $(STAMP) $(KERNELS) $(BROWSER)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The fast tier (docs/development.md): unit and property tests, no process started (no
# broker, no `obliviate` subprocess, no BentoML server, no browser), no `slow` test.
test-fast: $(STAMP) $(KERNELS)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not processes and not slow"

demo: $(STAMP) $(KERNELS)
	$(VENV)/bin/obliviate demo

bench: $(STAMP) $(KERNELS)
	for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

bench-quick: $(STAMP) $(KERNELS)
	for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b --quick || exit 1; done

# The deployment (docs/operations.md, "Images"): Docker from Debian's packages, a base
# image made by debootstrap (cached in build/deploy/), the sidecar's image from this
# checkout, PostgreSQL, Prometheus and the broker. Not part of `make test`.
images:
	sh deploy/images/build.sh

# deploy/compose.yaml started from those images, loaded, streamed and broken
# (docs/operations.md, "Testing the deployment").
test-deploy: images
	python3 tests/deploy/stack_check.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
