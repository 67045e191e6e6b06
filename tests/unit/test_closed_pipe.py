"""A command piped into a reader that closes early ends quietly (core/compat/closed_pipe.py): the real commands, their
stdout a real pipe that the test closes after reading one line (`| head -1`) or before reading any, end with exit
code 141 and nothing on stderr. A BrokenPipeError that is not stdout's stays an error."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from core.compat.closed_pipe import EXIT_CLOSED_PIPE
from core.recipe.config import dump_config, load_config
from tests.launching import REPO, write_synthetic

PAGE = 4096
"""The pipe's capacity here (its smallest): a command that prints more is still writing when the reader closes."""
MIMPIPE = [sys.executable, "-m", "core.entry.cli"]
"""`mimpipe` as a process (the module its console script calls)."""


def closed_after(cmd: list[str], num_lines: int) -> tuple[list[str], int, str]:
    """Run `cmd` with stdout a one-page pipe that is closed after reading `num_lines` lines from it; returns the lines
    read, the exit code and stderr. Its stdout is block-buffered, Python's default on a pipe: what it prints without
    flushing reaches the pipe at its last flush (before the fix: "Exception ignored ... BrokenPipeError", exit 120)."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PAGE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=write_end, stderr=subprocess.PIPE, text=True) as proc:
        os.close(write_end)
        lines = [read_line(read_end) for _ in range(num_lines)]
        os.close(read_end)
        _, stderr = proc.communicate(timeout=300)
    return lines, proc.returncode, stderr


def read_line(fd: int) -> str:
    """One line, a byte at a time: nothing after it leaves the pipe, so the command's next write waits for room."""
    data = b""
    while not data.endswith(b"\n") and (byte := os.read(fd, 1)):
        data += byte
    return data.decode()


@pytest.mark.parametrize("entry", [[sys.executable, "-m", "data"], [*MIMPIPE, "data"]], ids=["python -m", "mimpipe"])
def test_data_inspect_into_a_reader_that_takes_one_line_ends_quietly(entry, tmp_path):
    shards = write_synthetic(tmp_path / "shards", "train", 100, 100, seed=0)  # one shard: 100 lines, ~7 kB
    lines, code, stderr = closed_after([*entry, "inspect", str(shards), "--num-show", "100"], num_lines=1)
    shard = shards / "train-000000.tar"
    assert lines == [f"shards: 1 ({shard} ... {shard})\n"]
    assert (code, stderr) == (EXIT_CLOSED_PIPE, "")


@pytest.mark.parametrize("entry", [[sys.executable, "-m", "core.entry.status"], [*MIMPIPE, "status"]])
def test_status_into_a_reader_gone_before_it_prints_ends_quietly(entry, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, [f"run_dir={run_dir}"])))  # a run not started
    assert closed_after([*entry, str(run_dir)], num_lines=0) == ([], EXIT_CLOSED_PIPE, "")
    screen = subprocess.run([*entry, str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert screen.returncode == 0 and screen.stdout.startswith(f"{run_dir}  pretrain, mae on vit base")  # the pipe open


def test_a_broken_pipe_that_is_not_stdouts_stays_an_error(tmp_path):
    script = tmp_path / "worker_pipe.py"
    script.write_text(
        "import sys\n"
        "from core.compat.closed_pipe import quiet_on_closed_pipe\n\n"
        "def main():\n"
        "    print('before')\n"
        "    raise BrokenPipeError(32, 'Broken pipe')  # a worker's pipe, say: stdout's reader is still there\n\n"
        "sys.exit(quiet_on_closed_pipe(main))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "before\n"
    assert proc.stderr.splitlines()[-1] == "BrokenPipeError: [Errno 32] Broken pipe"


def test_exit_code_is_the_shells_for_a_command_sigpipe_ended():
    ended = subprocess.run(["bash", "-c", "yes | head -1 > /dev/null; echo ${PIPESTATUS[0]}"], capture_output=True)
    assert int(ended.stdout) == EXIT_CLOSED_PIPE == 128 + 13
