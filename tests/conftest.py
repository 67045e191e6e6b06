"""Session fixtures shared by tests/dist and tests/gpu: synthetic shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launching import write_synthetic


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    """Synthetic 16 px, 4 classes: train 512 samples in 8 shards, val 203 samples in 3 uneven shards."""
    root = tmp_path_factory.mktemp("shards")
    return {
        "train": write_synthetic(root / "train", "train", 512, 64, seed=0),
        "val": write_synthetic(root / "val", "val", 203, 70, seed=1),
    }
