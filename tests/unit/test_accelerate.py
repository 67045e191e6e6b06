"""core/launch/accelerate.py and core/compat/accelerate.py: a stage started by `accelerate launch` finds its world
(torchrun's variables, MPI's, or the processes `--cpu` asked for) and refuses accelerate's settings that disagree
with the recipe, one line each. The launch itself: tests/dist/test_accelerate_dist.py."""

from __future__ import annotations

import sys

import pytest
import torch

from core.compat import accelerate as acc_compat
from core.engine.distributed import DistInfo, world_from_launcher
from core.engine.failure import StageExit
from core.engine.run import check_launcher_settings
from core.launch.accelerate import cpu_launch_command, launch_argv, mpi_world, setting_conflicts
from core.recipe.config import load_config

ACCELERATE = "/venv/bin/accelerate"
CPU_ENV = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def parent(*args: str) -> list[str]:
    """The command line of `accelerate launch ARGS -m pretrain r.yaml`, as /proc shows it."""
    return ["/venv/bin/python", ACCELERATE, "launch", *args, "-m", "pretrain", "r.yaml"]


@pytest.mark.parametrize(
    "command",
    [
        ["/venv/bin/python", ACCELERATE, "launch", "--cpu", "x.py"],
        ["/venv/bin/python", "/venv/bin/accelerate-launch", "--cpu", "x.py"],
        ["python3", "-m", "accelerate.commands.launch", "--cpu", "x.py"],
        ["python3", "-m", "accelerate.commands.accelerate_cli", "launch", "--cpu", "x.py"],
    ],
)
def test_the_arguments_after_launch_are_found_in_each_form_of_the_command(command):
    assert launch_argv(command) == ["--cpu", "x.py"]


def test_other_parents_are_not_accelerate():
    assert launch_argv(["/bin/bash", "./launch.sh", "r.yaml"]) is None
    assert launch_argv(["/venv/bin/python", ACCELERATE, "config"]) is None
    assert launch_argv([]) is None


def test_cpu_launch_of_two_processes_becomes_torchrun_on_a_free_port():
    pytest.importorskip("accelerate")
    argv = ["r.yaml", "optim.base_lr=1e-3"]
    command = cpu_launch_command("pretrain", argv, CPU_ENV, parent("--num_processes", "2", "--cpu"))
    assert command[:3] == [sys.executable, "-m", "core.launch.torchrun"]
    flags = dict(zip(command[3:-4:2], command[4:-4:2], strict=True))
    assert {k: v for k, v in flags.items() if k != "--master-port"} == {
        "--nnodes": "1", "--node-rank": "0", "--nproc-per-node": "2", "--master-addr": "127.0.0.1",
    }  # fmt: skip
    assert flags["--master-port"].isdigit()  # a free one, as launch.sh takes on one node (accelerate says 29500)
    assert command[-4:] == ["-m", "pretrain", *argv]


def test_cpu_launch_over_machines_takes_accelerates_master_and_machine_rank():
    pytest.importorskip("accelerate")
    flags = ["--num_processes", "8", "--num_machines", "2", "--machine_rank", "1"]
    flags += ["--main_process_ip", "node0", "--main_process_port", "29555", "--cpu"]
    command = cpu_launch_command("finetune", ["r.yaml"], {**CPU_ENV, "MASTER_ADDR": "node0"}, parent(*flags))
    assert command[3:-3] == [
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4",
        "--master-addr", "node0", "--master-port", "29555",
    ]  # fmt: skip
    assert command[-3:] == ["-m", "finetune", "r.yaml"]


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({**CPU_ENV, "RANK": "0"}, ("--num_processes", "2", "--cpu")),  # torchrun's process (or the agent's child)
        ({**CPU_ENV, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, ("--num_processes", "2", "--cpu")),
        ({"ACCELERATE_USE_CPU": "True"}, ("--cpu",)),  # one process: accelerate sets no MASTER_ADDR
        (CPU_ENV, ("--num_processes", "1", "--cpu")),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, ("--num_processes", "2", "--cpu")),  # not accelerate's CPU mode
    ],
)
def test_a_process_that_already_has_its_place_or_is_alone_runs_as_it_is(env, args):
    pytest.importorskip("accelerate")
    assert cpu_launch_command("pretrain", ["r.yaml"], env, parent(*args)) is None


def test_a_count_that_does_not_split_over_the_machines_is_one_line():
    pytest.importorskip("accelerate")
    flags = ["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "h", "--main_process_port", "1"]
    with pytest.raises(ValueError, match="--num_processes 3 does not split over --num_machines 2"):
        cpu_launch_command("pretrain", ["r.yaml"], CPU_ENV, parent(*flags, "--cpu"))


@pytest.mark.parametrize(
    ("env", "world"),
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            ("3", "4", "1", "2"),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("1", "2", "1", "2")),
        ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"}, ("0", "2", "0", "1")),
    ],
)
def test_mpi_ranks_become_torchruns_variables(env, world):
    mapped = mpi_world(env)
    assert (mapped["RANK"], mapped["WORLD_SIZE"], mapped["LOCAL_RANK"], mapped["LOCAL_WORLD_SIZE"]) == world
    assert world_from_launcher({**env, "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == mapped
    with pytest.raises(ValueError, match="MPI started .* processes without MASTER_ADDR and MASTER_PORT"):
        world_from_launcher(env)


def test_without_a_launcher_a_process_is_a_world_of_one_on_loopback():
    alone = world_from_launcher({})
    assert (alone["RANK"], alone["WORLD_SIZE"], alone["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert alone["MASTER_PORT"].isdigit()
    # an MPI world of one (a SLURM step of one task) is still a world of one, wherever its master is
    assert world_from_launcher({"PMI_RANK": "0", "PMI_SIZE": "1", "MASTER_PORT": "7"})["MASTER_PORT"] == "7"


def cfg(*overrides: str):
    """The default recipe, its precision concrete (as `check_launcher_settings` gets it)."""
    return load_config(None, ["engine.precision=fp32", *overrides])


@pytest.mark.parametrize(
    ("env", "overrides", "refusal"),
    [
        (
            {"ACCELERATE_MIXED_PRECISION": "bf16"},
            (),
            "--mixed_precision bf16 (ACCELERATE_MIXED_PRECISION) against "
            "engine.precision fp32: the recipe sets the precision; launch with engine.precision=bf16",
        ),
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, (), "--mixed_precision fp8 (ACCELERATE_MIXED_PRECISION): mimpipe"),
        (
            {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
            (),
            "--zero_stage 3 (ACCELERATE_DEEPSPEED_ZERO_STAGE) against engine.zero_stage 1",
        ),
        ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, (), "launch with engine.grad_accum_steps=4"),
        ({"ACCELERATE_GRADIENT_CLIPPING": "1.0"}, (), "against optim.grad_clip 0.0"),
        ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"}, (), "against engine.offload_optimizer none"),
        ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}, (), "--deepspeed_config_file ds.json: mimpipe makes the"),
        ({"ACCELERATE_USE_FSDP": "true"}, (), "--use_fsdp (ACCELERATE_USE_FSDP): mimpipe trains with DeepSpeed"),
    ],
)
def test_a_setting_that_disagrees_with_the_recipe_is_refused_in_one_line(env, overrides, refusal):
    refusals, warnings = setting_conflicts(cfg(*overrides), env, "cpu")
    assert len(refusals) == 1 and refusal in refusals[0] and "\n" not in refusals[0], refusals
    assert warnings == []


def test_settings_that_agree_or_say_nothing_pass():
    agreeing = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
        "ACCELERATE_GRADIENT_CLIPPING": "1",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_USE_DEEPSPEED": "true",  # processes started by torchrun; the engine is ours
        "ACCELERATE_USE_CPU": "True",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
    }
    config = cfg("engine.precision=bf16", "engine.zero_stage=2", "engine.grad_accum_steps=2", "optim.grad_clip=1.0")
    assert setting_conflicts(config, agreeing, "cpu") == ([], [])
    # `--mixed_precision no` is accelerate's default: it cannot be told from no choice at all
    assert setting_conflicts(config, {"ACCELERATE_MIXED_PRECISION": "no"}, "cpu") == ([], [])


def test_cpu_on_a_gpu_run_is_refused_and_a_compile_backend_warned_about():
    refusals, _ = setting_conflicts(cfg(), {"ACCELERATE_USE_CPU": "True"}, "cuda")
    assert refusals == [
        "accelerate launch --cpu (ACCELERATE_USE_CPU) against engine.device auto, which trains on cuda: launch with "
        "engine.device=cpu"
    ]
    refusals, warnings = setting_conflicts(cfg(), {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "cpu")
    assert refusals == [] and warnings == [
        "accelerate launch --dynamo_backend inductor (ACCELERATE_DYNAMO_BACKEND) is ignored: engine.compile (auto) "
        "decides what is compiled"
    ]


def test_every_rank_stops_and_rank_0_says_why_one_line_per_setting(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    lines = {}
    for rank in (0, 1):
        dist = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
        with pytest.raises(StageExit) as stopped:
            check_launcher_settings(cfg(), dist)
        assert stopped.value.code == 2
        lines[rank] = stopped.value.line
    assert lines[1] is None
    said = lines[0].splitlines()
    assert len(said) == 2 and all(line.startswith("[mimpipe] refused: accelerate launch --") for line in said)


def test_accelerates_parser_is_checked_and_a_changed_one_named(monkeypatch):
    launch_module = pytest.importorskip("accelerate.commands.launch")
    acc_compat.check()
    monkeypatch.setattr(launch_module, "_validate_launch_command", lambda args, defaults=None: (args, None, False))
    with pytest.raises(acc_compat.AccelerateCompatError, match=r"accelerate patch 'launch_args' .* now takes"):
        acc_compat.launch_request(["--cpu", "x.py"])
