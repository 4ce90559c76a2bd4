"""`ats predict`: the CSV, every kind of input, --samples / --n-patches / --seed, and bad
inputs that are reported by name without stopping the others."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import ats_cli.predict as predict_mod
from ats_cli.checkpoint import CheckpointError, save_checkpoint
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.models import create_model, model_spec
from ats_cli.predict import evaluate, load_predictor, open_input, resolve_inputs

runner = CliRunner()
CLASSES = ["cat", "dog", "eel"]


def make_model(path: Path, *, seed: int = 0, classes: list[str] = CLASSES) -> Path:
    """An untrained but real model: 16x16 patches, low-res scale 0.25, 4 patches."""
    torch.manual_seed(seed)
    cfg = TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8)
    spec = model_spec(cfg, n_classes=len(classes), channels=1)
    save_checkpoint(path, spec=spec, classes=classes, model=create_model(spec))
    return path


def png(path: Path, seed: int, size: tuple[int, int] = (128, 128), mode: str = "L") -> Path:
    """Random-noise image (so that different patches really differ), size = (width, height)."""
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
    return path


@pytest.fixture
def setup(tmp_path: Path):
    model = make_model(tmp_path / "model.pt")
    images = [png(tmp_path / "imgs" / f"im{i}.png", i) for i in range(3)]
    return model, images


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def run(*args: str):
    return runner.invoke(app, ["predict", *map(str, args)])


# ---------------------------------------------------------------------------- the CSV


def test_csv_format(setup, tmp_path):
    model, images = setup
    out = tmp_path / "preds.csv"
    result = run(*images, "--model", model, "--out", out)
    assert result.exit_code == 0, result.output
    header, rows = read_csv(out)
    assert header == ["path", "prediction", "prob_cat", "prob_dog", "prob_eel"]
    assert [r["path"] for r in rows] == [str(p) for p in images]
    for r in rows:
        probs = [float(r[f"prob_{c}"]) for c in CLASSES]
        assert abs(sum(probs) - 1) < 1e-4
        assert r["prediction"] == CLASSES[int(np.argmax(probs))]
    assert "3 predicted, 0 failed" in result.output


def test_csv_to_stdout(setup):
    model, images = setup
    result = run(images[0], "--model", model, "--out", "-")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("path,prediction,prob_cat") and len(lines) == 2


# ---------------------------------------------------------------------------- input kinds


def test_directory_glob_and_file_inputs(setup, tmp_path):
    model, images = setup
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")  # skipped in a directory
    png(tmp_path / "imgs" / "sub" / "deep.png", 9)
    items = resolve_inputs([tmp_path / "imgs"])
    assert [i.path for i in items] == images  # sorted, non-recursive, images only
    assert len(resolve_inputs([tmp_path / "imgs"], recursive=True)) == 4
    pattern = str(tmp_path / "imgs" / "im[01].png")  # a glob the shell did not expand
    assert [i.path for i in resolve_inputs([pattern])] == images[:2]
    # a file reached twice is predicted once, at its first position
    assert [i.path for i in resolve_inputs([images[2], tmp_path / "imgs"])] == [images[2], *images[:2]]

    out = tmp_path / "p.csv"
    result = run(str(tmp_path / "imgs" / "*.png"), images[0], "--model", model, "--out", out)
    assert result.exit_code == 0, result.output
    assert [r["path"] for r in read_csv(out)[1]] == [str(p) for p in images]


def test_dataset_csv_with_labels_reports_accuracy(setup, tmp_path):
    model, images = setup
    data = tmp_path / "data"
    rows = [("../imgs/im0.png", "cat"), ("../imgs/im1.png", "dog"), (str(images[2]), "eel")]
    data.mkdir()
    (data / "test.csv").write_text("path,label,extra\n" + "".join(f"{p},{lab},x\n" for p, lab in rows))
    out = tmp_path / "p.csv"
    result = run(data / "test.csv", "--model", model, "--out", out)
    assert result.exit_code == 0, result.output
    header, got = read_csv(out)
    assert header[-1] == "label" and [r["label"] for r in got] == ["cat", "dog", "eel"]
    assert [Path(r["path"]) for r in got] == images  # relative to the CSV's directory
    correct = sum(r["label"] == r["prediction"] for r in got)
    assert f"accuracy {correct / 3:.2%} ({correct}/3" in result.output
    assert "Confusion matrix" in result.output

    # a dataset directory stands for its test split
    (data / "dataset.json").write_text(json.dumps({"classes": CLASSES}))
    result = run(data, "--model", model, "--out", out)
    assert result.exit_code == 0 and "accuracy" in result.output and len(read_csv(out)[1]) == 3


def test_evaluate_counts_unknown_labels_as_wrong():
    rows = [predict_mod.PredictionRow(Path("a"), "cat", "cat", (1, 0, 0)),
            predict_mod.PredictionRow(Path("b"), "emu", "cat", (1, 0, 0)),
            predict_mod.PredictionRow(Path("c"), "dog", None, None, error="c: broken")]
    ev = evaluate(rows, CLASSES)
    assert (ev.n, ev.correct, ev.unknown_labels) == (2, 1, ["emu"])
    assert ev.matrix[0] == [1, 0, 0] and ev.matrix[3] == [1, 0, 0]


# ---------------------------------------------------------------------------- options


def test_samples_and_n_patches_reach_the_model(setup, monkeypatch):
    model, images = setup
    seen = []
    real = predict_mod.predictor.predict_probs

    def spy(net, low, sources, **kwargs):
        seen.append(kwargs)
        return real(net, low, sources, **kwargs)

    monkeypatch.setattr(predict_mod.predictor, "predict_probs", spy)  # where Predictor finds it
    result = run(images[0], "--model", model, "--samples", "3", "--n-patches", "7")
    assert result.exit_code == 0, result.output
    assert seen and seen[0]["samples"] == 3 and seen[0]["n_patches"] == 7

    # and they change the computation: more patches than attention cells cannot be sampled
    # without replacement (128 * 0.25 = 32 -> 1024 cells), so that image fails, by name
    result = run(images[0], "--model", model, "--n-patches", "2000")
    assert result.exit_code == 1 and str(images[0]) in result.output


def test_estimator_is_saved_in_the_model_and_overridable(setup, tmp_path):
    """The estimator travels in the checkpoint; ``--estimator`` replaces it and changes the estimate (4 of
    1,024 cells: both are unbiased but weight the same draw differently)."""
    model, images = setup
    assert load_predictor(model, "cpu").model.estimator == "auto"
    ckpt = torch.load(model, weights_only=True)
    ckpt["spec"]["estimator"] = "sequential"
    torch.save(ckpt, tmp_path / "seq.pt")
    assert load_predictor(tmp_path / "seq.pt", "cpu").model.estimator == "sequential"
    assert load_predictor(tmp_path / "seq.pt", "cpu", estimator="threshold").model.estimator == "threshold"

    rows = {}
    for est in ("threshold", "sequential"):
        out = tmp_path / f"{est}.csv"
        result = run(images[0], "--model", model, "--estimator", est, "--out", out)
        assert result.exit_code == 0, result.output
        assert f"estimator {est}" in result.output
        rows[est] = read_csv(out)[1][0]
    assert rows["threshold"] != rows["sequential"]
    result = run(images[0], "--model", model, "--estimator", "mean")
    assert result.exit_code == 2 and "unknown estimator 'mean'" in result.output


def test_seed_determinism_and_batch_independence(setup, tmp_path):
    model, images = setup
    outs = {}
    for name, extra in (("a", ["--seed", "5"]), ("b", ["--seed", "5"]), ("c", ["--seed", "6"]),
                        ("batched", ["--seed", "5", "--batch-size", "3"]), ("alone", ["--seed", "5"])):
        inputs = images[1:2] if name == "alone" else images
        out = tmp_path / f"{name}.csv"
        result = run(*inputs, "--model", model, "--out", out, "--samples", "2", *extra)
        assert result.exit_code == 0, result.output
        outs[name] = read_csv(out)[1]
    assert outs["a"] == outs["b"]
    assert outs["a"] != outs["c"]
    # batch size 1: a file's probabilities do not depend on the other inputs
    assert outs["alone"][0] == outs["a"][1]
    assert [r["path"] for r in outs["batched"]] == [r["path"] for r in outs["a"]]
    for r in outs["batched"]:
        assert abs(sum(float(r[f"prob_{c}"]) for c in CLASSES) - 1) < 1e-4


def test_mixed_sizes_are_batched_separately(setup, tmp_path):
    model, images = setup
    other = [png(tmp_path / "wide" / f"w{i}.png", 10 + i, size=(160, 96)) for i in range(2)]
    out = tmp_path / "p.csv"
    result = run(images[0], *other, *images[1:], "--model", model, "--batch-size", "4", "--out", out)
    assert result.exit_code == 0, result.output
    assert [r["path"] for r in read_csv(out)[1]] == [str(p) for p in [images[0], *other, *images[1:]]]


# ---------------------------------------------------------------------------- bad inputs


def test_bad_files_are_named_and_the_others_predicted(setup, tmp_path):
    model, images = setup
    corrupt = tmp_path / "imgs" / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    tiny = png(tmp_path / "tiny.png", 3, size=(40, 12))  # 12 rows < the 16-pixel patch
    missing = tmp_path / "nope.png"
    out = tmp_path / "p.csv"
    result = run(images[0], corrupt, tiny, missing, images[1], "--model", model, "--out", out)
    assert result.exit_code == 1, result.output
    _, rows = read_csv(out)
    assert [r["path"] for r in rows] == [str(images[0]), str(images[1])]  # failures are not in the CSV
    err = result.stderr
    assert "3 input(s) failed" in err
    assert f"{corrupt}: cannot decode image" in err
    assert f"{tiny}: is 40x12 pixels" in err and "smaller than the model's 16x16 patch" in err
    assert f"{missing}: does not exist" in err
    assert "2 predicted, 3 failed" in result.output


@pytest.fixture
def said(monkeypatch):
    """A process that has logged no conversion yet (each is logged once per process)."""
    import ats_cli.data.images as images_mod
    monkeypatch.setattr(images_mod, "_SAID", set(), raising=False)


def _probs(out: Path) -> list[str]:
    return [v for r in read_csv(out)[1] for k, v in r.items() if k.startswith("prob_")]


def test_a_colour_or_transparent_image_is_read_as_its_gray_or_flattened_file_and_said_once(setup, tmp_path,
                                                                                             said, caplog):
    """A gray model given a colour PNG predicts what it predicts for the gray PNG PIL saves
    from it; an RGB model given a gray or a transparent PNG predicts what it predicts for
    the RGB file a viewer shows (gray copied, transparency on white). Each conversion is
    logged once, however many files need it."""
    model, _ = setup
    colours = [png(tmp_path / f"colour{i}.png", 4 + i, mode="RGB") for i in range(2)]
    gray = tmp_path / "gray.png"
    Image.open(colours[0]).convert("L").save(gray)
    outs = {}
    for name, image in (("colour", colours[0]), ("gray", gray)):
        result = run(image, colours[1], "--model", model, "--out", tmp_path / f"{name}.csv")
        assert result.exit_code == 0, result.output
        outs[name] = _probs(tmp_path / f"{name}.csv")
    assert outs["colour"] == outs["gray"]
    said = [r.getMessage() for r in caplog.records if "converted to gray" in r.getMessage()]
    assert len(said) == 1 and str(colours[0]) in said[0], said

    rgb_model = tmp_path / "rgb.pt"
    torch.manual_seed(0)
    spec = model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8), n_classes=3, channels=3)
    save_checkpoint(rgb_model, spec=spec, classes=CLASSES, model=create_model(spec))
    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, (128, 128, 4), dtype=np.uint8)
    rgba[:64, :, 3] = 0  # the top half transparent, over colours no viewer shows
    Image.fromarray(rgba, "RGBA").save(tmp_path / "cut.png")
    alpha = rgba[..., 3:].astype(np.uint16)
    flat = ((rgba[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    Image.fromarray(flat, "RGB").save(tmp_path / "flat.png")
    Image.open(gray).convert("RGB").save(tmp_path / "gray3.png")
    for a, b in (("cut.png", "flat.png"), ("gray.png", "gray3.png")):
        for name in (a, b):
            result = run(tmp_path / name, "--model", rgb_model, "--out", tmp_path / f"{name}.csv")
            assert result.exit_code == 0, result.output
        assert _probs(tmp_path / f"{a}.csv") == _probs(tmp_path / f"{b}.csv"), (a, b)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("composited on white" in m for m in messages) == 1
    assert sum("gray in each channel" in m for m in messages) == 1


def test_open_input_refuses_images_smaller_than_a_patch(tmp_path):
    with pytest.raises(ValueError, match="smaller than the model's 16x16 patch"):
        open_input(png(tmp_path / "a.png", 0, size=(15, 64)), channels=1, scale=0.25, patch_size=(16, 16))
    opened = open_input(png(tmp_path / "b.png", 0, size=(16, 16)), channels=1, scale=0.25, patch_size=(16, 16))
    assert tuple(opened.low.shape) == (1, 4, 4) and opened.source.size == (16, 16)


def test_empty_directory_and_unmatched_glob_are_errors(setup, tmp_path):
    model, images = setup
    (tmp_path / "empty").mkdir()
    result = run(tmp_path / "empty", str(tmp_path / "*.jpg"), images[0], "--model", model)
    assert result.exit_code == 1
    assert f"{tmp_path / 'empty'}: a directory with no image files" in result.stderr
    assert "the pattern matches no image files" in result.stderr


@pytest.mark.parametrize("kind", ["random-bytes", "plain-dict", "missing", "wrong-class-count"])
def test_a_model_that_is_not_ours_exits_2(setup, tmp_path, kind):
    _, images = setup
    bad = tmp_path / "bad.pt"
    if kind == "random-bytes":
        bad.write_bytes(np.random.default_rng(0).bytes(2048))
    elif kind == "plain-dict":
        torch.save({"weights": torch.zeros(3)}, bad)
    elif kind == "wrong-class-count":
        make_model(bad)
        ckpt = torch.load(bad, weights_only=True)
        ckpt["classes"] = ["only-one"]
        torch.save(ckpt, bad)
    result = run(images[0], "--model", bad, "--out", tmp_path / "p.csv")
    assert result.exit_code == 2, result.output
    assert str(bad) in result.stderr
    assert not (tmp_path / "p.csv").exists()  # nothing was predicted


def test_run_directory_as_model(setup, tmp_path):
    model, images = setup
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make_model(run_dir / "best.pt")
    assert load_predictor(run_dir, "cpu").path == run_dir / "best.pt"
    with pytest.raises(CheckpointError, match="without best.pt or last.pt"):
        load_predictor(tmp_path / "imgs", "cpu")
    assert run(images[0], "--model", run_dir).exit_code == 0
