"""ats pretrain: the patches it learns from are labelled right, both stages do what they
are for, and what it writes is a checkpoint ``ats train --set init=CKPT`` starts from and ``ats
export`` reads. Offline: bundled digits, a small generated dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint, load_model
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.data import load_dataset
from ats_cli.data.megapixel_mnist import generate_megapixel_mnist, make_config
from ats_cli.data.mnist import load_bundled_digits
from ats_cli.pretrain import PretrainError
from ats_cli.pretrain.attention import attention_masses, attention_targets
from ats_cli.pretrain.examples import read_all, read_example
from ats_cli.pretrain.patches import SMALL_GAP, SMALL_PATCHES, SMALL_SCALE, patch_label, shrunken_digits
from ats_cli.pretrain.regions import row_regions
from ats_cli.pretrain.run import PretrainOptions, pretrain
from ats_cli.pretrain.stage1 import uniform_loss
from ats_cli.train import train

NETS = {"attention_net": "block-attention", "attention_width": 16, "feature_width": 16}
SMALL = {"images": 12, "test_images": 4, "workers": 1, "device": "cpu", **NETS}
DIGITS = [str(c) for c in range(10)]
runner = CliRunner()


def _data(root: Path, n_noise: int) -> Path:
    config = make_config("small", n_train=12, n_test=4, width=300, height=300, n_noise=n_noise, seed=0,
                         noise="fragments,glyphs")
    generate_megapixel_mnist(root, config, load_bundled_digits(), workers=1)
    return root


def _boxes(rec) -> list[list[int]]:
    return row_regions(dict(rec.extra), "digits", DIGITS, str(rec.path))


def test_patch_labels() -> None:
    box = [[7, 100, 100, 28, 28]]
    assert patch_label(90, 90, 50, box) == 7  # whole digit inside
    assert patch_label(200, 200, 50, box) == 10  # nowhere near: none
    assert patch_label(114, 90, 50, box) is None  # half the digit: left out
    assert patch_label(90, 90, 50, [*box, [3, 110, 125, 28, 28]]) is None  # two digits meet
    assert patch_label(100, 126, 50, box) == 10  # 2 of 28 columns inside: at most TOUCH
    assert patch_label(200, 200, 50, [[1, 100, 100, 28, 28]], none=2) == 2  # none is the index after the classes


def test_patches_from_clean_images_hold_digits_or_nothing(tmp_path: Path) -> None:
    """Without noise a 'none' patch must be black and a digit patch must hold the whole digit
    of its class: the labels are what the pixels show."""
    data = load_dataset(_data(tmp_path / "clean", n_noise=0))
    seen = set()
    for rec in data["train"]:
        boxes = _boxes(rec)
        patches, labels = read_example(str(rec.path), boxes, 50, seed=rec.line)[:2]
        image = np.asarray(Image.open(rec.path))
        cut = len(labels) - SMALL_PATCHES  # the shrunken-digit negatives come last
        for patch in patches[cut:]:
            assert patch.max() > 0 and not any(_contains(patch, image[r : r + h, c : c + w])
                                               for _, r, c, h, w in boxes)
        assert (labels[cut:] == 10).all()
        for patch, label in zip(patches[:cut], labels[:cut], strict=True):
            seen.add(int(label))
            if label == 10:
                assert patch.max() == 0
            else:
                digits = [image[r : r + h, c : c + w] for k, r, c, h, w in boxes if k == label]
                assert any(d.sum() and _contains(patch, d) for d in digits)
    assert 10 in seen and len(seen) > 3


def test_shrunken_digits_are_small_and_from_the_image() -> None:
    """A shrunken-digit negative holds the image's digit at SMALL_SCALE of its size, on the
    given base patch, and nothing bigger: a whole-size digit labelled "none" would teach the
    feature net to miss real digits."""
    image = np.zeros((100, 100), np.uint8)
    image[34:54, 50:56] = 255  # a "1": 20 px tall, 6 wide, in a 28x28 box
    base = np.zeros((50, 50), np.uint8)
    base[0, :] = 99  # the base's own pixels are kept
    tall = []
    for seed in range(40):
        out = shrunken_digits(image, [[1, 30, 40, 28, 28]], base, np.random.default_rng(seed), count=1)
        assert (out[0] >= 99).all()
        rows = np.flatnonzero((out[1:] > 127).any(1))
        assert rows.size  # the digit is there ...
        tall.append(rows.max() - rows.min() + 1)
    lo, hi = SMALL_SCALE
    # ... at 0.3-0.6 of its 20 px height, both ends of the range drawn
    assert round(20 * lo) - 1 <= min(tall) <= round(20 * lo) + 2
    assert round(20 * hi) - 2 <= max(tall) <= round(20 * hi) + 1
    from skimage.measure import label as components

    def pieces(count: int, seed: int, adjacent: bool = False) -> np.ndarray:
        out = shrunken_digits(image, [[1, 30, 40, 28, 28]], np.zeros((50, 50), np.uint8),
                              np.random.default_rng(seed), count=count, adjacent=adjacent)
        return components(out > 0, connectivity=2)

    assert all(pieces(1, seed).max() == 1 for seed in range(20))
    assert sum(pieces(2, seed).max() == 2 for seed in range(20)) >= 15  # two copies (unless they overlap)
    # side by side: the two copies' centres SMALL_GAP times the sum of their ink radii apart
    # (they may touch: then one piece), in varied directions, never scattered
    ratios, directions = [], set()
    for seed in range(40):
        lab = pieces(2, seed, adjacent=True)
        if lab.max() != 2:
            continue
        boxes = [np.argwhere(lab == k) for k in (1, 2)]
        centres = [(b.min(0) + b.max(0)) / 2 for b in boxes]
        radii = [(b.max(0) - b.min(0)).max() / 2 + 0.5 for b in boxes]
        d = centres[1] - centres[0]
        ratios.append(float(np.hypot(*d)) / sum(radii))
        directions.add((int(np.sign(round(d[0] / 3))), int(np.sign(round(d[1] / 3)))))
    lo, hi = SMALL_GAP
    assert len(ratios) >= 20 and lo - 0.15 <= min(ratios) and max(ratios) <= hi + 0.15, ratios
    assert len(directions) >= 3  # stacked, side by side, diagonal


def _contains(patch: np.ndarray, digit: np.ndarray) -> bool:
    h, w = digit.shape
    return any(np.array_equal(patch[r : r + h, c : c + w], digit)
               for r in range(patch.shape[0] - h + 1) for c in range(patch.shape[1] - w + 1))


def test_pretrain_command_writes_a_checkpoint_ats_train_starts_from(tmp_path: Path) -> None:
    data = _data(tmp_path / "mix", n_noise=6)
    pre = tmp_path / "pre.pt"
    nets = ["--attention-net", "block-attention", "--attention-width", "16", "--feature-width", "16"]
    # a dataset that is not there, a column that is not there: one line naming it, nothing written
    result = runner.invoke(app, ["pretrain", str(tmp_path / "nowhere"), "--out", str(pre)])
    assert result.exit_code == 1 and "nowhere" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["pretrain", str(data), "--out", str(pre), "--regions", "boxes", "--workers", "0"])
    assert result.exit_code == 1 and "train.csv:" in result.output and "'boxes'" in result.output, result.output
    result = runner.invoke(app, ["pretrain", str(data), "--out", str(pre), "--pooling", "features"])
    assert result.exit_code == 2 and "--none-class on needs pooling votes" in result.output
    assert "topmost-counts" in result.output and "pooling features has no per-patch vote" in result.output
    assert not pre.exists()
    result = runner.invoke(app, ["pretrain", str(data), "--out", str(pre), "--images", "12", "--test-images", "4",
                                 "--epochs", "1", "--workers", "1", *nets])
    assert result.exit_code == 0, result.output
    out = result.output.splitlines()
    # stage 1b (on by default) reports the attention's mass on the digits of the test split
    attention = [line for line in out if line.startswith("attention on ")]
    assert len(attention) == 1 and str(data) in attention[0] and "mass on the digits" in attention[0]
    ckpt = load_checkpoint(pre)
    assert ckpt["classes"] == DIGITS and ckpt["pretrain"]["patches"] > 12
    assert ckpt["pretrain"]["shrunken"] == SMALL_PATCHES and ckpt["pretrain"]["regions"] == "digits"
    # the recipe's reading by default: counts with the none logit
    assert ckpt["spec"]["pooling"]["name"] == "counts" and ckpt["spec"]["pooling"]["none_class"] is True
    # the share of "none" among the training patches, for ats export --none-prior:
    # a count of patches over the count of all of them
    share = ckpt["pretrain"]["none_share"]
    assert 0 < share < 1 and round(share * ckpt["pretrain"]["patches"], 6).is_integer()
    assert ckpt["spec"]["gain"] is None and not any(k.startswith("gain.") for k in ckpt["model"])
    lines: list[str] = []
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), init=str(pre), epochs=1, lr=1e-12, workers=0,
                      batch_size=4, attention_net="block-attention", attention_width=16, feature_width=16,
                      scale=0.2, pooling="counts", none_class="on")
    train(cfg, log=lines.append)
    assert any("initialised the model from" in line for line in lines)
    tuned = load_checkpoint(tmp_path / "run" / "last.pt")["model"]
    # ~0 learning rate: the run kept the pretrained feature net and classifier
    for key in ("feature_net.body.0.weight", "classifier.weight", "classifier.bias"):
        assert torch.allclose(tuned[key], ckpt["model"][key], atol=1e-6), key
    # and a wrong network flag is refused, naming the file
    with pytest.raises(Exception, match="pre.pt"):
        train(TrainConfig(data=str(data), out=str(tmp_path / "run2"), init=str(pre), epochs=1, workers=0,
                          scale=0.2), log=lines.append)


def test_the_same_options_give_the_same_checkpoint(tmp_path: Path) -> None:
    """The seeds decide everything: two runs, one reading images in two worker processes,
    write the same weights (a model can be made again from its recipe)."""
    data = _data(tmp_path / "mix", n_noise=6)
    for name, workers in (("a", 1), ("b", 2)):
        pretrain(PretrainOptions(data=str(data), out=str(tmp_path / f"{name}.pt"), epochs=1, attention_epochs=1,
                                 **{**SMALL, "workers": workers}), log=lambda line: None)
    a, b = (load_checkpoint(tmp_path / f"{n}.pt")["model"] for n in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _test_patches(data: Path) -> tuple[torch.Tensor, np.ndarray]:
    """The test images' real patches (no shrunken ones) as floats [n, 1, 50, 50], and labels."""
    patches, labels = [], []
    for rec in load_dataset(data)["test"]:
        p, y = read_example(str(rec.path), _boxes(rec), 50, seed=rec.line, shrunken=0)[:2]
        patches.append(p)
        labels.append(y)
    return torch.from_numpy(np.concatenate(patches))[:, None].float() / 255.0, np.concatenate(labels)


def test_attention_targets_weigh_each_digit_alike(tmp_path: Path) -> None:
    """Stage 1b's target: every digit of the image gets the same mass, over cells ats train
    may sample whose patch (cut where ats train would cut it) holds that digit whole."""
    from ats_cli.config import settle, usable_hints
    from ats_cli.core.source import positions_to_offsets
    from ats_cli.data.facts import DataFacts
    from ats_cli.data.megapixel_mnist import box_fractions
    from ats_cli.models import create_model, model_spec
    from ats_cli.render.records import parse_boxes

    data = load_dataset(_data(tmp_path / "mix", n_noise=6))
    cfg = TrainConfig(data=str(data.root), attention_net="block-attention", attention_width=16, feature_width=16,
                      scale=0.2, min_brightness=0.15)
    cfg = settle(cfg, DataFacts(hints=usable_hints(data.hints)))[0].config  # the dataset's sizes, as ats train
    model = create_model(model_spec(cfg, n_classes=10, channels=1))
    views, cells = read_all(data["train"], data.classes, 50, 0, 1, "train", 0, (0.2, (60, 60), 0))[2:]
    assert views.shape == (12, 60, 60)
    targets = attention_targets(model, views, cells, (60, 60))
    corners = positions_to_offsets(torch.arange(3600)[None], (60, 60), (300, 300), (50, 50))[0].numpy()
    for view, rec, (idx, prob, digit) in zip(views, data["train"], targets, strict=True):
        boxes = [box for _, *box in parse_boxes(rec.extra["digits"])]
        assert np.isclose(prob.sum(), 1.0)
        per_digit = np.bincount(digit, weights=prob)
        assert len(set(digit)) >= 4 and np.allclose(per_digit[per_digit > 0], 1.0 / len(set(digit)))
        assert (box_fractions(corners[idx], boxes, (50, 50))[np.arange(len(idx)), digit] == 1.0).all()
        support = model.sampling_support(torch.from_numpy(view.astype(np.float32))[None, None], (60, 60))
        assert support is not None and support.flatten()[torch.from_numpy(idx)].all()


def test_attention_stage_puts_the_mass_on_the_digits(tmp_path: Path) -> None:
    """--attention-epochs: the checkpoint's attention net puts most of its mass on the digits'
    cells of images it was not taught on (at the start: the share of bright cells they hold).
    How evenly it spreads that mass over the digits is measured, not asserted: the target
    is even, the fit is not."""
    data = load_dataset(_data(tmp_path / "mix", n_noise=20))  # most bright cells are noise
    views, cells = read_all(data["test"], data.classes, 50, 0, 1, "test", 0, (0.2, (60, 60), 0))[2:]
    masses = {}
    for epochs in (0, 40):
        pre = tmp_path / f"att{epochs}.pt"
        pretrain(PretrainOptions(data=str(data.root), out=str(pre), epochs=1, attention_epochs=epochs, lr=0.01,
                                 **SMALL), log=lambda line: None)
        model, ckpt = load_model(pre)
        assert ckpt["pretrain"]["attention_epochs"] == epochs
        targets = attention_targets(model, views, cells, (60, 60))
        masses[epochs] = attention_masses(model, views, targets, (60, 60), "cpu")[0]
    assert np.median(masses[0]) < 0.5 < np.median(masses[40]), masses


def test_uniform_loss_is_least_when_the_ten_logits_are_equal() -> None:
    equal = torch.full((3, 10), 2.5, requires_grad=True)
    loss = uniform_loss(equal)
    loss.backward()
    assert loss.item() == pytest.approx(np.log(10)) and equal.grad.abs().max() < 1e-7
    assert uniform_loss(torch.randn(3, 10)).item() > np.log(10)


def _none_votes(ckpt_path: Path, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """Top softmax p of the checkpoint's classifier rows (ats train's start) on the test
    images' none patches (and on their digit patches)."""
    model, _ = load_model(ckpt_path)
    model.eval()
    x, y = _test_patches(data)
    with torch.no_grad():
        probs = model.classifier(model.patch_features(x)).softmax(1).numpy()
    return probs[y == 10].max(1), probs[y < 10].max(1)


def test_none_uniform_stops_none_patches_voting(tmp_path: Path) -> None:
    """--none-uniform: the ten digit rows the checkpoint hands to ats train give a "none"
    patch (nearly) equal logits: no vote. Without it they lean to some digit."""
    data = _data(tmp_path / "noisy", n_noise=20)
    votes = {}
    for weight in (0.0, 5.0):
        pre = tmp_path / f"w{weight}.pt"
        pretrain(PretrainOptions(data=str(data), out=str(pre), epochs=6, batch_size=16, lr=0.01, attention_epochs=0,
                                 shrunken=0, none_uniform=weight, **SMALL), log=lambda line: None)
        votes[weight] = _none_votes(pre, data)
    off, on = np.median(votes[0.0][0]), np.median(votes[5.0][0])
    # above uniform (0.1): 0.21 without, 0.12 with the loss when written
    assert on - 0.1 < (off - 0.1) / 3, (on, off)


def test_a_corrupt_image_is_skipped_once_and_the_rest_trains(tmp_path: Path, capsys) -> None:
    """Both stages read each image once: a damaged one gives one line naming it, and the
    patches and views of the others still train both stages."""
    data = _data(tmp_path / "clean", n_noise=0)
    bad = sorted((data / "train").glob("*.png"))[3]
    bad.write_bytes(bad.read_bytes()[:200])
    pre = tmp_path / "pre.pt"
    pretrain(PretrainOptions(data=str(data), out=str(pre), epochs=1, batch_size=16, attention_epochs=1, **SMALL),
             log=lambda line: None)
    err = capsys.readouterr().err
    assert err.count("skipped:") == 1 and bad.name in err, err
    assert load_checkpoint(pre)["pretrain"]["attention_epochs"] == 1


def test_none_class_keeps_the_none_row_so_noise_votes_little(tmp_path: Path) -> None:
    """--pooling votes --none-class on: the checkpoint's model has the stage's "none" row as
    its per-patch "no class here" logit, so a none patch's vote (the classes' share of its
    softmax, the pooling's values) is small and a digit patch's is not; without the row
    every patch's vote sums to 1. The flag without votes or counts is refused."""
    data = _data(tmp_path / "noisy", n_noise=20)
    pre = tmp_path / "none.pt"
    pretrain(PretrainOptions(data=str(data), out=str(pre), epochs=6, batch_size=16, lr=0.01, attention_epochs=0,
                             shrunken=0, pooling="votes", none_class="on", **SMALL), log=lambda line: None)
    model, ckpt = load_model(pre)
    assert ckpt["spec"]["pooling"] == {"name": "votes", "none_class": True}
    model.eval()
    x, y = _test_patches(data)
    with torch.no_grad():
        # a patch's whole vote
        vote = model.pooling.values(model.patch_features(x)[:, None], model.classifier)[:, 0].sum(-1).numpy()
    # after 6 epochs on 12 images: none patches a median 0.33 of a vote, digit patches 0.78
    assert np.median(vote[y == 10]) < 0.45 < 0.65 < np.median(vote[y < 10]), (vote[y == 10], vote[y < 10])
    with pytest.raises(PretrainError, match="needs pooling .*highest-counts.*pooling features has no per-patch vote"):
        pretrain(PretrainOptions(data=str(data), out=str(tmp_path / "x.pt"), pooling="features", none_class="on"))


def test_options_the_model_cannot_take_are_refused_in_one_line(tmp_path: Path) -> None:
    data = _data(tmp_path / "clean", n_noise=0)
    for args, says, code in ((["--attention-net", "foo"], "unknown network 'foo'", 1),
                             (["--lr", "0"], "--lr must be > 0", 2),
                             (["--none-class", "maybe"], "--none-class must be one of", 2)):
        result = runner.invoke(app, ["pretrain", str(data), "--out", str(tmp_path / "x.pt"), *args])
        assert result.exit_code == code and says in result.output and "Traceback" not in result.output, args
    assert not (tmp_path / "x.pt").exists()
