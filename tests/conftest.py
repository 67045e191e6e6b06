"""Session fixtures shared by tests/dist and tests/gpu: synthetic shards. Also pins DeepSpeed's accelerator of the
test process to the CPU's, as CI has it, gives each parallel test worker its share of the cores, and keeps W&B
offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.launching import write_synthetic

# DeepSpeed picks its accelerator once, at first use, from this variable, else CUDA's wherever a GPU is visible: the
# engines the unit tests build on the CPU would then move to the GPU. Processes the tests start set their own
# (tests/launching.py); tests/gpu runs its CUDA engines in such processes.
os.environ["DS_ACCELERATOR"] = "cpu"

# `make test` runs one test file per core at once (pytest-xdist). Torch in each worker then computes on its share of
# the cores: with a thread per core in every worker, their OpenMP threads spun against each other and the other
# worker's processes (a test of 0.2 s alone took 57 s beside a two-rank launch). Processes the tests start set their
# own (tests/launching.py).
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

# W&B (logging.wandb) never reaches the network in the tests: offline whatever a recipe says, no error reports, no
# git or code capture, no system metrics, quiet; every process the tests start inherits this.
os.environ.update(
    WANDB_MODE="offline",
    WANDB_SILENT="true",
    WANDB_CONSOLE="off",
    WANDB_DISABLE_GIT="true",
    WANDB_DISABLE_CODE="true",
    WANDB_ERROR_REPORTING="false",
    WANDB__DISABLE_STATS="true",
)


# Nor does a dataset lookup download anything (data/fashion_mnist.py): a machine without Fashion-MNIST skips the tests
# that read it (tests/helpers/datasets.py), and the download is tested against a local server.
os.environ["MIMPIPE_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    """Synthetic 16 px, 4 classes: train 512 samples in 8 shards, val 203 samples in 3 uneven shards."""
    root = tmp_path_factory.mktemp("shards")
    return {
        "train": write_synthetic(root / "train", "train", 512, 64, seed=0),
        "val": write_synthetic(root / "val", "val", 203, 70, seed=1),
    }
