"""The `mimpipe` command (core/entry/cli.py): each command runs what `python -m` runs, with the arguments unchanged;
--help lists the commands and points multi-GPU runs at ./launch.sh; an unknown command is one line and exit 2."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from core.entry import cli
from tests.launching import REPO


def mimpipe(*args: str) -> subprocess.CompletedProcess:
    """`mimpipe ARGS` as a process (`python -m core.entry.cli`, the module the console script calls)."""
    return subprocess.run([sys.executable, "-m", "core.entry.cli", *args], cwd=REPO, capture_output=True, text=True)


def test_help_lists_every_command_and_launch_sh():
    proc = mimpipe("--help")
    assert proc.returncode == 0
    for command in ("pretrain", "finetune", "data", "export", "python -m pretrain export", "status", "./launch.sh"):
        assert command in proc.stdout


def test_unknown_command_is_one_line_and_exit_2():
    proc = mimpipe("pretrian", "recipes/quickstart.yaml")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "mimpipe: unknown command 'pretrian' (choose from pretrain, finetune, data, export, evaluate, "
        "status; mimpipe --help)"
    ]


@pytest.mark.parametrize(
    ("argv", "module", "module_argv"),
    [
        (["pretrain", "r.yaml", "optim.base_lr=1e-4"], "pretrain", ["r.yaml", "optim.base_lr=1e-4"]),
        (
            ["finetune", "convert", "a", "b", "--arch", "vit_small"],
            "finetune",
            ["convert", "a", "b", "--arch", "vit_small"],
        ),
        (["data", "inspect", "/shards", "--num-show", "2"], "data", ["inspect", "/shards", "--num-show", "2"]),
        (["export", "runs/x", "--step", "3"], "pretrain", ["export", "runs/x", "--step", "3"]),
        (["evaluate", "runs/x/export", "--out", "r"], "finetune", ["evaluate", "runs/x/export", "--out", "r"]),
        (["status", "runs/x", "--json"], "core.entry.status", ["runs/x", "--json"]),
    ],
)
def test_each_command_runs_its_module_as_main_with_the_arguments_unchanged(argv, module, module_argv, monkeypatch):
    ran = []
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: ran.append((name, kw, sys.argv[1:])))
    monkeypatch.setattr(sys, "argv", ["mimpipe"])
    assert cli.main(argv) == 0
    assert ran == [(module, {"run_name": "__main__", "alter_sys": True}, module_argv)]


def test_data_command_writes_and_inspects_as_python_m_data(tmp_path):
    write = ["data", "write", "--source", "synthetic", "--num-samples", "24", "--image-size", "8", "--shard-size", "10"]
    assert mimpipe(*write, "--out", str(tmp_path / "a")).returncode == 0
    via_cli = mimpipe("data", "inspect", str(tmp_path / "a"))
    direct = subprocess.run(
        [sys.executable, "-m", "data", "inspect", str(tmp_path / "a")], cwd=REPO, capture_output=True, text=True
    )
    assert via_cli.returncode == direct.returncode == 0 and via_cli.stdout == direct.stdout
    failed = mimpipe("data", "write", "--source", "imagefolder", "--out", str(tmp_path / "c"), "--shard-size", "1")
    assert failed.returncode == 2  # the module's own error handling, as under python -m data
    assert failed.stderr.strip() == (
        "python -m data write: error: --source imagefolder needs --path (the class-per-subfolder root)"
    )
