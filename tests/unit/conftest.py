"""Fixtures shared by tests/unit: a one-process group for engines built in the test process. Model builders and
damaged files are in tests/helpers/."""

from __future__ import annotations

import pytest
import torch

from core.engine.distributed import DistInfo


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory):
    """A one-process gloo group, as torchrun would make it, for engines built by `parallelize`: one for the test
    process (an xdist worker runs several files), since DeepSpeed keeps the groups it derives from the first one it
    sees."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOCAL_RANK", "0")  # what torchrun sets; DeepSpeed asserts it
        store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("one_rank") / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        torch.distributed.destroy_process_group()
