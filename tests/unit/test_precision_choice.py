"""`engine.precision: auto` (core/launch/precision.py, core/engine/precision.py): the precision each kind of machine
runs fastest, with the capability checks monkeypatched to each kind, and what the launcher's pre-flight and a rank
make of it (refusal, warning, the plan line, run_dir/config.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from core.engine import precision as engine_precision
from core.engine.plan import launch_plan
from core.engine.precision import resolve_precision
from core.entry.launch_check import main as launch_check
from core.launch import preflight as launch_preflight
from core.launch.precision import Machine, choose_precision, cpu_machine, cuda_machine
from core.recipe.config import load_config
from data.__main__ import main as data_main
from tests.launching import TINY_MODEL

EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
SAPPHIRE_RAPIDS = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\nCPU part\t: 0xd0c\n"

MACHINES = {  # kind of machine -> (its Machine, what `auto` picks)
    "H100": (cuda_machine("NVIDIA H100 80GB HBM3", (9, 0)), "bf16"),
    "A100": (cuda_machine("NVIDIA A100-SXM4-40GB", (8, 0)), "bf16"),
    "L4": (cuda_machine("NVIDIA L4", (8, 9)), "bf16"),
    "V100": (cuda_machine("Tesla V100-SXM2-16GB", (7, 0)), "fp16"),
    "T4": (cuda_machine("Tesla T4", (7, 5)), "fp16"),
    "EPYC with AVX512-BF16": (cpu_machine(EPYC, "Linux"), "bf16"),
    "Xeon with AMX": (cpu_machine(SAPPHIRE_RAPIDS, "Linux"), "bf16"),
    "Xeon without native bf16": (cpu_machine(SKYLAKE, "Linux"), "fp32"),
    "Arm with BF16": (cpu_machine(GRAVITON3, "Linux"), "bf16"),
    "Arm without BF16": (cpu_machine(GRAVITON2, "Linux"), "fp32"),
}


@pytest.mark.parametrize("kind", MACHINES)
def test_auto_takes_what_each_kind_of_machine_runs_fastest(kind):
    machine, expected = MACHINES[kind]
    choice = choose_precision("auto", machine)
    assert (choice.precision, choice.problem, choice.warning) == (expected, None, None)
    assert choice.reason.startswith(f"auto: {machine.name}")
    for explicit in ("fp32", "fp16"):  # an explicit choice other than bf16 is the recipe's
        assert choose_precision(explicit, machine).precision == explicit


def test_cpu_features_are_read_from_cpuinfo():
    assert MACHINES["EPYC with AVX512-BF16"][0] == Machine("cpu", "AMD EPYC 9R14 (AVX512-BF16)", True)
    assert MACHINES["Xeon with AMX"][0].name == "Intel(R) Xeon(R) Platinum 8480+ (AMX-BF16)"
    assert MACHINES["Xeon without native bf16"][0] == Machine("cpu", "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", False)
    assert MACHINES["Arm with BF16"][0].bf16 and not MACHINES["Arm without BF16"][0].bf16
    assert MACHINES["H100"][0] == Machine("cuda", "NVIDIA H100 80GB HBM3 (sm_90)", True)


def test_explicit_bf16_is_refused_on_a_gpu_without_it_and_warned_about_on_such_a_cpu():
    v100 = choose_precision("bf16", MACHINES["V100"][0])
    assert v100.problem.startswith("bf16 needs a GPU of compute capability 8.0 or later")
    assert "Tesla V100-SXM2-16GB (sm_70)" in v100.problem and "engine.precision=auto" in v100.problem
    skylake = choose_precision("bf16", MACHINES["Xeon without native bf16"][0])
    assert skylake.precision == "bf16" and skylake.problem is None
    assert "no native bf16" in skylake.warning and "auto picks fp32" in skylake.warning
    assert choose_precision("bf16", MACHINES["H100"][0]).warning is None


def _config(*overrides: str):
    return load_config(None, ["run_dir=/tmp/unused", *overrides])


def test_a_rank_writes_the_choice_for_its_gpu_into_the_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    cfg = _config()
    assert cfg.engine.precision == "auto"
    choice = resolve_precision(cfg, torch.device("cuda", 0))
    assert cfg.engine.precision == "fp16" and "has no bf16" in choice.reason
    with pytest.raises(ValueError, match=r"engine.precision: bf16 needs a GPU of compute capability 8.0"):
        resolve_precision(_config("engine.precision=bf16"), torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("kind", "expected"), [("Xeon without native bf16", "fp32"), ("EPYC with AVX512-BF16", "bf16")]
)
def test_a_rank_on_a_cpu_resolves_auto_once_and_keeps_it(monkeypatch, kind, expected):
    monkeypatch.setattr(engine_precision, "cpu_machine", lambda: MACHINES[kind][0])
    cfg = _config()
    resolve_precision(cfg, torch.device("cpu"))
    assert cfg.engine.precision == expected
    assert resolve_precision(cfg, torch.device("cpu")).reason == "as the recipe sets it"  # concrete now: kept


def test_the_plan_line_says_which_precision_and_why():
    cfg = _config("engine.precision=fp32")
    dist = type("Dist", (), {"world_size": 1, "device": torch.device("cpu")})()
    plan = launch_plan(cfg, dist, total_steps=10, warmup_steps=1, samples=None, precision_reason="auto: X has none")
    assert "| precision fp32 (auto: X has none) |" in plan


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "train"
    args = ["--num-samples", "32", "--image-size", "16", "--num-classes", "4", "--shard-size", "16"]
    data_main(["write", "--source", "synthetic", "--out", str(out), *args])
    return out


def _recipe(tmp_path: Path, shards: Path, **engine) -> Path:
    recipe = {
        "run_dir": str(tmp_path / "run"),
        "model": TINY_MODEL,
        "data": {"train": str(shards), "global_batch_size": 8},
        "schedule": {"steps": 2},
        "engine": {"device": "cpu", **engine},
    }
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _launch_check(capsys, recipe: Path) -> tuple[int, str]:
    code = launch_check([str(recipe), "--nproc-per-node", "1"])
    out = capsys.readouterr()
    return code, out.err


def test_preflight_refuses_bf16_on_a_gpu_without_it_in_one_line(monkeypatch, capsys, tmp_path, shards):
    monkeypatch.setattr(launch_preflight, "launch_machine", lambda device: MACHINES["T4"][0])
    code, err = _launch_check(capsys, _recipe(tmp_path, shards, precision="bf16"))
    refusals = [line for line in err.splitlines() if line.startswith("launch.sh:")]
    assert code == 2 and refusals == [
        f"launch.sh: engine.precision: {choose_precision('bf16', MACHINES['T4'][0]).problem}"
    ]
    code, err = _launch_check(capsys, _recipe(tmp_path, shards))  # auto: fp16 on the T4
    assert code == 0 and "ZeRO-1, fp16 (auto: Tesla T4 (sm_75) has no bf16; fp16 with dynamic loss scaling)" in err


def test_preflight_warns_about_bf16_on_a_cpu_without_it_and_auto_takes_fp32(monkeypatch, capsys, tmp_path, shards):
    monkeypatch.setattr(launch_preflight, "launch_machine", lambda device: MACHINES["Xeon without native bf16"][0])
    code, err = _launch_check(capsys, _recipe(tmp_path, shards, precision="bf16"))
    assert code == 0 and "[mimpipe] warning: engine.precision bf16 on Intel(R) Xeon(R) Gold 6148" in err
    code, err = _launch_check(capsys, _recipe(tmp_path, shards))
    assert code == 0 and "warning" not in err and ", fp32 (auto: Intel(R) Xeon(R) Gold 6148" in err
