# Two entry points for a fresh machine (see README.md): `make quickstart` and `make test`.
# `make study` runs the mini-study (docs/mini_study.md; 74.5 min on 2 quiet CPU cores, measured).
PYTHON ?= python3
VENV   ?= .venv
OUT    ?= out/quickstart
STUDY_OUT ?= out/study
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
QS_STAMP := $(VENV)/.quickstart-stamp
PYTEST_ARGS ?=
# pytest workers for `make test`: 2 fills CI's two cores (tests/conftest.py orders the modules).
TEST_WORKERS ?= 2

.PHONY: install quickstart study lint test test-gpu slurm-deps shellcheck-deps browser-deps clean

install: $(STAMP)

# torch first, pinned: on these CPU machines 2.13.0 lies on disk; anything else pulls a CUDA build.
# The quickstart needs the package and the [eval] extra only; `make test` (and `make install`)
# add the test runner and NVIDIA DALI (a 424 MB wheel) on top of the same venv. W&B goes into a
# layer of its own (below).
$(QS_STAMP): pyproject.toml setup.py csrc/sample_index.cpp
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[eval]"
	touch $(QS_STAMP)

$(STAMP): $(QS_STAMP)
	$(BIN)/python -m pip install -q -e ".[eval,test,lint,dali]"
	touch $(STAMP)

# The [wandb] extra in a venv layered over $(VENV) (its site-packages added as a site dir), for
# tests/test_wandb.py: megatron-core imports wandb at import whenever it can (1.3 CPU-s a process
# here), and the suite starts some 150 such processes that never log to W&B.
WANDB_VENV  := .venv-wandb
WANDB_STAMP := $(WANDB_VENV)/.installed-stamp
SITE_DIR    := 'import site; print(site.getsitepackages()[0])'
$(WANDB_STAMP): $(STAMP)
	$(PYTHON) -m venv $(WANDB_VENV)
	printf 'import site; site.addsitedir("%s")\n' "$$($(BIN)/python -c $(SITE_DIR))" \
	  > "$$($(WANDB_VENV)/bin/python -c $(SITE_DIR))/base_venv.pth"
	$(WANDB_VENV)/bin/python -m pip install -q "wandb>=0.19"
	touch $(WANDB_STAMP)

quickstart: $(QS_STAMP)
	$(BIN)/mlmclm quickstart --out $(OUT)

study: $(QS_STAMP)
	$(BIN)/mlmclm study --out $(STUDY_OUT)

# Style and types (CONTRIBUTING.md): ruff's lint and format check over the tree, pyright (basic
# mode, pyproject.toml) over the config, the trainer and the FLOP count.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright --pythonpath $(BIN)/python

test: install $(WANDB_STAMP) slurm-deps shellcheck-deps browser-deps lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The GPU tier (docs/gpu.md), run with the Python that has megatron_mlmclm installed: inside the
# Docker image that is the image's own (the default); elsewhere e.g. `make test-gpu PY=.venv/bin/python`.
PY ?= python
test-gpu:
	$(PY) -m pytest -q -m gpu -rs tests/gpu $(PYTEST_ARGS)

# tests/test_slurm.py starts a private one-node SLURM cluster: Debian's slurm-wlm daemons, munge,
# and slurmdbd on a private MariaDB for its accounting (sacct).
SLURM_PKGS := slurmctld slurmd slurm-client slurmdbd mariadb-server munge
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
slurm-deps:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && \
	  command -v sbatch >/dev/null && command -v munged >/dev/null && \
	  command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null || { \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    --no-install-recommends $(SLURM_PKGS); }

# tests/test_submit.py runs shellcheck on the plan's submit_slurm.sh and examples/slurm/*.sbatch.
shellcheck-deps:
	@command -v shellcheck >/dev/null || { $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  shellcheck; }

# tests/test_slurm.py renders the status page (`mlmclm status`) in headless Chromium.
browser-deps:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  chromium; }

clean:
	rm -rf $(VENV) $(WANDB_VENV) build *.egg-info megatron_mlmclm/*.so
