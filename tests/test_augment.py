"""Training augmentation (`ats train --augment`, ats_cli.augment) and the synthetic slides'
per-slide stain (`--stain-jitter`): the colour model, one set of parameters per image for
its low-res view and its patches, flips that only move pixels, exact resumption, and a
model whose sampling and pooling the augmentation leaves alone."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from skimage.color import rgb2hed
from test_train import _cfg, _weights, _write_squares_dataset
from typer.testing import CliRunner

from ats_cli import augment
from ats_cli.augment import Augmentation, brightness_contrast, dihedral, hed_jitter
from ats_cli.cli import app
from ats_cli.config import settle
from ats_cli.core.model import ATSModel
from ats_cli.data.facts import DataFacts
from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, fingerprint, render_slide
from ats_cli.models import create_model, model_spec
from ats_cli.recipes import resolve_config
from ats_cli.train import TrainingInterrupted, train


def _rgb(shape, seed=0, low=0.02):
    return low + (1 - low) * torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _stained(b, h=8, w=8, seed=0):
    """RGB images [b, 3, h, w] made of stains (amounts in [0.05, 0.6]): what the model fits."""
    amounts = 0.05 + 0.55 * torch.rand(b, h, w, 3, generator=torch.Generator().manual_seed(seed))
    return torch.exp(-(amounts @ torch.tensor(augment.RUIFROK_HED))).permute(0, 3, 1, 2).contiguous()


def _stains(images):
    """Stain amounts [B, 3, h, w] of RGB images [B, 3, h, w] (Ruifrok & Johnston)."""
    m_inv = torch.linalg.inv(torch.tensor(augment.RUIFROK_HED, dtype=torch.float64))
    od = -torch.log(images.double().clamp_min(augment.OD_EPS))
    return torch.einsum("bchw,ck->bkhw", od, m_inv)


# ---------------------------------------------------------------------------- the colour model


def test_hed_round_trip_is_the_identity_and_the_matrix_is_skimages():
    x = _rgb((4, 3, 16, 16))
    same = hed_jitter(x, torch.ones(4, 3), torch.zeros(4, 3))
    assert torch.allclose(same, x, atol=1e-5)
    # the same deconvolution as skimage's rgb2hed (which divides OD by -log(1e-6) and clips at 0)
    ours = (_stains(x[:1])[0].permute(1, 2, 0) / -math.log(1e-6)).numpy()
    theirs = rgb2hed(x[0].permute(1, 2, 0).double().numpy())
    positive = theirs > 0
    assert positive.mean() > 0.3 and np.abs(ours[positive] - theirs[positive]).max() < 1e-6


def test_jitter_changes_colour_within_its_bounds_and_stays_in_0_1():
    x = _stained(64, seed=1)
    for seed in range(5):
        aug = Augmentation.draw("colour", 64, seed)
        assert ((aug.alpha - 1).abs() <= augment.STAIN_SCALE).all() and (aug.beta.abs() <= augment.STAIN_SHIFT).all()
        assert (aug.brightness.abs() <= augment.BRIGHTNESS).all()
        assert ((aug.contrast - 1).abs() <= augment.CONTRAST).all()
        assert (aug.alpha.std(0) > 0.05).all()  # one draw per image, not one per batch
        y = aug.colour(x)
        assert y.min() >= 0 and y.max() <= 1 and (y - x).abs().mean() > 0.01
    # the stain amounts scale by alpha, exactly (beta = 0; stained pixels stay inside (0, 1))
    alpha = torch.tensor([[0.8, 1.2, 1.0], [1.1, 0.9, 1.05]])
    y = hed_jitter(x[:2], alpha, torch.zeros(2, 3))
    assert torch.allclose(_stains(y), _stains(x[:2]) * alpha[:, :, None, None].double(), atol=1e-4)
    # brightness/contrast: (I - 0.5) c + 0.5 + b, clipped; extreme inputs stay in [0, 1]
    z = brightness_contrast(torch.tensor([[0.0, 0.25, 1.0]]).view(1, 1, 1, 3), torch.tensor([0.1]),
                            torch.tensor([1.2]))
    assert torch.allclose(z.flatten(), torch.tensor([0.0, 0.3, 1.0]))
    # black and white pixels, the strongest draws either way: finite, inside [0, 1]
    extreme = torch.tensor([0.0, 1.0]).view(1, 1, 2, 1).expand(2, 3, 2, 1)
    lo, hi = 1 - augment.STAIN_SCALE, 1 + augment.STAIN_SCALE
    out = hed_jitter(extreme, torch.tensor([[lo] * 3, [hi] * 3]), torch.tensor([[-augment.STAIN_SHIFT] * 3,
                                                                              [augment.STAIN_SHIFT] * 3]))
    assert out.isfinite().all() and out.min() >= 0 and out.max() <= 1


def test_single_channel_images_get_brightness_and_contrast_only():
    gray = _rgb((3, 1, 8, 8), seed=2)
    aug = Augmentation.draw("colour", 3, 0)
    assert torch.equal(aug.colour(gray), brightness_contrast(gray, aug.brightness, aug.contrast))


def test_an_images_low_view_and_its_patches_get_the_same_colours():
    """A patch of the transformed image equals the transformed patch (per-pixel transforms),
    with each image's own parameters, whether the batch is [B, C, h, w] or [B, n, C, h, w]."""
    B, n, p = 3, 5, 8
    full = _rgb((B, 3, 40, 48), seed=3)
    offsets = torch.randint(0, 32, (B, n, 2), generator=torch.Generator().manual_seed(0))
    patches = torch.stack([torch.stack([full[b, :, r:r + p, c:c + p] for r, c in offsets[b].tolist()])
                           for b in range(B)])
    aug = Augmentation.draw("colour", B, 11)
    coloured = aug.colour(full)
    want = torch.stack([torch.stack([coloured[b, :, r:r + p, c:c + p] for r, c in offsets[b].tolist()])
                        for b in range(B)])
    assert torch.allclose(aug.patches(patches), want, atol=1e-6)
    assert torch.equal(aug.low(full), coloured)
    # image b's parameters are b's: the batch's second image alone, with its row of parameters
    one = Augmentation(aug.alpha[1:2], aug.beta[1:2], aug.brightness[1:2], aug.contrast[1:2], False, None)
    assert torch.allclose(one.colour(full[1:2]), coloured[1:2], atol=1e-6)


# ---------------------------------------------------------------------------- flips


def test_flips_and_rotations_keep_each_patchs_pixels():
    patches = torch.rand(2, 8, 3, 6, 6)
    ops = torch.arange(8).repeat(2, 1)
    turned = dihedral(patches, ops)
    assert torch.equal(turned[:, 0], patches[:, 0])
    assert torch.equal(turned.flatten(2).sort(-1).values, patches.flatten(2).sort(-1).values)
    # the 8 symmetries of the square, all different on a generic patch
    one = dihedral(patches[:1, :1].expand(1, 8, 3, 6, 6), torch.arange(8)[None])[0]
    assert len({tuple(t.flatten().tolist()) for t in one}) == 8
    assert torch.equal(one[1], torch.rot90(patches[0, 0], 1, dims=(-2, -1)))
    assert torch.equal(one[4], patches[0, 0].flip(-1))
    # a non-square patch only turns by 0 or 180 degrees (mirrored or not): its shape stays
    wide = torch.rand(1, 4, 1, 4, 6)
    assert dihedral(wide, torch.tensor([[0, 2, 4, 6]])).shape == wide.shape
    with pytest.raises(ValueError, match="non-square"):
        dihedral(wide, torch.tensor([[1, 0, 0, 0]]))
    out = Augmentation.draw("colour+flips", 1, 0).patches(wide)
    assert out.shape == wide.shape


def test_colour_plus_flips_is_the_same_colour_then_a_permutation_of_each_patch():
    patches = _rgb((2, 6, 3, 8, 8), seed=4)
    coloured = Augmentation.draw("colour", 2, 5).patches(patches)
    flipped = Augmentation.draw("colour+flips", 2, 5).patches(patches)
    assert not torch.equal(coloured, flipped)
    assert torch.equal(flipped.flatten(2).sort(-1).values, coloured.flatten(2).sort(-1).values)
    # the low-res view is never turned: its geometry is the sampled positions'
    low = _rgb((2, 3, 8, 8), seed=5)
    assert torch.equal(Augmentation.draw("colour+flips", 2, 5).low(low), Augmentation.draw("colour", 2, 5).low(low))
    assert Augmentation.draw("none", 2, 5) is None
    with pytest.raises(ValueError, match="unknown augmentation"):
        Augmentation.draw("auto", 2, 5)


# ---------------------------------------------------------------------------- the model


def test_the_hook_changes_the_inputs_not_the_sampling_or_the_pooling():
    """ATS with ``patch_transform`` = ATS without it on images whose pixels were transformed:
    same positions, same probabilities, same pooled estimate (the colour part is per pixel,
    so transforming the gathered patches is transforming the image)."""
    torch.manual_seed(0)
    cfg = resolve_config(None, n_patches=6, patch_size=8, scale=0.25, feature_width=8, attention_width=4)
    model = create_model(model_spec(cfg, n_classes=2, channels=3)).train()
    assert isinstance(model, ATSModel)
    images = (255 * _rgb((2, 3, 64, 64), seed=6)).round().to(torch.uint8)
    low = torch.nn.functional.avg_pool2d(images.float() / 255, 4)
    aug = Augmentation.draw("colour", 2, 9)

    def run(sources, **kw):
        torch.manual_seed(1)  # the same batch-norm path, nothing else random but the generator
        return model(low, sources, generator=torch.Generator().manual_seed(3), return_patches=True, **kw)

    hooked = run(images, patch_transform=aug.patches)
    plain = run(aug.colour(images.float() / 255))
    for key in ("indices", "offsets", "sampled_probs", "attention", "entropy"):
        assert torch.equal(getattr(hooked, key), getattr(plain, key)), key
    assert torch.allclose(hooked.patches, plain.patches, atol=1e-6)
    assert torch.allclose(hooked.logits, plain.logits, atol=1e-5)
    # and no hook, no change: the forward pass of before
    assert torch.equal(run(images).logits, run(images, patch_transform=None).logits)


# ---------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def rgb_data(tmp_path_factory):
    return _write_squares_dataset(tmp_path_factory.mktemp("rgb"), n_train=24, n_test=8, channels=3)


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_augmented_training_is_deterministic_and_resumes_exactly(rgb_data, tmp_path):
    quiet = {"log": lambda s: None}
    train(_cfg(rgb_data, tmp_path / "a", augment="colour+flips"), **quiet)
    train(_cfg(rgb_data, tmp_path / "b", augment="colour+flips"), **quiet)
    assert _same(_weights(tmp_path / "a"), _weights(tmp_path / "b"))

    def interrupt(phase, step, total, info):
        if info["epoch"] == 2 and step == 2:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train(_cfg(rgb_data, tmp_path / "cut", augment="colour+flips"), progress=interrupt, **quiet)
    train(_cfg(rgb_data, tmp_path / "cut", augment="colour+flips"), resume=True, **quiet)
    assert _same(_weights(tmp_path / "a"), _weights(tmp_path / "cut"))
    # the augmentation did something, and colour alone is something else again
    train(_cfg(rgb_data, tmp_path / "none", augment="none"), **quiet)
    train(_cfg(rgb_data, tmp_path / "colour", augment="colour"), **quiet)
    runs = [_weights(tmp_path / name) for name in ("a", "none", "colour")]
    assert not _same(runs[0], runs[1]) and not _same(runs[0], runs[2]) and not _same(runs[1], runs[2])


def test_augment_none_trains_exactly_as_before(rgb_data, tmp_path, monkeypatch):
    """Off, the training step calls the model with the loader's low-res views and no hook,
    the call it made before augmentation existed; auto on images that are not slides is off."""
    calls = []
    forward = ATSModel.forward

    def spy(self, low, sources, **kw):
        calls.append(("patch_transform" in kw, low.clone()))
        return forward(self, low, sources, **kw)

    monkeypatch.setattr(ATSModel, "forward", spy)
    train(_cfg(rgb_data, tmp_path / "none", augment="none", epochs=1), log=lambda s: None)
    assert calls and not any(hooked for hooked, _ in calls)
    monkeypatch.setattr(ATSModel, "forward", forward)
    cfg = _cfg(rgb_data, tmp_path / "auto", epochs=1)
    assert cfg.augment == "auto"
    train(cfg, log=lambda s: None)
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["augment"] == "none"  # RGB, no tissue mask
    assert _same(_weights(tmp_path / "none"), _weights(tmp_path / "auto"))


@pytest.mark.parametrize("channels, masked, method, want", [
    (3, 4, "ats", "colour+flips"),  # RGB slides
    (1, 4, "ats", "none"),  # a grey tissue mask: no stains, and who knows what turning means
    (3, 0, "ats", "none"),  # photographs, digits: 6 and 9
    (3, 4, "uniform", "none"),  # the baselines train as the thesis's did
])
def test_auto_augments_rgb_slides_only(channels, masked, method, want):
    facts = DataFacts(channels=channels, probed=4, masked=masked)  # of the first training images, with a tissue mask
    assert settle(resolve_config(None, method=method), facts)[0].config.augment == want
    assert settle(resolve_config(None, method=method, augment="colour"), facts)[0].config.augment == "colour"


# ---------------------------------------------------------------------------- synthetic slides


SMALL = dict(size=512, n_spots=2, max_targets=1)


def test_stain_jitter_recolours_each_slide_and_keeps_its_layout():
    plain, layout = render_slide(SyntheticSlidesConfig(**SMALL), "train", 1)
    stained, same_layout = render_slide(SyntheticSlidesConfig(**SMALL, stain_jitter=0.4), "train", 1)
    again, _ = render_slide(SyntheticSlidesConfig(**SMALL, stain_jitter=0.4), "train", 1)
    assert np.array_equal(stained, again)  # deterministic
    assert same_layout == layout
    glass = plain.min(2) > 225
    tissue = ~glass
    moved = np.abs(stained.astype(float) - plain).mean(2)
    assert moved[tissue].mean() > 3 * moved[glass].mean()  # the tissue changes colour, the glass stays white
    # every slide its own stain: the tissue's mean colour shifts differently from slide to slide
    shifts = []
    for index in range(4):
        a, _ = render_slide(SyntheticSlidesConfig(**SMALL), "test", index)
        b, _ = render_slide(SyntheticSlidesConfig(**SMALL, stain_jitter=0.4), "test", index)
        t = a.min(2) <= 225
        shifts.append(b[t].mean(0) - a[t].mean(0))
    assert np.std(shifts, axis=0).max() > 3


def test_stain_jitter_0_is_todays_generator_and_is_recorded_when_on():
    default = SyntheticSlidesConfig(**SMALL)
    assert "stain_jitter" not in default.params() and "stain_jitter" not in fingerprint(default)["params"]
    on = SyntheticSlidesConfig(**SMALL, stain_jitter=0.3)
    assert on.params()["stain_jitter"] == 0.3 and fingerprint(on)["params"]["stain_jitter"] == 0.3
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="stain_jitter"):
            SyntheticSlidesConfig(**SMALL, stain_jitter=bad).validate()


def test_make_dataset_stain_jitter_flag_is_recorded(tmp_path):
    out = tmp_path / "stained"
    result = CliRunner().invoke(app, ["make-dataset", "synthetic-slides", str(out), "--n-train", "1", "--n-test", "1",
                                      "--size", "512", "--n-spots", "2", "--max-targets", "1", "--stain-jitter", "0.3",
                                      "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "stain jitter 0.3" in result.output
    assert json.loads((out / "dataset.json").read_text())["generator"]["params"]["stain_jitter"] == 0.3
