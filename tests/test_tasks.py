"""IPS's four Megapixel MNIST tasks and multi-label datasets, as a user meets them.

The four tasks render the same images for the same seed (only the label column differs), each
label follows its rule on the digits recorded in the row, rendering is deterministic byte for
byte, and a multi-label dataset goes end to end: make-dataset --task multilabel, train one
epoch (one sigmoid per class), predict with metrics and a threshold, visualize.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.config import settle_data
from ats_cli.data.dataset import DatasetError, load_dataset, write_dataset
from ats_cli.data.megapixel_mnist import TASKS, generate_megapixel_mnist, make_config
from ats_cli.data.mnist import load_bundled_digits
from ats_cli.multilabel import average_precision, metrics
from ats_cli.recipes import resolve_config

runner = CliRunner()
TINY = dict(n_train=6, n_test=4, width=160, height=140, n_noise=6, seed=0)
TRAIN = ["--epochs", 1, "--n-patches", 2, "--patch-size", 28, "--scale", 0.25, "--set", "attention_width=4",
         "--set", "feature_width=8", "--batch-size", 4, "--workers", 0, "--device", "cpu", "--set", "tissue_mask=off",
         "--seed", 3]


def ats(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATS_OFFLINE", "1")
    monkeypatch.setenv("ATS_CACHE_DIR", str(tmp_path / "cache"))


def _rows(root: Path, split: str) -> list[dict[str, str]]:
    with open(root / f"{split}.csv", newline="") as f:
        return list(csv.DictReader(f))


def _pixels(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("*/*.png"))}


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict[str, Path]:
    digits = load_bundled_digits()
    out = {}
    for task in TASKS:
        out[task] = tmp_path_factory.mktemp(task) / "data"
        generate_megapixel_mnist(out[task], make_config("small", **TINY, task=task), digits, workers=1)
    return out


def test_the_four_tasks_render_the_same_images_and_record_their_task(four):
    pixels = {task: _pixels(root) for task, root in four.items()}
    assert len(pixels["majority"]) == 10 and all(p == pixels["majority"] for p in pixels.values())
    for task, root in four.items():
        meta = json.loads((root / "dataset.json").read_text())
        assert meta["task"] == task and meta["generator"]["params"]["task"] == task
        assert load_dataset(root).multilabel == (task == "multilabel")
        # max and top: a rule over the digits present, which their recipe's pooling applies,
        # with more patches; the others (negative control): the thesis's model at the paper's 10
        rule = {"max": ("highest-counts", "on", 0.15, 20), "top": ("topmost-counts", "on", 0.15, 20)}
        flags = resolve_config(data=str(root), out="run")  # as ats train DATA: the recipe dataset.json names
        settled = settle_data(flags, load_dataset(root))[0].config
        assert (settled.pooling, settled.none_class, settled.count_floor, settled.n_patches) == \
            rule.get(task, ("features", "off", 0.0, 10))
        assert meta["recipe"] == settled.recipe == {"max": "megapixel-mnist-max", "top": "megapixel-mnist-top"}.get(
            task, "megapixel-mnist")
        assert "pooling" not in meta["hints"]  # the recipe's, not a hint
        assert settled.position_features == "off" and settled.eval_n_patches == 2 * settled.n_patches
        # max and top read at a lower floor than they train at (ats_cli.config._eval_count_floor); the others at theirs
        assert settled.eval_count_floor == (0.07 if task in ("max", "top") else settled.count_floor)


def test_each_label_follows_its_rule_on_the_recorded_digits(four):
    for task, root in four.items():
        for split in ("train", "test"):
            for row in _rows(root, split):
                digits = json.loads(row["digits"])  # [class, row, col, h, w], top to bottom, left to right
                classes = [d[0] for d in digits]
                counts = {c: classes.count(c) for c in classes}
                majority = max(counts, key=counts.get)
                ranked = sorted(counts.values(), reverse=True)
                assert len(ranked) == 1 or ranked[0] > ranked[1]  # a strict majority: no tie to break
                top = min(digits, key=lambda d: (d[1], d[2]))[0]
                expected = {"majority": str(majority), "max": str(max(classes)), "top": str(top),
                            "multilabel": ";".join(str(c) for c in sorted(set(classes)))}
                assert row["label"] == expected[task], (task, row)
                assert (row["max"], row["top"], row["present"]) == (expected["max"], expected["top"],
                                                                  expected["multilabel"])


def test_rendering_is_deterministic(four, tmp_path):
    """Same seed, same bytes (CSVs and dataset.json too); another seed, other images."""
    digits = load_bundled_digits()
    again = tmp_path / "again"
    generate_megapixel_mnist(again, make_config("small", **TINY, task="top"), digits, workers=2, chunk_size=1)
    for name in ("train.csv", "test.csv", "dataset.json"):
        assert (again / name).read_bytes() == (four["top"] / name).read_bytes(), name
    assert _pixels(again) == _pixels(four["top"])
    other = tmp_path / "other"
    generate_megapixel_mnist(other, make_config("small", **{**TINY, "seed": 1}, task="top"), digits, workers=1)
    assert _pixels(other) != _pixels(four["top"])


def test_an_unknown_task_is_refused_in_one_line(tmp_path):
    result = ats("make-dataset", "megapixel-mnist", tmp_path / "x", "--task", "bottom", "--offline")
    assert result.exit_code == 2 and "bottom" in result.output
    with pytest.raises(ValueError, match="task must be one of majority, max, top, multilabel"):
        make_config("small", task="bottom")


def test_multilabel_labels_are_read_from_semicolons(tmp_path):
    """Inferred from a ';' without any task in dataset.json; order and spaces do not matter, an
    empty cell is no class, an unknown name is named with its line."""
    img = tmp_path / "a.png"
    img.write_bytes(b"")
    rows = {"train": [{"path": "a.png", "label": "dog ; cat"}], "test": [{"path": str(img), "label": ""}]}
    write_dataset(tmp_path / "ds", ["cat", "dog", "bird"], {"train": rows["train"], "test": []})
    (tmp_path / "ds" / "a.png").write_bytes(b"")
    (tmp_path / "ds" / "test.csv").write_text("path,label\na.png,cat;dog\n")
    with pytest.raises(DatasetError, match="duplicate path"):
        load_dataset(tmp_path / "ds")
    (tmp_path / "ds" / "b.png").write_bytes(b"")
    (tmp_path / "ds" / "test.csv").write_text("path,label\nb.png,\n")
    data = load_dataset(tmp_path / "ds")
    assert data.multilabel
    rec = data["train"][0]
    assert rec.label_name == "cat;dog" and rec.target == (1.0, 1.0, 0.0)
    assert data["test"][0].target == (0.0, 0.0, 0.0)
    (tmp_path / "ds" / "test.csv").write_text("path,label\nb.png,cat;fish\n")
    with pytest.raises(DatasetError, match=r"test.csv:2: unknown label 'fish'"):
        load_dataset(tmp_path / "ds")


def test_the_metrics_are_the_textbook_ones():
    probs = torch.tensor([[0.9, 0.2], [0.6, 0.7], [0.1, 0.8], [0.4, 0.3]])
    target = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    m = metrics(probs, target, ["a", "b"])
    # class a: predicted {0, 1}, true {0, 3}: P = 1/2, R = 1/2; class b: predicted {1, 2} = true
    assert m["per_class"]["a"]["precision"] == 0.5 and m["per_class"]["a"]["recall"] == 0.5
    assert m["per_class"]["b"]["f1"] == 1.0 and m["macro_f1"] == 0.75
    assert m["exact_match"] == 0.5  # rows 2 and 3 right as a whole
    # AP of a: scores 0.9 (pos), 0.6, 0.4 (pos), 0.1: (1/1 + 2/3) / 2
    assert m["per_class"]["a"]["ap"] == pytest.approx((1 + 2 / 3) / 2)
    assert average_precision(torch.tensor([0.5, 0.5]), torch.tensor([True, False])) == 0.5  # a tie is one threshold
    assert m["per_class"]["b"]["ap"] == 1.0 and m["mean_ap"] == pytest.approx((5 / 6 + 1) / 2)


def test_multilabel_end_to_end(tmp_path):
    """make-dataset --task multilabel, one epoch of training, predict with metrics and a
    threshold (recorded), visualize a figure and GeoJSON that name the predicted set."""
    data, run = tmp_path / "ml", tmp_path / "run"
    assert ats("make-dataset", "megapixel-mnist", data, "--preset", "small", "--n-train", 8, "--n-test", 4, "--width",
               112, "--height", 112, "--n-noise", 2, "--workers", 1, "--offline", "--task", "multilabel").exit_code == 0
    result = ats("train", data, "--out", run, *TRAIN)
    assert result.exit_code == 0, result.output
    assert "best test exact match" in result.output
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 <= record["test_macro_f1"] <= 1 and 0 <= record["test_acc"] <= 1
    assert torch.load(run / "best.pt", weights_only=True)["spec"]["multilabel"] is True

    preds = tmp_path / "preds.csv"
    result = ats("predict", data, "--model", run, "--out", preds, "--threshold", 0.3)
    assert result.exit_code == 0, result.output
    assert "macro-F1" in result.output and "mean AP" in result.output and "exact match" in result.output
    rows = list(csv.DictReader(preds.open()))
    assert len(rows) == 4 and list(rows[0])[-1] == "label"
    for row in rows:
        probs = {c: float(row[f"prob_{c}"]) for c in map(str, range(10))}
        assert row["prediction"] == ";".join(c for c, p in probs.items() if p >= 0.3)
    assert json.loads(Path(f"{preds}.ats.json").read_text())["settings"]["threshold"] == 0.3

    result = ats("pretrain", data, "--out", tmp_path / "pre.pt")  # patch classes need one class per image
    assert result.exit_code != 0 and "multi-label dataset" in result.output

    image = sorted((data / "test").glob("*.png"))[0]
    for out in (tmp_path / "att.png", tmp_path / "att.geojson"):
        result = ats("visualize", image, "--model", run, "--out", out)
        assert result.exit_code == 0, result.output
        assert "predicted" in result.output
    geo = json.loads((tmp_path / "att.geojson").read_text())["properties"]
    decided = ";".join(c for c, p in geo["probabilities"].items() if p >= 0.5)  # the model's default threshold
    assert geo["prediction"] == (decided or "(none)")


def test_a_threshold_for_a_single_label_model_is_refused(tmp_path):
    data, run = tmp_path / "mm", tmp_path / "run"
    ats("make-dataset", "megapixel-mnist", data, "--preset", "small", "--n-train", 4, "--n-test", 2, "--width", 112,
        "--height", 112, "--n-noise", 2, "--workers", 1, "--offline")
    assert ats("train", data, "--out", run, *TRAIN).exit_code == 0
    result = ats("predict", data, "--model", run, "--threshold", 0.5)
    assert result.exit_code == 2 and "--threshold" in result.output and "one label per image" in result.output


def test_the_multilabel_loss_is_bce_minus_the_entropy_bonus():
    """One sigmoid per class: the loss of a multi-hot batch is the binary cross-entropy of the
    logits summed over the classes (the label set's negative log-likelihood), minus lambda
    H(attention) as for one label (thesis eq. 3.21); class indices keep
    the model's own cross-entropy."""
    from types import SimpleNamespace

    from ats_cli.train import correct, step_loss

    model = SimpleNamespace(entropy_weight=0.1, loss=lambda out, target: torch.tensor(-1.0))
    out = SimpleNamespace(logits=torch.tensor([[2.0, -1.0, 0.5]]), entropy=torch.tensor([3.0]))
    target = torch.tensor([[1.0, 0.0, 0.0]])
    expected = -(torch.log(torch.sigmoid(torch.tensor([2.0, 1.0, -0.5])))).sum() - 0.1 * 3.0  # summed: the NLL
    assert float(step_loss(model, out, target)) == pytest.approx(float(expected), rel=1e-6)
    assert float(step_loss(model, out, torch.tensor([0]))) == -1.0
    assert correct(out.logits, target) == 0.0 and correct(out.logits, torch.tensor([[1.0, 0.0, 1.0]])) == 1.0
    assert correct(out.logits, torch.tensor([0])) == 1.0
