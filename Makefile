# mimpipe: make quickstart | make quickstart-seg | make test | make lint | make bench | make bench-memory | make bench-data |
#         make bench-write | make bench-startup | make smoke-recipes | make encoders-table | make bench-quality |
#         make bench-monitors | make bench-seg | make gpu-check | make lease-wheels
VENV   ?= .venv
PY     := $(VENV)/bin/python
SHARDS ?= shards/quickstart
SCENES ?= shards/scenes
# torch/torchvision are pinned here (not in pyproject) to the build this machine serves from its own disk.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install quickstart quickstart-beit quickstart-data quickstart-seg quickstart-seg-data test test-long test-faults test-unit test-dist lint format bench bench-memory \
	bench-data bench-write bench-resume bench-startup smoke-recipes encoders-table bench-quality bench-monitors bench-seg gpu-check \
	lease-wheels recipe-reference

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TORCH_PINS)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[dev]"
	@# DeepSpeed JIT-builds its CPU shared-memory comm op on a run's first start (~25 s of g++, again for every new
	@# .venv path); building it here keeps that out of the first run.
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	@# Where PYTHONDONTWRITEBYTECODE is set (this project's machines do) no process caches the bytecode of our modules, so
	@# every stage process compiled them again (~0.25 CPU-s each, hundreds per `make test`); compiled once here, as pip
	@# does for site-packages. A file changed since is compiled afresh, in memory.
	$(PY) -m compileall -q core data pretrain finetune
	touch $@

install: $(VENV)/.installed

# Fashion-MNIST shards (train 60k, test 10k): Debian's package, MIMPIPE_FASHION_MNIST, the download cache, else a
# download (torchvision's mirrors); without any, synthetic images, said loudly (data/quickstart.py).
quickstart-data: install
	$(PY) -m data quickstart --out $(SHARDS)

# MAE pretraining on CPU, export, then fine-tuning at 28 px from the export (zero-initialised head), then the export's
# report card (mimpipe evaluate: kNN, L-BFGS probe, few-shot on 3,000 + 1,000 images, ~25 s on 2 cores; no data
# workers: 28 px images decode faster in the process than beside its forwards on 2 cores; docs/evaluate.md).
quickstart: quickstart-data
	rm -rf runs/quickstart runs/quickstart_finetune runs/quickstart_evaluate
	./launch.sh recipes/quickstart.yaml
	./launch.sh recipes/quickstart_finetune.yaml
	$(VENV)/bin/mimpipe evaluate runs/quickstart/export --train $(SHARDS)/train --val $(SHARDS)/test \
	  --suite knn,linear,fewshot --max-train 3000 --max-val 1000 --num-workers 0 --out runs/quickstart_evaluate
	@echo "TensorBoard: $(VENV)/bin/tensorboard --logdir runs"

# Segmentation: Fashion-MNIST garments in scenes of 64-96 px (4,000 train, 500 val), UperNet on the quickstart's MAE
# encoder (pretrained first if runs/quickstart/export is not there).
quickstart-seg-data: install
	grep -qs fashion-mnist-scenes $(SCENES)/train/index.json || $(PY) -m data write --source fashion-mnist-scenes \
	  --split train --num-samples 4000 --out $(SCENES)/train --shard-size 500
	grep -qs fashion-mnist-scenes $(SCENES)/val/index.json || $(PY) -m data write --source fashion-mnist-scenes \
	  --split val --num-samples 500 --out $(SCENES)/val --shard-size 125

quickstart-seg: quickstart-data quickstart-seg-data
	test -f runs/quickstart/export/model.safetensors || ./launch.sh recipes/quickstart.yaml
	rm -rf runs/quickstart_seg
	./launch.sh recipes/quickstart_seg.yaml
	@echo "TensorBoard: $(VENV)/bin/tensorboard --logdir runs"

# BEiT-style: a VQ-VAE tokenizer, masked-patch prediction of its codes, then the same fine-tuning from that export.
quickstart-beit: quickstart-data
	rm -rf runs/quickstart_tokenizer runs/quickstart_beit runs/quickstart_beit_finetune
	./launch.sh recipes/quickstart_tokenizer.yaml
	./launch.sh recipes/quickstart_beit.yaml
	./launch.sh recipes/quickstart_finetune.yaml model.init=runs/quickstart_beit/export run_dir=runs/quickstart_beit_finetune
	@echo "TensorBoard: $(VENV)/bin/tensorboard --logdir runs"

# Two test files at a time (pytest-xdist; a file's module fixtures stay in one worker): a multi-process test keeps 2
# cores only ~60% busy while its processes start, wait on each other and write checkpoints. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# CI's suite, also on a GPU host: tests/gpu (marked gpu) is `make gpu-check`'s.
test: install
	$(PYTEST) -m "not slow and not gpu and not faults and not long" --durations=15

# Runs at full size (the ViT-B recipes' chain) and the compiled launch's cold compile: a minute or more each alone,
# which `make test` leaves to it. .ci/run runs it after `make test`.
test-long: install
	$(PYTEST) -m "long and not slow and not gpu" --durations=10

# The fault matrix's slow cases (docs/faults.md): real runs killed, stalled or filled up on purpose. .ci/run runs it
# after `make test`.
test-faults: install
	$(PYTEST) -m "faults and not gpu" --durations=10

test-unit: install
	$(PYTEST) tests/unit

test-dist: install
	$(PYTEST) tests/dist

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# docs/recipe-reference.md from the recipe schema's field descriptions (tests/unit/test_recipe_reference.py fails
# while it is stale).
recipe-reference: install
	$(PY) -m core.recipe.reference > docs/recipe-reference.md

# The engine against a plain loop where the 10% target is read: MAE ViT-B, batch 32, tcmalloc (as launch.sh runs),
# ZeRO 0-3 and ZeRO-2 with engine.compile; with OFFICIAL_MAE=/path/to/facebookresearch/mae also the official training
# step (timm 0.3.2 and timm 1.0 attention) and the autocast-Linear ceiling in the same rounds (the checkout is read
# from there, never copied here);
# then the quickstart models' fixed per-step cost (engine / plain timm loop; `--before REV` adds an older tree).
OFFICIAL_MAE ?=
bench: install
	$(PY) -m benchmarks.bench_engine --batch 32 --allocators tcmalloc --rounds 3 --compile-stages 2 \
	  $(if $(OFFICIAL_MAE),--official-mae $(OFFICIAL_MAE)) --out benchmarks/results/engine_batch32.md
	$(PY) -m benchmarks.bench_overhead

bench-memory: install
	$(PY) -m benchmarks.bench_memory

# Every published recipe at its real size, 2 steps of batch 2 each, chained through its exports (~30 min, 2 cores):
# benchmarks/results/smoke_recipes.md. A stage that would not fit in the free memory is listed as not run.
smoke-recipes: install
	$(PY) -m benchmarks.smoke_recipes

# The encoder table (docs/encoders.md): ViT, hybrid, T2T-ViT and VT-ResNet fine-tuned from scratch on the quickstart budget,
# the hybrid and T2T-ViT also after SimMIM (8 runs, ~40 min on 2 cores): benchmarks/results/encoders.md.
encoders-table: quickstart-data
	$(PY) -m benchmarks.encoders_table

# The data path at 224 px: images/s per DataLoader worker, torchvision ImageFolder against our loader with the old
# (torchvision PIL) and the new (data/transforms.py CropFlip) transform, on generated ImageNet-like JPEGs (~10 minutes).
bench-data: install
	$(PY) -m benchmarks.bench_data

# Shards written resized (data write --max-side 384) against full size: the write rate at 1 and 2 workers and the
# pretraining data path's rate over both (~4 minutes once the JPEGs exist): a section of benchmarks/results/data.md.
bench-write: install
	$(PY) -m benchmarks.bench_write

# Resume start-up after 1x, 10x and 100x the steps: from the saved data cursor against main's replay of the stream
# from its start, on generated shards (~3 minutes): benchmarks/results/resume.md.
bench-resume: install
	$(PY) -m benchmarks.bench_resume

# Start-up: ./launch.sh recipes/quickstart.yaml to its first training step, in phases (check, engine, loop), 3 rounds
# (~2 minutes; STARTUP_ARGS="--before REV" adds an older tree side by side): benchmarks/results/startup.md.
bench-startup: quickstart-data
	$(PY) -m benchmarks.bench_startup $(STARTUP_ARGS)

# Representation quality (issue 14): MAE, BEiT-style, ViT-paper MPP, SimMIM and data2vec 2.0 pretraining of one ViT,
# then 1% / 10% / full-label fine-tuning and an L-BFGS linear probe of each encoder and of scratch (recipes/bench/):
# hours on 2 cores, resumable (a finished arm is skipped). benchmarks/results/quality.md + quality.png. Then time to
# accuracy (issue 50): MAE and data2vec 2.0 measured at 5 points of their pretraining against its CPU-seconds, side by
# side, and fine-tuned (about 2 hours): benchmarks/results/time_to_accuracy.md + .png. QUALITY_ARGS: e.g. --scale
# 0.02; TTA_ARGS: e.g. --scale 0.05 --finetune-scale 0.05.
bench-quality: quickstart-data
	$(PY) -m benchmarks.bench_quality --shards $(SHARDS) $(QUALITY_ARGS)
	$(PY) -m benchmarks.time_to_accuracy --shards $(SHARDS) $(TTA_ARGS)

# The label-free and few-shot monitors (issue 30): MAE's and SimMIM's bench-quality pretraining with them on, each
# against kNN top-1 step by step, and their cost to the quickstart's pretraining (with/without, side by side): about
# 70 minutes on 2 cores, resumable. benchmarks/results/monitors.md. MONITORS_ARGS: e.g. --scale 0.05 for a smoke run.
bench-monitors: quickstart-data
	$(PY) -m benchmarks.bench_monitors --shards $(SHARDS) $(MONITORS_ARGS)

# Segmentation (issue 29): UperNet and the linear probe from an MAE encoder against scratch, VT-FPN against panoptic FPN
# on the Fashion-MNIST scenes, and both FPNs' parameters and GMACs: about 1.5 hours on 2 cores, resumable.
# benchmarks/results/segmentation.md. SEG_ARGS: e.g. --scale 0.05 for a smoke run.
bench-seg: quickstart-seg-data
	$(PY) -m benchmarks.bench_seg --scenes $(SCENES) $(SEG_ARGS)

# One command for a GPU host (docs/gpu.md): tests/gpu (CUDA against the CPU, the engine path: bf16 inside the engine,
# ZeRO 0-3, NCCL with 2+ GPUs, compile, resume, fine-tuning, activation checkpointing), then benchmarks/bench_gpu.py
# (MAE ViT-B/16 and ViT-L/16 at 224 px, bf16 eager / compiled at ZeRO-0 and fp32, largest batch:
# benchmarks/results/gpu.md; runs even when a test failed, and the exit code says so). Without a GPU: says why and
# exits 0. On a lease of minutes: benchmarks/gpu_lease.sh (docs/gpu.md).
gpu-check: install
	@reason="$$($(PY) -m benchmarks.bench_gpu --skip-reason)" || exit 1; \
	if [ -n "$$reason" ]; then echo "make gpu-check: skipped, $$reason"; exit 0; fi; \
	tests=0; $(PY) -m pytest -q tests/gpu || tests=$$?; \
	$(PY) -m benchmarks.bench_gpu && exit $$tests

# Wheels for a GPU lease machine (Python 3.12, torch of its own, no package index: docs/gpu.md), at the versions this
# .venv runs, into .whl/ (git ignores it; the lease carries it): what the machine's image lacks or holds at another
# version. DeepSpeed has no wheel on PyPI: built here, without its ops (they JIT-build where needed).
LEASE_WHEELS := timm webdataset braceexpand pydantic pydantic_core annotated-types typing-inspection hjson
pinned = $(1)==$$($(PY) -c "import importlib.metadata as m; print(m.version('$(1)'))")
lease-wheels: install
	rm -rf .whl && mkdir -p .whl
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps -w .whl "$(call pinned,deepspeed)"
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $(foreach p,$(LEASE_WHEELS),"$(call pinned,$(p))")
	@ls .whl
