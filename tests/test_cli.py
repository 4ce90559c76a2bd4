"""The command line end to end, as a user runs it: every command `ats --help` lists, on tiny
generated data (a dozen 112x112 Megapixel MNIST images, two 512x512 synthetic slides).

One journey, shared through module fixtures: make a dataset, train on it, predict,
visualize, inspect the files. The details of each command (failure modes, options) are
tested in the files named after them; here each is checked for what a user would look at:
the exit status, the files written and that their content makes sense.
"""

from __future__ import annotations

import csv
import json
import re
import shutil

import pytest
from PIL import Image
from typer.testing import CliRunner

from ats_cli import __version__
from ats_cli.cli import app
from ats_cli.config import AUTO_MIN_BRIGHTNESS, TrainConfig

runner = CliRunner()
COMMANDS = ("make-dataset", "train", "predict", "visualize", "info", "benchmark", "compare", "doctor", "selfcheck")
SIZE = 112
TRAIN_KEYS = {"epochs": 2, "n_patches": 2, "patch_size": 28, "scale": 0.25, "attention_width": 4, "feature_width": 8,
              "batch_size": 4, "workers": 0, "device": "cpu", "lr": 0.01, "tissue_mask": "off", "seed": 3}


def train_args(keys: dict) -> list:
    """``keys`` as ats train's arguments: a key's flag where it has one, else --set KEY=VALUE."""
    from ats_cli.cli.options import FIELDS

    return [x for k, v in keys.items()
            for x in ((f"--{k.replace('_', '-')}", v) if FIELDS[k].metadata["flag"] else ("--set", f"{k}={v}"))]


TRAIN_FLAGS = train_args(TRAIN_KEYS)


def ats(*args: object, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    """`ats make-dataset megapixel-mnist`, offline, from the bundled digits."""
    out = tmp_path_factory.mktemp("data") / "mnist"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATS_CACHE_DIR", str(out.parent / "cache"))  # no MNIST download nor a user's cached copy
        result = ats("make-dataset", "megapixel-mnist", out, "--preset", "small", "--n-train", 8, "--n-test", 4,
                     "--width", SIZE, "--height", SIZE, "--n-noise", 2, "--workers", 1, "--offline")
    return out, result


@pytest.fixture(scope="module")
def run(mnist, tmp_path_factory):
    """`ats train` for two epochs on it, a few flags given, the rest left to their defaults."""
    out = tmp_path_factory.mktemp("runs") / "run"
    result = ats("train", mnist[0], "--out", out, *TRAIN_FLAGS)
    return out, result


@pytest.fixture(scope="module")
def image(mnist):
    return sorted((mnist[0] / "test").glob("*.png"))[0]


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for command in COMMANDS:
        assert command in result.output
        assert ats(command, "--help").exit_code == 0, command


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_selfcheck_passes():
    result = runner.invoke(app, ["selfcheck", "--draws", "20000"])
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output


def test_make_dataset_megapixel_mnist(mnist):
    out, result = mnist
    assert result.exit_code == 0, result.output
    assert "wrote 12 images" in result.output
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["classes"] == [str(d) for d in range(10)]
    for split, n in (("train", 8), ("test", 4)):
        with open(out / f"{split}.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == n and all(r["label"] in meta["classes"] for r in rows)
        with Image.open(out / rows[0]["path"]) as im:
            assert im.size == (SIZE, SIZE)


def test_make_dataset_from_folder(mnist, tmp_path):
    """An ImageFolder tree (one folder per class) becomes a dataset, stratified and seeded."""
    src = tmp_path / "folder"
    for i, path in enumerate(sorted((mnist[0] / "train").glob("*.png"))):
        (src / ("odd" if i % 2 else "even")).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, src / ("odd" if i % 2 else "even") / path.name)
    result = ats("make-dataset", "from-folder", src, tmp_path / "ds", "--test", 0.25)
    assert result.exit_code == 0, result.output
    assert "2 classes (even, odd); train 6, test 2" in result.output
    meta = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert meta["classes"] == ["even", "odd"]
    with open(tmp_path / "ds" / "test.csv") as f:
        assert sorted(r["label"] for r in csv.DictReader(f)) == ["even", "odd"]


def test_make_dataset_synthetic_slides_and_info_reads_their_pyramid(tmp_path):
    out = tmp_path / "slides"
    result = ats("make-dataset", "synthetic-slides", out, "--n-train", 1, "--n-test", 1, "--size", 512,
                 "--n-spots", 2, "--max-targets", 1, "--spot-radius", 12, "--workers", 1)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "dataset.json").read_text())["classes"] == ["normal", "tumor"]
    slides = sorted(out.rglob("*.tif"))
    assert len(slides) == 2
    info = ats("info", slides[0], env={"COLUMNS": "200"})
    assert info.exit_code == 0, info.output
    assert "vendor: generic-tiff" in info.output and "mpp: 0.5 x 0.5" in info.output
    assert re.search(r"│ +0 │ +512 │ +512 │ +1 │", info.output) and re.search(r"│ +1 │ +128 │ +128 │ +4 │", info.output)


def test_info_on_an_image_and_a_bad_file(image, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    result = ats("info", image, tmp_path / "bad.png", env={"COLUMNS": "200"})
    assert result.exit_code == 1  # went on past the bad file, then said so
    assert "reader: pillow" in result.output and re.search(rf"│ +0 │ +{SIZE} │ +{SIZE} │ +1 │", result.output)
    assert "bad.png" in result.stderr and "1 of 2 file(s) failed" in result.stderr


def test_train_writes_a_run_with_the_flags_and_the_defaults(run, mnist):
    out, result = run
    assert result.exit_code == 0, result.output
    assert re.search(r"done: best test accuracy [\d.]+ at epoch [12]", result.output)
    for name in ("best.pt", "last.pt", "curves.png", "metrics.jsonl", "epochs/epoch_001.pt", "epochs/epoch_002.pt"):
        assert (out / name).is_file(), name
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2] and all(0 <= e["test_acc"] <= 1 for e in epochs)
    saved = json.loads((out / "config.json").read_text())
    given = dict(TRAIN_KEYS)
    defaults = {k: v for k, v in TrainConfig().to_dict().items() if k not in given}
    assert saved["recipe"] == "megapixel-mnist"  # the one make-dataset's dataset.json names
    del defaults["recipe"]
    # -1 = auto (and augment's auto): settled from the images
    del defaults["data"], defaults["out"], defaults["min_brightness"], defaults["rarity_prior"], defaults["augment"]
    del defaults["rarity_cap"]  # follows the prior: none here
    del defaults["patch_gain"], defaults["patch_loss"]
    del defaults["eval_n_patches"]
    del defaults["feature_train"], defaults["position_features"], defaults["pooling"], defaults["none_class"]
    del defaults["count_floor"], defaults["eval_count_floor"]
    del defaults["feature_net"]  # auto: grey images start from the random-initialised net
    del defaults["feature_store"]  # auto: off, the feature net trains
    assert {k: saved[k] for k in given} == given
    assert {k: saved[k] for k in defaults} == defaults
    assert saved["min_brightness"] == AUTO_MIN_BRIGHTNESS  # Megapixel MNIST: a black background
    assert saved["rarity_prior"] == 0.0 and saved["rarity_cap"] == 0.0  # a black background: the support's job
    assert saved["patch_loss"] == 0.0  # not photographs
    assert saved["feature_net"] == "small-cnn"  # grey: no ImageNet encoder
    assert saved["augment"] == "none"  # not slides: a turned 6 is a 9
    assert saved["patch_gain"] == "off"  # not slides: a majority of digits weighs each digit alike
    assert saved["eval_n_patches"] == 2 * saved["n_patches"]  # auto: twice the training count
    assert saved["feature_train"] == "all"  # auto: a net of ours from random weights trains
    assert saved["position_features"] == "off"  # auto: no dataset.json hint (the majority task)
    assert saved["pooling"] == "features"  # auto: no dataset.json hint (the majority task)
    assert saved["none_class"] == "off" and saved["count_floor"] == 0.0  # features: no vote, no count
    assert saved["eval_count_floor"] == 0.0  # read at the training floor
    assert saved["data"] == str(mnist[0]) and saved["out"] == str(out)


def test_predict_writes_a_row_per_test_image(run, mnist):
    csv_path = run[0].parent / "predictions.csv"
    result = ats("predict", mnist[0], "--model", run[0], "--out", csv_path, "--tissue-mask", "auto")
    assert result.exit_code == 0, result.output
    assert "4 predicted, 0 failed" in result.output and "accuracy" in result.output
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    for row in rows:
        probs = [float(row[f"prob_{c}"]) for c in range(10)]
        assert abs(sum(probs) - 1) < 1e-4 and row["prediction"] == str(max(range(10), key=probs.__getitem__))
        assert row["label"] in [str(c) for c in range(10)]


def test_visualize_draws_the_attention_of_an_image_and_across_epochs(run, image):
    folder = run[0].parent
    result = ats("visualize", image, "--model", run[0], "--out", folder / "fig.png")  # --device: auto
    assert result.exit_code == 0, result.output
    assert re.search(r"wrote .*fig\.png \(\d+x\d+ px\): predicted \d \(p = [\d.]+\), label \d", result.output)
    with Image.open(folder / "fig.png") as im:
        assert im.format == "PNG" and min(im.size) > 200
    result = ats("visualize", run[0], "--image", image, "--out", folder / "epochs.png")
    assert result.exit_code == 0, result.output
    assert "epochs 1, 2" in result.output
    with Image.open(folder / "epochs.png") as im:
        assert im.width > im.height  # the epochs side by side
    result = ats("visualize", image, "--model", run[0], "--out", folder / "attention.geojson")
    assert result.exit_code == 0, result.output
    features = json.loads((folder / "attention.geojson").read_text())["features"]
    assert features and all(f["geometry"]["type"] == "Polygon" for f in features)


def test_benchmark_on_a_dataset_directory(mnist, tmp_path):
    """Its first test image, one method, one timed step: a row with a time and a memory."""
    rows = tmp_path / "rows.json"
    result = ats("benchmark", "--dataset", mnist[0], "--quick", "--methods", "ats", "--feature-width", 8,
                 "--threads", 1, "--json", rows)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(rows.read_text())
    assert row["method"] == "ats" and row["image_size"] == [SIZE, SIZE] and row["device"] == "cpu"
    assert row["time_ms_per_sample"] > 0 and row["peak_mem_mb_per_sample"] > 0


def test_doctor_reports_versions_and_the_patch_path(monkeypatch):
    monkeypatch.setenv("ATS_NATIVE", "0")  # report only: no kernel build
    result = ats("doctor")
    assert result.exit_code == 0, result.output
    assert re.search(rf"│ ats +│ {re.escape(__version__)} ", result.output)
    assert "torch" in result.output and "patches on cpu" in result.output


def test_a_path_that_does_not_exist_is_said_to_not_exist(tmp_path):
    """train DATA, predict, info and visualize name a missing path as missing, not as "not a
    directory" or "file not found"; class folders without dataset.json name the next step."""
    nowhere, photo = tmp_path / "nowhere", tmp_path / "nowhere.png"
    result = ats("train", nowhere, "--out", tmp_path / "run", env={"COLUMNS": "1000"})
    assert result.exit_code != 0 and f"{nowhere}: does not exist" in result.output, result.output
    for args in (["info", photo], ["visualize", tmp_path, "--image", photo, "--out", tmp_path / "v.png"]):
        result = ats(*args, env={"COLUMNS": "1000"})
        assert result.exit_code != 0 and f"{photo}: does not exist" in result.output, result.output
    photos = tmp_path / "photos"
    for name in ("cat", "dog"):
        (photos / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(photos / name / "a.png")
    result = ats("train", photos, "--out", tmp_path / "run", env={"COLUMNS": "1000"})
    assert f"run `ats make-dataset from-folder {photos} DATA` first" in result.output, result.output
    assert not (tmp_path / "run").exists()  # refused before a run directory is made
