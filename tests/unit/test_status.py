"""`mimpipe status RUN_DIR` (core/entry/status.py) on run_dirs written by hand: the owner from the lease (running,
stale, gone, none), the step of the schedule's total, images/s over the last windows and the ETA, the last monitor
values, checkpoints being written or partial, the resume choice and its line exactly as the resume code gives them
(a torn `latest`, a damaged checkpoint under --verify), the export and finished.json, and what is not a run_dir.
Launched runs: tests/dist/test_status_dist.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from core.entry import status
from core.entry.status import complete_lines_backwards, main, read_status
from core.entry.status_screen import render
from core.launch.ckpt_files import choose_resume, tag_of, write_marker
from core.launch.lease import Lease, here
from core.recipe.config import dump_config, load_config

NOW = 1_800_000_000.0
BATCH = 32


def write_config(run_dir: Path, *overrides: str, name: str = "config.yaml") -> None:
    cfg = load_config(None, ["run_dir=/elsewhere/run", f"data.global_batch_size={BATCH}", *overrides])
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_text(dump_config(cfg))


def write_checkpoint(run_dir: Path, step: int, *, complete: bool = True) -> Path:
    """A checkpoint folder as a save leaves it: a model file and rank 0's state, then (complete) its marker."""
    tag_dir = run_dir / "checkpoints" / tag_of(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "model_states.json").write_text(json.dumps({"weights": [0.5] * 100}))
    (tag_dir / "rank_00000.json").write_text(json.dumps({"world_size": 1, "train": {"step": step}}))
    if complete:
        write_marker(tag_dir, {p.name: p.stat().st_size for p in tag_dir.iterdir()})
    return tag_dir


def write_metrics(run_dir: Path, lines: list[dict], tail: str = "") -> None:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics.jsonl").write_text(text + tail)


def write_lease(run_dir: Path, *, pid: int, host: str | None = None, heartbeat_age: float = 2.0) -> Lease:
    """A lease as core/launch/lease.py writes it (on this host unless `host` says), for process `pid`."""
    place = here()
    lease = Lease(
        host=host or place.host,
        pid=pid,
        slurm_job_id="812",
        started=NOW - 3725,
        heartbeat=NOW - heartbeat_age,
        stale_after_s=30.0,
        stage="pretrain",
        recipe="recipes/tiny.yaml",
        owner="0123abcd" * 4,
        pid_started=psutil.Process(pid).create_time() if pid == os.getpid() else None,
        pid_namespace=place.namespace,
    )
    (run_dir / "lease.json").write_bytes(lease.encode())
    return lease


LAST_RATES = [100.0, 200.0, 400.0, 400.0, 400.0]
"""perf/images_per_sec of the last five windows (steps 6-10); the earlier ones log 1.0."""
RATE = len(LAST_RATES) / sum(1 / r for r in LAST_RATES)  # 222.2: 5 equal windows of images over their summed time


def training_metrics(last_step: int = 10) -> list[dict]:
    """Steps 1..last_step; kNN and few-shot at step 5, the collapse monitor at step 8 (lines of their own)."""
    lines = []
    for step in range(1, last_step + 1):
        rate = LAST_RATES[step - last_step - 1] if step > last_step - 5 else 1.0
        lines.append({"step": step, "time": NOW - 60 + step, "train/loss": 2 - step / 10, "perf/images_per_sec": rate})
        if step == 5:
            lines.append(
                {"step": 5, "time": NOW, "knn/top1": 0.5, "fewshot/top1_5shot": 0.3, "fewshot/top1_10shot": 0.4}
            )
        if step == 8:
            lines.append({"step": 8, "time": NOW, "features/effective_rank": 12.5})
    return lines


MONITORS_ON = (
    "eval.knn.enabled=true",
    "eval.knn.fewshot=[5,10]",
    "eval.features.enabled=true",
    "data.train=/x",
    "data.val=/v",
)


@pytest.fixture
def running(tmp_path, monkeypatch) -> Path:
    """A run at step 10 of 1000 whose lease this process holds, saving step 10 now (no marker yet)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, "schedule.steps=1000", *MONITORS_ON)
    write_metrics(run_dir, training_metrics(), tail='{"step": 11, "time": 1')  # a line being appended
    write_checkpoint(run_dir, 5)
    write_checkpoint(run_dir, 10, complete=False)
    (run_dir / "checkpoints" / "latest").write_text(tag_of(5))
    write_lease(run_dir, pid=os.getpid())
    return run_dir


def test_a_running_run_shows_owner_step_rate_eta_monitors_and_a_checkpoint_being_written(running):
    got = read_status(running, now=NOW)
    assert got["alive"] and got["lease"]["state"] == "live" and got["lease"]["pid"] == os.getpid()
    assert (got["stage"], got["objective"], got["config"]) == ("pretrain", "mae", "config.yaml")
    assert (got["step"], got["total_steps"], got["logged_age_s"]) == (10, 1000, 50.0)  # step 11 is not complete
    assert got["images_per_sec"] == pytest.approx(RATE) and got["rate_windows"] == 5
    assert got["eta_s"] == pytest.approx(990 * BATCH / RATE)  # 142.6 s
    assert got["monitors"] == {
        "train/loss": {"value": pytest.approx(1.0), "step": 10},
        "knn/top1": {"value": 0.5, "step": 5},
        "fewshot/top1_10shot": {"value": 0.4, "step": 5},
        "fewshot/top1_5shot": {"value": 0.3, "step": 5},
        "features/effective_rank": {"value": 12.5, "step": 8},
    }
    assert [(c["tag"], c["state"]) for c in got["checkpoints"]] == [
        (tag_of(5), "complete"),
        (tag_of(10), "being written"),
    ]
    sizes = sum(p.stat().st_size for p in (running / "checkpoints").rglob("*") if p.is_file())
    assert got["checkpoint_bytes"] == sizes
    assert got["resume"] == {"tag": tag_of(5), "step": 5, "note": None, "verified": False}
    assert got["finished"] is None and got["export"] is None

    screen = render(got).splitlines()
    assert (
        screen[0] == f"{running}  pretrain, mae on vit base at 224 px, patch 16 (recipe recipes/tiny.yaml; config.yaml)"
    )
    assert screen[1] == (
        f"  state       running: host {here().host} pid {os.getpid()} (SLURM job 812), launch 0123abcd; heartbeat "
        "2 s ago, started 1:02:05 ago"
    )
    assert screen[2] == "  step        10 / 1000 (1.0%), last logged 0:00:50 ago"
    assert screen[3] == "  speed       222.2 images/s (last 5 logged windows), eta 0:02:23"
    assert screen[4].startswith("  monitors    train/loss 1 (step 10), knn/top1 0.5 (step 5), fewshot/top1_10shot 0.4")
    assert f"{tag_of(10)}  being written" in screen[7] and screen[8] == f"  latest      {tag_of(5)}"
    assert screen[9] == f"  resume      {tag_of(5)} (step 5): the one latest names, complete"


def test_a_stale_lease_a_gone_process_and_no_lease_are_not_running(running):
    write_lease(running, host="gpu-node-7", pid=31337, heartbeat_age=100.0)
    got = read_status(running, now=NOW)
    assert not got["alive"] and got["lease"]["state"] == "stale"
    assert [c["state"] for c in got["checkpoints"]] == ["complete", "partial"]  # nobody is writing it
    screen = render(got)
    assert "  state       not running: last heartbeat 100 s ago (host gpu-node-7 pid 31337), probably killed" in screen
    assert " eta " not in screen and "990 steps left, 0:02:23 at that rate" in screen
    assert f"{tag_of(10)}  partial" in screen and "no completeness marker (a save that did not finish)" in screen

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lease(running, pid=int(ended.stdout), heartbeat_age=1.0)  # on this host, fresh, but its process is gone
    got = read_status(running, now=NOW)
    assert got["lease"]["state"] == "gone" and not got["alive"]
    assert f"not running: process {int(ended.stdout)} on this host is gone (last heartbeat 1 s ago)" in render(got)

    (running / "lease.json").write_text('{"host": "a"}')  # edited by hand: no lease
    assert read_status(running, now=NOW)["lease"] == {"state": "unreadable", "alive": False}
    assert "  state       not known: lease.json holds no lease" in render(read_status(running, now=NOW))

    (running / "lease.json").unlink()
    got = read_status(running, now=NOW)
    assert got["lease"] == {"state": "none", "alive": False}
    assert "  state       not running (no lease)" in render(got)


@pytest.mark.parametrize("torn", ["", "step_0000\x00\x00", "garbage"])
def test_a_torn_latest_resumes_where_the_resume_code_does_and_says_why(tmp_path, torn):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, "schedule.steps=20")
    for step in (5, 10):
        write_checkpoint(run_dir, step)
    write_checkpoint(run_dir, 15, complete=False)
    (run_dir / "checkpoints" / "latest").write_text(torn)

    got = read_status(run_dir, now=NOW)
    ckpt_dir = run_dir / "checkpoints"
    expected_tag, expected_note = choose_resume(ckpt_dir)
    assert (got["resume"]["tag"], got["resume"]["note"]) == (expected_tag, expected_note)
    assert expected_tag == tag_of(10) and got["resume"]["step"] == 10  # the newest complete: 15 has no marker
    assert expected_note == (
        f"[mimpipe] warning: {ckpt_dir}/latest is unreadable or names no checkpoint; resuming from "
        f"{ckpt_dir}/{tag_of(10)}, the newest complete one"
    )
    assert got["latest"] is None and got["latest_torn"]
    screen = render(got).splitlines()
    at = screen.index(f"  resume      {tag_of(10)} (step 10)")
    assert screen[at + 1] == " " * 14 + expected_note.removeprefix("[mimpipe] warning: ")
    assert "  latest      torn: names no checkpoint" in screen


def test_verify_passes_over_a_damaged_checkpoint_as_the_resume_does(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, "schedule.steps=20")
    write_checkpoint(run_dir, 5)
    damaged = write_checkpoint(run_dir, 10)
    state = damaged / "rank_00000.json"
    state.write_text("x" * state.stat().st_size)  # same size: its marker still holds, its JSON does not parse
    (run_dir / "checkpoints" / "latest").write_text(tag_of(10))

    assert read_status(run_dir, now=NOW)["resume"]["tag"] == tag_of(10)  # the marker alone: no file read back
    from core.engine.checkpoint import resumable_tag

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        expected = resumable_tag(run_dir / "checkpoints")
    got = read_status(run_dir, verify=True, now=NOW)["resume"]
    assert got == {"tag": expected, "step": 5, "note": printed.getvalue().strip(), "verified": True}
    assert expected == tag_of(5) and "rank_00000.json is damaged" in got["note"]
    assert f"names {tag_of(10)}, which cannot be loaded: rank_00000.json is damaged" in got["note"]


def test_a_finished_run_with_its_export_and_a_later_launch_config(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, "schedule.steps=10")
    write_config(run_dir, "schedule.steps=20", name="configs/launch_0002.yaml")  # lengthened, then finished again
    write_metrics(run_dir, training_metrics(20))
    write_checkpoint(run_dir, 20)
    (run_dir / "checkpoints" / "latest").write_text(tag_of(20))
    (run_dir / "finished.json").write_text(json.dumps({"step": 20, "tag": tag_of(20)}))
    (run_dir / "export").mkdir()
    manifest = {"method": "finetune", "step": 18, "num_params": 5_000, "num_tensors": 12, "metrics": {"val/top1": 0.75}}
    (run_dir / "export" / "mimpipe.json").write_text(json.dumps({**manifest, "created": "2026-01-02T03:04:05+00:00"}))
    (run_dir / "export" / "model.safetensors").write_bytes(b"\0" * 2500)

    got = read_status(run_dir, now=NOW)
    assert (got["config"], got["step"], got["total_steps"]) == ("configs/launch_0002.yaml", 20, 20)
    assert got["finished"] == {"step": 20, "tag": tag_of(20), "relaunch_does_nothing": True}
    assert got["export"]["step"] == 18 and got["export"]["files"]["model.safetensors"] == 2500
    screen = render(got)
    assert f"  finished    at step 20 ({tag_of(20)}): relaunching with this schedule does nothing" in screen
    assert "  export      step 18: finetune, 5,000 parameters in 12 tensors, val/top1 0.75; " in screen
    assert "model.safetensors 2.5 kB; written 2026-01-02T03:04:05+00:00" in screen

    write_config(run_dir, "schedule.steps=30", name="configs/launch_0003.yaml")  # a longer schedule: trains on
    assert read_status(run_dir, now=NOW)["finished"]["relaunch_does_nothing"] is False


def test_a_schedule_in_epochs_counts_the_shards_or_says_the_total_is_unknown(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    names = ["train-000000.tar", "train-000001.tar"]
    for name in names:
        (shards / name).touch()
    index = {"num_samples": 320, "shards": [{"name": n, "num_samples": 160} for n in names]}
    (shards / "index.json").write_text(json.dumps(index))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, "schedule.epochs=2.5", f"data.train={shards}")

    assert read_status(run_dir, now=NOW)["total_steps"] == math.ceil(2.5 * 320 / BATCH) == 25
    (shards / "index.json").unlink()
    got = read_status(run_dir, now=NOW)
    assert got["total_steps"] is None and got["step"] is None
    assert got["total_unknown"].startswith("schedule in epochs, and the shards' size is not known here (shard dir")
    assert "  step        none logged yet; total unknown: schedule in epochs" in render(got)


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_an_empty_or_missing_folder_is_one_line_and_exit_2(tmp_path, kind, capsys):
    path = tmp_path / "folder"
    if kind == "empty":
        path.mkdir()
    assert main([str(path)]) == 2
    out, err = capsys.readouterr()
    why = (
        "not a run_dir (none of config.yaml, checkpoints, metrics.jsonl, lease.json)"
        if kind == "empty"
        else ("no such folder")
    )
    assert out == "" and err == f"mimpipe status: {path}: {why}\n"
    assert main([str(path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {"run_dir": str(path), "error": f"{path}: {why}"}


def test_json_is_the_same_status_as_one_object(running, capsys, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOW)
    assert main([str(running), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(read_status(running, now=NOW)))
    assert printed["step"] == 10 and printed["lease"]["alive"] and printed["resume"]["tag"] == tag_of(5)


@pytest.mark.parametrize("chunk", [1, 7, 64, 2**20])
def test_lines_are_read_backwards_whole_and_a_line_being_appended_is_left_out(tmp_path, chunk):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "x": "y" * (i % 13)}) for i in range(50)]
    path.write_text("\n".join(lines) + '\n{"step": 50, "x')
    assert [line.decode() for line in complete_lines_backwards(path, 10**9, chunk)] == lines[::-1]
    last = [line.decode() for line in complete_lines_backwards(path, 200, chunk)]
    assert last == lines[::-1][: len(last)] and len(last) >= 4 and sum(len(x) + 1 for x in last) <= 200
    assert list(complete_lines_backwards(tmp_path / "none.jsonl", 100, chunk)) == []


def test_what_is_read_of_metrics_stays_the_same_however_long_the_run(tmp_path, monkeypatch):
    """Runs of 1,000 and 20,000 steps, their monitor logged near the end: the status reads as many lines of each;
    one logged before the last TAIL_BYTES is not shown."""
    read = []

    def counted(path, max_bytes, chunk=2**20):
        for line in complete_lines_backwards(path, max_bytes, chunk):
            read.append(line)
            yield line

    monkeypatch.setattr(status, "complete_lines_backwards", counted)
    counts = []
    for steps in (1_000, 20_000):
        run_dir = tmp_path / f"run{steps}"
        run_dir.mkdir()
        write_config(run_dir, f"schedule.steps={steps}", "eval.features.enabled=true")
        lines = [{"step": s, "time": NOW, "train/loss": 1.0, "perf/images_per_sec": 100.0} for s in range(1, steps + 1)]
        lines.insert(-3, {"step": steps - 3, "features/effective_rank": 9.0})
        write_metrics(run_dir, lines)
        read.clear()
        got = read_status(run_dir, now=NOW)
        assert got["step"] == steps and got["monitors"]["features/effective_rank"] == {"value": 9.0, "step": steps - 3}
        counts.append(len(read))
    assert counts == [6, 6]  # five rate windows and the monitor's line

    monkeypatch.setattr(status, "TAIL_BYTES", 4_000)
    lines[-4:-3] = []
    lines.insert(-100, {"step": steps - 100, "features/effective_rank": 9.0})  # about 7 kB before the end
    write_metrics(run_dir, lines)
    read.clear()
    got = read_status(run_dir, now=NOW)
    assert got["step"] == steps and "features/effective_rank" not in got["monitors"]
    assert sum(len(line) + 1 for line in read) <= 4_000
