"""Megapixel MNIST: digit sources, image content, determinism across workers, resume, CLI.

Everything runs offline: the autouse fixture sets ATS_OFFLINE=1, points the cache at a
temporary folder and makes every socket connection fail.
"""

from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ats_cli.data import DatasetError, load_dataset
from ats_cli.data.generation import LOCK_NAME
from ats_cli.data.megapixel_mnist import (
    PRESETS,
    MegapixelMNISTConfig,
    generate_megapixel_mnist,
    image_layout,
    make_config,
    render_image,
    split_patterns,
)
from ats_cli.data.mnist import (
    DigitSet,
    DigitSourceError,
    load_bundled_digits,
    load_mnist,
    read_idx,
    resolve_digits,
)

TINY = dict(n_train=6, n_test=4, width=160, height=140, n_noise=6, seed=0)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATS_OFFLINE", "1")
    monkeypatch.setenv("ATS_CACHE_DIR", str(tmp_path / "cache"))

    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket, "create_connection", no_network)


@pytest.fixture(scope="module")
def bundled() -> DigitSet:
    return load_bundled_digits()


def _idx_bytes(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _fake_mnist(n_per_class: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", n_per_class), ("test", max(1, n_per_class // 2))):
        labels = np.repeat(np.arange(10, dtype=np.uint8), n)
        images = rng.integers(0, 256, size=(len(labels), 28, 28), dtype=np.uint8)
        out[f"x_{split}"], out[f"y_{split}"] = images, labels
    return out


def _write_idx_dir(folder: Path, arrays: dict[str, np.ndarray], gz: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
    for key, name in names.items():
        data = _idx_bytes(arrays[key])
        (folder / (name + ".gz" if gz else name)).write_bytes(gzip.compress(data) if gz else data)
    return folder


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- digit sources


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx(tmp_path: Path, gz: bool) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 1], dtype=np.uint8)
    for name, arr in (("img", images), ("lab", labels)):
        data = _idx_bytes(arr)
        (tmp_path / name).write_bytes(gzip.compress(data) if gz else data)
    np.testing.assert_array_equal(read_idx(tmp_path / "img"), images)
    np.testing.assert_array_equal(read_idx(tmp_path / "lab"), labels)
    assert read_idx(tmp_path / "img").dtype == np.uint8


def test_read_idx_rejects_garbage(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(DigitSourceError, match="bad: not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx_bytes(np.zeros((2, 3), np.uint8))[:-1])
    with pytest.raises(DigitSourceError, match=r"short: header says shape \(2, 3\) \(6 bytes\), file has 5"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_idx_dir_and_npz(tmp_path: Path, gz: bool) -> None:
    arrays = _fake_mnist(3, seed=1)
    digits = load_mnist(_write_idx_dir(tmp_path / "idx", arrays, gz))
    assert digits.kind == "idx"
    for key, arr in arrays.items():
        np.testing.assert_array_equal(getattr(digits, key), arr)
    np.savez(tmp_path / "m.npz", **arrays)
    from_npz = load_mnist(tmp_path / "m.npz")
    assert from_npz.kind == "npz" and from_npz.sha256() == digits.sha256()
    (tmp_path / "idx2").mkdir()
    with pytest.raises(DigitSourceError, match="no train-images-idx3-ubyte"):
        load_mnist(tmp_path / "idx2")


def test_bundled_digits(bundled: DigitSet) -> None:
    assert bundled.kind == "bundled"
    assert bundled.x_train.shape == (8004, 28, 28) and bundled.x_test.shape == (1996, 28, 28)
    assert bundled.x_train.dtype == np.uint8
    assert set(np.unique(bundled.y_train)) == set(range(10)) == set(np.unique(bundled.y_test))
    train = {x.tobytes() for x in bundled.x_train}
    assert not any(x.tobytes() in train for x in bundled.x_test), "train and test pools must be disjoint"
    with np.load("sample_data/mnist_digits.npz") as z:
        prov = json.loads(str(z["provenance"]))
    assert (prov["package"], prov["version"], prov["license"]) == ("mnist", "1.1.0", "MIT")
    assert len(prov["tarball_sha256"]) == 64


def test_resolve_digits_order(tmp_path: Path) -> None:
    notices: list[str] = []
    # offline and nothing cached: the bundled digits, with a one-line notice
    digits = resolve_digits(on_notice=notices.append)
    assert digits.kind == "bundled" and len(notices) == 1 and "bundled" in notices[0]
    assert digits.notes == ("MNIST download skipped (offline mode)",)
    # online but no network: the download attempt fails fast and is only noted
    digits = resolve_digits(offline=False, timeout=1.0)
    assert digits.kind == "bundled" and "MNIST download failed" in digits.notes[0]
    # a complete cached download is used without the network
    arrays = _fake_mnist(2, seed=2)
    cache = _write_idx_dir(tmp_path / "cache" / "mnist", arrays, gz=False)
    assert resolve_digits().kind == "bundled", "no completion marker: not a cache"
    (cache / "COMPLETE").write_text("")
    cached = resolve_digits()
    assert cached.kind == "torchvision"
    np.testing.assert_array_equal(cached.y_train, arrays["y_train"])
    # an explicit path wins and its errors are not swallowed
    assert resolve_digits(cache).kind == "idx"
    with pytest.raises(DigitSourceError, match="no such file"):
        resolve_digits(tmp_path / "nope")


# ---------------------------------------------------------------------------- configuration


def test_presets_and_overrides() -> None:
    paper = make_config("paper")
    assert (paper.n_train, paper.n_test, paper.width, paper.height) == (5000, 1000, 1500, 1500)
    assert (paper.n_digits, paper.n_target, paper.n_noise, paper.seed) == (5, 3, 50, 0)
    small = make_config("small", n_noise=None, seed=7)
    assert (small.width, small.n_train, small.n_noise, small.seed) == (500, 1000, 10, 7)
    assert PRESETS["paper"] == MegapixelMNISTConfig()
    # the paper's images plus a val split, so best.pt is not chosen on test; the demo's preset has none
    assert (paper.n_val, small.n_val) == (1000, 0)
    # both presets use the reference generator's noise, placed as it places it
    for config in (paper, small):
        assert (config.noise, config.noise_overlap, config.overlaps("reference")) == ("reference", None, True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_target=6), "n_target must be in 1..n_digits"),
        (dict(n_digits=30, n_target=3), "cannot all stay below"),
        (dict(width=100, height=100, n_noise=20, noise="strokes"), "would cover over half"),
        (dict(width=100, height=100, n_digits=9, n_target=5), "would cover over half"),
        (dict(noise="fog"), "unknown noise family 'fog'"),
        (dict(noise_overlap=1), "noise_overlap must be True, False or None"),
        (dict(width=20), "smaller than a digit"),
        (dict(n_test=0), "n_train and n_test must be at least 1"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config("small", **overrides)


def test_the_val_split_scales_with_the_training_images_asked_for() -> None:
    """--n-train 16 --n-test 8 made 1,000 val images: the val split follows the preset's
    share of the training images (0.2 in paper) unless --n-val is given."""
    assert make_config("paper", n_train=16, n_test=8).n_val == 3
    assert make_config("paper", n_train=2).n_val == 1
    assert make_config("paper", n_train=10_000).n_val == 2000
    assert make_config("paper", n_test=8).n_val == 1000  # the paper's training set, the paper's val
    assert make_config("paper", n_train=16, n_val=0).n_val == 0
    assert make_config("paper", n_train=16, n_val=40).n_val == 40
    assert make_config("small", n_train=16).n_val == 0  # a preset without a val split still has none


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_config("huge")


# ---------------------------------------------------------------------------- image content


@pytest.mark.parametrize("n_digits, n_target", [(5, 3), (7, 2)])
def test_image_content_matches_recorded_boxes(bundled: DigitSet, n_digits: int, n_target: int) -> None:
    # non-overlapping noise (strokes); the reference's overlapping noise: tests/test_noise.py
    config = make_config("small", width=260, height=240, n_noise=12, n_digits=n_digits, n_target=n_target,
                         noise="strokes")
    targets = set()
    for split in ("train", "test"):
        images = bundled.x_train if split == "train" else bundled.x_test
        for index in range(15):
            image, layout = render_image(config, bundled, split, index)
            row = layout.row(f"{split}/{index}.png")
            digits = json.loads(row["digits"])
            classes = [d[0] for d in digits]
            assert len(digits) == n_digits
            counts = np.bincount(classes, minlength=10)
            assert int(row["label"]) == layout.target == int(np.argmax(counts))
            assert counts[layout.target] == n_target and np.sort(counts)[-2] < n_target  # strict majority
            assert row["max"] == str(max(classes))
            assert row["top"] == str(classes[0]) and [d[1] for d in digits] == sorted(d[1] for d in digits)
            assert row["present"] == ";".join(str(c) for c in sorted(set(classes)))
            targets.add(layout.target)

            boxes = [(r, c) for _, r, c, _, _ in digits] + [tuple(b) for b in layout.noise_boxes.tolist()]
            assert len(boxes) == n_digits + config.n_noise
            covered = np.zeros_like(image, dtype=bool)
            for r, c in boxes:
                assert 0 <= r <= config.height - 28 and 0 <= c <= config.width - 28
                assert not covered[r : r + 28, c : c + 28].any(), "objects overlap"
                covered[r : r + 28, c : c + 28] = True
                assert image[r : r + 28, c : c + 28].any(), "an object box is empty"
            assert not image[~covered].any(), "pixels outside every box must be 0"
            # the pixels inside each recorded digit box are exactly a pool digit of the recorded class
            labels = bundled.y_train if split == "train" else bundled.y_test
            index_at = {tuple(rc): i for rc, i in zip(layout.digit_boxes.tolist(), layout.digit_index.tolist(),
                                                      strict=True)}
            for cls, r, c, h, w in digits:
                assert (h, w) == (28, 28)
                idx = index_at[(r, c)]
                np.testing.assert_array_equal(image[r : r + h, c : c + w], images[idx])
                assert labels[idx] == cls
            # noise never looks brighter than 255 * 1.0 nor fainter than its 0.8 floor at stroke centres
            for r, c in layout.noise_boxes.tolist():
                assert image[r : r + 28, c : c + 28].max() >= int(0.8 * 255) - 1
    assert len(targets) >= 5, "targets should vary across images"


def test_layout_depends_only_on_seed_split_index(bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    a = image_layout(config, bundled, "train", 3)
    b = image_layout(config, bundled, "train", 3)
    assert a.digits_json() == b.digits_json()
    assert image_layout(config, bundled, "test", 3).digits_json() != a.digits_json()
    # train of seed s uses seed+1: identical entropy to test of seed s+1, as in the reference
    shifted = make_config("small", **{**TINY, "seed": 1})
    assert image_layout(shifted, bundled, "test", 3).digit_boxes.tolist() == a.digit_boxes.tolist()


# ---------------------------------------------------------------------------- generation


def test_generate_writes_a_valid_dataset(tmp_path: Path, bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    report = generate_megapixel_mnist(tmp_path / "out", config, bundled, workers=1)
    assert (report.written, report.skipped) == (10, 0) and report.images_per_s > 0
    ds = load_dataset(tmp_path / "out")
    assert ds.classes == [str(d) for d in range(10)]
    assert [len(ds["train"]), len(ds["test"])] == [6, 4]
    # the facts of the images as hints; the settings ats train reads them with, a recipe's name
    assert ds.hints == {"channels": 1, "image_size": [140, 160]} and ds.recipe == "megapixel-mnist"
    gen = ds.meta["generator"]
    assert gen["name"] == "megapixel-mnist" and gen["params"] == config.params()
    assert gen["digits"]["kind"] == "bundled" and gen["digits"]["sha256"] == bundled.sha256()
    assert not (tmp_path / "out" / LOCK_NAME).exists()
    for split in ("train", "test"):
        for i, record in enumerate(ds[split]):
            with Image.open(record.path) as im:
                assert (im.format, im.mode, im.size) == ("PNG", "L", (160, 140))
                pixels = np.asarray(im)
            expected, layout = render_image(config, bundled, split, i)
            np.testing.assert_array_equal(pixels, expected)
            assert record.label == layout.target
            assert json.loads(record.extra["digits"]) == json.loads(layout.digits_json())


def test_byte_identical_across_worker_counts(tmp_path: Path, bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    generate_megapixel_mnist(tmp_path / "w1", config, bundled, workers=1)
    generate_megapixel_mnist(tmp_path / "w2", config, bundled, workers=2, chunk_size=1)
    one, two = _files(tmp_path / "w1"), _files(tmp_path / "w2")
    assert len(one) == 10 + 3  # images + train.csv, test.csv, dataset.json
    assert one == two


class _Interrupt(Exception):
    pass


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_after_interruption(tmp_path: Path, bundled: DigitSet, workers: int) -> None:
    config = make_config("small", **TINY)
    generate_megapixel_mnist(tmp_path / "clean", config, bundled, workers=1)

    out = tmp_path / "resumed"

    def stop_early(split: str, done: int, total: int) -> None:
        if done >= 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        generate_megapixel_mnist(out, config, bundled, workers=workers, chunk_size=2, progress=stop_early)
    assert (out / LOCK_NAME).exists() and not (out / "dataset.json").exists()
    made = sorted(out.glob("*/*.png"))
    assert {out / "train" / "00000.png", out / "train" / "00001.png"} <= set(made)
    if workers == 1:
        assert len(made) == 2  # stopped right after the first chunk
    # What a hard kill or a user can leave behind: a stray temporary file, a missing
    # image, a truncated image (e.g. copied by hand; our own writes are atomic).
    (out / "train" / ".00005.png.12345.tmp").write_bytes(b"\x89PNG half")
    (out / "train" / "00001.png").unlink()
    clean_png = (tmp_path / "clean" / "train" / "00000.png").read_bytes()
    (out / "train" / "00000.png").write_bytes(clean_png[: len(clean_png) // 2])

    report = generate_megapixel_mnist(out, config, bundled, workers=workers)
    assert report.skipped == len(made) - 2 and report.written == 10 - report.skipped
    assert _files(out) == _files(tmp_path / "clean")
    assert not (out / LOCK_NAME).exists()

    again = generate_megapixel_mnist(out, config, bundled, workers=workers)
    assert (again.written, again.skipped) == (0, 10)
    assert _files(out) == _files(tmp_path / "clean")


def test_rerun_with_other_parameters_refuses(tmp_path: Path, bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    out = tmp_path / "out"
    generate_megapixel_mnist(out, config, bundled, workers=1)
    before = _files(out)
    with pytest.raises(DatasetError, match=r"dataset\.json: was generated with different parameters \(seed: 0 -> 1"):
        generate_megapixel_mnist(out, make_config("small", **{**TINY, "seed": 1}), bundled, workers=1)
    other = load_mnist(_write_idx_dir(tmp_path / "idx", _fake_mnist(3, seed=0), gz=True))
    with pytest.raises(DatasetError, match="digit source: bundled sample digits .* -> MNIST IDX files"):
        generate_megapixel_mnist(out, config, other, workers=1)
    assert _files(out) == before

    # an interrupted run is protected the same way, through its lock file
    (out / "dataset.json").unlink()
    (out / LOCK_NAME).write_text(json.dumps({"name": "megapixel-mnist", "version": 1,
                                             "params": {**config.params(), "n_noise": 3}, "digits": {}}))
    with pytest.raises(DatasetError, match=r"\.ats-generate\.json: .*n_noise: 3 -> 6"):
        generate_megapixel_mnist(out, config, bundled, workers=1)

    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "holiday.jpg").write_bytes(b"")
    with pytest.raises(DatasetError, match="not empty and holds no megapixel-mnist run"):
        generate_megapixel_mnist(stranger, config, bundled, workers=1)


def _rows_of(patches: np.ndarray, patterns: np.ndarray) -> list[bool]:
    """Whether each pasted noise patch is one of ``patterns``."""
    return [any(np.array_equal(p, q) for q in patterns) for p in patches]


def test_val_split_draws_its_own_noise_and_train_digits(tmp_path: Path, bundled: DigitSet) -> None:
    """A val image's 50 patterns are its own (none of train's or test's, none of another val
    image's) and its digits come from the train pool; train and test are the images they
    were without a val split, so adding one changes no existing file."""
    config = make_config("small", **{**TINY, "n_val": 3})
    ds_dir = tmp_path / "val"
    generate_megapixel_mnist(ds_dir, config, bundled, workers=2, chunk_size=1)
    ds = load_dataset(ds_dir)
    assert [len(ds[s]) for s in ("train", "val", "test")] == [6, 3, 4]
    without = tmp_path / "without"
    generate_megapixel_mnist(without, make_config("small", **TINY), bundled, workers=1)
    old = _files(without)
    new = _files(ds_dir)
    assert {k: v for k, v in new.items() if k.startswith(("train/", "test/", "train.csv", "test.csv"))} == \
        {k: v for k, v in old.items() if k != "dataset.json"}

    train_p, test_p = split_patterns(0, "train"), split_patterns(0, "test")
    seen: list[np.ndarray] = []
    for i, record in enumerate(ds["val"]):
        pixels, layout = render_image(config, bundled, "val", i)
        with Image.open(record.path) as im:
            np.testing.assert_array_equal(np.asarray(im), pixels)
        assert record.label == layout.target
        assert not any(_rows_of(layout.noise_patches, train_p)) and not any(_rows_of(layout.noise_patches, test_p))
        assert not any(any(_rows_of(layout.noise_patches, other)) for other in seen)
        seen.append(layout.noise_patches)
        for idx, cls in zip(layout.digit_index.tolist(), layout.digit_classes.tolist(), strict=True):
            assert bundled.y_train[idx] == cls  # a train-pool digit of the drawn class
    # the negative control: a test image's noise all comes from the test split's patterns
    _, test_layout = render_image(config, bundled, "test", 0)
    assert all(_rows_of(test_layout.noise_patches, test_p))
    with pytest.raises(ValueError, match="val split has no split-level patterns"):
        split_patterns(0, "val")


def test_val_split_resumes_old_datasets_and_refuses_a_change(tmp_path: Path, bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    out = tmp_path / "out"
    generate_megapixel_mnist(out, config, bundled, workers=1)
    # a run begun before val splits existed records no n_val: it resumes as n_val 0
    block = json.loads((out / "dataset.json").read_text())["generator"]
    del block["params"]["n_val"]
    (out / "dataset.json").unlink()
    (out / LOCK_NAME).write_text(json.dumps(block))
    # ... and asked for a val split (the paper preset's default) it says how to resume it as it was
    with pytest.raises(DatasetError, match=r"n_val: 0 -> 2 \(it was made without a val split: --n-val 0 resumes"):
        generate_megapixel_mnist(out, make_config("small", **{**TINY, "n_val": 2}), bundled, workers=1)
    assert generate_megapixel_mnist(out, config, bundled, workers=1).skipped == 10
    with pytest.raises(DatasetError, match=r"n_val: 0 -> 2 \(it was made without a val split"):
        generate_megapixel_mnist(out, make_config("small", **{**TINY, "n_val": 2}), bundled, workers=1)
    with pytest.raises(ValueError, match="n_val must be >= 0"):
        make_config("small", n_val=-1)


def test_cli_smoke(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    try:
        from ats_cli.cli import app

        args = ["make-dataset", "megapixel-mnist"]
    except Exception:  # the root app belongs to another module; fall back to ours
        from ats_cli.cli.make_dataset import make_dataset_app as app

        args = ["megapixel-mnist"]
    runner = CliRunner()
    out = tmp_path / "cli"
    flags = ["--preset", "small", "--n-train", "3", "--n-test", "2", "--width", "200", "--height", "200",
             "--workers", "1", "--offline"]
    result = runner.invoke(app, [*args, str(out), *flags])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "wrote 5 images, skipped 0" in text and "images/s" in text
    assert "bundled" in text
    ds = load_dataset(out)
    assert ds.meta["generator"]["params"]["n_noise"] == 10 and ds.hints["image_size"] == [200, 200]

    refused = runner.invoke(app, [*args, str(out), *flags[:-3], "--seed", "5", "--workers", "1", "--offline"])
    assert refused.exit_code == 1
    assert "different parameters" in refused.output and "seed: 0 -> 5" in refused.output
    with_val = runner.invoke(app, [*args, str(tmp_path / "val"), *flags, "--n-val", "2"])
    assert with_val.exit_code == 0, with_val.output
    assert "3 train + 2 val + 2 test images" in " ".join(with_val.output.split())
    assert len(load_dataset(tmp_path / "val")["val"]) == 2
    bad = runner.invoke(app, [*args, str(tmp_path / "bad"), "--n-target", "9", "--offline"])
    assert bad.exit_code == 1 and "n_target must be in 1..n_digits" in bad.output
