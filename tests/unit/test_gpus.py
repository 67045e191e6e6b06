"""The GPUs a node's processes may use (core/launch/gpus.py) and the refusal to fall back to the CPU on a node whose
GPUs torch cannot use, with a stand-in nvidia-smi on PATH (tests/launching.py `fake_nvidia_smi`) and this machine's
torch, which sees no GPU."""

from __future__ import annotations

import os

import pytest
import torch

from core.engine.distributed import pick_device
from core.launch import gpus
from tests.launching import fake_nvidia_smi

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Put a fake nvidia-smi listing `num_gpus` GPUs first on PATH (none: no nvidia-smi at all); clear the variables
    that narrow the count."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("SLURM_JOB_ID", "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(name, raising=False)

    path = os.environ["PATH"]

    def with_gpus(num_gpus: int | None) -> None:
        if num_gpus is None:
            monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi (and nothing else) on PATH
        else:
            monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / f'bin{num_gpus}', num_gpus)}:{path}")

    return with_gpus


@pytest.mark.parametrize(
    ("physical", "env", "expected"),
    [
        (8, {}, 8),
        (None, {}, 0),
        (0, {}, 0),  # nvidia-smi without a working driver
        (8, {"CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        (8, {"CUDA_VISIBLE_DEVICES": ""}, 0),
        (8, {"CUDA_VISIBLE_DEVICES": "3,-1,5"}, 1),  # CUDA stops at the first invalid entry
        (4, {"CUDA_VISIBLE_DEVICES": "0,7,1"}, 1),  # no GPU 7 on this node
        (8, {"CUDA_VISIBLE_DEVICES": "GPU-00000001-0000-0000-0000-000000000000,MIG-abc"}, 2),
        (None, {"CUDA_VISIBLE_DEVICES": "0,1"}, 0),  # it narrows, it does not make a CPU machine a GPU node
        (8, {"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "4"}, 4),  # the step's GPUs on this node
        (8, {"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        (8, {"SLURM_JOB_ID": "7", "SLURM_STEP_GPUS": "2,3"}, 2),
        (8, {"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0,1,2,3,4,5"}, 6),  # the job's, when the step names none
        (8, {"SLURM_GPUS_ON_NODE": "4"}, 8),  # left over outside a job: ignored
        (None, {"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "4"}, 4),  # no nvidia-smi: SLURM's count stands
        (8, {"SLURM_JOB_ID": "7"}, 8),
    ],
)
def test_visible_gpus_narrows_the_node_to_cuda_visible_devices_and_the_slurm_step(node, physical, env, expected):
    node(physical)
    assert gpus.visible_gpus(env) == expected


def test_auto_is_refused_where_nvidia_smi_sees_gpus_that_torch_does_not(node, monkeypatch):
    node(2)
    problem = gpus.cuda_unusable("auto", {})
    assert "\n" not in problem
    assert problem.startswith("'auto', but nvidia-smi sees 2 GPUs (driver 470.57.02) and torch ")
    assert f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use them" in problem
    assert problem.endswith("or set engine.device=cpu to train on the CPU")
    with pytest.raises(ValueError, match=r"^engine.device: 'auto', but nvidia-smi sees 2 GPUs \(driver 470.57.02\)"):
        pick_device("auto")
    assert pick_device("cpu") == torch.device("cpu")
    assert gpus.cuda_unusable("auto", {"CUDA_VISIBLE_DEVICES": ""}) is None  # the user hid the GPUs on purpose
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "(a CPU-only build) cannot use them" in gpus.cuda_unusable("cuda", {})


def test_without_gpus_auto_takes_the_cpu_and_cuda_is_refused(node):
    node(None)
    assert pick_device("auto") == torch.device("cpu")
    assert gpus.cuda_unusable("auto", {}) is None
    with pytest.raises(ValueError, match=r"^engine.device: 'cuda', but torch sees no CUDA device$"):
        pick_device("cuda")
