# Everything a fresh machine needs lives here: `make train` and `make test` install on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
LITDATA ?= litdata==0.2.76
# torchao for strategy.float8 (its float8 linears; emulated on CPU): pure Python and one optional CUDA library.
TORCHAO ?= torchao==0.18.0
# Pinned: transformers 5.25.0's from_pretrained turns Hub kernels on by default and fails without the `kernels`
# package (which would fetch kernels from the Hub at run time); 5.24.0 leaves them off.
TRANSFORMERS ?= transformers==5.24.0
# lm-evaluation-harness, which tests/test_export_clients.py scores an export with (its HFLM needs accelerate too).
LM_EVAL ?= lm_eval==0.4.13
# What the harness's command line (`python -m lm_eval run`, tests/harness.py) imports beyond lm_eval itself, for
# loglikelihood and multiple_choice tasks: datasets (its tasks' data), sacrebleu (lm_eval.api.metrics imports it),
# pytablewriter (the table it prints); their own lower bounds in lm_eval's requirements. Not evaluate, sqlitedict,
# word2number, more_itertools, rouge-score or scikit-learn: no module of them is imported by such a run (checked
# in sys.modules at its end). Installed with their dependencies into $(VENV)/lm-eval-deps, which the harness's
# process alone appends to sys.path after site-packages: the environment's numpy, huggingface_hub, fsspec, ...
# win, and pip's copies of them there go unused. No torch among them. Measured on a 2-core machine: 14 to 16 s
# (with or without pip's cache), 425 MB (pyarrow 170, pandas 84, the unused numpy 73).
LM_EVAL_DEPS ?= "datasets>=2.16.0" "sacrebleu>=1.5.0" pytablewriter
# litgpt, timed beside project.train by `make bench` (and its test): never imported by a run.
LITGPT ?= litgpt==0.5.13
# Horovod for strategy=horovod and its tests: built from source against the pinned torch, once per machine
# (about 3 minutes), the wheel kept in HOROVOD_CACHE; `make install-horovod`.
HOROVOD ?= 0.28.1
HOROVOD_CACHE ?= $(HOME)/.cache/llama-platform
# pytest-xdist workers of `make test` and `make test-fast`: one more than the cores of a 2-core machine, since many
# tests spend part of their time waiting on the processes they start (measured: 366 s against 400 s for two).
TEST_WORKERS ?= 3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# One stamp per torch requirement: `make install TORCH=...` re-installs when it changes.
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH)' | tr -c 'A-Za-z0-9.=\n' '_')
EXPERIMENT ?= shakespeare
# `make train` trains in one run directory per experiment with ckpt_path=auto: a run stopped before the end (Ctrl-C,
# a kill, a crash) resumes from its last checkpoint, a finished one says so and goes on to the sample, and a first one
# starts. RUN_DIR=outputs/runs/NAME trains in another folder; SAMPLE_PROMPT= is what the trained model continues.
RUN_DIR ?= outputs/runs/train-$(EXPERIMENT)
SAMPLE_PROMPT ?= To be, or not to be

.PHONY: install install-horovod train prepare test test-fast lint typecheck format bench gpu-check gpu-wheels docs check-torch-floor clean slurm

install: $(STAMP) $(VENV)/hf-reference/sitecustomize.py

# transformers beside the environment imports torchao wherever it is installed, and torchao's import logs lines no
# user can act on: a process with hf-reference on its path (the docs' transformers commands) filters them first.
$(VENV)/hf-reference/sitecustomize.py: project/runtime/hf_reference_site.py $(STAMP)
	cp $< $@

# torch first and pinned, so later installs find it satisfied and never swap in a CUDA build;
# litdata last and without its declared deps (torchvision is not needed for tokens, and a torchvision
# built against another torch breaks `import lightning`): installed before the rest, pip's conflict
# check would print an ERROR about the missing torchvision.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps "$(LITDATA)" "$(TORCHAO)"
	# transformers, which the tests compare the model and the export with, goes beside the environment
	# (tests/conftest.py puts it on sys.path), not into it: torchmetrics, which Lightning imports, imports
	# transformers wherever it is installed, which costs every process of every run about 1.3 s at start.
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/hf-reference "$(TRANSFORMERS)"
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/hf-reference "$(LM_EVAL)" "accelerate>=0.26"
	# With their dependencies (resolved on their own, whatever the environment holds), beside hf-reference; pip's
	# conflict check is of the environment, which this install does not touch (litdata's missing torchvision).
	$(PIP) install -q --upgrade --no-warn-conflicts --target $(VENV)/lm-eval-deps $(LM_EVAL_DEPS)
	test ! -e $(VENV)/lm-eval-deps/torch || { echo "torch was installed into $(VENV)/lm-eval-deps"; exit 1; }
	$(PY) -c "import torch, lightning, litdata, hydra, wandb; print('installed torch', torch.__version__, 'lightning', lightning.__version__)"
	touch $(STAMP)

# Horovod is an extra: only strategy=horovod needs it (and the tests of that strategy, which skip without it).
install-horovod: $(VENV)/.installed-horovod-$(HOROVOD)

$(VENV)/.installed-horovod-$(HOROVOD): $(STAMP) scripts/install_horovod.sh
	bash scripts/install_horovod.sh $(PY) $(HOROVOD) $(HOROVOD_CACHE)
	touch $@

prepare: install
	$(PY) -m project.prepare experiment=$(EXPERIMENT)

train: prepare
	$(PY) -m project.train experiment=$(EXPERIMENT) hydra.run.dir=$(RUN_DIR) ckpt_path=auto
	$(PY) -m project.generate ckpt_path=$(RUN_DIR)/checkpoints/last.ckpt prompt="$(SAMPLE_PROMPT)" max_new_tokens=100

# The docs build too (make docs, --strict): a broken link or a page missing from the nav fails the tests. The 25
# slowest tests are listed at the end, for whoever keeps the suite's time in check.
test: install slurm install-horovod $(VENV)/litgpt-reference/.installed lint typecheck docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# ruff's formatter (code wrapped at 120 characters) and linter (pyproject.toml): a second, before the tests.
# `make format` applies both where they can.
lint: install
	$(PY) -m ruff format --check project tools benchmarks tests
	$(PY) -m ruff check project tools benchmarks tests

# mypy on the core packages (model, parallel, training, checkpoint, data), as pyproject.toml sets it.
typecheck: install
	$(PY) -m mypy

format: install
	$(PY) -m ruff format project tools benchmarks tests
	$(PY) -m ruff check --fix project tools benchmarks tests

# A SLURM for tests/test_clusters.py, which starts a two-node cluster on this host: Debian's slurm-wlm,
# installed where make runs as root with apt. Elsewhere those tests skip and say why.
slurm:
	@command -v slurmctld >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null 2>&1; }; } && \
		echo "installed slurm-wlm (apt) for tests/test_clusters.py"; } || \
		echo "SLURM not installed (needs root and apt): tests/test_clusters.py will skip its SLURM tests"

test-fast: install $(VENV)/litgpt-reference/.installed lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

# Training-step throughput of the debug and small10m presets and the config error latency (new files
# experiments/benchmarks/<date>-<host>.json and .md), and the pipeline bubble of GPipe, 1F1B and interleaved
# 1F1B on 2 stages (experiments/benchmarks/<date>-<host>-pipeline-bubble-pp2.*), and the data path: the order's
# start-up and locality, prepare and loader rates (experiments/benchmarks/<date>-<host>-data.*), and python -m
# project.train against a hand-written loop and litgpt, eager and compiled, with MFU, data-parallel scaling and
# start-up (experiments/benchmarks/<date>-<host>-platform.*). No tracked file is edited.
bench: install $(VENV)/litgpt-reference/.installed
	$(PY) -m benchmarks.model_step presets=debug  # small10m's bare step: the hand loop of bench_platform below
	$(PY) -m benchmarks.train_step presets=debug,small10m  # small50m too: 5 more minutes here
	$(PY) -m benchmarks.pipeline pp=2 microbatches=1,2,4,8 layers=4  # the defaults (m up to 16, 8 layers): 7 more minutes
	$(PY) -m benchmarks.data
	$(PY) -m benchmarks.init  # each rank's initialization, before and after O(shard) draws (<date>-<host>-init.*)
	$(PY) -m benchmarks.loss  # the loss's peak memory, whole logits against chunks of tokens (<date>-<host>-loss.*)
	$(PY) -m benchmarks.host_sync  # the host's waits for the device per step, by layout (<date>-<host>-host-sync.*)
	$(PY) -m benchmarks.document_mask  # building the document mask: dense, torch's block mask, ours (-document-mask.*)
	$(PY) -m benchmarks.context_parallel  # cp=1 against 2 on 2 processes, 1,024 to 8,192 tokens, beside the planner (-context-parallel.*)
	$(PY) -m benchmarks.comms  # collectives per step and rank of every layout, measured beside the planner's (-comms.*)
	$(PY) -m benchmarks.checkpoint  # training time lost per save, foreground against background, fsdp2 on 2 (-checkpoint.*)
	$(PY) -m benchmarks.stability  # loss-spike actions on make train's run, prose and poisoned prose (-stability.*), ~20 minutes

# On a machine with GPUs: ten minutes that prove they train (fp32, bf16, compile, FSDP2, and DDP, tensor parallel
# and a pipeline over 2 or more) and measure a ~1B Llama's step (tokens/s, MFU, memory beside the planner's
# prediction): new files experiments/benchmarks/<date>-<gpu>-gpu.{json,md} (docs/performance.md). Without a GPU it
# says so and exits 0. GPU_CHECK= passes options, e.g. GPU_CHECK="minutes=5 devices=2" or GPU_CHECK=device=cpu.
gpu-check: install
	$(PY) -m tools.gpu_check $(GPU_CHECK)

# For a GPU node without a package index: the wheels the check needs beyond torch, for the node's Python
# (GPU_PYTHON), into GPU_WHEELS; there, scripts/gpu_check_offline.sh GPU_WHEELS runs the check.
GPU_WHEELS ?= gpu-wheels
GPU_PYTHON ?= 3.12
gpu-wheels: install
	$(PY) -m tools.gpu_check.wheels out=$(GPU_WHEELS) python=$(GPU_PYTHON)

# Beside the environment, like transformers: litgpt's package imports psutil, which nothing else here needs,
# and it declares versions of litdata and huggingface_hub that its model does not use.
$(VENV)/litgpt-reference/.installed: $(STAMP)
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/litgpt-reference "$(LITGPT)" psutil
	touch $@

# The documentation site (mkdocs.yml, docs/), built strictly (every page in nav, no broken link) into outputs/site/.
# The `docs` extra (pyproject.toml) goes into the environment once, with its own stamp.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict  # without mkdocs-material's banner about its successor

$(VENV)/.installed-docs: $(STAMP)
	$(PIP) install -q -e ".[docs]"
	touch $@

# The oldest torch pyproject.toml admits, in an environment of its own (.venv-floor; PyPI's build of it, with CUDA:
# about 4 GB): every module imports, and the tests of the newest torch APIs the code calls pass
# (tests/test_torch_floor.py says which). Run it when the floor or the code's use of torch changes.
TORCH_FLOOR ?= torch==2.13.0
FLOOR_TESTS ?= tests/test_torch_floor.py tests/test_pipeline.py tests/test_moe.py tests/test_context_parallel.py
check-torch-floor:
	$(MAKE) install VENV=.venv-floor TORCH="$(TORCH_FLOOR)"
	.venv-floor/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -p no:cacheprovider $(FLOOR_TESTS)

clean:
	rm -rf outputs multirun lightning_logs
