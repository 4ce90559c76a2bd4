"""``ats predict`` counts a multi-label row whose label is the empty set (issue #67, case 5).

It used to read an empty label cell as "no label" and leave those rows out of its
metrics ("exact match 0.00% (4 labelled images)" where 4 of 8 rows were empty sets and the
figure was 50%), while training's evaluation counted them: the two disagreed on the same
data. Both tests were seen failing on the code before the fix.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data.dataset import write_dataset
from ats_cli.recipes import resolve_config
from ats_cli.train import train

runner = CliRunner(env={"COLUMNS": "1000"})


@pytest.fixture(scope="module")
def empty_sets(tmp_path_factory):
    """A multi-label dataset (classes a, b) of flat grey 32x32 images, half of each split
    labelled with the empty set. A flat image gives every patch the same feature, so the
    prediction does not depend on which patches are sampled: training's evaluation and
    ``ats predict`` see the same probabilities."""
    root = tmp_path_factory.mktemp("empty_sets")
    labels = ["", "a", "", "a;b", "", "b", "", "a"]
    rows = {}
    for split in ("train", "test"):
        (root / split).mkdir()
        rows[split] = []
        for i, label in enumerate(labels):
            Image.fromarray(np.full((32, 32), 60 + 20 * i, np.uint8)).save(root / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": label})
    write_dataset(root, ["a", "b"], rows, hints={"channels": 1}, task="multilabel")
    return root


@pytest.fixture(scope="module")
def trained(empty_sets, tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "run"
    cfg = resolve_config(None, data=str(empty_sets), out=str(run), n_patches=2, patch_size=8, scale=0.25,
                         feature_width=8, batch_size=4, epochs=3, workers=0, lr=3e-2, entropy=0.0, seed=0,
                         min_brightness=0.0)
    history = train(cfg, log=lambda _: None)
    return run, history


def test_predict_counts_empty_set_labels_and_agrees_with_training(empty_sets, trained):
    run, history = trained
    best = max(history, key=lambda h: (h["test_acc"], h["epoch"]))  # best.pt: chosen on test (no val split)
    result = runner.invoke(app, ["predict", str(empty_sets), "-m", str(run / "best.pt")])
    assert result.exit_code == 0, result.output
    found = re.search(r"exact match ([\d.]+)% \((\d+) labelled images\)", result.output)
    assert found, result.output
    assert int(found.group(2)) == 8  # every row, the 4 empty sets included
    assert float(found.group(1)) == pytest.approx(100 * best["test_acc"], abs=0.01), (result.output, best)
    f1 = re.search(r"macro-F1 ([\d.]+)", result.output)
    assert float(f1.group(1)) == pytest.approx(best["test_macro_f1"], abs=5e-4), (result.output, best)
    # the empty sets are shown as such, not as a missing label
    assert "(none)" in result.output and " - " not in result.output.split("Per class")[0].split("label")[-1]


def test_the_predictions_csv_keeps_the_empty_set_label(empty_sets, trained, tmp_path):
    run, _ = trained
    out = tmp_path / "p.csv"
    result = runner.invoke(app, ["predict", str(empty_sets / "test.csv"), "-m", str(run / "best.pt"), "--out",
                                 str(out)])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0].endswith(",label") and len(lines) == 9
    assert [line.rsplit(",", 1)[1] for line in lines[1:]] == ["", "a", "", "a;b", "", "b", "", "a"]
    assert json.loads((empty_sets / "dataset.json").read_text())["task"] == "multilabel"
