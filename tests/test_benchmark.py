"""`ats benchmark`: every method measured in one run, rows a user can read and compare."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from ats_cli.benchmark import benchmark_image, ratio_to_ats
from ats_cli.cli import app

runner = CliRunner()


def test_quick_json_smoke(tmp_path):
    """The smoke form of `ats benchmark --quick --json` at tiny sizes (times are not asserted)."""
    out = tmp_path / "rows.json"
    # the three kinds of model a row builds (uniform is ats's model with its attention fixed:
    # each row is a process start, ~5 s of the suite's CPU)
    result = runner.invoke(app, ["benchmark", "--quick", "--methods", "ats,deepmil,cnn", "--image-size", "128",
                                 "--patch-size", "16", "--scale", "0.5", "--feature-width", "8", "--threads", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [(r["method"], r["n_patches"]) for r in rows] == [("ats", 10), ("deepmil", None), ("cnn", None)]
    for r in rows:
        assert set(r) == {"method", "n_patches", "device", "batch_size", "image_size", "time_ms_per_sample",
                          "peak_mem_mb_per_sample"}, r
        assert r["device"] == "cpu" and r["image_size"] == [128, 128] and r["batch_size"] == 1
        assert r["time_ms_per_sample"] > 0 and r["peak_mem_mb_per_sample"] >= 0
    # Deep MIL reads all 225 grid patches, ATS 10: it must need more memory for its step
    deepmil = next(r for r in rows if r["method"] == "deepmil")
    assert deepmil["peak_mem_mb_per_sample"] > rows[0]["peak_mem_mb_per_sample"]
    assert "deepmil" in result.output and "time / ATS-10" in result.output
    # progress on stderr, a line as each row starts, reaches each part and ends; the table on stdout
    for i, row in enumerate(["ats-10", "deepmil", "cnn"], 1):
        for part in ("starting a process", "started", "warm-up step", "memory step", "1 timed step"):
            assert f"[{i}/3] {row}: {part}" in result.stderr, result.stderr
        assert re.search(rf"\[{i}/3\] {row}: [\d.]+ ms, [\d.]+ MB per sample \(row took", result.stderr)
    assert "time / ATS-10" in result.stdout and "warm-up" not in result.stdout


def test_a_batch_is_measured_per_sample(tmp_path):
    """--batch-size B: B copies of the image in one step, the row per sample and saying B."""
    out = tmp_path / "rows.json"
    result = runner.invoke(app, ["benchmark", "--quick", "--methods", "ats", "--image-size", "96", "--patch-size",
                                 "16", "--scale", "0.5", "--feature-width", "8", "--threads", "1", "--batch-size", "3",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())
    assert row["batch_size"] == 3 and row["time_ms_per_sample"] > 0
    assert "batch 3" in result.stdout


def test_unknown_method_and_bad_counts_are_errors():
    assert runner.invoke(app, ["benchmark", "--methods", "ats,mil", "--image-size", "64"]).exit_code == 2
    assert runner.invoke(app, ["benchmark", "--n-patches", "0", "--image-size", "64"]).exit_code == 2
    bad = runner.invoke(app, ["benchmark", "--attention-net", "no-such-net", "--image-size", "300"])
    assert bad.exit_code == 2 and "block-attention" in bad.output  # the error lists the names to choose from
    bad = runner.invoke(app, ["benchmark", "--feature-net", "no-such-net", "--image-size", "300"])
    assert bad.exit_code == 2 and "small-cnn" in bad.output


def test_generated_image_is_a_megapixel_mnist_canvas():
    image = benchmark_image("megapixel-mnist", 300)
    assert image.shape == (1, 300, 300) and image.dtype.name == "uint8" and 0 < (image > 0).mean() < 0.5


def test_ratios_are_taken_against_ats_with_the_reference_count():
    rows = [{"method": "ats", "n_patches": 5, "time_ms_per_sample": 1.0},
            {"method": "ats", "n_patches": 10, "time_ms_per_sample": 2.0},
            {"method": "deepmil", "n_patches": None, "time_ms_per_sample": 9.0}]
    assert ratio_to_ats(rows, 10) is rows[1] and ratio_to_ats(rows, 50) is rows[0]
    assert ratio_to_ats(rows[2:], 10) is None


def test_synthetic_slides_dataset_uses_its_own_settings(tmp_path):
    image = benchmark_image("synthetic-slides", 512)
    assert image.shape == (3, 512, 512) and image.dtype.name == "uint8"
    out = tmp_path / "rows.json"
    result = runner.invoke(app, ["benchmark", "--dataset", "synthetic-slides", "--quick", "--methods", "ats",
                                 "--feature-width", "8", "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())
    assert row["method"] == "ats" and row["image_size"] == [512, 512] and row["time_ms_per_sample"] > 0
