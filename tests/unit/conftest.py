"""Builders shared by tests/unit: tiny timm ViTs (from `core.models.vit.build_vit`) with seeded random weights, and a
one-process group for engines built in the test process; bit rot in checkpoint files."""

from __future__ import annotations

import struct
import zipfile

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from core.engine.distributed import DistInfo
from core.models.vit import build_vit
from tests.launching import TINY_MODEL

# 16 px images in 4 px patches (a 4x4 grid), 32 wide, 2 blocks of 2 heads: the recipes' model in tests/dist.
SMALL = {key: value for key, value in TINY_MODEL.items() if key != "size"}
# 28 px images in 4 px patches (the quickstart's 7x7 grid), 64 wide, 2 blocks of 4 heads.
WIDE = dict(img_size=28, patch_size=4, embed_dim=64, depth=2, num_heads=4)


def flip_a_bit(path, at: int) -> None:
    """Bit rot: one bit of byte `at` of `path` flipped; the size stays."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def rot_a_tensor(path) -> None:
    """Bit rot in the bytes of the first tensor `torch.save` wrote to `path` (a zip archive, one record per tensor)."""
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if "/data/" in info.filename)
    with open(path, "rb") as f:
        f.seek(record.header_offset)
        header = f.read(30)  # a zip local file header, then the name and the extra field, then the data
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    flip_a_bit(path, record.header_offset + 30 + name_len + extra_len + record.file_size // 2)


def tiny_vit(seed: int = 0, **overrides) -> VisionTransformer:
    """SMALL, without a head unless `num_classes` says so; any `build_vit` keyword overrides (e.g. `distilled=True`).
    Weights drawn after seeding `seed`; in eval mode, so a forward pass is deterministic."""
    torch.manual_seed(seed)
    return build_vit("tiny", **(SMALL | overrides)).eval()


def wide_vit(seed: int = 0, **overrides) -> VisionTransformer:
    """`tiny_vit` with WIDE's shape: 28 px, 7x7 grid, 64 wide."""
    return tiny_vit(seed, **(WIDE | overrides))


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
