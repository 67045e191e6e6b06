"""`make encoders-table` (python -m benchmarks.encoders_table), through its command line: the commands it runs
(`--dry-run`) and the table it assembles from the runs' metrics.jsonl (`--assemble-only` on fake runs; the real
runs take ~1.5 h)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.export.handoff import fit_problems
from core.export.read import Checkpoint
from core.models.build import build_model
from core.recipe.config import load_config

REPO = Path(__file__).resolve().parents[2]
ROWS = ("vit", "hybrid", "t2t", "vt", "vt_cluster", "hybrid_simmim", "t2t_simmim")  # the table's rows, in order


def encoders_table(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.encoders_table", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("encoders")


@pytest.fixture(scope="module")
def plans(runs) -> dict[str, list[list[str]]]:
    """Each row's `./launch.sh` commands, in order, as `--dry-run` prints them (a row's runs go to run_dir=RUNS/ROW,
    its SimMIM pretraining to RUNS/ROW_pretrain)."""
    proc = encoders_table("--dry-run", "--runs-dir", str(runs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_row: dict[str, list[list[str]]] = {}
    for line in proc.stdout.splitlines():
        command = line.removeprefix("[encoders] ").split()
        run_dir = Path(next(arg for arg in command if arg.startswith("run_dir=")).split("=", 1)[1])
        by_row.setdefault(run_dir.name.removesuffix("_pretrain"), []).append(command)
    return by_row


def config_of(command: list[str]):
    """The resolved recipe a `./launch.sh RECIPE overrides...` command runs."""
    launcher, recipe, *overrides = command
    assert launcher == "./launch.sh"
    return load_config(REPO / recipe, overrides)


def test_dry_run_plans_every_row_and_simmim_rows_fine_tune_from_their_own_pretraining_export(plans, runs):
    assert list(plans) == list(ROWS)
    pretrain, finetune = plans["t2t_simmim"]
    assert pretrain[1] == "recipes/quickstart_simmim.yaml" and finetune[1] == "recipes/quickstart_t2t.yaml"
    assert f"run_dir={runs / 't2t_simmim_pretrain'}" in pretrain
    assert f"model.init={runs / 't2t_simmim_pretrain' / 'export'}" in finetune
    (scratch,) = plans["vit"]
    assert config_of(scratch).model.init is None and config_of(scratch).run_dir == str(runs / "vit")
    (cluster,) = plans["vt_cluster"]  # the VT row's recipe with the clustering tokenizer, nothing else changed
    assert config_of(cluster).model.vt_tokenizer == "cluster"
    assert config_of(cluster).model_dump(exclude={"run_dir", "model"}) == config_of(plans["vt"][0]).model_dump(
        exclude={"run_dir", "model"}
    )


@pytest.mark.parametrize("name", ROWS)
def test_every_command_is_a_valid_recipe_and_a_simmim_encoder_fits_its_fine_tuning(name, plans, tmp_path):
    commands = plans[name]
    configs = [config_of(command) for command in commands]
    assert [c.stage for c in configs] == ["pretrain"] * (len(configs) - 1) + ["finetune"]
    assert configs[-1].schedule.steps == 1000 and configs[-1].data.global_batch_size == 128  # the quickstart budget
    if len(configs) == 2:
        pretrain, finetune = configs
        assert pretrain.objective.kind == "simmim" and pretrain.model.arch == finetune.model.arch
        with torch.device("meta"):
            encoder = build_model(pretrain).state_dict()
            classifier = build_model(finetune, num_classes=10)
        export = Checkpoint(state=dict(encoder), source=tmp_path / "export", format="mimpipe-export")
        assert fit_problems(classifier, export) == []  # the hand-off's own check (launch.sh's pre-flight runs it)
        same_grid = all(classifier.state_dict()[k].shape == v.shape for k, v in encoder.items() if "pos_embed" in k)
        assert same_grid  # pretrained at the fine-tuning grid: nothing to resize


def write_run(run_dir: Path, start: float, lines: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps({"time": start + 60 * minute, **values}) + "\n" for minute, values in lines)
    (run_dir / "metrics.jsonl").write_text(text)


def test_table_assembled_from_the_runs_metrics(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "encoders.md"
    vit = [(0, {"step": 1, "train/loss": 2.3}), (3, {"step": 1000, "val/top1": 0.84}), (6.5, {"step": 2000})]
    vit.append((6.5, {"step": 2000, "val/top1": 0.8312}))  # the last evaluation is not the best one
    write_run(runs / "vit", 1000.0, vit)
    write_run(runs / "t2t_simmim_pretrain", 0.0, [(0, {"step": 1, "train/loss": 1.0}), (5.25, {"step": 700})])
    t2t = [(0, {"step": 1}), (2, {"step": 1000, "val/top1": 0.8}), (8, {"step": 2000, "val/top1": 0.86})]
    write_run(runs / "t2t_simmim", 0.0, t2t)

    proc = encoders_table("--assemble-only", "--runs-dir", str(runs), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = {line.split(" | ")[-1].strip("` |"): line for line in out.read_text().splitlines() if line.endswith("` |")}
    assert set(rows) == set(ROWS)
    assert "| 0.8312 (step 2000) | 0.8400 (step 1000) | 6.5 |" in rows["vit"]
    assert "| SimMIM (quickstart budget) | 0.8600 (step 2000) | 0.8600 (step 2000) | 5.2 + 8.0 |" in rows["t2t_simmim"]
    assert "| none (from scratch) | not run |" in rows["hybrid"]
    assert "| not run |" in rows["hybrid_simmim"] and f"[encoders] written to {out}" in proc.stdout


def test_unknown_rows_are_refused_naming_the_known_ones():
    proc = encoders_table("--rows", "vit,deit", "--dry-run")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown rows ['deit']; known: vit, hybrid, t2t, vt, vt_cluster, hybrid_simmim, t2t_simmim" in proc.stderr
