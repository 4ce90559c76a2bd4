"""`ats visualize`: both figures are written and open as images of a sensible size; digit
boxes are found in a dataset CSV; epochs are chosen and capped; errors exit 1 or 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.checkpoint import save_checkpoint
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.models import create_model, model_spec
from ats_cli.render.figure import MAX_STRIP
from ats_cli.render.records import patch_sites
from ats_cli.visualize import find_image_info, render_attention, sample_attention, select_epochs

runner = CliRunner()


def make_model(path: Path, *, seed: int = 0, replace: bool = False) -> Path:
    """An untrained model: 16x16 patches, scale 0.25, 4 patches, classes cat/dog/eel."""
    torch.manual_seed(seed)
    spec = model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8, replace=replace),
                      n_classes=3, channels=1)
    model = create_model(spec)
    torch.nn.init.normal_(model.attention_net.score.weight, std=0.5)  # not uniform: something to draw
    save_checkpoint(path, spec=spec, classes=["cat", "dog", "eel"], model=model)
    return path


def png(path: Path, seed: int, size: tuple[int, int] = (128, 128)) -> Path:
    """A random grayscale image of size (width, height)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0]), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A dataset laid out like the generators write it: DATA/test.csv, DATA/test/*.png."""
    root = tmp_path / "data"
    png(root / "test" / "00000.png", 0)
    png(root / "test" / "00001.png", 1, size=(160, 96))
    digits = json.dumps([[3, 10, 20, 28, 28], [3, 70, 90, 28, 28]])
    (root / "test.csv").write_text(f'path,label,digits\ntest/00000.png,cat,"{digits.replace(chr(34), chr(34) * 2)}"\n'
                                   "test/00001.png,dog,\n")
    return root


def opens(path: Path, min_size: tuple[int, int]) -> tuple[int, int]:
    with Image.open(path) as im:
        im.load()
        assert im.format == "PNG"
        assert im.width >= min_size[0] and im.height >= min_size[1], im.size
        assert im.width <= 4000 and im.height <= 4000, im.size
        return im.size


def test_attention_figure(tmp_path, data):
    model = make_model(tmp_path / "model.pt")
    out = tmp_path / "figs" / "attention.png"
    result = runner.invoke(app, ["visualize", str(data / "test" / "00000.png"), "--model", str(model),
                                 "--out", str(out), "--n-patches", "6", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "predicted" in result.output and "label cat" in result.output and "2 boxes marked" in result.output
    opens(out, (600, 600))
    # a non-square image, many patches (two rows in the strip), no CSV entry for the boxes
    other = png(tmp_path / "loose.png", 5, size=(160, 96))
    summary = render_attention(model, other, tmp_path / "b.png", n_patches=14, device="cpu")
    assert summary.label is None and summary.n_boxes == 0 and summary.prediction in ("cat", "dog", "eel")
    opens(summary.out, (600, 300))


def test_patch_sites_are_distinct_locations_heaviest_first():
    offsets = [[0, 0], [5, 5], [0, 0], [9, 1], [5, 5], [0, 0]]
    attention = [0.2, 0.3, 0.2, 0.05, 0.3, 0.2]
    # with replacement every draw weighs 1/n: a place drawn three times outweighs one drawn twice
    sites = patch_sites(offsets, attention, [1 / 6] * 6)
    assert [(s.row, s.col) for s in sites] == [(0, 0), (5, 5), (9, 1)]
    assert [s.draws for s in sites] == [(1, 3, 6), (2, 5), (4,)] and [s.index for s in sites] == [0, 1, 3]
    assert [round(s.weight * 6) for s in sites] == [3, 2, 1] and sites[0].attention == 0.2
    # without weights the attention ranks them, each place counted once; ties keep draw order
    assert [(s.row, s.col, s.weight) for s in patch_sites(offsets, attention)] == [(5, 5, 0.3), (0, 0, 0.2),
                                                                                     (9, 1, 0.05)]
    ties = patch_sites([[1, 1], [2, 2], [3, 3]], [0.1, 0.1, 0.1], [0.4, 0.5, 0.4])
    assert [(s.row, s.col) for s in ties] == [(2, 2), (1, 1), (3, 3)]


def test_attention_figure_boxes_distinct_places_and_orders_the_strip_by_weight(tmp_path, data):
    """With replacement, 200 draws land on fewer places: one box per place, and the strip
    shows the MAX_STRIP most drawn (the estimator weights 1/n per draw), most first."""
    from ats_cli.predict import load_predictor

    model = make_model(tmp_path / "model.pt", replace=True)
    image = data / "test" / "00000.png"
    summary = render_attention(model, image, tmp_path / "many.png", n_patches=200, seed=1)
    predictor = load_predictor(model, "cpu")
    net = predictor.model
    opened = predictor.opener()(image, channels=1, scale=net.scale, patch_size=net.patch_size)
    offsets = [tuple(o) for o in sample_attention(predictor, opened, n_patches=200, seed=1,
                                            return_patches=False).offsets[0].tolist()]
    counts = {o: offsets.count(o) for o in offsets}
    assert 16 < summary.n_sites == len(counts) < 200  # the repeats are drawn once
    assert len(summary.strip) == MAX_STRIP and len(set(summary.strip)) == MAX_STRIP
    drawn = [counts[o] for o in summary.strip]
    assert drawn == sorted(drawn, reverse=True) and drawn[0] == max(counts.values())
    assert min(drawn) >= max(c for o, c in counts.items() if o not in summary.strip)
    first = {o: offsets.index(o) for o in counts}  # equal counts: the earlier draw first
    assert all(first[a] < first[b] for a, b in zip(summary.strip, summary.strip[1:], strict=False)
               if counts[a] == counts[b])
    opens(summary.out, (600, 600))


def test_evolution_figure(tmp_path, data):
    run_dir = tmp_path / "run"
    (run_dir / "epochs").mkdir(parents=True)
    for epoch in (1, 2, 3):
        make_model(run_dir / "epochs" / f"epoch_{epoch:03d}.pt", seed=epoch)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e, "test_acc": e / 10}) + "\n"
                                                   for e in (1, 2, 3)))
    out = tmp_path / "evolution.png"
    result = runner.invoke(app, ["visualize", str(run_dir), "--image", str(data / "test" / "00000.png"),
                                 "--out", str(out), "--epochs", "1,3"])
    assert result.exit_code == 0, result.output
    assert "epochs 1, 3" in result.output and "2 boxes marked" in result.output
    width, height = opens(out, (600, 300))
    assert width > height  # panels side by side
    result = runner.invoke(app, ["visualize", str(run_dir), "--image", str(data / "test" / "00001.png"),
                                 "--out", str(out), "--data", str(data)])
    assert result.exit_code == 0, result.output
    assert "epochs 1, 2, 3" in result.output and "label dog" in result.output


def test_select_epochs():
    assert select_epochs("all", [1, 2, 3]) == [1, 2, 3]
    many = select_epochs(None, list(range(1, 21)))
    assert len(many) == 8 and many[0] == 1 and many[-1] == 20 and many == sorted(set(many))
    assert select_epochs("5, 1,last", [1, 5, 9]) == [1, 5, 9]
    with pytest.raises(ValueError, match="epoch 4 has no checkpoint"):
        select_epochs("1,4", [1, 2, 3])
    with pytest.raises(ValueError, match="not an epoch number"):
        select_epochs("first", [1, 2, 3])


def test_find_image_info(data, tmp_path):
    info = find_image_info(data / "test" / "00000.png")
    assert info is not None and info.label == "cat" and info.csv == data / "test.csv"
    assert [(b.cls, b.row, b.col, b.h, b.w) for b in info.boxes] == [("3", 10, 20, 28, 28), ("3", 70, 90, 28, 28)]
    assert find_image_info(data / "test" / "00001.png", data / "test.csv").boxes == []
    assert find_image_info(png(tmp_path / "elsewhere.png", 0)) is None


def test_errors(tmp_path, data):
    model = make_model(tmp_path / "model.pt")
    image = data / "test" / "00000.png"
    out = tmp_path / "x.png"

    def code(*args):
        result = runner.invoke(app, ["visualize", *map(str, args), "--out", str(out)])
        return result.exit_code, result.stderr

    status, err = code(image)  # no --model
    assert status == 2 and "--model" in err
    status, err = code(tmp_path / "data")  # a directory without --image
    assert status == 2 and "--image" in err
    status, err = code(tmp_path / "data", "--image", image)  # not a run directory
    assert status == 2 and "no epochs/epoch_NNN.pt" in err
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00" * 100)
    status, err = code(image, "--model", junk)
    assert status == 2 and str(junk) in err
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"garbage")
    status, err = code(broken, "--model", model)
    assert status == 1 and str(broken) in err
    assert not out.exists()


def test_a_model_with_a_patch_gain_ranks_the_patches_by_weight_times_gain(tmp_path):
    """The released slides model has a learned gain (--patch-gain): a nest patch of small
    attention can carry the call. On sample 0001 (three nests) the two patches ranked first
    are on nests, the order of weight x gain; by weight alone a decoy came second."""
    import csv

    root = Path(__file__).resolve().parents[1]
    samples = root / "sample_data" / "synthetic-slides"
    row = next(r for r in csv.DictReader(open(samples / "test.csv")) if r["path"].endswith("0001.tif"))
    boxes = [b[1:] for b in json.loads(row["boxes"])]
    summary = render_attention(root / "models" / "synthetic-slides-ats.pt", samples / "0001.tif",
                               tmp_path / "gain.png", seed=0, data=samples / "test.csv")

    def on_nest(offset) -> bool:
        r, c = offset
        return any(r < br + bh and r + 64 > br and c < bc + bw and c + 64 > bc for br, bc, bh, bw in boxes)

    assert [on_nest(o) for o in summary.strip[:2]] == [True, True]
    opens(summary.out, (600, 600))


def test_a_counts_model_ranks_the_patches_by_what_they_add_to_the_counts(tmp_path):
    """The released Megapixel MNIST model pools counts: a draw's share in the figure is its
    estimator weight x its vote's total / max(M, floor), as the model's output reports it,
    and these shares add up to the counts the prediction was made from (the sum of
    exp(logits)); the figure's strip is in the order of those shares."""
    from ats_cli.predict import load_predictor

    root = Path(__file__).resolve().parents[1]
    model, image = root / "models" / "megapixel-mnist-ats.pt", root / "sample_data" / "megapixel-mnist" / "00001.png"
    predictor = load_predictor(model, "cpu")
    net = predictor.model
    opened = predictor.opener()(image, channels=1, scale=net.scale, patch_size=net.patch_size)
    result = sample_attention(predictor, opened, n_patches=None, seed=0, return_patches=True)
    weights, shares = result.weights.double(), result.contributions.double()
    assert float((shares / weights.clamp_min(1e-12)).max()) <= 1 / net.pooling.floor + 1e-9
    counts = result.logits.double().exp().sum()
    assert torch.allclose(shares.sum(), counts, rtol=1e-4), (shares.sum(), counts)
    summary = render_attention(predictor, image, tmp_path / "counts.png", seed=0)
    offsets = [tuple(o) for o in result.offsets[0].tolist()]
    share = {o: sum(float(s) for p, s in zip(offsets, shares[0], strict=True) if p == o) for o in summary.strip}
    assert [share[o] for o in summary.strip] == sorted(share.values(), reverse=True)
    opens(summary.out, (600, 600))
