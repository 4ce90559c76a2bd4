"""The on-disk dataset format: round trips, validation errors that name the row, from-folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ats_cli.data import Dataset, DatasetError, dataset_from_folder, load_dataset, write_dataset
from ats_cli.data.folder import stratified_split
from ats_cli.io import atomic_write_text


def _png(path: Path, value: int = 0, mode: str = "L") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (4, 3), value).save(path)
    return path


def _toy(root: Path, n_train: int = 3, n_test: int = 2) -> None:
    """A valid two-class dataset with an extra column."""
    rows = {"train": [], "test": []}
    for split, n in (("train", n_train), ("test", n_test)):
        for i in range(n):
            _png(root / "img" / f"{split}{i}.png", i)
            rows[split].append({"path": f"img/{split}{i}.png", "label": "cat" if i % 2 else "dog", "note": f"n{i}"})
    write_dataset(root, ["dog", "cat"], rows, hints={"channels": 1, "scale": 0.5})


def _append(csv: Path, line: str) -> int:
    """Append a row; return its line number (header = line 1)."""
    text = csv.read_text()
    csv.write_text(text + line + "\n")
    return len(text.splitlines()) + 1


def test_round_trip(tmp_path: Path) -> None:
    _toy(tmp_path)
    ds = load_dataset(tmp_path)
    assert isinstance(ds, Dataset)
    assert ds.classes == ["dog", "cat"]
    assert list(ds.splits) == ["train", "test"]
    assert [len(ds["train"]), len(ds["test"])] == [3, 2]
    first = ds["train"][1]
    assert first.path == (tmp_path / "img" / "train1.png").resolve()
    assert first.path.is_absolute()
    assert (first.label, first.label_name, first.extra["note"], first.line) == (1, "cat", "n1", 3)
    assert ds.hints == {"channels": 1, "scale": 0.5}
    meta = json.loads((tmp_path / "dataset.json").read_text())
    assert meta["classes"] == ["dog", "cat"] and meta["splits"] == ["train", "test"]


def test_absolute_paths_and_minimal_json(tmp_path: Path) -> None:
    """A hand-written dataset: absolute paths, a one-key dataset.json, an optional val.csv."""
    img = _png(tmp_path / "elsewhere" / "a.png")
    root = tmp_path / "ds"
    root.mkdir()
    (root / "dataset.json").write_text('{"classes": ["x"]}')
    for split, name in (("train", "a.png"), ("test", "b.png"), ("val", "c.png")):
        path = img if split == "train" else _png(tmp_path / "elsewhere" / name)
        (root / f"{split}.csv").write_text(f"path,label\n{path},x\n")
    ds = load_dataset(root)
    assert list(ds.splits) == ["train", "val", "test"]
    assert ds["train"][0].path == img.resolve()
    assert ds.hints == {}


@pytest.mark.parametrize(
    "row, problem",
    [
        ("img/nope.png,dog,x", "missing file 'img/nope.png'"),
        ("img/extra.png,cow,x", "unknown label 'cow' (classes: dog, cat)"),
        ("img/train0.png,dog,x", "duplicate path 'img/train0.png' (first at train.csv:2)"),
        (",dog,x", "empty path"),
    ],
)
def test_row_problems_name_file_and_line(tmp_path: Path, row: str, problem: str) -> None:
    _toy(tmp_path)
    _png(tmp_path / "img" / "extra.png")
    line = _append(tmp_path / "train.csv", row)
    with pytest.raises(DatasetError) as info:
        load_dataset(tmp_path)
    err = info.value
    assert isinstance(err, ValueError)
    assert [str(p) for p in err.problems] == [f"train.csv:{line}: {problem}"]
    assert f"train.csv:{line}: {problem}" in str(err)


def test_empty_split(tmp_path: Path) -> None:
    _toy(tmp_path)
    (tmp_path / "test.csv").write_text("path,label,note\n")
    with pytest.raises(DatasetError, match=r"test\.csv: empty split"):
        load_dataset(tmp_path)


def test_missing_pieces(tmp_path: Path) -> None:
    _toy(tmp_path)
    (tmp_path / "test.csv").unlink()
    with pytest.raises(DatasetError, match=r"test\.csv: missing"):
        load_dataset(tmp_path)
    (tmp_path / "dataset.json").unlink()
    with pytest.raises(DatasetError, match=r"dataset\.json: missing"):
        load_dataset(tmp_path)
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(DatasetError, match=r"dataset\.json:1: not valid JSON"):
        load_dataset(tmp_path)


def test_bad_header(tmp_path: Path) -> None:
    _toy(tmp_path)
    (tmp_path / "train.csv").write_text("file,class\nimg/train0.png,dog\n")
    with pytest.raises(DatasetError, match=r"train\.csv:1: header .* lacks column\(s\) \['path', 'label'\]"):
        load_dataset(tmp_path)


def test_all_problems_collected_first_ones_shown(tmp_path: Path) -> None:
    _toy(tmp_path)
    lines = [_append(tmp_path / "train.csv", f"img/missing{i}.png,dog,") for i in range(14)]
    _append(tmp_path / "test.csv", "img/test1.png,cat,")  # duplicate in another split
    with pytest.raises(DatasetError) as info:
        load_dataset(tmp_path)
    err = info.value
    assert len(err.problems) == 15
    message = str(err)
    assert message.startswith(f"dataset {tmp_path.resolve()}: 15 problems:")
    assert f"train.csv:{lines[0]}: missing file 'img/missing0.png'" in message
    assert f"train.csv:{lines[9]}:" in message and f"train.csv:{lines[10]}:" not in message
    assert "... and 5 more" in message
    assert any(str(p).startswith("test.csv:4: duplicate path") for p in err.problems)


def test_check_files_off(tmp_path: Path) -> None:
    _toy(tmp_path)
    _append(tmp_path / "train.csv", "img/later.png,dog,")
    assert len(load_dataset(tmp_path, check_files=False)["train"]) == 4


def test_atomic_write_leaves_no_temporaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.json"
    atomic_write_text(target, "old")

    def boom(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_write_dataset_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown split"):
        write_dataset(tmp_path, ["a"], {"training": []})
    with pytest.raises(ValueError, match="unique"):
        write_dataset(tmp_path, ["a", "a"], {"train": []})
    with pytest.raises(ValueError, match="row 1: every row needs 'path' and 'label'"):
        write_dataset(tmp_path, ["a"], {"train": [{"path": "x.png"}]})


# ---------------------------------------------------------------------------- from-folder


def _tree(root: Path, counts: dict[str, int]) -> None:
    for cls, n in counts.items():
        for i in range(n):
            sub = "nested/" if i % 3 == 0 else ""
            _png(root / cls / f"{sub}{cls}_{i}.png", i, mode="RGB")
    (root / next(iter(counts)) / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()


def test_stratified_split_sizes() -> None:
    rng = np.random.default_rng(0)
    parts = stratified_split(10, {"test": 0.2, "val": 0.1}, rng)
    assert [len(parts[k]) for k in ("train", "test", "val")] == [7, 2, 1]
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(10))
    small = stratified_split(2, {"test": 0.2, "val": 0.1}, np.random.default_rng(0))
    assert len(small["train"]) == 1 and len(small["test"]) == 1 and len(small["val"]) == 0


def test_from_folder_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    counts = {"cat": 10, "dog": 20, "emu": 5}
    _tree(src, counts)
    ds = dataset_from_folder(src, tmp_path / "out", test_fraction=0.2, val_fraction=0.2, seed=3)
    assert ds.classes == ["cat", "dog", "emu"]
    assert ds.hints == {"channels": 3}
    everything = [r for split in ds.splits.values() for r in split]
    assert sorted(str(r.path) for r in everything) == sorted(str(p) for p in src.rglob("*.png"))
    for record in everything:
        assert record.path.is_absolute() and record.path.parent.name in (record.label_name, "nested")
    per = {s: {c: sum(r.label_name == c for r in ds[s]) for c in counts} for s in ds.splits}
    assert per["test"] == {"cat": 2, "dog": 4, "emu": 1} and per["val"] == per["test"]
    assert per["train"] == {"cat": 6, "dog": 12, "emu": 3}

    again = dataset_from_folder(src, tmp_path / "out2", test_fraction=0.2, val_fraction=0.2, seed=3)
    assert {s: [r.path for r in rs] for s, rs in again.splits.items()} == {
        s: [r.path for r in rs] for s, rs in ds.splits.items()
    }
    other = dataset_from_folder(src, tmp_path / "out3", test_fraction=0.2, val_fraction=0.2, seed=4)
    assert [r.path for r in other["test"]] != [r.path for r in ds["test"]]


@pytest.mark.parametrize("mode", ["copy", "link"])
def test_from_folder_copy_and_link(tmp_path: Path, mode: str) -> None:
    src = tmp_path / "src"
    _tree(src, {"a": 4, "b": 4})
    ds = dataset_from_folder(src, tmp_path / "out", test_fraction=0.25, mode=mode)
    csv = (tmp_path / "out" / "train.csv").read_text()
    assert "images/a/" in csv and str(src) not in csv  # relative paths into OUT
    for record in ds["train"] + ds["test"]:
        assert record.path.is_relative_to((tmp_path / "out" / "images").resolve())
        assert record.path.is_symlink() == (mode == "link")
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_from_folder_errors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(DatasetError, match="no class sub-folders"):
        dataset_from_folder(src, tmp_path / "out")
    _tree(src, {"a": 3, "b": 3})
    (src / "empty").mkdir()
    with pytest.raises(DatasetError, match="empty/: class folder holds no images"):
        dataset_from_folder(src, tmp_path / "out")
    (src / "empty").rmdir()
    with pytest.raises(DatasetError, match="must not be inside the source tree"):
        dataset_from_folder(src, src / "out")
    dataset_from_folder(src, tmp_path / "out")
    with pytest.raises(DatasetError, match="already exists"):
        dataset_from_folder(src, tmp_path / "out")
    dataset_from_folder(src, tmp_path / "out", overwrite=True)
    with pytest.raises(ValueError, match="test_fraction must be > 0"):
        dataset_from_folder(src, tmp_path / "o2", test_fraction=0)
    one = tmp_path / "one"
    _png(one / "a" / "x.png")
    with pytest.raises(DatasetError, match="too few images for a test split"):
        dataset_from_folder(one, tmp_path / "o3")


def test_from_folder_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ats_cli.cli.make_dataset import make_dataset_app

    src = tmp_path / "src"
    _tree(src, {"a": 5, "b": 5})
    runner = CliRunner()
    result = runner.invoke(make_dataset_app, ["from-folder", str(src), str(tmp_path / "out"), "--test", "0.2",
                                              "--val", "0.2", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "2 classes (a, b); train 6, val 2, test 2" in " ".join(result.output.split())
    assert load_dataset(tmp_path / "out").classes == ["a", "b"]
    again = runner.invoke(make_dataset_app, ["from-folder", str(src), str(tmp_path / "out")])
    assert again.exit_code == 1
    assert "already exists" in again.output


def test_a_folder_that_is_not_a_dataset_is_one_line_saying_what_it_is_and_the_next_step(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_dataset(tmp_path / "nowhere")
    assert str(err.value) == f"{tmp_path / 'nowhere'}: does not exist"
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    with pytest.raises(DatasetError) as err:
        load_dataset(notes)
    assert str(err.value).startswith(f"{notes}: is a file, not a dataset folder")
    photos = tmp_path / "photos"
    _png(photos / "cat" / "a.png")
    _png(photos / "dog" / "b.png")
    with pytest.raises(DatasetError) as err:
        load_dataset(photos)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{photos}: has class folders (cat, dog) but no dataset.json")
    assert f"ats make-dataset from-folder {photos} DATA" in message
    with pytest.raises(DatasetError, match="does not exist"):
        dataset_from_folder(tmp_path / "nowhere", tmp_path / "out")
