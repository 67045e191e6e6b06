"""examples/k8s_mae_vitl.yaml, the Kubernetes PyTorchJob beside the SLURM script: its pods run ./launch.sh with a
torchrun rendezvous, and what it gives the launcher agrees with itself, with launch.sh and with the recipe it runs."""

from __future__ import annotations

import math
import re
from pathlib import PurePosixPath

import pytest
import yaml

from core.recipe.config import load_config
from tests.launching import REPO

MANIFEST = REPO / "examples" / "k8s_mae_vitl.yaml"
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(text: str | int) -> int:
    """A Kubernetes quantity ("4Gi", "500M", 8) in units."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return int(float(number) * UNITS.get(unit, 1))


@pytest.fixture(scope="module")
def documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


@pytest.fixture(scope="module")
def job(documents) -> dict:
    return documents["PyTorchJob"]


def replicas(job: dict) -> dict[str, dict]:
    return job["spec"]["pytorchReplicaSpecs"]


def trainer(job: dict, replica: str = "Master") -> dict:
    """The training container of a replica's pod (the operator requires the name `pytorch`)."""
    (container,) = [c for c in replicas(job)[replica]["template"]["spec"]["containers"] if c["name"] == "pytorch"]
    return container


def env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"]}


def recipe_of(container: dict):
    """The recipe launch.sh runs with the command's overrides, as the pre-flight loads it."""
    launcher, recipe, *overrides = container["command"]
    assert launcher == "./launch.sh" and container["workingDir"].endswith("/mimpipe")
    return load_config(REPO / recipe, overrides)


def launch_sh_reads() -> set[str]:
    """Every environment variable launch.sh reads (`${NAME...}`)."""
    return set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (REPO / "launch.sh").read_text()))


def test_a_kubeflow_pytorchjob_whose_pods_all_run_launch_sh_the_same_way(job):
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert set(replicas(job)) == {"Master", "Worker"} and replicas(job)["Master"]["replicas"] == 1
    pods = [spec["template"]["spec"] for spec in replicas(job).values()]
    assert pods[0] == pods[1]  # the Master is a worker like the others that also hosts the rendezvous
    recipe_of(trainer(job))  # the recipe exists and loads with the command's overrides


def test_the_launcher_environment_is_launch_shs_and_agrees_with_the_job(job):
    container, name = trainer(job), job["metadata"]["name"]
    given = env(container)
    assert set(given) <= launch_sh_reads(), set(given) - launch_sh_reads()
    assert int(given["NNODES"]) == sum(spec["replicas"] for spec in replicas(job).values())
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert int(given["NPROC_PER_NODE"]) == gpus == container["resources"]["requests"]["nvidia.com/gpu"]
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port"]
    assert given["RDZV_ENDPOINT"] == f"{name}-master-0:{port}"  # the operator's service for the master pod
    assert given["RDZV_ID"] == name and int(given["MAX_RESTARTS"]) >= 1
    assert not {"NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE"} & set(given)  # the rendezvous ranks the nodes
    cfg = recipe_of(container)
    world = int(given["NNODES"]) * int(given["NPROC_PER_NODE"])
    assert cfg.batch_size_per_device(world) * world * cfg.engine.grad_accum_steps == cfg.data.global_batch_size
    # Kubernetes' SIGKILL comes after torchrun's own grace for the ranks' checkpoint
    shutdown = re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)", (REPO / "launch.sh").read_text())
    assert replicas(job)["Master"]["template"]["spec"]["terminationGracePeriodSeconds"] > int(shutdown[1])


def test_run_dir_is_on_a_shared_volume_and_shared_memory_holds_the_workers_batches(documents, job):
    container, pod = trainer(job), replicas(job)["Master"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {PurePosixPath(mount["mountPath"]): volumes[mount["name"]] for mount in container["volumeMounts"]}
    cfg = recipe_of(container)

    run_dir = PurePosixPath(cfg.run_dir)
    (runs,) = [volume for path, volume in mounts.items() if path in run_dir.parents]
    claim = documents["PersistentVolumeClaim"]
    assert runs["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # every pod writes its ranks' shards there
    assert any(path in PurePosixPath(cfg.data.train).parents for path in mounts)

    shm = mounts[PurePosixPath("/dev/shm")]["emptyDir"]
    assert shm["medium"] == "Memory"
    world = int(env(container)["NNODES"]) * int(env(container)["NPROC_PER_NODE"])
    batch_bytes = cfg.batch_size_per_device(world) * 3 * math.prod(cfg.model.image_hw)  # uint8 (data/device.py)
    in_flight = int(env(container)["NPROC_PER_NODE"]) * 2 * cfg.data.num_workers * batch_bytes  # prefetch_factor 2
    assert quantity(shm["sizeLimit"]) >= 2 * in_flight
    memory = quantity(container["resources"]["limits"]["memory"])
    assert memory > quantity(shm["sizeLimit"])  # a memory emptyDir counts against the pod's limit
