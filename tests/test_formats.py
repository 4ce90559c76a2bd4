"""One input layer: the suffix table decides for every command, one PIL decoder with one
mode table reads images the same way on every path, and one parser reads dataset CSVs
for training and for ats predict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ats_cli.data import DatasetError, dataset_from_folder, load_dataset
from ats_cli.data.dataset import BACKENDS, OMEZARR, PILLOW, backend
from ats_cli.data.images import ImageReadError, decode_pil, pil_channels, read_image
from ats_cli.data.slides import SlideReadError, open_image
from ats_cli.predict import read_inputs_csv, resolve_inputs


def test_from_folder_and_predict_dir_accept_the_same_suffixes(tmp_path: Path) -> None:
    Image.new("L", (4, 3), 7).save(tmp_path / "one.png")
    png = (tmp_path / "one.png").read_bytes()  # the contents do not matter: only the names are listed
    src = tmp_path / "src"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        names = [f"x{i}{suffix.upper() if i % 2 else suffix}" for i, suffix in enumerate(BACKENDS)]
        for name in [*names, "notes.txt", "data.csv", ".hidden.png", "no_suffix"]:
            if backend(name) == OMEZARR:  # an OME-Zarr store is a directory; its insides are no inputs
                (src / cls / name / "0").mkdir(parents=True)
                (src / cls / name / "0" / "inside.png").write_bytes(png)
            else:
                (src / cls / name).write_bytes(png)
        (src / cls / "file.zarr").write_bytes(png)  # a file is no store

    ds = dataset_from_folder(src, tmp_path / "out", test_fraction=0.2)
    from_folder = sorted(str(r.path) for split in ds.splits.values() for r in split)
    predicted = sorted(str(item.path) for item in resolve_inputs([src], recursive=True))
    assert from_folder == predicted
    assert {Path(p).suffix.lower() for p in predicted} == set(BACKENDS)
    assert len(predicted) == 2 * len(BACKENDS)


def test_webp_is_an_input_everywhere_and_decodes(tmp_path: Path) -> None:
    path = tmp_path / "d" / "x.webp"
    path.parent.mkdir()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(path, lossless=True)
    assert backend(path) == PILLOW
    assert [item.path for item in resolve_inputs([path.parent])] == [path]
    assert read_image(path, 3).shape == (3, 6, 8)
    with open_image(path) as reader:
        assert reader.name == PILLOW and reader.size == (6, 8)


@pytest.mark.parametrize("mode, channels", [("1", 1), ("L", 1), ("LA", 1), ("P", 3), ("RGB", 3), ("RGBA", 3),
                                            ("CMYK", 3)])
def test_one_mode_table_for_every_reader_and_the_channels_hint(tmp_path: Path, mode: str, channels: int) -> None:
    path = tmp_path / f"x.{'jpg' if mode == 'CMYK' else 'png'}"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).convert(mode).save(path)
    arr = decode_pil(path)
    assert arr.dtype == np.uint8 and arr.shape == (6, 8, channels) and pil_channels(path) == channels
    assert np.array_equal(read_image(path).permute(1, 2, 0).numpy(), arr)
    with open_image(path, reader=PILLOW) as reader:
        assert np.array_equal(reader.read_region(0, 0, 6, 8), arr)


def test_an_rgba_folder_hints_the_channels_its_images_are_read_with(tmp_path: Path) -> None:
    for cls in ("a", "b"):
        for i in range(3):
            (tmp_path / "src" / cls).mkdir(parents=True, exist_ok=True)
            Image.new("RGBA", (4, 3), (i, 2, 3, 128)).save(tmp_path / "src" / cls / f"{i}.png")
    ds = dataset_from_folder(tmp_path / "src", tmp_path / "out", test_fraction=0.3)
    assert ds.hints == {"channels": 3}
    assert read_image(ds["train"][0].path, ds.hints["channels"]).shape == (3, 3, 4)


def test_deep_images_are_refused_alike_by_both_pil_paths(tmp_path: Path) -> None:
    path = tmp_path / "deep.png"
    Image.fromarray(np.full((3, 4), 1000, dtype=np.uint16)).save(path)
    with pytest.raises(ImageReadError, match="16/32-bit") as plain:
        read_image(path)
    with pytest.raises(SlideReadError, match="16/32-bit") as lazy:
        open_image(path, reader=PILLOW)
    assert str(plain.value) == str(lazy.value)
    assert pil_channels(path) is None


def test_the_dataset_loader_and_predict_refuse_the_same_csv_rows_alike(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    for name in ("a.png", "b.png"):
        Image.new("L", (4, 3)).save(root / name)
    (root / "dataset.json").write_text('{"classes": ["cat", "dog"]}')
    (root / "test.csv").write_text("path,label\nb.png,dog\n")
    (root / "train.csv").write_text('path,label\na.png,cat\n,dog\nb.png,dog,more\n"a.png,cat\nb.png,dog\n')
    with pytest.raises(DatasetError) as err:
        load_dataset(root)
    from_loader = [f"{p.line}: {p.message}" for p in err.value.problems]
    items = read_inputs_csv(root / "train.csv")
    assert (items[0].path, items[0].label, items[0].error) == (root / "a.png", "cat", None)
    from_predict = [item.error.removeprefix(f"{root / 'train.csv'}:") for item in items[1:]]
    assert from_predict == from_loader
    assert from_loader[:2] == ["3: empty path", "4: 3 fields, the header has 2"]
    assert from_loader[2].startswith("5: a quote opened on this line is never closed")
