"""SIGTERM during an evaluation, the kNN pass or a save (core/engine/preempt.py): the pass stops on every rank at
once, a save in progress finishes, and the loop ends with that step's checkpoint and `EXIT_PREEMPTED`. Ctrl-C (SIGINT)
the same, with `EXIT_INTERRUPTED`; a second one ends the process at once with one line.

The signal is real (sent to this process); the other rank of a two-rank run is an all-reduce that says what it
received. Loop recipe: defaults with a toy objective through `parallelize` (one gloo rank), as tests/unit/
test_host_syncs.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import finetune.evaluate as evaluate_module
import pretrain.knn as knn_module
from core.engine import loop as loop_module
from core.engine import preempt
from core.engine.loop import LoopHooks
from core.engine.run import run_loop
from core.engine.setup import parallelize
from core.engine.stage import StageRun
from core.engine.train_state import TrainState
from core.recipe.config import dump_config, load_config
from core.report.logging import MetricsLogger
from data.pipeline import zero_counts
from tests.helpers.models import tiny_vit
from tests.launching import REPO, read_metrics
from tests.unit.test_evaluate import DIST, EchoEngine, one_hot_batch
from tests.unit.test_host_syncs import Toy


@pytest.fixture
def watching(ctrl_c_put_back):
    """SIGTERM and SIGINT handled as a run handles them, for the test's duration."""
    preempt.install()
    yield
    preempt.restore()


@pytest.fixture
def ctrl_c_put_back(monkeypatch):
    """After a test that sends SIGINT: the test process's own SIGINT handler back, and no Ctrl-C on record (a run
    keeps both after a Ctrl-C, see `preempt.restore`; the next test in this process is no run stopped by one)."""
    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(preempt._Watch, "ctrl_c", preempt._Watch.ctrl_c)  # put back at teardown
    yield
    signal.signal(signal.SIGINT, handler)


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


HANG_S = 600


def _then_sigterm_and_hang(batches: list[dict], sent: list[float] | None = None):
    """Yields `batches`, then receives SIGTERM (its time appended to `sent`) while waiting for a batch that would take
    `HANG_S` seconds."""
    yield from batches
    (sent if sent is not None else []).append(time.monotonic())
    _sigterm_self()
    time.sleep(HANG_S)
    yield batches[0]


def test_a_sigterm_while_waiting_for_a_batch_ends_the_wait(watching):
    """A rank waiting on a slow or stuck evaluation loader stops waiting (and says so to the others)."""
    sent = []
    assert preempt.next_unless_stopping(_then_sigterm_and_hang([], sent)) is None
    assert time.monotonic() - sent[0] < HANG_S and preempt.stop_requested()  # the wait ended, not the batch came
    assert preempt.next_unless_stopping(iter([1])) is None  # once stopping, nothing more is read


def test_without_sigterm_next_unless_stopping_is_next(watching):
    batches = iter([1, 2])
    assert [preempt.next_unless_stopping(batches) for _ in range(3)] == [1, 2, None]
    assert not preempt.stop_requested()


def peer_stops(position: int):
    """all_reduce as seen by a rank whose peer still has data and received SIGTERM (its flag at `position`)."""

    def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op == "max":
            tensor[0], tensor[position] = 1.0, 1.0
        return tensor

    return all_reduce


def test_evaluation_stops_on_every_rank_when_one_received_sigterm(monkeypatch):
    monkeypatch.setattr(evaluate_module, "all_reduce", peer_stops(2))
    engine = EchoEngine()
    with pytest.raises(preempt.StopAgreed):
        evaluate_module.evaluate(engine, [one_hot_batch([0], [0])] * 3, dist=DIST, precision="fp32")
    assert engine.num_forwards == 0 and engine.training  # stopped before the first forward, back in training mode


def test_knn_pass_stops_on_every_rank_when_one_received_sigterm(monkeypatch):
    monkeypatch.setattr(knn_module, "all_reduce", peer_stops(1))
    vit, seen = tiny_vit(), []
    vit.patch_embed.register_forward_hook(lambda module, args, out: seen.append(1))
    batch = {"image": torch.randn(2, 3, 16, 16), "label": torch.tensor([1, 2])}
    with pytest.raises(preempt.StopAgreed):
        knn_module.embed(vit, [batch] * 3, dist=DIST, precision="fp32", pooling="cls", image_shape=(3, 16, 16))
    assert seen == []


def _run(one_rank, tmp_path: Path, steps: int, hooks: LoopHooks, *overrides: str) -> tuple[int, Path]:
    """run_loop on the toy objective: (exit code, checkpoints directory)."""
    cfg = load_config(
        None,
        [f"run_dir={tmp_path}", f"schedule.steps={steps}", "schedule.warmup_steps=0", "engine.zero_stage=1"]
        + ["data.global_batch_size=2", "logging.every_steps=1", "engine.sync_every_steps=100", *overrides],
    )
    torch.manual_seed(0)
    engine, optimizer = parallelize(Toy(), cfg=cfg, dist=one_rank, run_dir=tmp_path)
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, total_steps=steps)
    run = StageRun(cfg, "", one_rank, tmp_path, dump_config(cfg), None, steps, 0, None, TrainState(), logger)

    def batches():
        while True:
            yield {"image": torch.randn(2, 4), **zero_counts()}

    return run_loop(run, engine, optimizer, batches(), hooks), tmp_path / "checkpoints"


def test_sigterm_during_an_evaluation_saves_that_step_and_exits_preempted(one_rank, tmp_path):
    """The evaluation at step 2 waits for its second batch when SIGTERM arrives: the loop saves step 2 at once (no
    checkpoint was due) and returns 4; nothing of the cut evaluation is logged."""

    sent = []

    def evaluate(step: int) -> dict[str, float]:
        batches = _then_sigterm_and_hang([one_hot_batch([0], [0])], sent)
        return evaluate_module.evaluate(EchoEngine(), batches, dist=one_rank, precision="fp32")

    code, checkpoints = _run(one_rank, tmp_path, 10, LoopHooks(evaluate=evaluate), "eval.knn.every_steps=2")
    assert code == preempt.EXIT_PREEMPTED and time.monotonic() - sent[0] < HANG_S  # not the batch: the stop
    assert (checkpoints / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000002"]
    logged = read_metrics(tmp_path)
    assert max(m["step"] for m in logged) == 2 and not any("val/top1" in m for m in logged)


def test_sigterm_during_a_save_ends_the_run_with_that_checkpoint(one_rank, tmp_path, monkeypatch):
    """The save of step 3 is under way when SIGTERM arrives: it completes, and the run stops with it, instead of
    running on to the next agreement (step 6, another save) inside the grace period."""
    real_save = loop_module.save_checkpoint

    def save_while_signalled(*args, **kwargs):
        _sigterm_self()
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop_module, "save_checkpoint", save_while_signalled)
    code, checkpoints = _run(one_rank, tmp_path, 12, LoopHooks(), "checkpoint.every_steps=3")
    assert code == preempt.EXIT_PREEMPTED
    assert (checkpoints / "latest").read_text() == "step_00000003"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000003"]


def test_ctrl_c_during_a_save_ends_the_run_with_that_checkpoint_and_exit_130(
    one_rank, tmp_path, monkeypatch, capsys, ctrl_c_put_back
):
    """As a SIGTERM: the save of step 3 under way completes and the run stops with it, exit code 130 and one line
    naming the step and the checkpoint; SIGINT keeps the run's handler after the loop (the process is on its way out,
    and a second Ctrl-C must still stop it at once)."""
    real_save = loop_module.save_checkpoint

    def save_while_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop_module, "save_checkpoint", save_while_interrupted)
    code, checkpoints = _run(one_rank, tmp_path, 12, LoopHooks(), "checkpoint.every_steps=3")
    assert code == preempt.EXIT_INTERRUPTED == 130
    assert (checkpoints / "latest").read_text() == "step_00000003"
    line = (
        f"[mimpipe] stopped by Ctrl-C after step 3 of 12 with checkpoint {checkpoints / 'step_00000003'}; launch the "
        "same command again to resume from it (exit code 130)"
    )
    assert line in capsys.readouterr().out.splitlines()
    assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN)


def test_a_sigterm_after_ctrl_c_confirms_the_stop_and_keeps_it_ctrl_cs(watching):
    """torchrun's agent SIGTERMs the ranks still running once one has exited: that is no second Ctrl-C."""
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    assert preempt.stop_requested() and preempt.ctrl_c_received()  # and this process still runs


SECOND_CTRL_C = """
import os, signal, sys, time
from core.engine import preempt
preempt.install()
os.kill(os.getpid(), signal.SIGINT)
print("saving", flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(60)  # a save that would take a minute
print("saved", flush=True)
"""


def test_a_second_ctrl_c_stops_at_once_with_one_line_and_exit_130():
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30  # not the minute of the save
    assert proc.returncode == 130 and proc.stdout == "saving\n"
    assert proc.stderr.splitlines() == [
        "[mimpipe] rank 0: Ctrl-C received; stopping after the current step with a checkpoint (Ctrl-C again: stop at "
        "once, without saving)",
        "[mimpipe] stopped by a second Ctrl-C, at once and without saving; launch the same command again to resume "
        "from the last complete checkpoint, the one checkpoints/latest names (exit code 130)",
    ]
