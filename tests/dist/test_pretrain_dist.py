"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`) through ./launch.sh with 2 gloo processes."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import timm
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import metadata as hparams_metadata

from core.recipe.config import load_config
from pretrain.objectives import objective_builder
from tests.helpers.wandb_files import history, offline_runs, run_ids
from tests.launching import REPO, assert_resume_repeats, launch, losses, pretrain_recipe, read_metrics, write_recipe

pytestmark = pytest.mark.dist


def test_zero2_run_logs_checkpoints_and_exports(zero2_run, monkeypatch):
    run_dir, output = zero2_run
    assert "global batch 32 = 16 per device x 1 accumulation x 2 ranks" in output
    assert json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    steps = losses(run_dir)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in steps.values())
    last = read_metrics(run_dir)[-1]
    assert last["perf/images_per_sec"] > 0 and 0 <= last["perf/data_wait_fraction"] <= 1
    assert 0 < last["perf/mfu"] <= 1  # rank 0's: the other rank counts no FLOPs (start_meter)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000006"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000006"]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = timm.create_model(f"local-dir:{run_dir / 'export'}", pretrained=True)
    exported = load_file(str(run_dir / "export" / "model.safetensors"))
    assert set(model.state_dict()) == set(exported)
    assert model.patch_embed.grid_size == (4, 4) and model.embed_dim == 32
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["step"] == 6

    # The tests' shards are synthetic images: the plan, TensorBoard, the stage's end, the manifest and the card say so
    said = "SYNTHETIC images: these numbers say nothing about the method"
    assert f"[mimpipe] data.train holds {said} (its index.json: source synthetic)" in output
    assert f"[mimpipe] this run trained on {said}" in output.split("[mimpipe] TensorBoard: ")[-1]  # at the end
    assert (
        manifest["synthetic_data"] is True
        and f"**Trained on {said}**" in (run_dir / "export" / "README.md").read_text()
    )
    texts = [
        value.tag
        for events in (run_dir / "tb").glob("events.out.tfevents.*")
        for event in EventFileLoader(str(events)).Load()
        for value in event.summary.value
    ]
    assert "data/synthetic/text_summary" in texts


def test_export_from_zero2_checkpoint_at_an_earlier_step(zero2_run, tmp_path):
    run_dir, _ = zero2_run
    out = tmp_path / "export_step3"
    cmd = [sys.executable, "-m", "pretrain", "export", str(run_dir), "--step", "3", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    early, final = load_file(str(out / "model.safetensors")), load_file(str(run_dir / "export" / "model.safetensors"))
    assert set(early) == set(final)
    assert torch.equal(early["pos_embed"], final["pos_embed"])  # fixed sin-cos, never trained
    assert not torch.equal(early["blocks.0.attn.qkv.weight"], final["blocks.0.attn.qkv.weight"])

    again = tmp_path / "export_step6"
    subprocess.run([*cmd[:5], "--out", str(again)], cwd=REPO, check=True, capture_output=True)
    latest = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(latest[k], final[k]) for k in final)  # offline consolidation == in-run export


def test_resume_gives_the_same_next_losses(zero2_run, tmp_path):
    """Restart from the step-3 checkpoint of the finished run: steps 4-6 must repeat exactly. The resumed run adds
    its pictures to TensorBoard but not a second hparams entry."""
    run_dir, _ = zero2_run
    assert_resume_repeats(run_dir, tmp_path / "run", from_step=3, last_step=6)
    files = sorted((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 2  # the first run's and the resumed run's

    def tags(file):
        return [value.tag for event in EventFileLoader(str(file)).Load() for value in event.summary.value]

    first, resumed = tags(files[0]), tags(files[1])
    assert first.count(hparams_metadata.SESSION_START_INFO_TAG) == 1
    assert hparams_metadata.SESSION_START_INFO_TAG not in resumed
    assert first.count("train/reconstruction") == 3 and resumed.count("train/reconstruction") == 2  # 1, 3, 6; 4, 6
    for name in ("filters", "position_similarity", "attention_distance", "attention_rollout"):  # the ViT paper's
        assert first.count(f"inspect/{name}") == 3 and resumed.count(f"inspect/{name}") == 2

    # W&B: the resumed launch continues the run's W&B run in a folder of its own (its metrics.jsonl was removed
    # above, so nothing counts as sent already and steps 4-6 go to W&B again)
    first_wandb, resumed_wandb = offline_runs(tmp_path / "run")
    assert run_ids(first_wandb) == run_ids(resumed_wandb)
    assert {step: row["train/loss"] for step, row in history(resumed_wandb).items()} == losses(tmp_path / "run")


def test_bad_recipe_fails_before_any_process_starts(shards, tmp_path):
    recipe = write_recipe(tmp_path / "bad.yaml", pretrain_recipe(shards, tmp_path / "run"))
    proc = launch(recipe, "optim.base_rl=1e-3")
    assert proc.returncode == 2
    assert "optim.base_rl: unknown key (did you mean 'base_lr'?)" in proc.stdout
    assert not (tmp_path / "run").exists()
    proc = launch(recipe, "data.global_batch_size=33", nproc=2)
    assert proc.returncode == 2 and "data.global_batch_size 33 is not divisible by world size 2" in proc.stdout


def test_zero3_with_accumulation_exports_consolidated_weights(shards, tmp_path):
    """Recipe: tiny MAE with engine.zero_stage=3, grad_accum_steps=2 (8 per device x 2 x 2 ranks = 32)."""
    recipe = pretrain_recipe(
        shards,
        tmp_path / "run",
        engine={"zero_stage": 3, "grad_accum_steps": 2},
        schedule={"steps": 4, "warmup_steps": 1},
        checkpoint={"every_steps": 2},
    )
    proc = launch(write_recipe(tmp_path / "tiny_mae_z3.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "global batch 32 = 8 per device x 2 accumulation x 2 ranks" in proc.stdout
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    # Built under deepspeed.zero.Init: rank 0 only ever allocated about half of the weights.
    held = re.search(r"ZeRO-3 partitioned parameters: this rank holds ([\d,]+) of ([\d,]+)", proc.stdout)
    assert held, proc.stdout[-3000:]
    share = int(held[1].replace(",", "")) / int(held[2].replace(",", ""))
    assert 0.45 < share < 0.55
    # Activation checkpointing and CPU offload of optimizer state and parameters change memory, not the numbers.
    recipe["run_dir"] = str(tmp_path / "run_offload")
    recipe["engine"] = {**recipe["engine"], "activation_checkpointing": True, "offload_optimizer": "cpu"}
    recipe["engine"]["offload_param"] = "cpu"
    proc_offload = launch(write_recipe(tmp_path / "tiny_mae_z3_offload.yaml", recipe))
    assert proc_offload.returncode == 0, proc_offload.stdout[-4000:]
    assert losses(tmp_path / "run_offload") == losses(tmp_path / "run")
    in_run = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert in_run["blocks.0.attn.qkv.weight"].shape == (96, 32)  # gathered, not a ZeRO-3 placeholder
    out = tmp_path / "offline"
    cmd = [sys.executable, "-m", "pretrain", "export", str(tmp_path / "run"), "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    offline = load_file(str(out / "model.safetensors"))
    assert set(offline) == set(in_run) and all(torch.equal(offline[k], in_run[k]) for k in in_run)
    # The optimizer steps the parameter partitions themselves (no fp32 master copy): a resume still repeats exactly.
    assert_resume_repeats(tmp_path / "run", tmp_path / "resumed", from_step=2, last_step=4)


def test_dry_run_prints_config_and_torchrun_command(shards, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", pretrain_recipe(shards, tmp_path / "run"))
    proc = launch(recipe, "optim.base_lr=2e-3", "--dry-run", extra_env={"NNODES": "2", "NODE_RANK": "1"})
    assert proc.returncode == 0, proc.stdout
    assert "base_lr: 0.002" in proc.stdout
    assert "core.launch.torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2" in proc.stdout
    assert "-m pretrain" in proc.stdout and not (tmp_path / "run").exists()


def test_zero0_and_zero2_give_the_same_losses_and_grad_norms(zero2_run, shards, tmp_path):
    """The grad norm is measured by the optimizer on logging steps: ZeRO-2 partitions must sum to ZeRO-0's norm.
    ZeRO-2 reduces the Linear layers' gradients in bf16 (`engine.grad_reduce_dtype`), ZeRO-0 in fp32, so they agree
    to bf16's rounding of each rank's gradient (2^-9), not bit for bit (tests/dist/test_zero_init_dist.py compares
    the stages exactly in fp32); a missing partition would move the norm by ~30%."""
    run_dir, _ = zero2_run
    recipe = pretrain_recipe(shards, tmp_path / "run", engine={"zero_stage": 0})
    proc = launch(write_recipe(tmp_path / "tiny_mae_zero0.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]

    def norms(path):
        return [m["train/grad_norm"] for m in read_metrics(path) if "train/grad_norm" in m]

    assert len(norms(run_dir)) == 6 and all(n > 0 for n in norms(run_dir))
    for a, b in zip(norms(tmp_path / "run"), norms(run_dir), strict=True):
        assert math.isclose(a, b, rel_tol=2e-3), (norms(tmp_path / "run"), norms(run_dir))
    for step, loss in losses(tmp_path / "run").items():
        assert math.isclose(loss, losses(run_dir)[step], rel_tol=2e-3), (losses(tmp_path / "run"), losses(run_dir))


def test_pretraining_warm_starts_from_an_official_layout_file_at_zero2_and_zero3(zero2_run, shards, tmp_path):
    """model.init in a pretraining recipe (2 ranks): a file in the official MAE layout (the zero2_run's exported
    encoder, a decoder beside it whose output layer is zero) warm-starts ZeRO-2 and ZeRO-3 alike. A zero prediction of
    per-patch standardised pixels scores at most (P - 1) / P = 47/48 (unbiased variance, 48 values per patch) where
    the fresh decoder scores ~1.7, so the first step's loss, computed before any update, shows the file's decoder is
    in every rank's ZeRO-3 partition (a rank left with its fresh partition would change the model each rank gathers)."""
    run_dir, _ = zero2_run
    plain = load_config(write_recipe(tmp_path / "plain.yaml", pretrain_recipe(shards, tmp_path / "plain")))
    torch.manual_seed(7)
    decoder = objective_builder(plain)()
    state = {k: v for k, v in decoder.state_dict().items() if not k.startswith("encoder.")}
    state["decoder_pred.weight"], state["decoder_pred.bias"] = (
        state["decoder_pred.weight"] * 0,
        state["decoder_pred.bias"] * 0,
    )
    state |= load_file(str(run_dir / "export" / "model.safetensors"))  # timm's names at the top level, as models_mae
    torch.save({"model": state, "epoch": 6}, tmp_path / "mae_official.pth")
    first = {}
    for stage in (2, 3):
        model = {"init": str(tmp_path / "mae_official.pth")}
        recipe = pretrain_recipe(shards, tmp_path / f"z{stage}", model=model, engine={"zero_stage": stage})
        proc = launch(write_recipe(tmp_path / f"warm_z{stage}.yaml", recipe))
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert f"[mimpipe] warm start from {tmp_path / 'mae_official.pth'}" in proc.stdout
        report = json.loads((tmp_path / f"z{stage}" / "load_report.json").read_text())
        assert "decoder_pred.weight" in report["objective_loaded"] and report["objective_fresh"] == []
        assert "blocks.0.attn.qkv.weight" in report["loaded"]
        first[stage] = losses(tmp_path / f"z{stage}")[1]
    assert math.isclose(first[3], first[2], rel_tol=2e-3), first
    assert first[2] <= 47 / 48 + 1e-3 and losses(run_dir)[1] > 1.5, (first, losses(run_dir)[1])
