"""bench_write's own logic: its write table and the crop statistics it reports."""

from benchmarks import bench_write
from benchmarks.bench_write import crop_stats, imagenet_estimate, write_table


def test_write_table_and_imagenet_estimate_from_timings():
    runs = {
        (None, 1): [{"wall": 1.0, "cpu": 1.0, "others": 0.1}] * 3,
        (384, 1): [{"wall": 10.0, "cpu": 10.0, "others": 0.5}, {"wall": 8.0, "cpu": 10.0, "others": 0.2}],
    }
    results = {"runs": runs, "identical": {None: True, 384: False}, "startup": 2.0}
    lines = write_table(results, num_images=2000)
    assert lines[2] == "| none | 1 | 2000 | 2000 | 2000 / 2000 / 2000 | yes | 10% |"
    assert lines[3] == "| 384 | 1 | 225 | 200 | 200 / 250 | **no** | 50% |"
    (estimate,) = imagenet_estimate(results, 2000, 384)  # 1,281,167 / (200 x 16) s
    assert (
        "200 images per CPU-second" in estimate
        and f"~{1_281_167 / (200 * bench_write.CORES) / 60:.0f} minutes" in estimate
    )


def test_crop_statistics_follow_the_stored_size():
    assert crop_stats(1000, 750, draws=500)[0] == 0.0  # every box of 20%+ of the area has 224 px or more
    upsampled, median = crop_stats(256, 192, draws=500)
    assert upsampled == 1.0 and 130 < median < 180
    assert crop_stats(384, 288, draws=500)[1] > 224 > crop_stats(320, 240, draws=500)[1]
