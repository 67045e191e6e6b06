"""Multi-node launches through ./launch.sh as a cluster user runs them.

Recipe: tiny MAE (tests/launching.py `pretrain_recipe`), ZeRO-2, 3 steps, one process per node: two torchrun nodes
on loopback, the same across two network namespaces joined by a veth pair, and one DeepSpeed-hostfile launch. The
commands launch.sh derives from SLURM, a hostfile and a c10d rendezvous are checked with --dry-run.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import timm

from tests.launching import REPO, fake_scontrol, free_port, losses, pretrain_recipe, write_recipe

pytestmark = pytest.mark.dist

LAUNCH_VARS = {"NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE", "MAX_RESTARTS"}
LAUNCH_VARS |= {"RDZV_ENDPOINT", "RDZV_ID"}
TIMEOUT_S = 300


def node_env(**values: str) -> dict[str, str]:
    """This environment without launch or SLURM variables (the suite may run inside an allocation), plus values."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **values}


def tiny_recipe(shards, tmp_path: Path) -> Path:
    recipe = pretrain_recipe(
        shards,
        tmp_path / "run",
        engine={"zero_stage": 2},
        schedule={"steps": 3, "warmup_steps": 1},
        checkpoint={"every_steps": 3},
    )
    return write_recipe(tmp_path / "tiny_mae_2nodes.yaml", recipe)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (torchrun passes it to its workers, which run in their own sessions), then SIGKILL
    whatever of its process tree is left."""
    try:
        tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    proc.terminate()
    _, alive = psutil.wait_procs([psutil.Process(p.pid) for p in tree if psutil.pid_exists(p.pid)], timeout=20)
    for p in alive:
        p.kill()
    proc.wait()


def run_nodes(commands: list[list[str]], envs: list[dict], logs: list[Path], watch=None) -> list[int | None]:
    """Start every node at once; return their exit codes (None: still running at the deadline, then stopped).
    The first node to fail stops the others, which would otherwise wait for it until the timeout. `watch(procs)`
    is called while they run."""
    procs = []
    try:
        for cmd, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if watch is not None:
                watch(procs)
            time.sleep(0.5)
        return [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)


def check_two_node_run(run_dir: Path, codes: list[int | None], logs: list[Path], monkeypatch) -> None:
    outputs = [log.read_text() for log in logs]
    tails = [
        f"--- node {rank} (exit {code}):\n{out[-3000:]}"
        for rank, (code, out) in enumerate(zip(codes, outputs, strict=True))
    ]
    assert codes == [0, 0], "\n".join(tails)
    for rank, output in enumerate(outputs):
        assert f"2 nodes x 1 process per node = world size 2, this is node {rank}" in output, output[-4000:]
    assert "global batch 32 = 16 per device x 1 accumulation x 2 ranks" in outputs[0]
    steps = losses(run_dir)
    assert sorted(steps) == [1, 2, 3] and all(math.isfinite(v) for v in steps.values())
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000003"
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_00000003").glob("rank_*.json")) == [
        "rank_00000.json",
        "rank_00001.json",
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = timm.create_model(f"local-dir:{run_dir / 'export'}", pretrained=True)
    assert model.embed_dim == 32


def test_two_nodes_on_loopback(shards, tmp_path, monkeypatch):
    """Two launch.sh (NNODES=2, NODE_RANK=0/1, one process each) meet at 127.0.0.1 and share the run_dir."""
    recipe = tiny_recipe(shards, tmp_path)
    common = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    envs = [node_env(**common, NODE_RANK=str(rank)) for rank in range(2)]
    codes = run_nodes([[str(REPO / "launch.sh"), str(recipe)]] * 2, envs, logs)
    check_two_node_run(tmp_path / "run", codes, logs, monkeypatch)


@pytest.mark.faults
def test_rendezvous_restart_resumes_from_latest(shards, tmp_path):
    """RDZV_ENDPOINT + MAX_RESTARTS=1, two nodes on loopback: a worker killed after the first checkpoint makes both
    nodes restart their workers, which meet again and resume from `latest` (tiny MAE, 30 steps, checkpoint every 3)."""
    run_dir = tmp_path / "run"
    recipe = pretrain_recipe(
        shards,
        run_dir,
        schedule={"steps": 30, "warmup_steps": 1},
        checkpoint={"every_steps": 3},
        logging={"every_steps": 1, "image_every_steps": 30},
    )
    recipe = write_recipe(tmp_path / "tiny_mae_restart.yaml", recipe)
    rdzv = {"NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "MAX_RESTARTS": "1"}
    killed = []

    def kill_node1_worker_once(procs):
        if not killed and (run_dir / "checkpoints" / "latest").exists():
            workers = [p for p in psutil.Process(procs[1].pid).children() if "pretrain" in p.cmdline()]
            for worker in workers:
                worker.kill()
            killed.extend(workers)

    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    cmd = [str(REPO / "launch.sh"), str(recipe)]
    codes = run_nodes([cmd] * 2, [node_env(**rdzv)] * 2, logs, watch=kill_node1_worker_once)
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-6000:]
    assert killed, "the run ended before a worker could be killed"
    assert "exitcode: -9" in output and "resumed from" in output
    assert max(losses(run_dir)) == 30
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000030"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def veth_namespaces():
    """Two network namespaces joined by a veth pair, 10.123.0.1/24 and 10.123.0.2/24: yields ((ns, ifname) x 2).
    Skips the test when this process may not create them; always removes them."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    tag = os.getpid()
    nodes = [(f"mimpipe{tag}a", f"mpv{tag}a", "10.123.0.1/24"), (f"mimpipe{tag}b", f"mpv{tag}b", "10.123.0.2/24")]
    try:
        for ns, _, _ in nodes:
            made = _ip("netns", "add", ns)
            if made.returncode:
                pytest.skip(
                    f"cannot create a network namespace here (`ip netns add` said: {made.stderr.strip()}); "
                    "it needs CAP_SYS_ADMIN, which unprivileged containers do not have"
                )
        steps = [("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])]
        for ns, ifname, addr in nodes:
            steps += [("link", "set", ifname, "netns", ns), ("-n", ns, "addr", "add", addr, "dev", ifname)]
            steps += [("-n", ns, "link", "set", ifname, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode:
                pytest.skip(f"cannot set up the veth pair here (`ip {' '.join(step)}` said: {done.stderr.strip()})")
        yield [(ns, ifname) for ns, ifname, _ in nodes]
    finally:
        for ns, ifname, _ in nodes:
            _ip("netns", "del", ns)
            _ip("link", "del", ifname)  # only left in this namespace when the set-up stopped half way


def test_two_nodes_across_network_namespaces(shards, tmp_path, monkeypatch):
    """The same two-node run, each node in its own network namespace, talking over a veth pair as two hosts would."""
    with veth_namespaces() as nodes:
        recipe = tiny_recipe(shards, tmp_path)
        common = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "10.123.0.1", "MASTER_PORT": "29500"}
        # Both namespaces share this host's name, which does not resolve to their addresses: gloo is told which
        # interface to use, as on a cluster whose hostnames resolve to the wrong network.
        envs = [node_env(**common, NODE_RANK=str(r), GLOO_SOCKET_IFNAME=ifname) for r, (_, ifname) in enumerate(nodes)]
        commands = [["ip", "netns", "exec", ns, str(REPO / "launch.sh"), str(recipe)] for ns, _ in nodes]
        logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
        codes = run_nodes(commands, envs, logs)
    check_two_node_run(tmp_path / "run", codes, logs, monkeypatch)


def test_hostfile_launch_through_deepspeed_runner(shards, tmp_path, monkeypatch):
    """HOSTFILE with one host, one slot: DeepSpeed's runner checks ssh (a stub here), then starts the process
    locally with `--module pretrain` and no --local_rank argument."""
    recipe = tiny_recipe(shards, tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one host\nlocalhost slots=1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "ssh.log"}\n')
    (bin_dir / "ssh").chmod(0o755)
    env = node_env(HOSTFILE=str(hostfile), MASTER_PORT=str(free_port()), PATH=f"{bin_dir}:{os.environ['PATH']}")
    codes = run_nodes([[str(REPO / "launch.sh"), str(recipe)]], [env], [tmp_path / "node.log"])
    output = (tmp_path / "node.log").read_text()
    assert codes == [0], output[-4000:]
    assert "1 node x 1 process per node = world size 1; DeepSpeed launcher" in output
    assert "localhost hostname" in (tmp_path / "ssh.log").read_text()
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000003"


def dry_run(recipe: Path, path_prefix: Path | None = None, **values: str) -> subprocess.CompletedProcess:
    env = node_env(**values)
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    cmd = [str(REPO / "launch.sh"), str(recipe), "--dry-run"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_slurm_allocation_sets_nodes_rank_and_master(shards, tmp_path):
    """`srun ./launch.sh` on the second node of a two-node job: everything comes from SLURM and scontrol."""
    recipe = tiny_recipe(shards, tmp_path)
    bin_dir = fake_scontrol(tmp_path / "bin", {"gpu-[07-08]": ["gpu-07", "gpu-08"]})
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu-[07-08]",
    }
    proc = dry_run(recipe, bin_dir, **slurm, SLURM_GPUS_ON_NODE="4", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2")
    assert proc.returncode == 0, proc.stderr
    assert (
        "core.launch.torchrun --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr gpu-07 --master-port 24242"
        in proc.stdout
    )
    assert "2 nodes x 4 processes per node = world size 8, this is node 1" in proc.stderr

    proc = dry_run(recipe, bin_dir, **slurm, SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="16")
    assert proc.returncode == 2 and "run one launch.sh per node (srun --ntasks-per-node=1)" in proc.stderr
    proc = dry_run(recipe, bin_dir, **slurm, NNODES="1", NPROC_PER_NODE="2")  # the user's NNODES turns SLURM off
    assert proc.returncode == 0 and "--nnodes 1 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1" in proc.stdout


def test_hostfile_dry_run_sums_slots_and_uses_deepspeed_runner(shards, tmp_path):
    recipe = tiny_recipe(shards, tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\n\n# spare\nworker-1 slots=2\nworker-2 slots=4\n")
    proc = dry_run(recipe, HOSTFILE=str(hostfile))
    assert proc.returncode == 0, proc.stderr
    assert "3 nodes (worker-0: 2, worker-1: 2, worker-2: 4) = world size 8" in proc.stderr
    assert (
        f"deepspeed.launcher.runner --hostfile {hostfile} --master_addr worker-0 --master_port 29500 --no_local_rank "
        f"--module pretrain {recipe}" in proc.stdout
    )
    proc = dry_run(recipe, HOSTFILE=str(hostfile), NNODES="2", NPROC_PER_NODE="8", MASTER_ADDR="10.0.0.1")
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes x 8 processes per node = world size 16" in proc.stderr
    assert "--master_addr 10.0.0.1 --master_port 29500 --num_nodes 2 --num_gpus 8 --no_local_rank" in proc.stdout
    proc = dry_run(recipe, HOSTFILE=str(hostfile), NPROC_PER_NODE="3")  # 32 / 9 does not split
    assert proc.returncode == 2 and "not divisible by world size 9" in proc.stderr
    hostfile.write_text("worker-0 gpus=2\n")
    proc = dry_run(recipe, HOSTFILE=str(hostfile))
    assert proc.returncode == 2 and "expected `host slots=N`" in proc.stderr


def test_rendezvous_dry_run_uses_c10d_and_restarts(shards, tmp_path):
    recipe = tiny_recipe(shards, tmp_path)
    rdzv = {"NNODES": "2", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": "head:29400"}
    proc = dry_run(recipe, **rdzv, MAX_RESTARTS="3")
    assert proc.returncode == 0, proc.stderr
    assert (
        "--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint head:29400 --rdzv-id mimpipe "
        "--max-restarts 3 -m pretrain" in proc.stdout
    )
    assert "--node-rank" not in proc.stdout and "--master-addr" not in proc.stdout
    assert proc.stdout.startswith("env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")  # restarts need a fresh store
    proc = dry_run(recipe, MAX_RESTARTS="3")
    assert proc.returncode == 2 and "MAX_RESTARTS needs a c10d rendezvous" in proc.stderr
    proc = dry_run(recipe, **rdzv, SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2")  # the job id names the rendezvous
    assert proc.returncode == 0 and "--rdzv-id 77" in proc.stdout
    proc = dry_run(recipe, **rdzv | {"NNODES": "1:4"})
    assert proc.returncode == 2 and "elastic node range is not supported" in proc.stderr
    assert not (tmp_path / "run").exists()
