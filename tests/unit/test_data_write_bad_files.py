"""`python -m data write` on a folder with bad files: one line naming the file and exit code 2, nothing left behind;
`--skip-bad` writes the rest and lists what it left out; a truncated JPEG is caught with or without `--max-side`;
`python -m data inspect` shows the samples per class."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import webdataset as wds
from PIL import Image, ImageFile

from data.__main__ import _command, inspect_shards, main
from data.sources import BadImageError
from data.write import check_image_bytes
from tests.launching import REPO


def _jpeg(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)  # (H, W, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def _png(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width), seed, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


TRUNCATED = _jpeg(64, 48, seed=9)[: len(_jpeg(64, 48, seed=9)) // 2]  # its header reads, its pixels do not
BAD = {
    "cat/empty.jpg": (b"", "not a readable image (empty file)"),
    "dog/cut.jpg": (TRUNCATED, "not a readable image (damaged JPEG: image file is truncated ("),  # N bytes not ...
    "dog/notes.png": (b"shopping list\n", "not a readable image (neither JPEG nor PNG data)"),
}


def _photos(root, bad: tuple[str, ...] = tuple(BAD)) -> None:
    """`root/photos`: cat a.jpg b.png, dog c.jpg d.png e.jpg (5 good images, 40-50 px a side) and the `bad` files."""
    good = {"cat/a.jpg": _jpeg(40, 30, 0), "cat/b.png": _png(30, 40, 1), "dog/c.jpg": _jpeg(50, 50, 2)}
    good |= {"dog/d.png": _png(20, 20, 3), "dog/e.jpg": _jpeg(48, 36, 4)}
    for name, data in (good | {name: BAD[name][0] for name in bad}).items():
        (root / "photos" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "photos" / name).write_bytes(data)


def _write(root, out: str, *extra: str) -> None:
    main(["write", "--source", "imagefolder", "--path", str(root / "photos"), "--out", str(root / out), *extra])


def _paths(out) -> list[str]:
    index = json.loads((out / "index.json").read_text())
    samples = [s for shard in index["shards"] for s in wds.tarfile_samples([{"url": str(out / shard["name"])}])]
    return [json.loads(s["json"])["path"] for s in samples]


def test_a_bad_file_stops_the_write_with_one_line_exit_2_and_nothing_left(tmp_path):
    _photos(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = f"{sys.executable} -m data write --source imagefolder --path photos --out out --no-shuffle --shard-size 1"
    proc = subprocess.run(command.split(), cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (2, "")  # cat/a.jpg and cat/b.png were written as shards of 1 first
    assert proc.stderr == (
        "python -m data write: error: photos/cat/empty.jpg: not a readable image (empty file); fix or remove it, "
        "or pass --skip-bad\n"
    )
    assert os.listdir(tmp_path / "out") == []  # no shard, under any name, and no index: run it again as it is


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("name", list(BAD))
def test_each_bad_file_is_named_with_what_is_wrong(tmp_path, name, workers):
    _photos(tmp_path, bad=(name,))
    with pytest.raises(BadImageError) as caught:
        _write(tmp_path, "out", "--shard-size", "2", "--workers", workers, "--no-shuffle")
    assert str(caught.value).startswith(f"{tmp_path}/photos/{name}: {BAD[name][1]}")
    assert os.listdir(tmp_path / "out") == []  # 6 samples, shards of 2: the 1 or 2 finished before it are gone


@pytest.mark.parametrize("extra", [[], ["--max-side", "32"], ["--max-side", "64"]])
def test_a_truncated_jpeg_is_caught_whether_or_not_the_write_resizes(tmp_path, extra):
    # 64x48: downscaled with --max-side 32, stored as it is without --max-side or with --max-side 64.
    _photos(tmp_path, bad=("dog/cut.jpg",))
    with pytest.raises(BadImageError, match=r"cut.jpg: not a readable image \(damaged JPEG: image file is truncated"):
        _write(tmp_path, "out", *extra)


def test_the_whole_file_check_decodes_only_bytes_that_do_not_end_as_their_format_ends(monkeypatch):
    decoded = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda img: decoded.append(img.format) or load(img))
    whole_jpeg, whole_png = _jpeg(40, 30, 0), _png(30, 20, 1)
    assert check_image_bytes("a", whole_jpeg) == ("jpg", (40, 30)) and check_image_bytes("b", whole_png)[0] == "png"
    assert decoded == []  # ends with the end-of-image marker / the IEND chunk: the header is all that is read
    assert check_image_bytes("c", whole_jpeg + b"\0\0 trailer") == ("jpg", (40, 30))  # decodes: kept
    assert decoded == ["JPEG"]
    with pytest.raises(BadImageError, match=r"^d: not a readable image \(damaged PNG: "):
        check_image_bytes("d", whole_png[: len(whole_png) // 2])
    with pytest.raises(BadImageError, match=r"^e: not a readable image \(damaged JPEG: image file is truncated"):
        check_image_bytes("e", TRUNCATED)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_skip_bad_writes_every_good_image_and_lists_the_bad_ones(tmp_path, workers, capsys, monkeypatch):
    _photos(tmp_path)
    out = tmp_path / "out"
    command = f"write --source imagefolder --path {tmp_path}/photos --out {out} --shard-size 2 --workers {workers}"
    monkeypatch.setattr(sys, "argv", ["python -m data", *command.split(), "--skip-bad"])
    assert _command() == 0
    stdout = capsys.readouterr().out.splitlines()
    assert len(stdout) == 2 and stdout[0].startswith("wrote 5 samples in 3 shards to ")
    assert stdout[1] == f"skipped 3 unusable images, listed in {out}/skipped.txt"
    listed = (out / "skipped.txt").read_text().splitlines()  # sorted by file, not in the (shuffled) written order
    assert [line.split("\t")[0] for line in listed] == [f"{tmp_path}/photos/{name}" for name in BAD]
    assert all(line.split("\t")[1].startswith(BAD[name][1]) for line, name in zip(listed, BAD, strict=True))
    assert listed[1].endswith(" bytes not processed))")  # Pillow's own words, after "truncated ("
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 5 and [s["num_samples"] for s in index["shards"]] == [2, 2, 1]
    assert index["num_skipped"] == 3
    assert sorted(_paths(out)) == ["cat/a.jpg", "cat/b.png", "dog/c.jpg", "dog/d.png", "dog/e.jpg"]
    assert sorted(os.listdir(out)) == ["index.json", "skipped.txt", "train-000000.tar", "train-000001.tar",
                                       "train-000002.tar"]  # fmt: skip


def test_skip_bad_without_bad_files_writes_no_list_and_all_bad_is_an_error(tmp_path, capsys):
    _photos(tmp_path, bad=())
    _write(tmp_path, "clean", "--skip-bad")
    assert len(capsys.readouterr().out.splitlines()) == 1  # the summary alone
    assert json.loads((tmp_path / "clean" / "index.json").read_text())["num_skipped"] == 0
    assert not (tmp_path / "clean" / "skipped.txt").exists()
    _write(tmp_path, "plain")
    assert "num_skipped" not in json.loads((tmp_path / "plain" / "index.json").read_text())  # without the flag

    bad_only = tmp_path / "bad"
    (bad_only / "photos" / "cat").mkdir(parents=True)
    (bad_only / "photos" / "cat" / "empty.jpg").write_bytes(b"")
    all_bad = r"no samples to write to .*: all 1 images were unusable, e\.g\. .*/empty\.jpg \(not a readable"
    with pytest.raises(ValueError, match=all_bad):
        _write(bad_only, "out", "--skip-bad")
    assert os.listdir(bad_only / "out") == []


def test_other_write_errors_exit_2_with_one_line_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m data", "write", "--source", "synthetic", "--out", str(tmp_path),
                                      "--workers", "0"])  # fmt: skip
    assert _command() == 2
    assert capsys.readouterr().err == "python -m data write: error: --workers must be >= 1, got 0\n"


def test_inspect_shows_the_samples_per_class_and_the_files_left_out(tmp_path):
    _photos(tmp_path)
    out = tmp_path / "out"
    _write(tmp_path, "out", "--skip-bad", "--shard-size", "2", "--no-shuffle")
    lines = inspect_shards(str(out), num_show=0)
    assert lines[1] == f"samples: 5 (index.json: 5); left out when written: 3 ({out}/skipped.txt)"
    assert lines[2] == "classes (2), samples per class: cat: 2, dog: 3"  # read from the .cls of every sample
    assert inspect_shards(str(out / "train-00000[01].tar"), num_show=0)[2] == (
        "classes (2), samples per class: cat: 2, dog: 2"  # the shards named, not the folder's index
    )

    os.remove(out / "index.json")  # another tool's shards: `data index` records label_counts, which inspect shows
    main(["index", str(out)])
    index = json.loads((out / "index.json").read_text())
    assert index["label_counts"] == [2, 3]
    (out / "index.json").write_text(json.dumps(index | {"label_counts": [7, 8]}))
    assert inspect_shards(str(out), num_show=0)[2] == "classes (2), samples per class: 0: 7, 1: 8"  # not read again

    index_free = tmp_path / "index_free"
    index_free.mkdir()
    for shard in ("train-000000.tar", "train-000001.tar"):
        os.replace(out / shard, index_free / shard)
    (index_free / "extra.tar").write_bytes(_tar({"__key__": "x", "jpg": _jpeg(8, 8, 5)}))  # a sample without a label
    assert inspect_shards(str(index_free), num_show=0)[2] == "classes (2), samples per class: 0: 2, 1: 2; no label: 1"


def _tar(sample: dict) -> bytes:
    buffer = io.BytesIO()
    with wds.TarWriter(buffer) as writer:
        writer.write(sample)
    return buffer.getvalue()
