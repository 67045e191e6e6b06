"""How a rank ends on an error (core/engine/failure.py): one console line, the traceback in run_dir/logs; a recipe
that does not load, started without launch.sh, refused as launch.sh's check refuses it (its lines, exit code 2); and
the one-line report of a failed torchrun run and the agent's exit code (core/launch/torchrun.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.utils.data import DataLoader, IterableDataset

from core.engine import failure
from core.engine.distributed import nccl_error_handling
from core.launch.torchrun import EXIT_FAILED, EXIT_REFUSED, exit_code, failure_line
from core.recipe.config import ConfigError
from data.decode import LabelError
from tests.launching import REPO

MESSAGE = "sample train_00000070 in shard /data/train-000002.tar has no .cls label (fields: json, png)"


class _Raises(IterableDataset):
    def __iter__(self):
        raise LabelError(MESSAGE)


def _fail(err: Exception) -> int:
    def main() -> int:
        raise err

    return failure.run_guarded(main)


@pytest.fixture(autouse=True)
def rank_1(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MIMPIPE_DEBUG", raising=False)
    monkeypatch.setattr(failure, "_log_dir", None)


def test_error_is_one_line_and_the_traceback_goes_to_the_rank_log(tmp_path, capsys):
    failure.log_tracebacks_to(tmp_path / "run")
    assert _fail(LabelError(MESSAGE)) == failure.EXIT_ERROR
    log = tmp_path / "run" / "logs" / "rank1.log"
    assert capsys.readouterr().err == f"[mimpipe] error: {MESSAGE} (rank 1; traceback in {log})\n"
    text = log.read_text()
    assert "rank 1 on" in text and "Traceback (most recent call last)" in text and f"LabelError: {MESSAGE}" in text


def test_debug_prints_the_traceback_too(tmp_path, capsys, monkeypatch):
    failure.log_tracebacks_to(tmp_path / "run")
    monkeypatch.setenv("MIMPIPE_DEBUG", "1")
    _fail(ValueError("bad"))
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "ValueError: bad" in err
    assert (
        err.splitlines()[-1] == f"[mimpipe] error: bad (rank 1; traceback in {tmp_path / 'run' / 'logs' / 'rank1.log'})"
    )


def test_without_a_run_dir_the_traceback_stays_on_the_console(capsys):
    _fail(ValueError("bad recipe"))
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.splitlines()[-1] == "[mimpipe] error: bad recipe (rank 1)"


def test_a_recipe_error_is_its_own_lines_from_rank_0_without_a_traceback_and_exit_2(tmp_path, capsys, monkeypatch):
    failure.log_tracebacks_to(tmp_path / "run")
    err = ConfigError("r.yaml: invalid recipe\n  schedule.stpes: unknown key (did you mean 'steps'?)")
    assert _fail(err) == failure.EXIT_REFUSED == 2 and capsys.readouterr().err == ""  # rank 1: rank 0 says it
    monkeypatch.setenv("RANK", "0")
    assert _fail(err) == 2
    assert capsys.readouterr().err == f"[mimpipe] refused: {err}\n"
    assert not (tmp_path / "run").exists()  # no traceback logged: the recipe is the user's, not a fault


# A typo in an override, as each stage's recipe gets it on the command line.
TYPOS = {
    "pretrain": ("recipes/quickstart.yaml", "schedule.stpes=10", "schedule.stpes: unknown key (did you mean 'steps'?)"),
    "finetune": (
        "recipes/quickstart_finetune.yaml",
        "optim.base_rl=1e-4",
        "optim.base_rl: unknown key (did you mean 'base_lr'?)",
    ),
}


@pytest.mark.parametrize("stage", TYPOS)
@pytest.mark.parametrize("entry", [["-m"], ["-m", "core.entry.cli"]], ids=["python -m", "mimpipe"])
def test_a_recipe_error_without_launch_sh_is_launch_sh_s_lines_and_exit_2(entry, stage):
    """`python -m STAGE RECIPE key=typo` and `mimpipe STAGE ...` (one process, no launch.sh) print what
    `./launch.sh RECIPE key=typo` prints, with the stage's prefix: no traceback, no `(+1 lines)`, exit code 2."""
    recipe, override, key_line = TYPOS[stage]
    env = {k: v for k, v in os.environ.items() if k not in ("MIMPIPE_DEBUG", "RANK")}
    options = {"cwd": REPO, "env": env, "capture_output": True, "text": True, "timeout": 300}
    stage_run = subprocess.run([sys.executable, *entry, stage, recipe, override], **options)
    launch = subprocess.run([str(REPO / "launch.sh"), recipe, override], **options)
    assert (stage_run.returncode, stage_run.stdout) == (2, ""), stage_run.stderr[-2000:]
    assert stage_run.stderr.splitlines() == [f"[mimpipe] refused: {recipe}: invalid recipe", f"  {key_line}"]
    assert (launch.returncode, launch.stdout) == (2, "")
    assert launch.stderr.splitlines() == [f"launch.sh: {recipe}: invalid recipe", f"  {key_line}"]


def test_a_data_worker_error_is_unwrapped_to_its_own_message():
    with pytest.raises(LabelError) as caught:
        next(iter(DataLoader(_Raises(), batch_size=None, num_workers=1)))
    assert "Original Traceback" in str(caught.value)  # torch's wrapping
    assert failure.first_line(caught.value) == MESSAGE


def test_a_collective_broken_by_another_rank_is_a_quiet_line(tmp_path, capsys):
    failure.log_tracebacks_to(tmp_path)
    gloo = "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:3236. This is typically caused..."
    assert _fail(RuntimeError(gloo)) == failure.EXIT_ERROR
    assert capsys.readouterr().err == (
        "[mimpipe] rank 1 stopped: another rank failed first (RuntimeError: Connection closed by peer; rank 1; "
        f"traceback in {tmp_path / 'logs' / 'rank1.log'})\n"
    )


# What the ranks of a run on NCCL raise when a peer dies (messages as torch 2.x's ProcessGroupNCCL words them).
NCCL_WATCHDOG = (
    "NCCL communicator was aborted on rank 1. Original reason for failure was: [PG ID 0 PG GUID 0(default_pg) Rank 1] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=2, NumelOut=2, "
    "Timeout(ms)=600000) ran for 600045 milliseconds before timing out."
)
NCCL_REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or there "
    "was a network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a "
    "remote process exiting prematurely.\nLast error:\nNET/IB : Got completion from peer 10.0.0.2<53211> with status=12"
)


@pytest.mark.parametrize(
    ("err", "cause"),
    [
        (dist.DistBackendError(NCCL_WATCHDOG), "DistBackendError: NCCL communicator was aborted"),
        (RuntimeError(NCCL_WATCHDOG), "RuntimeError: NCCL communicator was aborted"),  # older torch: a RuntimeError
        (RuntimeError(NCCL_REMOTE), "RuntimeError: ncclRemoteError"),
        (dist.DistNetworkError("Connection timed out: 10.0.0.1:29500"), "DistNetworkError: collective failed"),
        (
            RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)"),
            "RuntimeError: Watchdog",
        ),
    ],
)
def test_a_peer_lost_under_nccl_is_the_same_quiet_line_as_under_gloo(err, cause, tmp_path, capsys):
    """One rank's own error and its peer's NCCL error: the job's output has one `[mimpipe] error:` line, the cause."""
    failure.log_tracebacks_to(tmp_path)
    assert _fail(ValueError(MESSAGE)) == failure.EXIT_ERROR  # the rank that failed on its own
    assert _fail(err) == failure.EXIT_ERROR  # its peer, whose collective NCCL aborted
    own, peer = capsys.readouterr().err.splitlines()
    assert own == f"[mimpipe] error: {MESSAGE} (rank 1; traceback in {tmp_path / 'logs' / 'rank1.log'})"
    assert peer.startswith(f"[mimpipe] rank 1 stopped: another rank failed first ({cause}")


def test_waiting_for_a_rank_that_went_away_is_a_quiet_line(tmp_path, capsys):
    failure.log_tracebacks_to(tmp_path)
    assert _fail(failure.PeerLostError("rank 0 could not convert /run/checkpoints/step_00000003")) == 1
    assert capsys.readouterr().err == (
        "[mimpipe] rank 1 stopped: rank 0 could not convert /run/checkpoints/step_00000003 "
        f"(rank 1; traceback in {tmp_path / 'logs' / 'rank1.log'})\n"
    )


def test_a_peer_gone_after_ctrl_c_is_that_stop_and_says_nothing(capsys, monkeypatch):
    """A rank still in a collective when its peer stopped at once on a second Ctrl-C: the peer's line says it."""
    monkeypatch.setattr(failure, "ctrl_c_received", lambda: True)
    assert _fail(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")) == 130
    assert capsys.readouterr().err == ""
    assert _fail(ValueError("bad")) == failure.EXIT_ERROR  # its own error is still one


def test_ctrl_c_outside_the_loop_is_one_line_from_rank_0_and_exit_130(capsys, monkeypatch):
    def main() -> int:
        raise KeyboardInterrupt

    assert failure.run_guarded(main) == 130 and capsys.readouterr().err == ""  # rank 1: quiet
    monkeypatch.setenv("RANK", "0")
    assert failure.run_guarded(main) == 130
    assert capsys.readouterr().err.startswith("[mimpipe] stopped by Ctrl-C outside the training loop, nothing saved;")


def test_nccl_aborts_its_communicators_and_lets_the_rank_raise_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nccl_error_handling()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: no SIGABRT from the watchdog thread
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nccl_error_handling()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_a_long_message_keeps_its_first_line():
    assert failure.first_line(ValueError("x does not fit (2 keys):\n  a\n  b")) == "x does not fit (2 keys): (+2 lines)"


def test_torchrun_failure_is_one_line_with_each_rank_and_its_code():
    first = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file="<N/A>")
    killed = ProcessFailure(local_rank=0, pid=10, exitcode=-9, error_file="<N/A>")
    first.timestamp, killed.timestamp = 100, 101
    line = failure_line(ChildFailedError("finetune", {0: killed, 1: first}))
    assert line.startswith(
        "[mimpipe] torchrun: finetune failed: rank 1 (exit code 1) first, then rank 0 (killed by SIGKILL);"
    )
    assert "\n" not in line


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ((2, 2), EXIT_REFUSED),  # every rank refused before training (rank 0 told the others)
        ((2, -15), EXIT_REFUSED),  # the other still ending when torchrun SIGTERMed it after the first had exited
        ((-15, 2), EXIT_REFUSED),
        ((2, 1), EXIT_FAILED),  # a rank that failed on its own is a failure, whatever the others said
        ((2, -9), EXIT_FAILED),
        ((-15, -15), EXIT_FAILED),
        ((1,), EXIT_FAILED),
        ((3, 3), EXIT_FAILED),  # non-finite and preempted (4) under torchrun stay torchrun's 1
        ((4, 4), EXIT_FAILED),
        ((130, 130), 130),  # Ctrl-C
        ((130, 2), EXIT_FAILED),
    ],
)
def test_torchrun_exits_as_its_ranks_only_for_a_refusal_and_ctrl_c(codes, expected):
    failures = {
        rank: ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=code, error_file="<N/A>")
        for rank, code in enumerate(codes)
    }
    assert exit_code(ChildFailedError("pretrain", failures)) == expected
