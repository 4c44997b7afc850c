# tuneq: `make install`, `make demo`, `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch first and pinned: a looser spec lets pip pick a multi-GB CUDA build on a CPU host.
TORCH  ?= torch==2.13.0
# `no` where DeepSpeed was built with its ops compiled in (DS_BUILD_*, as Dockerfile.gpu does).
BUILD_OPS ?= yes
# uv installs the dependencies in seconds where pip takes minutes (the same versions: both take
# the newest that pyproject.toml allows). `INSTALLER=pip` where only pip's own configuration
# (pip.conf, PIP_INDEX_URL) reaches your packages: uv reads UV_INDEX_URL and friends instead.
INSTALLER ?= uv
# pyproject.toml's extras to install: `dev,gpu` on a GPU host (Dockerfile.gpu) adds Liger Kernel.
EXTRAS ?= dev
comma  := ,
# One stamp per set of extras: `make install EXTRAS=dev,gpu` after a plain install adds the GPU extra.
STAMP  := $(VENV)/.tuneq-installed-$(subst $(comma),-,$(EXTRAS))
# The install and the demo say what they do in a line a step; `make V=1 ...` shows the commands too.
Q      := $(if $(V),,@)

.PHONY: install bytecode demo test test-fast lint format clean bench soak

install: $(STAMP)

# DeepSpeed builds against the torch already installed, hence no build isolation. Bytecode
# compiled now (pip does by default, uv when asked): otherwise every tuneq process compiles
# transformers, DeepSpeed, FastAPI, SQLAlchemy... again where PYTHONDONTWRITEBYTECODE is set,
# as in many CI and container images (a `tuneq dev` start: 16 CPU-s without, 9 with).
# Last, DeepSpeed's ops the ranks load (CPU Adam, fused Adam, on a CPU host the shared-memory
# all-reduce), compiled now rather than in the first job; `tuneq build-ops` prints each op's
# start and end.
$(STAMP): pyproject.toml Makefile
	@echo "install: the virtual environment $(VENV) (pip, setuptools, wheel)"
	$(Q)test -x $(PY) || python3 -m venv $(VENV)
	$(Q)$(PY) -m pip install --quiet --upgrade pip "setuptools>=69" wheel
	@echo "install: $(TORCH) (pip)"
	$(Q)$(PY) -m pip install --quiet "$(TORCH)"
	@echo "install: DeepSpeed, transformers and tuneq with the extras $(EXTRAS) ($(INSTALLER))"
ifeq ($(INSTALLER),uv)
	$(Q)$(PY) -m pip install --quiet "uv>=0.5"
	$(Q)$(VENV)/bin/uv pip install --quiet --python $(PY) --no-build-isolation --compile-bytecode -e '.[$(EXTRAS)]'
else
	$(Q)$(PY) -m pip install --quiet --no-build-isolation -e '.[$(EXTRAS)]'
endif
ifeq ($(BUILD_OPS),yes)
	@echo "install: DeepSpeed's ops (tuneq build-ops)"
	$(Q)$(VENV)/bin/tuneq build-ops
endif
	$(Q)touch $(STAMP)
	@echo "install: done; the commands are in $(VENV)/bin (tuneq: $(VENV)/bin/tuneq)"

demo: install
	$(Q)$(VENV)/bin/tuneq demo

# Three test processes (pytest-xdist) on this 2-core machine, each file's tests in one of them
# so a module's shared service is started once: the end-to-end tests wait (for a lease to run out,
# a store to come back) as much as they compute, and with two processes the CPUs were idle a fifth
# of the time (pytest 572 s with 2, 518 s with 3, BENCHMARKS.md). In tests/conftest.py's order
# (the long end-to-end files first), not xdist's default of the files with the most tests first,
# which left the slowest single tests for last.
TEST_WORKERS ?= 3

# tuneq's own modules compiled as an installed package's are (the editable install leaves them
# as source): the tests start a few hundred tuneq processes.
SOURCES := api cli shared worker tests benchmarks

bytecode:
	@echo "bytecode: compiling $(SOURCES)"
	$(Q)$(PY) -m compileall -q $(SOURCES)

test: install bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test-fast: install bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow"

# A few hundred tiny jobs on two workers (each its own home, one store) while Postgres and Redis
# restart, one worker's disk (a tmpfs) fills up and is freed, workers are stopped at random
# instants, hostile records and uploads are sent and bursts of reads come in (tests/soak.py): every
# job run once, none failed for a cause outside it, hostile input a 4xx, no 5xx but 503 +
# Retry-After, nothing left in /dev/shm, the mounts or the process table. Not in `make test`: it
# restarts this machine's Postgres and Redis and mounts a tmpfs (root). SOAK_ARGS="--jobs 60".
soak: install
	$(PY) -m tests.soak $(SOAK_ARGS)

# Benchmarks (BENCHMARKS.md): writes benchmarks/results/<date>.json, prints the table.
# BENCH_ARGS="--only B4,B5 --repeats 5" picks benchmarks and repeats.
bench: install
	$(PY) -m benchmarks.run $(BENCH_ARGS)

# mypy's cache kept per user, not per checkout: a fresh clone (CI's, a worktree) re-reads only
# what differs from what was checked before, torch and transformers included (41 s -> 1 s on the
# dev box). mypy checks each cached module against its source's hash, so a stale entry is rechecked.
# In $XDG_CACHE_HOME (~/.cache) where there is a home; in the checkout (mypy's default) where not.
CACHE_HOME := $(or $(XDG_CACHE_HOME),$(if $(HOME),$(HOME)/.cache))
MYPY_CACHE_DIR ?= $(if $(CACHE_HOME),$(CACHE_HOME)/tuneq/mypy,.mypy_cache)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .tuneq .mypy_cache .ruff_cache .pytest_cache
