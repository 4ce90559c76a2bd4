"""Megapixel MNIST noise families: the reference's noise recipe, placement, mixing, records.

The ``reference`` family must be the 2019 reference generator's noise
(idiap/attention-sampling, scripts/make_mnist.py): 50 patterns per split, each the union
of two 1-px lines from a top corner, per-pixel gain U(0.8, 1), pasted after the digits
anywhere in [28, H-28). Offline like tests/test_megapixel_mnist.py (bundled digits only).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from ats_cli.data import DatasetError, load_dataset
from ats_cli.data.megapixel_mnist import (
    generate_megapixel_mnist,
    image_layout,
    make_config,
    render_image,
    split_patterns,
)
from ats_cli.data.mnist import DigitSet, load_bundled_digits
from ats_cli.data.noise import FAMILIES, NoiseContext, parse_families

TINY = dict(n_train=4, n_test=3, width=160, height=140, n_noise=6, seed=0)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATS_OFFLINE", "1")
    monkeypatch.setenv("ATS_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bundled() -> DigitSet:
    return load_bundled_digits()


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _connected_to_top_corners(lit: np.ndarray) -> np.ndarray:
    """The lit pixels reachable (8-connectivity, through lit pixels) from a lit (0, 0) or (0, 27)."""
    seen = np.zeros_like(lit)
    stack = [(0, c) for c in (0, lit.shape[1] - 1) if lit[0, c]]
    for r, c in stack:
        seen[r, c] = True
    while stack:
        r, c = stack.pop()
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                rr, cc = r + dr, c + dc
                if 0 <= rr < lit.shape[0] and 0 <= cc < lit.shape[1] and lit[rr, cc] and not seen[rr, cc]:
                    seen[rr, cc] = True
                    stack.append((rr, cc))
    return seen


# ---------------------------------------------------------------------------- reference: the patterns


def test_reference_patterns_follow_the_recipe() -> None:
    patterns = split_patterns(0, "test")
    assert patterns.shape == (50, 28, 28) and patterns.dtype == np.uint8
    assert len({p.tobytes() for p in patterns}) == 50, "50 distinct patterns per split"
    for p in patterns:
        lit = p > 0
        assert lit[0, 0], "the pattern's own line starts at the top-left corner"
        # gain U(0.8, 1) per lit pixel, times 255, drawn per pixel (so it varies inside a pattern)
        assert p[lit].min() >= int(0.8 * 255) and p[lit].max() <= 255
        assert len(np.unique(p[lit])) >= 5
        # two lines of 28-56 pixels each, both 1 px wide: never a filled 3x3 block
        assert 28 <= lit.sum() <= 112
        blocks = np.lib.stride_tricks.sliding_window_view(lit, (3, 3)).all(axis=(2, 3))
        assert not blocks.any(), "a 1-px line pair cannot fill a 3x3 block"
        # every line touches (0, 0) or its mirror (0, 27): all ink is connected to those corners
        assert (_connected_to_top_corners(lit) == lit).all()
        # slopes up to tan(72 deg): on row 0 a line covers at most 3 pixels next to its corner
        assert set(np.flatnonzero(lit[0])) <= {0, 1, 2, 25, 26, 27}


def test_reference_partner_mirrored_about_four_ninths() -> None:
    # two independent 1/3 mirrorings along the same axis: net 2 * 0.33 * 0.67 = 0.44
    mirrored = [bool(p[0, 27]) for seed in range(20) for p in split_patterns(seed, "test")]
    assert 0.38 <= np.mean(mirrored) <= 0.50


def test_reference_patterns_per_split_and_seed() -> None:
    train, test = split_patterns(0, "train"), split_patterns(0, "test")
    assert not ({p.tobytes() for p in train} & {p.tobytes() for p in test}), "splits have their own patterns"
    np.testing.assert_array_equal(split_patterns(0, "test"), test)
    assert not np.array_equal(split_patterns(1, "test"), test)
    # the reference's seeding: train of seed s draws what test of seed s+1 draws
    np.testing.assert_array_equal(split_patterns(1, "test"), train)
    with pytest.raises(ValueError):
        test[0, 0, 0] = 1  # shared by every image of the split: read-only


# ---------------------------------------------------------------------------- reference: the images


def test_reference_images_use_the_split_patterns(bundled: DigitSet) -> None:
    config = make_config("small", width=300, height=260, n_noise=20)
    assert config.noise == "reference" and config.overlaps("reference")
    for split in ("train", "test"):
        patterns = {p.tobytes(): i for i, p in enumerate(split_patterns(0, split))}
        used = set()
        for index in range(12):
            image, layout = render_image(config, bundled, split, index)
            assert layout.noise_families == ("reference",) * 20
            for k, ((r, c), patch) in enumerate(zip(layout.noise_boxes.tolist(), layout.noise_patches, strict=True)):
                assert patch.tobytes() in patterns, "every noise patch is one of the split's 50 patterns"
                used.add(patterns[patch.tobytes()])
                assert 28 <= r < 260 - 28 and 28 <= c < 300 - 28
                later = layout.noise_boxes[k + 1 :]
                if not np.any((np.abs(later[:, 0] - r) < 28) & (np.abs(later[:, 1] - c) < 28)):
                    np.testing.assert_array_equal(image[r : r + 28, c : c + 28], patch)
        assert len(used) >= 40, "pattern indices are drawn uniformly from 0..49"


def test_reference_noise_is_pasted_over_digits(bundled: DigitSet) -> None:
    config = make_config("paper", n_train=1, n_test=1)
    covered = 0
    for index in range(40):
        image, layout = render_image(config, bundled, "test", index)
        for r, c in layout.digit_boxes.tolist():
            rows, cols = layout.noise_boxes[:, 0], layout.noise_boxes[:, 1]
            hits = np.flatnonzero((np.abs(rows - r) < 28) & (np.abs(cols - c) < 28))
            if len(hits):
                k = hits[-1]  # the last patch pasted over this digit box
                nr, nc = layout.noise_boxes[k]
                r0, r1, c0, c1 = max(r, nr), min(r, nr) + 28, max(c, nc), min(c, nc) + 28
                np.testing.assert_array_equal(image[r0:r1, c0:c1],
                                              layout.noise_patches[k][r0 - nr : r1 - nr, c0 - nc : c1 - nc])
                covered += 1
    # positions ignore the digits: with 50 patches on 1500x1500 about 3 in 10 images have a digit box hit
    assert 3 <= covered <= 40


def test_reference_images_are_deterministic(bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    a, _ = render_image(config, bundled, "test", 2)
    b, _ = render_image(config, bundled, "test", 2)
    np.testing.assert_array_equal(a, b)
    other, _ = render_image(make_config("small", **{**TINY, "seed": 5}), bundled, "test", 2)
    assert not np.array_equal(a, other)


def test_strokes_reproduce_generator_version_1(bundled: DigitSet) -> None:
    """``noise="strokes"`` keeps version 1's draw order: the same pixels as version 1 gave."""
    expected = {  # sha256 of the raw pixels, recorded with generator version 1
        ("tiny", "train", 0): "70011c1a8c69f3ee",
        ("tiny", "test", 3): "6bce1fce19fa9eab",
        ("small", "train", 0): "2743d46c439ad08d",
        ("small", "test", 3): "10798c46c2f1dea7",
    }
    configs = {"tiny": make_config("small", **{**TINY, "n_train": 6, "n_test": 4}, noise="strokes"),
               "small": make_config("small", noise="strokes")}
    for (name, split, index), digest in expected.items():
        image, layout = render_image(configs[name], bundled, split, index)
        assert hashlib.sha256(image.tobytes()).hexdigest()[:16] == digest, (name, split, index)
        assert not configs[name].overlaps("strokes")


# ---------------------------------------------------------------------------- records and resume


def test_dataset_json_records_the_noise(tmp_path: Path, bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    generate_megapixel_mnist(tmp_path / "ref", config, bundled, workers=1)
    gen = load_dataset(tmp_path / "ref").meta["generator"]
    assert gen["version"] == 2
    assert gen["params"]["noise"] == "reference" and gen["params"]["noise_overlap"] is None
    assert gen["noise"]["families"] == ["reference"] and gen["noise"]["overlap"] == {"reference": True}
    assert gen["noise"]["params"]["reference"]["patterns_per_split"] == 50
    assert "reference" in json.loads((tmp_path / "ref" / "dataset.json").read_text())["description"]


def test_resume_with_other_noise_is_refused(tmp_path: Path, bundled: DigitSet) -> None:
    config = make_config("small", **TINY)
    out = tmp_path / "out"
    generate_megapixel_mnist(out, config, bundled, workers=1)
    before = _files(out)
    with pytest.raises(DatasetError, match="noise: reference -> strokes"):
        generate_megapixel_mnist(out, make_config("small", **TINY, noise="strokes"), bundled, workers=1)
    with pytest.raises(DatasetError, match="noise_overlap: None -> False"):
        generate_megapixel_mnist(out, make_config("small", **TINY, noise_overlap=False), bundled, workers=1)
    assert _files(out) == before
    again = generate_megapixel_mnist(out, config, bundled, workers=1)
    assert (again.written, again.skipped) == (0, 7)


def test_cli_noise_options(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ats_cli.cli.make_dataset import make_dataset_app

    runner = CliRunner()
    flags = ["--preset", "small", "--n-train", "2", "--n-test", "1", "--width", "120", "--height", "120",
             "--n-noise", "4", "--workers", "1", "--offline"]
    result = runner.invoke(make_dataset_app, ["megapixel-mnist", str(tmp_path / "a"), *flags])
    assert result.exit_code == 0, result.output
    assert "reference, may cover digits" in " ".join(result.output.split())
    result = runner.invoke(make_dataset_app, ["megapixel-mnist", str(tmp_path / "b"), *flags,
                                              "--noise", "strokes", "--noise-overlap"])
    assert result.exit_code == 0, result.output
    gen = load_dataset(tmp_path / "b").meta["generator"]
    assert gen["params"]["noise"] == "strokes" and gen["noise"]["overlap"] == {"strokes": True}
    bad = runner.invoke(make_dataset_app, ["megapixel-mnist", str(tmp_path / "c"), *flags, "--noise", "fog"])
    assert bad.exit_code == 1 and "unknown noise family 'fog'" in bad.output
    refused = runner.invoke(make_dataset_app, ["megapixel-mnist", str(tmp_path / "b"), *flags])
    assert refused.exit_code == 1 and "noise: strokes -> reference" in " ".join(refused.output.split())


def test_noise_config_validation() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        make_config("small", noise="strokes,strokes")
    with pytest.raises(ValueError, match="overlapping noise is placed in"):
        make_config("small", width=50, height=50, n_digits=1, n_target=1)
    make_config("small", width=50, height=50, n_digits=1, n_target=1, n_noise=0)  # a clean set fits
    # overlapping noise needs no room of its own; non-overlapping noise does
    make_config("small", width=100, height=100, n_noise=20)
    with pytest.raises(ValueError, match="would cover over half"):
        make_config("small", width=100, height=100, n_noise=20, noise="strokes")
    assert parse_families(" strokes , reference") == ("strokes", "reference")
    assert make_config("small", noise=["strokes", "reference"]).noise == "strokes,reference"


# ---------------------------------------------------------------------------- every family


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_renders_a_deterministic_patch(name: str, bundled: DigitSet) -> None:
    family = FAMILIES[name]
    context = NoiseContext(patterns=split_patterns(0, "test"), digits=bundled.x_test)
    patches = []
    for seed in range(6):
        patch = family.render(np.random.default_rng(seed), context)
        assert patch.shape == (28, 28) and patch.dtype == np.uint8
        assert patch.max() >= 128 and 0 < (patch > 0).mean() < 0.6, "visible, and not a filled box"
        np.testing.assert_array_equal(family.render(np.random.default_rng(seed), context), patch)
        patches.append(patch.tobytes())
    assert len(set(patches)) >= 4, "different seeds draw different patches"
    many = family.many(np.random.default_rng(0), context, 3)
    assert len(many) == 3 and all(p.shape == (28, 28) and p.dtype == np.uint8 for p in many)


def test_families_needing_split_material_say_so() -> None:
    with pytest.raises(ValueError, match="patterns"):
        FAMILIES["reference"].render(np.random.default_rng(0), NoiseContext())
    with pytest.raises(ValueError, match="digits"):
        FAMILIES["fragments"].render(np.random.default_rng(0), NoiseContext())


def test_fragments_are_small_pieces_of_the_given_digits() -> None:
    digits = np.zeros((3, 28, 28), dtype=np.uint8)
    digits[:, 4:24, 4:24] = 200  # a "digit" that is ink everywhere inside its 20x20 core
    for seed in range(10):
        patch = FAMILIES["fragments"].render(np.random.default_rng(seed), NoiseContext(digits=digits))
        assert set(np.unique(patch)) <= {0, 200}, "pixels come from the given digits only"
        assert 0 < (patch > 0).sum() <= 2 * 13 * 13, "two pieces of at most 13x13"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_no_overlap_keeps_every_digit_intact(name: str, bundled: DigitSet) -> None:
    config = make_config("small", width=200, height=180, n_noise=8, noise=name, noise_overlap=False)
    for index in range(3):
        image, layout = render_image(config, bundled, "test", index)
        for (r, c), idx in zip(layout.digit_boxes.tolist(), layout.digit_index.tolist(), strict=True):
            np.testing.assert_array_equal(image[r : r + 28, c : c + 28], bundled.x_test[idx])
            assert not np.any((np.abs(layout.noise_boxes[:, 0] - r) < 28) & (np.abs(layout.noise_boxes[:, 1] - c) < 28))


def test_overlap_forced_on_places_any_family_like_the_reference(bundled: DigitSet) -> None:
    config = make_config("small", width=200, height=180, n_noise=30, noise="blobs", noise_overlap=True)
    boxes = np.concatenate([image_layout(config, bundled, "train", i).noise_boxes for i in range(4)])
    assert boxes[:, 0].min() >= 28 and boxes[:, 0].max() < 180 - 28
    assert boxes[:, 1].min() >= 28 and boxes[:, 1].max() < 200 - 28


def test_mixing_draws_each_patch_family_uniformly(tmp_path: Path, bundled: DigitSet) -> None:
    mix = "reference,strokes,blobs,glyphs"
    config = make_config("small", width=300, height=300, n_noise=20, noise=mix)
    patterns = {p.tobytes() for p in split_patterns(0, "test")}
    chosen: list[str] = []
    for index in range(10):
        image, layout = render_image(config, bundled, "test", index)
        chosen += layout.noise_families
        for (r, c), fam, patch in zip(layout.noise_boxes.tolist(), layout.noise_families, layout.noise_patches,
                                      strict=True):
            if fam == "reference":  # the paper's noise keeps the paper's placement inside a mix
                assert patch.tobytes() in patterns and 28 <= r < 300 - 28
            else:  # the others keep theirs: never on a digit
                assert not np.any((np.abs(layout.digit_boxes[:, 0] - r) < 28)
                                  & (np.abs(layout.digit_boxes[:, 1] - c) < 28))
    counts = {f: chosen.count(f) for f in parse_families(mix)}
    assert all(35 <= n <= 65 for n in counts.values()), counts  # 200 draws, 50 expected each
    again = [render_image(config, bundled, "test", 4)[0] for _ in range(2)]
    np.testing.assert_array_equal(*again)

    generate_megapixel_mnist(tmp_path / "mix", make_config("small", **TINY, noise=mix), bundled, workers=1)
    noise = load_dataset(tmp_path / "mix").meta["generator"]["noise"]
    assert noise["families"] == list(parse_families(mix)) and set(noise["params"]) == set(parse_families(mix))
    assert noise["overlap"] == {"reference": True, "strokes": False, "blobs": False, "glyphs": False}
    assert "uniform" in noise["mixing"]


# ---------------------------------------------------------------------------- where the released model looks


def test_released_model_attends_to_the_digits_of_clean_images(tmp_path: Path, bundled: DigitSet) -> None:
    """Without noise the only bright cells are the digits, so the released model's attention
    (sampling bright cells only) lies on them and its draws reach all 5: the cell -> pixel
    geometry (positions_to_offsets) and the generator's digit boxes line up; swapped axes or
    a wrong window would put the mass beside the digits."""
    import torch

    from ats_cli.checkpoint import load_model
    from ats_cli.core.source import positions_to_offsets
    from ats_cli.data.images import read_image
    from ats_cli.data.inputs import low_res_view
    from ats_cli.data.megapixel_mnist import box_fractions
    from ats_cli.render.records import parse_boxes

    config = make_config("small", n_train=1, n_test=4, width=400, height=400, n_noise=0, seed=0)
    generate_megapixel_mnist(tmp_path / "clean", config, bundled, workers=1)
    model, ckpt = load_model("models/megapixel-mnist-ats.pt")
    ds = load_dataset(tmp_path / "clean")
    gen = torch.Generator().manual_seed(0)
    right, on_digits = 0, []
    for rec in ds["test"]:
        rects = [box for _, *box in parse_boxes(rec.extra.get("digits"))]
        image = read_image(rec.path, int(ckpt["spec"]["channels"]))
        low = low_res_view(image, model.scale)[None]
        with torch.no_grad():
            out = model(low, image[None], generator=gen)
        right += int(out.logits.argmax(1).item() == rec.label)
        att = out.attention[0]
        corners = positions_to_offsets(torch.arange(att.numel())[None], tuple(att.shape), tuple(image.shape[-2:]),
                                       model.patch_size, low_size=tuple(low.shape[-2:]),
                                       margin=getattr(model.attention_net, "margin", 0))[0].numpy()
        whole = box_fractions(corners, rects, model.patch_size) >= 1.0  # [cells, digits]: the patch holds it whole
        masses = att.flatten().double().numpy() @ whole
        assert (masses > 0).all(), masses
        on_digits.append(masses.sum())
        drawn = out.sampled_probs[0].numpy() > 0
        cover = box_fractions(out.offsets[0].numpy()[drawn], rects, model.patch_size)
        assert set(cover.argmax(1)[cover.max(1) >= 0.5].tolist()) == set(range(len(rects)))  # every digit drawn
        assert (cover.max(1) >= 0.1).all()  # no draw far from every digit: nothing else is bright
    assert np.median(on_digits) > 0.95 and min(on_digits) > 0.5, on_digits
    assert right == len(ds["test"]) == 4
