"""A resume continues the run it names on the data that run started with (issue #67, case 1).

Reversing ``classes`` in dataset.json used to resume with exit 0 and save the head
trained on the old order under the new names (predictions on the training images fell
from 43.8% to 4.2%); swapping val.csv and test.csv used to resume too, choosing best.pt
across two validation sets. Both are now refused in one line that names what changed and
the way on. Every test here was seen failing on the code before the fix.
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint
from ats_cli.cli import app
from ats_cli.runtime import RunDirError
from ats_cli.train import train
from tests.test_trust import square_cfg, write_squares

runner = CliRunner(env={"COLUMNS": "1000"})
quiet = {"log": lambda _: None}


@pytest.fixture(scope="module")
def three_splits(tmp_path_factory):
    """A tiny two-class dataset with train (8), val (4) and test (4) 32x32 images."""
    return write_squares(tmp_path_factory.mktemp("three"), (("train", 8), ("val", 4), ("test", 4)))


def _cfg(data, out, **kw):
    return square_cfg(data, out, **{"epochs": 1, **kw})


@pytest.fixture
def a_run(three_splits, tmp_path):
    """(dataset copy, run directory): one epoch trained on the copy."""
    data = tmp_path / "data"
    shutil.copytree(three_splits, data)
    run = tmp_path / "run"
    train(_cfg(data, run), **quiet)
    return data, run


def _one_line_refusal(result, *words):
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert len(result.output.strip().splitlines()) == 1, result.output
    for word in words:
        assert word in result.output, (word, result.output)


def test_a_resume_after_the_classes_were_reordered_is_refused_and_leaves_the_run_as_it_was(a_run):
    data, run = a_run
    meta = json.loads((data / "dataset.json").read_text())
    meta["classes"] = meta["classes"][::-1]
    (data / "dataset.json").write_text(json.dumps(meta))
    before = (run / "last.pt").read_bytes()
    result = runner.invoke(app, ["train", "--resume", str(run), "--epochs", "2"])
    _one_line_refusal(result, "dataset.json", "another order", "b, a", "a, b", "--overwrite", "--out")
    assert (run / "last.pt").read_bytes() == before  # nothing saved under the new names
    assert load_checkpoint(run / "last.pt")["classes"] == ["a", "b"]


def test_a_resume_with_val_and_test_swapped_is_refused(a_run):
    data, run = a_run
    (data / "val.csv").rename(data / "tmp.csv")
    (data / "test.csv").rename(data / "val.csv")
    (data / "tmp.csv").rename(data / "test.csv")
    result = runner.invoke(app, ["train", "--resume", str(run), "--epochs", "2"])
    _one_line_refusal(result, "val.csv now lists test.csv's rows", "test.csv now lists val.csv's rows", "best.pt",
                      "--overwrite")


def test_a_resume_after_a_val_row_changed_label_or_the_val_split_went_is_refused(a_run):
    data, run = a_run
    text = (data / "val.csv").read_text()
    (data / "val.csv").write_text(text.replace("val/0.png,a", "val/0.png,b"))
    with pytest.raises(RunDirError, match=r"val.csv lists other rows \(4 images, was 4\)"):
        train(_cfg(data, run, epochs=2), resume=True, **quiet)
    (data / "val.csv").write_text(text)
    meta = json.loads((data / "dataset.json").read_text())
    meta["splits"] = ["train", "test"]
    (data / "dataset.json").write_text(json.dumps(meta))
    (data / "val.csv").unlink()
    with pytest.raises(RunDirError, match="val.csv is gone"):
        train(_cfg(data, run, epochs=2), resume=True, **quiet)


def test_a_resume_on_the_same_data_still_continues(a_run):
    data, run = a_run
    history = train(_cfg(data, run, epochs=2), resume=True, **quiet)
    assert [h["epoch"] for h in history] == [1, 2]
