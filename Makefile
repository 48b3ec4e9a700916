# Everything runs from a project-local virtual environment, .venv, created on first use.
#   make test            ruff format --check, ruff check, and every tier below but the release-only
#                        tests (CI runs this; under 15 minutes on 2 cores)
#   make test-unit       tests/unit: one process, no ranks, under a minute (the inner loop)
#   make test-distributed tests/distributed: gloo ranks, subprocesses, simulated ranks
#   make test-notebooks  tests/notebooks: every notebook executed headless
#   make test-gpu        tests/gpu: NCCL and CUDA checks (skipped, with the reason, without CUDA)
#   make coverage        python -m verify.linecoverage: the library's line coverage under
#                        verify --quick --resume, against verify/uncovered.toml (about 2 minutes)
#   make faults          python -m verify.faults --release: every fault case, with the figures
#                        (the release tier; its fast subset runs in make test)
#   make repro           the main job: python -m paper_figures (pass options with ARGS="...")
#   make test-full       the release tier: every test, hypothesis profile "full"
#   make format          ruff format + ruff check --fix
#   make strip-notebooks strip outputs and execution counts from notebooks/*.ipynb in place
#   make clean           remove caches and build outputs (keeps .venv; see clean-venv)

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff
STAMP := $(VENV)/.installed
ARGS ?=

# The editable install maps the top-level packages that exist when it runs, so re-install when one
# of them appears (or pyproject.toml changes).
PACKAGE_INITS := $(wildcard reference/__init__.py zero/__init__.py measure/__init__.py \
	verify/__init__.py paper_figures/__init__.py notebooks/__init__.py)

.PHONY: coverage faults test test-unit test-distributed test-notebooks test-gpu test-full repro format lint strip-notebooks clean clean-venv

# torch goes in first and pinned: asking pip for plain `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml $(PACKAGE_INITS)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev,models]'
	touch $@

lint: $(STAMP)
	$(RUFF) format --check .
	$(RUFF) check .

# The fault suite's fast subset mostly waits (on timeouts, signals and heartbeats), so it runs beside
# the other tiers, its output printed after theirs; either failing fails the target.
test: lint
	@log=$$(mktemp); \
	$(VPY) -m pytest -p no:cacheprovider -m "faults and not full" -q tests/faults >$$log 2>&1 & \
	faults=$$!; \
	$(VPY) -m pytest -p no:cacheprovider -m "not full and not faults" --durations=20 -q; rest=$$?; \
	wait $$faults; fault_rc=$$?; \
	echo "--- the fault suite's fast subset (run beside the tiers above), exit $$fault_rc:"; \
	tail -n 40 $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$fault_rc -eq 0

test-unit: $(STAMP)
	$(VPY) -m pytest -p no:cacheprovider -m "not full" --durations=10 -q tests/unit

test-distributed: $(STAMP)
	$(VPY) -m pytest -p no:cacheprovider -m "not full" --durations=20 -q tests/distributed

test-notebooks: $(STAMP)
	$(VPY) -m pytest -p no:cacheprovider -m "not full" -q tests/notebooks

test-gpu: $(STAMP)
	$(VPY) -m pytest -p no:cacheprovider -rs -q tests/gpu

test-full: lint
	HYPOTHESIS_PROFILE=full $(VPY) -m pytest -p no:cacheprovider --durations=30 -q

coverage: $(STAMP)
	$(VPY) -m verify.linecoverage $(ARGS)

faults: $(STAMP)
	$(VPY) -m verify.faults --release $(ARGS)

repro: $(STAMP)
	$(VPY) -m paper_figures $(ARGS)

format: $(STAMP)
	$(RUFF) format .
	$(RUFF) check --fix .

strip-notebooks: $(STAMP)
	$(VPY) -m notebooks.tool strip $(wildcard notebooks/*.ipynb)
	$(VPY) -m notebooks.tool index

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o -type d -name .ipynb_checkpoints -exec rm -rf {} +

clean-venv:
	rm -rf $(VENV)
