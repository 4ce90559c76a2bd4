"""Results you can trust (issue items 4-5 and the smaller ones): wrong answers or crashes
that a file's metadata, a symlink, a replaced file or a changed dataset used to cause.

Every test here was seen failing on the code before its fix. Memory cases never allocate
much: the files are tiny and only their metadata claims absurd sizes; each such test
checks that the refusal comes before the large allocation (the resize that would make
the view is watched and must not be reached with a large size).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from typer.testing import CliRunner

import ats_cli.data.slides as slides_mod
import ats_cli.train as train_mod
from ats_cli.checkpoint import save_checkpoint
from ats_cli.cli import app
from ats_cli.config import ConfigError, TrainConfig
from ats_cli.data import dataset_from_folder
from ats_cli.data.dataset import DatasetError, Record, load_dataset, write_dataset
from ats_cli.data.images import ImageReadError, read_image
from ats_cli.data.inputs import ViewCache, open_input, view_cache_for
from ats_cli.data.slides import SlideReadError, open_image
from ats_cli.models import create_model, model_spec
from ats_cli.recipes import resolve_config
from ats_cli.runtime import RunDirError
from ats_cli.train import train

runner = CliRunner(env={"COLUMNS": "1000"})


def settle_physical_scale(cfg: TrainConfig, records: list[Record], _log=None) -> float | None:
    """The microns per pixel ats train settles for these training files (ats_cli.config), by the
    same call: the files' facts read, then the one settle."""
    from ats_cli.config import settle_data

    class Training:
        hints: dict = {}
        multilabel = False

        def __getitem__(self, split: str) -> list[Record]:
            return records

    return settle_data(cfg, Training())[0].mpp
SLIDES_MODEL = Path(__file__).resolve().parents[1] / "models" / "synthetic-slides-ats.pt"


def _tiff(path: Path, *, mpp: float | None = None, size: int = 512, seed: int = 0, per_inch: bool = False) -> Path:
    """A small RGB tiled TIFF whose resolution tags say ``mpp`` µm/px (per cm, or per inch)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    kw = {}
    if mpp is not None:
        kw = {"resolution": ((25_400 if per_inch else 10_000) / mpp,) * 2,
              "resolutionunit": "INCH" if per_inch else "CENTIMETER"}
    tifffile.imwrite(path, image, tile=(128, 128), photometric="rgb", metadata=None, **kw)
    return path


def _model(path: Path, *, mpp: float | None = 0.5, patch: int = 32, scale: float = 0.25) -> Path:
    torch.manual_seed(0)
    spec = model_spec(TrainConfig(patch_size=patch, scale=scale, n_patches=2, feature_width=8), n_classes=2,
                      channels=3, mpp=mpp)
    save_checkpoint(path, spec=spec, classes=["a", "b"], model=create_model(spec))
    return path


@pytest.fixture
def no_large_views(monkeypatch):
    """Fail the test if a slide's view resize is asked for more than a million pixels: the
    refusal must come from the header, before anything that size is allocated."""
    real = slides_mod.resize_in_bands

    def guarded(rows, shape, size, **kw):
        assert size[0] * size[1] <= 1_000_000 and shape[1] * size[1] <= 4_000_000, f"allocating {size} from {shape}"
        return real(rows, shape, size, **kw)

    monkeypatch.setattr(slides_mod, "resize_in_bands", guarded)


# ---------------------------------------------------------------------------- 4. microns per pixel


def test_4_a_slide_claiming_1000_microns_per_pixel_is_read_as_it_is_said_by_name_without_allocating(
        tmp_path, no_large_views):
    # no microscope's scale, so none (issue 66): read as it is, not upsampled 2000-fold or refused
    slide = _tiff(tmp_path / "huge-mpp.tif", mpp=1000.0)
    result = runner.invoke(app, ["predict", str(slide), "--model", str(SLIDES_MODEL)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "huge-mpp.tif:" in x and "µm/px" in x)
    assert "level 0 read as it is" in line and "scale unknown" in line and "1000 µm/px" in line, line
    assert "resolution tags" in line and "0.01-100" in line, line


def test_4_a_plausible_scale_whose_view_would_exceed_the_budget_is_refused_from_the_header(tmp_path, no_large_views):
    # 5 µm/px read at the model's 0.5: a 10x upsampled 5120x5120 level, a 1280x1280 view
    slide = _tiff(tmp_path / "coarse.tif", mpp=5.0)
    with pytest.raises(SlideReadError, match=r"coarse.tif: .*low-res view.*over the limit of 1,000,000"):
        open_input(slide, channels=3, scale=0.25, patch_size=(32, 32), mpp=0.5, max_pixels=1_000_000)


def test_4_a_slide_claiming_a_tiny_scale_is_read_as_it_is_rather_than_called_1x1_pixels(tmp_path):
    slide = _tiff(tmp_path / "tiny-mpp.tif", mpp=0.0001)
    opened = open_input(slide, channels=3, scale=0.25, patch_size=(32, 32), mpp=0.5)
    assert opened.source.size == (512, 512) and tuple(opened.low.shape) == (3, 128, 128)
    assert "scale unknown" in opened.reading and "0.0001 µm/px" in opened.reading and "0.01-100" in opened.reading


def test_4_mpp_0_means_off_as_the_help_says(tmp_path):
    slide = _tiff(tmp_path / "x.tif", mpp=0.25)
    model = _model(tmp_path / "m.pt")
    result = runner.invoke(app, ["predict", str(slide), "--model", str(model), "--mpp", "0"])
    assert result.exit_code == 0, result.output
    assert "1 predicted, 0 failed" in result.output and "read as it is" in result.output, result.output


def test_4_an_absurd_mpp_flag_is_refused_naming_the_flag(tmp_path):
    slide = _tiff(tmp_path / "x.tif", mpp=0.25)
    result = runner.invoke(app, ["predict", str(slide), "--model", str(_model(tmp_path / "m.pt")), "--mpp", "1000"])
    assert result.exit_code == 2, result.output
    assert "--mpp" in result.output and "0.01-100" in result.output, result.output


def test_4_a_png_saved_at_72_dpi_is_read_as_it_is(tmp_path, no_large_views):
    # decision: dpi of ordinary images is a print size, not a microscope's scale
    png = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)).save(png, dpi=(72, 72))
    opened = open_input(png, channels=3, scale=0.25, patch_size=(32, 32), mpp=0.5)
    assert opened.source.size == (512, 512) and tuple(opened.low.shape) == (3, 128, 128)


def test_4_patch_um_below_a_pixel_or_absurdly_large_is_one_line(tmp_path):
    slide = _tiff(tmp_path / "x.tif", mpp=0.5)
    records = [Record(slide, 0, "a")]
    with pytest.raises(ConfigError, match=r"--patch-um 0.001 is 0.002 pixels at 0.5 µm/px"):
        settle_physical_scale(TrainConfig(patch_um=0.001), records, print)
    with pytest.raises(ConfigError, match=r"--patch-um 1e\+06 is 2,000,000 pixels"):
        settle_physical_scale(TrainConfig(patch_um=1e6), records, print)


def test_4_training_refuses_an_absurd_mpp_flag_by_name(tmp_path):
    records = [Record(_tiff(tmp_path / "x.tif", mpp=0.5), 0, "a")]
    with pytest.raises(ConfigError, match=r"--mpp 1000 µm/px is outside the plausible 0.01-100"):
        settle_physical_scale(TrainConfig(mpp=1000.0), records, print)


def test_4_training_takes_a_72_dpi_slide_as_one_of_unknown_scale(tmp_path):
    # 72 dpi (352.8 µm/px) is a tool's default, no scale (issue 66, tests/test_tiff_scale.py): the
    # model records none, rather than one that resamples every slide it reads 700-fold
    records = [Record(_tiff(tmp_path / "dpi.tif", mpp=25_400 / 72, per_inch=True), 0, "a")]
    assert settle_physical_scale(TrainConfig(), records, print) is None
    with pytest.raises(ConfigError, match=r"--patch-um 32 needs the microns per pixel"):
        settle_physical_scale(TrainConfig(patch_um=32.0), records, print)


# ---------------------------------------------------------------------------- 5. symlink loops


def _class_tree(root: Path) -> Path:
    src = root / "src"
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(np.full((8, 8), 40 * i, np.uint8)).save(src / c / f"{c}{i}.png")
    return src


def test_5_a_symlink_loop_is_followed_once_and_no_image_changes_class(tmp_path):
    src = _class_tree(tmp_path)
    (src / "dog" / "loop").symlink_to("..")  # dog/loop -> src: a loop, and a way into cat/
    (src / "cat" / "again").symlink_to(".")  # cat/again -> cat itself
    ds = dataset_from_folder(src, tmp_path / "out", test_fraction=0.2)
    rows = [(r.path, r.label_name) for split in ds.splits.values() for r in split]
    assert len(rows) == 10, rows
    assert len({os.path.realpath(p) for p, _ in rows}) == 10
    assert all(Path(p).name.startswith(label) for p, label in rows), rows
    train_files = {os.path.realpath(r.path) for r in ds.splits["train"]}
    assert not train_files & {os.path.realpath(r.path) for r in ds.splits["test"]}


def test_5_one_file_linked_into_two_classes_is_refused_by_name(tmp_path):
    src = _class_tree(tmp_path)
    (src / "dog" / "which.png").symlink_to(src / "cat" / "cat0.png")
    with pytest.raises(DatasetError, match=r"cat0.png.*both.*cat.*dog"):
        dataset_from_folder(src, tmp_path / "out", test_fraction=0.2)


# ---------------------------------------------------------------------------- the smaller ones


def test_a_slide_replaced_by_another_of_the_same_size_and_mtime_gets_a_new_view(tmp_path):
    slide = _tiff(tmp_path / "s.tif", mpp=0.5, size=256, seed=1)
    cache = ViewCache(tmp_path / "cache")
    with open_image(slide) as s:
        first, _ = cache.view(s, 0.25)
    st = os.stat(slide)
    other = _tiff(tmp_path / "other.tif", mpp=0.5, size=256, seed=2)
    assert other.stat().st_size == st.st_size
    os.replace(other, slide)
    os.utime(slide, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open_image(slide) as s:
        second, _ = cache.view(s, 0.25)
        assert torch.equal(second, s.low_res_view(0.25))
    assert not torch.equal(first, second)


def test_an_unwritable_view_cache_is_one_warning_and_training_goes_on(tmp_path, capsys):
    slide = _tiff(tmp_path / "s.tif", mpp=0.5, size=256)
    (tmp_path / "file").write_text("not a directory")
    cache = ViewCache(tmp_path / "file" / "views")
    with open_image(slide) as s:
        low, mask = cache.view(s, 0.25)
        again, _ = cache.view(s, 0.25)
        assert torch.equal(low, s.low_res_view(0.25)) and torch.equal(again, low)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "view cache" in err and str(tmp_path / "file") in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert view_cache_for(tmp_path / "file" / "run") is None  # a run is told once, when it starts
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def write_squares(root, splits=(("train", 8), ("test", 4))):
    """A tiny two-class dataset of 32x32 images, a square of 255 (b) or 120 (a) somewhere:
    ``splits`` gives each split's image count. Also used by test_refusals and test_resume_data."""
    rows = {}
    rng = np.random.default_rng(0)
    for split, n in splits:
        (root / split).mkdir()
        rows[split] = []
        for i in range(n):
            img = np.zeros((32, 32), np.uint8)
            r, c = rng.integers(0, 16, 2)
            img[r:r + 16, c:c + 16] = 255 if i % 2 else 120
            Image.fromarray(img).save(root / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": "ab"[i % 2]})
    write_dataset(root, ["a", "b"], rows, hints={"channels": 1})
    return root


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    """A tiny two-class dataset: 8 training + 4 test 32x32 images."""
    return write_squares(tmp_path_factory.mktemp("squares"))


def square_cfg(data, out, **kw):
    """A small, fast training configuration for :func:`write_squares`' images."""
    base = dict(data=str(data), out=str(out), n_patches=2, patch_size=8, scale=0.25, feature_width=8,
                batch_size=4, epochs=2, workers=0, lr=3e-3, entropy=0.0, seed=0)
    base.update(kw)
    return resolve_config(None, **base)


_cfg = square_cfg


def test_a_full_disk_writing_last_pt_in_epoch_1_can_be_resumed_as_the_message_says(squares, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = train_mod.save_checkpoint

    def full_at_last(path, **kw):
        if Path(path).name == "last.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, **kw)

    with monkeypatch.context() as m:
        m.setattr(train_mod, "save_checkpoint", full_at_last)
        with pytest.raises(RunDirError, match="continue with --resume"):
            train(_cfg(squares, run), log=lambda _: None)
    assert (run / "best.pt").is_file() and (run / "epochs" / "epoch_001.pt").is_file()
    history = train(_cfg(squares, run), resume=True, log=lambda _: None)
    assert [h["epoch"] for h in history] == [1, 2]


def test_a_full_disk_before_any_checkpoint_does_not_advise_resume(squares, tmp_path, monkeypatch):
    def full(path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_mod, "save_checkpoint", full)
    with pytest.raises(RunDirError, match="--overwrite") as e:
        train(_cfg(squares, tmp_path / "run", epochs=1), log=lambda _: None)
    assert "--resume" not in str(e.value)


def test_resume_against_a_grown_training_set_is_refused(squares, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(squares, data)
    run = tmp_path / "run"
    train(_cfg(data, run, epochs=1), log=lambda _: None)
    ds = load_dataset(data)
    rows = {s: [{"path": str(r.path), "label": r.label_name} for r in recs] for s, recs in ds.splits.items()}
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(data / "train" / "new.png")
    rows["train"].append({"path": str(data / "train" / "new.png"), "label": "a"})
    write_dataset(data, ["a", "b"], rows, hints={"channels": 1})
    with pytest.raises(RunDirError, match=r"train.csv.*9 images.*8"):
        train(_cfg(data, run, epochs=2), resume=True, log=lambda _: None)


def test_resume_with_another_method_is_one_line(squares, tmp_path):
    run = tmp_path / "run"
    train(_cfg(squares, run, epochs=1), log=lambda _: None)
    result = runner.invoke(app, ["train", "--resume", str(run), "--epochs", "2", "--method", "uniform"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "method" in result.output and "'ats'" in result.output and "'uniform'" in result.output, result.output
    assert len(result.output.strip().splitlines()) <= 2, result.output


def test_a_directory_given_as_an_image_is_called_a_directory(tmp_path):
    (tmp_path / "d.png").mkdir()
    with pytest.raises(ImageReadError, match=r"d.png: is a directory"):
        read_image(tmp_path / "d.png")
    with pytest.raises(SlideReadError, match=r"d.png: is a directory"):
        open_image(tmp_path / "d.png")
    root = tmp_path / "ds"
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "x.png").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / "imgs" / "y.png")
    write_dataset(root, ["a"], {"train": [{"path": "imgs/x.png", "label": "a"}],
                                "test": [{"path": "imgs/y.png", "label": "a"}]})
    with pytest.raises(DatasetError, match=r"is a directory"):
        load_dataset(root)


def test_an_animated_gif_is_refused_by_name(tmp_path):
    frames = [Image.fromarray(np.full((16, 16), v, np.uint8)) for v in (0, 255)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageReadError, match=r"anim.gif: .*2 frames"):
        read_image(tmp_path / "anim.gif")


def test_exif_orientation_is_applied_as_photo_viewers_do(tmp_path):
    image = np.zeros((20, 40), np.uint8)  # 40 wide, 20 high; the top-left corner marked
    image[:5, :5] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    Image.fromarray(image).save(tmp_path / "phone.jpg", exif=exif, quality=100)
    shown = read_image(tmp_path / "phone.jpg")
    assert tuple(shown.shape) == (1, 40, 20)
    assert shown[0, :5, -5:].float().mean() > 200  # the mark is now at the top right
    opened = open_input(tmp_path / "phone.jpg", channels=1, scale=0.5, patch_size=(8, 8))
    assert tuple(opened.low.shape[-2:]) == (20, 10) and opened.source.size == (40, 20)


# ---------------------------------------------------------------------------- patches a network cannot read


def test_a_patch_smaller_than_the_feature_nets_window_is_one_line_naming_the_flag(tmp_path):
    """The paper's feature net (unpadded 7x7 and 3x3 convolutions) cannot read a 4x4 patch:
    said at the start in one line naming --patch-size, not as torch's traceback at the first step."""
    rows = {split: [] for split in ("train", "test")}
    for split in rows:
        for i in range(2):
            name = f"{split}{i}.png"
            Image.fromarray(np.full((64, 64), 60 * i, np.uint8)).save(tmp_path / name)
            rows[split].append({"path": name, "label": "ab"[i]})
    write_dataset(tmp_path, ["a", "b"], rows, hints={"channels": 1})
    result = runner.invoke(app, ["train", str(tmp_path), "--out", str(tmp_path / "run"), "--patch-size", "4",
                                 "--feature-net", "mnist-features", "--n-patches", "2", "--scale", "0.25",
                                 "--epochs", "1", "--workers", "0", "--batch-size", "2"])
    assert result.exit_code == 1, result.output
    assert "--patch-size 4: the feature network mnist-features cannot read 4x4 patches" in result.output
    lines = result.output.strip().splitlines()
    assert "Traceback" not in result.output and lines[0].startswith("settled from the data")
    # the reasons (indented), the prepared-images line, then the error: one line, the last, whole
    assert all(line.startswith("  ") or line.startswith("prepared images") for line in lines[1:-1]), lines
    assert "--patch-size 4: the feature network mnist-features cannot read 4x4 patches" in lines[-1]
    assert lines[-1].rstrip().endswith("give larger patches or another --feature-net")
