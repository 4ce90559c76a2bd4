"""tools/pretrain_mnist_features.py: the patches it learns from are labelled right, and what
it writes is a checkpoint ``ats train --init`` starts from (feature net and classifier as
pretrained, attention fresh). Offline: bundled digits, a small generated dataset."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ats_cli.checkpoint import load_checkpoint
from ats_cli.config import TrainConfig
from ats_cli.data import load_dataset
from ats_cli.data.megapixel_mnist import generate_megapixel_mnist, make_config
from ats_cli.data.mnist import load_bundled_digits
from ats_cli.train import train

ROOT = Path(__file__).resolve().parents[1]
NETS = ["--attention-net", "block-attention", "--attention-width", "16", "--feature-width", "16"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("pretrain_tool", ROOT / "tools" / "pretrain_mnist_features.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(root: Path, n_noise: int) -> Path:
    config = make_config("small", n_train=12, n_test=4, width=300, height=300, n_noise=n_noise, seed=0,
                         noise="fragments,glyphs")
    generate_megapixel_mnist(root, config, load_bundled_digits(), workers=1)
    return root


def test_patch_labels(tool) -> None:
    box = [[7, 100, 100, 28, 28]]
    assert tool._label(90, 90, 50, box) == 7  # whole digit inside
    assert tool._label(200, 200, 50, box) == 10  # nowhere near: none
    assert tool._label(114, 90, 50, box) is None  # half the digit: left out
    assert tool._label(90, 90, 50, [*box, [3, 110, 125, 28, 28]]) is None  # two digits meet
    assert tool._label(100, 126, 50, box) == 10  # 2 of 28 columns inside: at most TOUCH


def test_patches_from_clean_images_hold_digits_or_nothing(tool, tmp_path: Path) -> None:
    """Without noise a 'none' patch must be black and a digit patch must hold the whole digit
    of its class: the labels are what the pixels show."""
    data = load_dataset(_data(tmp_path / "clean", n_noise=0))
    seen = set()
    for rec in data["train"]:
        boxes = tool._boxes(dict(rec.extra), str(rec.path), data.classes)
        patches, labels = tool.read_example(str(rec.path), boxes, 50, seed=rec.line)[:2]
        image = np.asarray(Image.open(rec.path))
        cut = len(labels) - tool.SMALL_PATCHES  # the shrunken-digit negatives come last
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


def test_shrunken_digits_are_small_and_from_the_image(tool) -> None:
    """A shrunken-digit negative holds the image's digit at SMALL_SCALE of its size, on the
    given base patch, and nothing bigger: a whole-size digit labelled "none" would teach the
    feature net to miss real digits."""
    image = np.zeros((100, 100), np.uint8)
    image[30:58, 40:68] = 0
    image[34:54, 50:56] = 255  # a "1": 20 px tall, 6 wide, in a 28x28 box
    base = np.zeros((50, 50), np.uint8)
    base[0, :] = 99  # the base's own pixels are kept
    tall = []
    for seed in range(40):
        out = tool.shrunken_digits(image, [[1, 30, 40, 28, 28]], base, np.random.default_rng(seed), count=1)
        assert (out[0] >= 99).all()
        rows = np.flatnonzero((out[1:] > 127).any(1))
        assert rows.size  # the digit is there ...
        tall.append(rows.max() - rows.min() + 1)
    lo, hi = tool.SMALL_SCALE
    # ... at 0.3-0.6 of its 20 px height, both ends of the range drawn
    assert round(20 * lo) - 1 <= min(tall) <= round(20 * lo) + 2
    assert round(20 * hi) - 2 <= max(tall) <= round(20 * hi) + 1
    from skimage.measure import label as components

    def pieces(count: int, seed: int, adjacent: bool = False) -> np.ndarray:
        out = tool.shrunken_digits(image, [[1, 30, 40, 28, 28]], np.zeros((50, 50), np.uint8),
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
    lo, hi = tool.SMALL_GAP
    assert len(ratios) >= 20 and lo - 0.15 <= min(ratios) and max(ratios) <= hi + 0.15, ratios
    assert len(directions) >= 3  # stacked, side by side, diagonal


def _contains(patch: np.ndarray, digit: np.ndarray) -> bool:
    h, w = digit.shape
    return any(np.array_equal(patch[r : r + h, c : c + w], digit)
               for r in range(patch.shape[0] - h + 1) for c in range(patch.shape[1] - w + 1))


def test_checkpoint_starts_ats_train(tool, tmp_path: Path, capsys) -> None:
    data = _data(tmp_path / "mix", n_noise=6)
    pre = tmp_path / "pre.pt"
    with pytest.raises(SystemExit, match="nowhere"):  # a --check set that is not there: refused before training
        tool.main([str(data), str(pre), "--check", str(tmp_path / "nowhere"), *NETS])
    assert not pre.exists()
    tool.main([str(data), str(pre), "--images", "12", "--test-images", "4", "--epochs", "1", "--workers", "1",
               "--check", str(data), "--check-images", "3", *NETS])
    # the check line names the set and its noise, and counts only real patches (no shrunken ones)
    out = capsys.readouterr().out.splitlines()
    check = [line for line in out if line.startswith("check ")]
    assert len(check) == 1 and str(data) in check[0] and "(noise fragments,glyphs)" in check[0]
    # stage 1b (on by default) reports the attention's mass on the digits: the test split, then the check set
    attention = [line for line in out if line.startswith("attention on ")]
    assert len(attention) == 2 and all(str(data) in line and "mass on the digits" in line for line in attention)
    ckpt = load_checkpoint(pre)
    assert ckpt["classes"] == [str(c) for c in range(10)] and ckpt["pretrain"]["patches"] > 12
    assert ckpt["pretrain"]["shrunken"] == tool.SMALL_PATCHES
    # the share of "none" among the training patches, for tools/release_model.py --none-prior:
    # a count of patches over the count of all of them
    share = ckpt["pretrain"]["none_share"]
    assert 0 < share < 1 and round(share * ckpt["pretrain"]["patches"], 6).is_integer()
    assert ckpt["spec"]["patch_gain"] is False and "gain.weight" not in ckpt["model"]  # no --patch-gain: none
    lines: list[str] = []
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), init=str(pre), epochs=1, lr=1e-12, workers=0,
                      batch_size=4, attention_net="block-attention", attention_width=16, feature_width=16,
                      scale=0.2)
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


def _test_patches(tool, data: Path) -> tuple[torch.Tensor, np.ndarray]:
    """The test images' real patches (no shrunken ones) as floats [n, 1, 50, 50], and labels."""
    patches, labels = [], []
    for rec in load_dataset(data)["test"]:
        p, y = tool.read_example(str(rec.path), tool._boxes(dict(rec.extra), "x", [str(c) for c in range(10)]),
                                 50, seed=rec.line, shrunken=0)[:2]
        patches.append(p)
        labels.append(y)
    return torch.from_numpy(np.concatenate(patches))[:, None].float() / 255.0, np.concatenate(labels)


def test_patch_gain_learns_digit_one_none_zero(tool, tmp_path: Path) -> None:
    """--patch-gain on: the checkpoint carries ats train's patch gain, trained towards 1 on a
    digit patch and 0 on a "none" patch, so that after ``ats train --init --patch-gain on`` a
    patch of noise adds (almost) nothing to the pooled feature while every digit weighs
    alike; a run without the flag has no gain."""
    data = _data(tmp_path / "clean", n_noise=0)
    pre = tmp_path / "gain.pt"
    tool.main([str(data), str(pre), "--images", "12", "--test-images", "4", "--epochs", "20", "--batch-size", "8",
               "--lr", "0.01", "--workers", "1", "--patch-gain", "on", *NETS])
    ckpt = load_checkpoint(pre)
    assert ckpt["spec"]["patch_gain"] is True and "gain.weight" in ckpt["model"]
    from ats_cli.models import create_model

    model = create_model(ckpt["spec"])
    model.load_state_dict(ckpt["model"])
    model.eval()
    x, y = _test_patches(tool, data)
    with torch.no_grad():
        gain = model.patch_gains(x)[:, 0].numpy()
    # from 1 everywhere at the start: every digit patch above every none patch, and apart by half
    assert gain[y == 10].max() < gain[y < 10].min(), (gain[y == 10], gain[y < 10])
    assert np.median(gain[y == 10]) < 0.5 < np.median(gain[y < 10])


def test_attention_targets_weigh_each_digit_alike(tool, tmp_path: Path) -> None:
    """Stage 1b's target: every digit of the image gets the same mass, over cells ats train
    may sample whose patch (cut where ats train would cut it) holds that digit whole."""
    from ats_cli.core.geometry import positions_to_offsets
    from ats_cli.data.megapixel_mnist import box_fractions
    from ats_cli.geojson import parse_boxes
    from ats_cli.models import create_model, model_spec

    data = load_dataset(_data(tmp_path / "mix", n_noise=6))
    cfg = TrainConfig(data=str(data.root), attention_net="block-attention", attention_width=16, feature_width=16,
                      scale=0.2, min_brightness=0.15)
    cfg.from_data(data.hints)
    model = create_model(model_spec(cfg, n_classes=10, channels=1))
    views, cells = tool._read_all(data["train"], data.classes, 50, 0, 1, "train", 0, (0.2, (60, 60), 0))[2:]
    assert views.shape == (12, 60, 60)
    targets = tool.attention_targets(model, views, cells, (60, 60))
    corners = positions_to_offsets(torch.arange(3600)[None], (60, 60), (300, 300), (50, 50))[0].numpy()
    for view, rec, (idx, prob, digit) in zip(views, data["train"], targets, strict=True):
        boxes = [box for _, *box in parse_boxes(rec.extra["digits"])]
        assert np.isclose(prob.sum(), 1.0)
        per_digit = np.bincount(digit, weights=prob)
        assert len(set(digit)) >= 4 and np.allclose(per_digit[per_digit > 0], 1.0 / len(set(digit)))
        assert (box_fractions(corners[idx], boxes, (50, 50))[np.arange(len(idx)), digit] == 1.0).all()
        support = model.support(torch.from_numpy(view.astype(np.float32))[None, None], (60, 60))
        assert support is not None and support.flatten()[torch.from_numpy(idx)].all()


def test_attention_stage_puts_the_mass_on_the_digits(tool, tmp_path: Path) -> None:
    """--attention-epochs: the checkpoint's attention net puts most of its mass on the digits'
    cells of images it was not taught on (at the start: the share of bright cells they hold).
    How evenly it spreads that mass over the digits is measured, not asserted: the target
    is even, the fit is not (benchmarks/README.md, "Stage 1")."""
    from ats_cli.models import create_model

    data = load_dataset(_data(tmp_path / "mix", n_noise=20))  # most bright cells are noise
    views, cells = tool._read_all(data["test"], data.classes, 50, 0, 1, "test", 0, (0.2, (60, 60), 0))[2:]
    masses = {}
    for epochs in (0, 40):
        pre = tmp_path / f"att{epochs}.pt"
        tool.main([str(data.root), str(pre), "--images", "12", "--test-images", "4", "--epochs", "1",
                   "--workers", "1", "--scale", "0.2", "--attention-epochs", str(epochs), "--lr", "0.01", *NETS])
        ckpt = load_checkpoint(pre)
        assert ckpt["pretrain"]["attention_epochs"] == epochs
        model = create_model(ckpt["spec"])
        model.load_state_dict(ckpt["model"])
        targets = tool.attention_targets(model, views, cells, (60, 60))
        masses[epochs] = tool.attention_masses(model, views, targets, (60, 60), "cpu")[0]
    assert np.median(masses[0]) < 0.5 < np.median(masses[40]), masses


def test_uniform_loss_is_least_when_the_ten_logits_are_equal(tool) -> None:
    equal = torch.full((3, 10), 2.5, requires_grad=True)
    loss = tool.uniform_loss(equal)
    loss.backward()
    assert loss.item() == pytest.approx(np.log(10)) and equal.grad.abs().max() < 1e-7
    assert tool.uniform_loss(torch.randn(3, 10)).item() > np.log(10)


def _none_votes(tool, ckpt_path: Path, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """Top softmax p of the checkpoint's classifier rows (ats train's start) on the test
    images' none patches (and on their digit patches)."""
    from ats_cli.checkpoint import load_model

    model, _ = load_model(ckpt_path)
    model.eval()
    x, y = _test_patches(tool, data)
    with torch.no_grad():
        probs = model.classifier(model.patch_features(x)).softmax(1).numpy()
    return probs[y == 10].max(1), probs[y < 10].max(1)


def test_none_uniform_stops_none_patches_voting(tool, tmp_path: Path) -> None:
    """--none-uniform: the ten digit rows the checkpoint hands to ats train give a "none"
    patch (nearly) equal logits: no vote. Without it they lean to some digit."""
    data = _data(tmp_path / "noisy", n_noise=20)
    votes = {}
    for weight in ("0", "5"):
        pre = tmp_path / f"w{weight}.pt"
        tool.main([str(data), str(pre), "--images", "12", "--test-images", "4", "--epochs", "6", "--batch-size",
                   "16", "--lr", "0.01", "--workers", "1", "--attention-epochs", "0", "--shrunken", "0",
                   "--none-uniform", weight, *NETS])
        votes[weight] = _none_votes(tool, pre, data)
    off, on = np.median(votes["0"][0]), np.median(votes["5"][0])
    # above uniform (0.1): 0.21 without, 0.12 with the loss when written
    assert on - 0.1 < (off - 0.1) / 3, (on, off)


def test_a_corrupt_image_is_skipped_once_and_the_rest_trains(tool, tmp_path: Path, capsys) -> None:
    """Both stages read each image once: a damaged one gives one line naming it, and the
    patches and views of the others still train both stages."""
    data = _data(tmp_path / "clean", n_noise=0)
    bad = sorted((data / "train").glob("*.png"))[3]
    bad.write_bytes(bad.read_bytes()[:200])
    pre = tmp_path / "pre.pt"
    tool.main([str(data), str(pre), "--images", "12", "--test-images", "4", "--epochs", "1", "--batch-size", "16",
               "--workers", "1", "--attention-epochs", "1", *NETS])
    err = capsys.readouterr().err
    assert err.count("skipped:") == 1 and bad.name in err, err
    assert load_checkpoint(pre)["pretrain"]["attention_epochs"] == 1


def test_none_class_keeps_the_none_row_so_noise_votes_little(tool, tmp_path: Path) -> None:
    """--pooling votes --none-class on: the checkpoint's model has the stage's "none" row as
    its per-patch "no class here" logit, so a none patch's vote (the classes' share of its
    softmax, ATSModel.patch_values) is small and a digit patch's is not; without the row
    every patch's vote sums to 1. The flag without votes or counts is refused."""
    from ats_cli.checkpoint import load_model

    data = _data(tmp_path / "noisy", n_noise=20)
    pre = tmp_path / "none.pt"
    tool.main([str(data), str(pre), "--images", "12", "--test-images", "4", "--epochs", "6", "--batch-size", "16",
               "--lr", "0.01", "--workers", "1", "--attention-epochs", "0", "--shrunken", "0", "--pooling", "votes",
               "--none-class", "on", *NETS])
    model, ckpt = load_model(pre)
    assert ckpt["spec"]["none_class"] is True and ckpt["spec"]["pooling"] == "votes"
    model.eval()
    x, y = _test_patches(tool, data)
    with torch.no_grad():
        vote = model.patch_values(model.patch_features(x)).sum(1).numpy()  # a patch's whole vote
    # after 6 epochs on 12 images: none patches a median 0.33 of a vote, digit patches 0.78
    assert np.median(vote[y == 10]) < 0.45 < 0.65 < np.median(vote[y < 10]), (vote[y == 10], vote[y < 10])
    with pytest.raises(SystemExit):
        tool.main([str(data), str(tmp_path / "x.pt"), "--none-class", "on"])
