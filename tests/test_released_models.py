"""The released models (models/*.pt): safe to load, and they work on the shipped samples
right after install, as the README and their cards promise."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint
from ats_cli.cli import app
from ats_cli.models import SPEC_VERSION, migrate_spec

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

RELEASED = [
    # model, sample CSV, its first rows predicted (None: all), classes, minimum correct on them
    # (the card's figure minus a margin)
    ("megapixel-mnist-ats.pt", "sample_data/megapixel-mnist/test.csv", None, [str(d) for d in range(10)], 6),  # 8/8
    ("synthetic-slides-ats.pt", "sample_data/synthetic-slides/test.csv", None, ["normal", "tumor"], 3),  # card: 4/4
    # a normal and a tumour slide of the four (card: 4/4): each 100k² slide's coarse view costs ~8 s of CPU
    ("synthetic-slides-100k-ats.pt", "sample_data/virtual-slides/test.csv", 2, ["normal", "tumor"], 2),
]


def _first_rows(samples: Path, rows: int | None, folder: Path) -> Path:
    """``samples`` itself, or a copy of its header and first ``rows`` rows with absolute paths."""
    if rows is None:
        return samples
    with open(samples, newline="") as fh:
        header, *lines = list(csv.reader(fh))
    copy = folder / "samples.csv"
    with open(copy, "w", newline="") as fh:
        csv.writer(fh).writerows([header, *([str(samples.parent / row[0]), *row[1:]] for row in lines[:rows])])
    return copy


@pytest.mark.parametrize("name, samples, rows, classes, min_correct", RELEASED)
def test_released_model_loads_safely_and_predicts_the_samples(name, samples, rows, classes, min_correct, tmp_path):
    path = ROOT / "models" / name
    assert path.is_file(), f"{path} is missing"
    assert (ROOT / "models" / name.replace(".pt", ".md")).is_file(), "a released model needs its card"
    ckpt = torch.load(path, weights_only=True)  # plain tensors and values only, never pickled objects
    assert ckpt["format"] == "ats-checkpoint" and ckpt["classes"] == classes
    assert "optimizer" not in ckpt  # a release, not a training state
    spec = ckpt["spec"]  # the released spec layout (version 1): the extensions as nested plain specs
    assert spec["version"] == 1 and isinstance(spec["pooling"], dict)
    migrated = load_checkpoint(path)["spec"]  # read in the current layout: every key of the file kept
    assert migrated["version"] == SPEC_VERSION and migrated == migrate_spec(spec)
    assert all(migrated[k] == v for k, v in spec.items() if k not in ("version", "input"))
    assert all(spec[k] is None or isinstance(spec[k], dict) for k in ("support", "prior", "gain"))
    out = tmp_path / "preds.csv"
    samples = _first_rows(ROOT / samples, rows, tmp_path)
    result = runner.invoke(app, ["predict", str(samples), "--model", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = out.read_text().splitlines()[1:]
    correct = sum(r.split(",")[1] == r.split(",")[-1] for r in rows)
    assert len(rows) == len(samples.read_text().splitlines()) - 1
    assert correct >= min_correct, result.output
