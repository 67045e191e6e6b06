"""`python -m data write --max-side N --workers N`: downscaled images, byte-identical parallel shards, named errors,
and the progress lines of the long `data` commands (data/progress.py)."""

import io
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import webdataset as wds
from PIL import ExifTags, Image

from data import write_workers
from data.__main__ import inspect_shards, main
from data.decode import decode_rgb
from data.index import index_shards
from data.progress import Progress, format_duration, format_rate
from data.write import write_shards
from data.write_workers import encode_in_workers


def _read_tar(path) -> list[dict]:
    return list(wds.tarfile_samples([{"url": str(path)}]))


def _stored(out) -> list[dict]:
    index = json.loads((out / "index.json").read_text())
    return [s for shard in index["shards"] for s in _read_tar(out / shard["name"])]


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour gradients with a little noise: content a resize keeps and a wrong orientation would not."""
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(seed).integers(0, 8, (height, width))
    pixels = np.stack([255 * x // width, 255 * y // height, 128 + noise], axis=-1)  # (H, W, 3)
    return Image.fromarray(pixels.astype(np.uint8))


def _encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def _write(tree, out, *extra: str) -> None:
    main(["write", "--source", "imagefolder", "--path", str(tree), "--out", str(out), "--no-shuffle", *extra])


def _mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


def test_large_images_are_downscaled_as_jpeg_small_ones_stored_as_they_are(tmp_path):
    tree = tmp_path / "tree" / "c"
    tree.mkdir(parents=True)
    files = {
        "a_wide.jpg": _encode(_photo(300, 200), "JPEG", quality=95),
        "b_tall.jpg": _encode(_photo(90, 250), "JPEG", quality=95),
        "c_small.jpg": _encode(_photo(64, 40), "JPEG"),  # longer side == N: kept
        "d_alpha.png": _encode(_photo(200, 100).convert("RGBA"), "PNG"),
        "e_small.png": _encode(_photo(30, 30), "PNG"),
    }
    for name, data in files.items():
        (tree / name).write_bytes(data)
    _photo(120, 80).save(tree / "f_large.bmp")
    _photo(20, 10).save(tree / "g_small.bmp")
    _write(tmp_path / "tree", tmp_path / "out", "--max-side", "64")

    stored = _stored(tmp_path / "out")
    fields = [next(f for f in ("jpg", "png") if f in s) for s in stored]
    sizes = [Image.open(io.BytesIO(s[f])).size for s, f in zip(stored, fields, strict=True)]
    assert fields == ["jpg", "jpg", "jpg", "jpg", "png", "jpg", "png"]
    # (width, height): longer side 64, shorter rounded: 200 * 64 / 300 = 42.7, 90 * 64 / 250 = 23.0, 80 * 64 / 120
    assert sizes == [(64, 43), (23, 64), (64, 40), (64, 32), (30, 30), (64, 43), (20, 10)]
    assert stored[2]["jpg"] == files["c_small.jpg"] and stored[4]["png"] == files["e_small.png"]  # the same bytes
    assert Image.open(io.BytesIO(stored[0]["jpg"])).info.get("progression") is None  # a plain baseline JPEG
    # The content is the image's, resized: close to Pillow's own resize of the full-size original (JPEG loss aside).
    for k, name in ((0, "a_wide.jpg"), (1, "b_tall.jpg")):
        reference = decode_rgb(files[name]).resize(sizes[k], Image.Resampling.BICUBIC)
        assert _mean_abs_diff(decode_rgb(stored[k]["jpg"]), reference) < 3
    alpha = decode_rgb(stored[3]["jpg"])  # composited over white, as the loaders decode a transparent PNG
    assert _mean_abs_diff(alpha, decode_rgb(files["d_alpha.png"]).resize((64, 32), Image.Resampling.BICUBIC)) < 3
    bmp = np.asarray(decode_rgb(stored[5]["jpg"]), dtype=np.float64)  # (43, 64, 3): red grows left to right
    assert bmp[:, -4:, 0].mean() - bmp[:, :4, 0].mean() > 200

    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["max_side"] == 64 and index["jpeg_quality"] == 90 and index["image_size"] is None  # sizes differ
    assert "max_side: 64 (JPEG quality 90)" in inspect_shards(str(tmp_path / "out"), num_show=0)[3]
    plain = tmp_path / "plain"
    _write(tmp_path / "tree", plain)
    assert "max_side" not in json.loads((plain / "index.json").read_text())


def test_downscaled_set_records_its_image_size_and_quality(tmp_path):
    out = tmp_path / "syn"
    main(
        f"write --source synthetic --num-samples 6 --image-size 40 --max-side 25 --jpeg-quality 70 --out {out}".split()
    )
    index = json.loads((out / "index.json").read_text())
    assert index["image_size"] == [25, 25] and index["max_side"] == 25 and index["jpeg_quality"] == 70
    high = tmp_path / "high"
    main(
        f"write --source synthetic --num-samples 6 --image-size 40 --max-side 25 --jpeg-quality 98 --out {high}".split()
    )
    assert sum(len(s["jpg"]) for s in _stored(out)) < sum(len(s["jpg"]) for s in _stored(high))  # quality applied


def test_exif_rotated_jpeg_is_downscaled_in_its_displayed_orientation(tmp_path):
    tree = tmp_path / "tree" / "c"
    tree.mkdir(parents=True)
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # stored 200 x 100; displayed rotated 90 degrees clockwise: 100 x 200
    rotated = _encode(_photo(200, 100), "JPEG", quality=95, exif=exif.tobytes())
    small = _encode(_photo(40, 20), "JPEG", exif=exif.tobytes())
    (tree / "a.jpg").write_bytes(rotated)
    (tree / "b.jpg").write_bytes(small)
    _write(tmp_path / "tree", tmp_path / "out", "--max-side", "64")

    big, kept = _stored(tmp_path / "out")
    stored = Image.open(io.BytesIO(big["jpg"]))
    assert stored.size == (32, 64) and stored.getexif().get(ExifTags.Base.Orientation) is None  # turned, no EXIF
    displayed = decode_rgb(rotated).resize((32, 64), Image.Resampling.BICUBIC)
    unturned = decode_rgb(_encode(_photo(200, 100), "JPEG", quality=95)).resize((32, 64), Image.Resampling.BICUBIC)
    assert _mean_abs_diff(decode_rgb(big["jpg"]), displayed) < 3
    assert _mean_abs_diff(decode_rgb(big["jpg"]), unturned) > 20  # what ignoring the orientation would store
    assert kept["jpg"] == small  # under the limit: stored as it is, EXIF and all (the loaders turn it)


def _mixed_tree(root, num_files: int) -> None:
    """Two classes of JPEGs and PNGs, some over 24 px a side, some under."""
    for k in range(num_files):
        folder = root / f"class{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        width, height = (20 + 7 * k % 31, 18 + 5 * k % 23)
        image = _photo(width, height, seed=k)
        image.save(folder / f"{k:03d}.{'jpg' if k % 3 else 'png'}")


def test_workers_write_the_same_bytes_as_one_process(tmp_path):
    _mixed_tree(tmp_path / "tree", num_files=40)
    for workers in ("1", "2"):
        for name, extra in (("plain", []), ("small", ["--max-side", "24"])):
            _write(tmp_path / "tree", tmp_path / f"{name}{workers}", "--shard-size", "7", "--workers", workers, *extra)
    for name in ("plain", "small"):
        one, two = tmp_path / f"{name}1", tmp_path / f"{name}2"
        assert (
            sorted(os.listdir(one))
            == sorted(os.listdir(two))
            == ["index.json"] + [f"train-{k:06d}.tar" for k in range(6)]
        )
        assert all((one / n).read_bytes() == (two / n).read_bytes() for n in os.listdir(one))
    sides = [max(Image.open(io.BytesIO(s.get("jpg") or s["png"])).size) for s in _stored(tmp_path / "small2")]
    assert max(sides) == 24 and min(sides) < 24 and len(sides) == 40


def test_workers_hold_a_bounded_number_of_chunks_and_keep_the_order(monkeypatch):
    submitted = []

    class Counting(ProcessPoolExecutor):
        def submit(self, fn, /, *args):
            submitted.append(args)
            return super().submit(fn, *args)

    monkeypatch.setattr(write_workers, "ProcessPoolExecutor", Counting)
    taken = list(itertools.islice(encode_in_workers(range(10**12), abs, num_workers=2, chunk_size=3), 10))
    assert taken == list(range(10))
    # 10 results need chunks 0-3; at most 2 chunks per worker beyond the one being handed back were asked for.
    assert submitted == [(3 * k, 3 * k + 3) for k in range(8)]
    assert list(encode_in_workers([-k for k in range(50)], abs, num_workers=3, chunk_size=4)) == list(range(50))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_corrupt_image_is_named_and_leaves_no_partial_shard(tmp_path, workers):
    _mixed_tree(tmp_path / "tree", num_files=30)
    whole = _encode(_photo(100, 80), "JPEG")
    truncated = whole[: len(whole) // 2]  # its header reads; its pixels do not
    (tmp_path / "tree" / "class1" / "015.jpg").write_bytes(truncated)  # sample 22 (class0 holds 15)
    out = tmp_path / "out"
    bad = f"{tmp_path}/tree/class1/015.jpg: not a readable image"
    with pytest.raises(ValueError, match=rf"{bad} \(damaged JPEG: image file is truncated"):
        _write(tmp_path / "tree", out, "--shard-size", "7", "--max-side", "24", "--workers", str(workers))
    assert os.listdir(out) == []  # the 3 shards of the 21 samples before it are removed too: no index, no shard

    (tmp_path / "tree" / "class1" / "015.jpg").write_bytes(b"GIF89a not a JPEG")
    with pytest.raises(ValueError, match=rf"{bad} \(neither JPEG nor PNG data\)"):
        _write(tmp_path / "tree", tmp_path / "plain", "--shard-size", "10", "--workers", str(workers))
    assert os.listdir(tmp_path / "plain") == []


def test_a_bad_label_in_a_worker_is_named(tmp_path):
    samples = [(f"k_{i}", Image.new("L", (4, 4), i), i % 2 if i != 5 else 9, {}) for i in range(12)]
    with pytest.raises(ValueError, match=r"sample k_5: label 9 outside \[0, 2\)"):
        write_shards(samples, str(tmp_path), shard_size=4, split="k", classes=["x", "y"], source="t", num_workers=2)
    assert os.listdir(tmp_path) == []  # the shard finished before it is removed as well
    with pytest.raises(ValueError, match="needs the samples as a sequence"):
        write_shards(
            iter(samples), str(tmp_path / "b"), shard_size=4, split="k", classes=["x"], source="t", num_workers=2
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-side", "0"], "--max-side must be >= 1, got 0"),
        (["--max-side", "64", "--jpeg-quality", "0"], r"--jpeg-quality must lie in 1\.\.100, got 0"),
        (["--max-side", "64", "--jpeg-quality", "101"], r"--jpeg-quality must lie in 1\.\.100, got 101"),
        (["--jpeg-quality", "80"], "--jpeg-quality applies to downscaled images only: add --max-side"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--source", "segfolder", "--path", "/x", "--max-side", "512"], "refused for --source segfolder: its masks"),
        (["--source", "fashion-mnist-scenes", "--max-side", "512"], "--max-side is refused for --source fashion-mn"),
    ],
)  # fmt: skip
def test_bad_resize_and_worker_flags_are_named(tmp_path, extra, message):
    source = [] if "--source" in extra else ["--source", "synthetic", "--num-samples", "4"]
    with pytest.raises(ValueError, match=message):
        main(["write", *source, "--out", str(tmp_path / "out"), *extra])
    assert not (tmp_path / "out").exists()  # refused before anything is read or written


def test_write_shards_refuses_resizing_a_segmentation_set(tmp_path):
    from data.segmentation import SegInfo

    with pytest.raises(ValueError, match="max_side does not apply to a segmentation set"):
        write_shards([], str(tmp_path), shard_size=2, split="s", classes=["a", "b"], source="t",
                     segmentation=SegInfo(2, False), max_side=64)  # fmt: skip


class _Clock:
    """A fake monotonic clock: `now` seconds."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_give_rate_and_time_left_at_most_every_interval():
    clock, stream = _Clock(), io.StringIO()
    progress = Progress(1000, "images", label="data write", every_s=5, stream=stream, clock=clock)
    for _ in range(8):  # 4 s: no line yet
        clock.now += 0.5
        progress.advance(25)
    assert stream.getvalue() == ""
    clock.now += 1.0
    progress.advance(50)  # 250 images in 5 s
    clock.now += 4.5
    progress.advance(10)  # 4.5 s after the last line: throttled
    assert stream.getvalue() == "data write: 250/1,000 images (25%) in 5s, 50.0 images/s, ~15s left\n"
    clock.now += 0.5
    progress.advance(0)
    progress.advance(740)  # 0 s after the last line
    clock.now += 290
    progress.finish()
    assert stream.getvalue().splitlines()[1:] == [
        "data write: 260/1,000 images (26%) in 10s, 26.0 images/s, ~28s left",
        "data write: 1,000/1,000 images (100%) in 5m00s, 3.33 images/s",
    ]


def test_progress_without_lines_stays_quiet_and_formats():
    stream = io.StringIO()
    quick = Progress(3, "shards", label="data index", stream=stream, clock=_Clock())
    quick.advance(3)
    quick.finish()  # a short command prints nothing
    assert stream.getvalue() == ""
    assert Progress(None, "shards", label="x", clock=_Clock()).line(110.0) == "x: 0 shards in 10s, 0.00 shards/s"
    assert Progress(5, "shards", label="x", clock=_Clock()).line(110.0).endswith(", time left unknown")
    assert [format_duration(s) for s in (0, 42.9, 185, 3599, 3720, 90000)] == [
        "0s", "42s", "3m05s", "59m59s", "1h02m", "25h00m"
    ]  # fmt: skip
    assert [format_rate(r) for r in (0.523, 41.46, 3210.4)] == ["0.52", "41.5", "3,210"]


def test_write_and_index_advance_progress_per_sample_and_shard(tmp_path):
    clock, stream = _Clock(), io.StringIO()

    def ticking() -> float:  # every sample takes 1 s
        clock.now += 1
        return clock.now

    samples = [(f"k_{i}", Image.new("L", (4, 4), i), 0, {}) for i in range(6)]
    progress = Progress(6, "images", label="data write", every_s=2, stream=stream, clock=ticking)
    write_shards(samples, str(tmp_path), shard_size=2, split="k", classes=["x"], source="t", progress=progress)
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "data write: 2/6 images (33%) in 2s, 1.00 images/s, ~4s left"
    assert lines[-1].startswith("data write: 6/6 images (100%)") and len(lines) == 4

    stream.seek(0)
    stream.truncate()
    progress = Progress(3, "shards", label="data index", every_s=0, stream=stream, clock=ticking)
    index_shards(str(tmp_path / "k-*.tar"), out=str(tmp_path / "idx"), progress=progress)
    assert [line.split(" in ")[0] for line in stream.getvalue().splitlines()] == [
        f"data index: {k}/3 shards ({100 * k // 3}%)" for k in (1, 2, 3)
    ]
