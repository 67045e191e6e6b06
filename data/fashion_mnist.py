"""Where Fashion-MNIST's four IDX files are found, on any machine: the quickstart's real data.

Sources, in this order (`find`):
1. the folder given (`--path`), else the environment variable `MIMPIPE_FASHION_MNIST`;
2. Debian's package (`apt-get install -y dataset-fashion-mnist`): /usr/share/datasets/fashion-mnist;
3. the download cache, in torchvision's own layout: `$MIMPIPE_CACHE_DIR` (else `$XDG_CACHE_HOME/mimpipe`, else
   `~/.cache/mimpipe`) `/fashion-mnist/FashionMNIST/raw/`;
4. with `download` (and `MIMPIPE_OFFLINE` unset: the tests set it), torchvision's `FashionMNIST(download=True)` (its
   mirrors, its MD5 checks, its progress bar) into a temporary folder beside the cache, moved into the cache only when
   every file arrived whole, so that a failed or cut download leaves nothing half-written there.
Each source that fails is named with why (`Lookup.tried`), so that a machine that ends up on synthetic images says
exactly what it looked for.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

ENV = "MIMPIPE_FASHION_MNIST"
"""An environment variable naming a folder that holds the four files."""
OFFLINE = "MIMPIPE_OFFLINE"
"""An environment variable that, set, forbids downloading."""
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's `dataset-fashion-mnist` package puts them."""
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
"""The IDX files of each split, as every source names them."""


class Lookup(NamedTuple):
    """What `find` found: the folder holding the four files (None: no source had them), how, and every source that
    failed with why."""

    path: str | None
    source: str | None
    tried: list[str]


def cache_root() -> Path:
    """The download cache's root (torchvision's `root`: the files lie in `FashionMNIST/raw` under it)."""
    if os.environ.get("MIMPIPE_CACHE_DIR"):
        return Path(os.environ["MIMPIPE_CACHE_DIR"]) / "fashion-mnist"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mimpipe" / "fashion-mnist"


def missing(folder: str | os.PathLike) -> str | None:
    """Why `folder` does not hold the four files (the first one missing), or None when it does."""
    if not os.path.isdir(folder):
        return "no such folder"
    for name in FILES["train"] + FILES["test"]:
        if not os.path.isfile(os.path.join(folder, name)):
            return f"no {name}"
    return None


def find(path: str | None = None, *, download: bool = False) -> Lookup:
    """The first source (see the module docstring) that holds the four files; downloads them with `download`."""
    local = [("--path", path)] if path else []
    if os.environ.get(ENV):
        local.append((f"${ENV}", os.environ[ENV]))
    local += [("Debian's dataset-fashion-mnist", DEBIAN_DIR), ("the download cache", str(raw_folder()))]
    tried = []
    for source, folder in local:
        why = missing(folder)
        if why is None:
            return Lookup(folder, source, tried)
        tried.append(f"{source} ({folder}): {why}")
        if source == "--path":  # a folder the user named is the one meant: no other is taken in its place
            return Lookup(None, None, tried)
    if download and os.environ.get(OFFLINE):
        tried.append(f"download: ${OFFLINE} is set")
    elif download:
        why = fetch()
        if why is None:
            return Lookup(str(raw_folder()), "a download into the cache", tried)
        tried.append(f"download into {raw_folder()}: {why}")
    return Lookup(None, None, tried)


def raw_folder() -> Path:
    """The cache's folder of the four files."""
    return cache_root() / "FashionMNIST" / "raw"


def fetch() -> str | None:
    """Download the four files with torchvision into the cache; None when they arrived, else why not (one line)."""
    from torchvision.datasets import FashionMNIST

    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        FashionMNIST(str(staging), train=True, download=True)  # every file of both splits, each MD5-checked
        target = raw_folder()
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES["train"] + FILES["test"]:
            os.replace(staging / "FashionMNIST" / "raw" / name, target / name)
        return None
    except (RuntimeError, OSError, ValueError) as err:  # torchvision's: every mirror failed, a checksum, the disk
        return " ".join(str(err).split()) or type(err).__name__
    finally:
        shutil.rmtree(staging, ignore_errors=True)
