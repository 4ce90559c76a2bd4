"""Images of different sizes and aspect ratios in one batch (issue #66).

Their low-res views are padded bottom/right to the batch's largest height and width
(:func:`ats_cli.data.inputs.batch_views`) and the model, told each view's size, gives each
image what it gets alone: the same attention on its own cells (the padding none, never
drawn), the same patches, estimate, logits and gradients for the same draw. Each exactness
test has a negative control: without the view sizes (the padded tensor read as one image)
the attention moves and padding is drawn, and a Monte Carlo mean with padding drawable
misses the exact expectation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import ats_cli.core.model as model_module
from ats_cli.core.model import ATSModel, exploration
from ats_cli.core.sampling import Draw, attention_distribution, sample
from ats_cli.core.source import TensorSource, low_res_view, positions_to_offsets
from ats_cli.data.inputs import batch_support, batch_views, collate
from ats_cli.extensions.pooling import Where
from ats_cli.nets import create
from tests.montecarlo import TinyFeatures, max_z

SCALE, PATCH, N = 0.125, 8, 4
SIZES = [(64, 96), (88, 40), (48, 56)]  # (H, W): wide, tall, nearly square: views 8x12, 11x5, 6x7


def _model(**options) -> ATSModel:
    torch.manual_seed(3)
    m = ATSModel(create("mnist-attention", in_channels=1, width=4), TinyFeatures(), n_classes=3, n_patches=N,
                 patch_size=(PATCH, PATCH), scale=SCALE, entropy_weight=0.05, feature_scale=3.0, **options)
    torch.nn.init.normal_(m.attention_net.score.weight, std=0.5)  # the last layer starts at zero
    return m.train()


def _images(sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(1, h, w, generator=g) * 255).to(torch.uint8) for h, w in sizes]


def _batch(images):
    low, view_sizes = batch_views([low_res_view(img, SCALE) for img in images])
    return low, [TensorSource(img) for img in images], view_sizes


class _Replay:
    """``sample`` that records the mixed batch's draw and hands each image alone the same
    cells (re-indexed to its own grid) and threshold: the comparison is then exact."""

    def __init__(self):
        self.draw: Draw | None = None
        self.grid_w = 0
        self.image: int | None = None

    def __call__(self, probs, n, *, replace=False, generator=None, exists=None):
        if self.image is None:  # the mixed batch: draw, and keep it
            self.draw = sample(probs, n, replace=replace, generator=generator, exists=exists)
            return self.draw
        cols = self.own_w
        idx = self.draw.indices[self.image:self.image + 1]
        own = torch.div(idx, self.grid_w, rounding_mode="floor") * cols + idx % self.grid_w
        threshold = None if self.draw.threshold is None else self.draw.threshold[self.image:self.image + 1]
        return Draw(own, probs.gather(1, own), threshold)


def _grads(loss, m):
    params = [p for p in m.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])


def _per_image_loss(m, out, b, target):
    return m.pooling.nll(out.logits[b:b + 1], target[b:b + 1]) - m.entropy_weight * exploration(out)[b]


@pytest.mark.parametrize("estimator,replace", [("auto", False), ("threshold", False), ("sequential", False),
                                               ("auto", True)])
def test_each_image_of_a_mixed_batch_gets_what_it_gets_alone(monkeypatch, estimator, replace):
    m = _model(estimator=estimator, replace=replace)
    images = _images()
    low, sources, view_sizes = _batch(images)
    assert tuple(low.shape) == (3, 1, 11, 12) and view_sizes.tolist() == [[8, 12], [11, 5], [6, 7]]
    target = torch.tensor([0, 2, 1])
    replay = _Replay()
    monkeypatch.setattr(model_module, "sample", replay)
    mixed = m(low, sources, generator=torch.Generator().manual_seed(5), view_sizes=view_sizes)
    grid_h, grid_w = mixed.attention.shape[-2:]
    for b, img in enumerate(images):
        replay.image, replay.grid_w = None, grid_w
        h, w = low_res_view(img, SCALE).shape[-2:]
        replay.own_w, replay.image = w, b
        alone = m(low_res_view(img, SCALE)[None], [TensorSource(img)])
        # the attention on its own cells, nothing on the padding
        torch.testing.assert_close(mixed.attention[b, :h, :w], alone.attention[0], rtol=1e-6, atol=1e-9)
        padding = torch.ones(grid_h, grid_w, dtype=torch.bool)
        padding[:h, :w] = False
        assert (mixed.attention[b].detach()[padding] == 0).all()
        # the same patches, estimate and logits
        assert torch.equal(mixed.offsets[b], alone.offsets[0])
        torch.testing.assert_close(mixed.weights[b], alone.weights[0], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(mixed.logits[b], alone.logits[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mixed.entropy[b], alone.entropy[0], rtol=1e-6, atol=1e-7)
        # the same gradients of its loss, attention net, feature net and classifier
        g_mixed = _grads(_per_image_loss(m, mixed, b, target), m)
        g_alone = _grads(_per_image_loss(m, alone, 0, target[b:b + 1]), m)
        assert g_alone.abs().max() > 0
        torch.testing.assert_close(g_mixed, g_alone, rtol=1e-4, atol=1e-6)
        replay.image = None


def test_without_the_view_sizes_the_padding_changes_the_attention_and_is_drawn():
    """Negative controls: the padded tensor read as one image puts attention on the padding
    and draws it; masking the padding out but running the net on the padded tensor still
    changes the border cells (the 'same' convolutions see the padding's zeros where alone
    they see their own border): why the net runs on each image's own view."""
    m = _model()
    images = _images()
    low, sources, view_sizes = _batch(images)
    b = 2  # the smallest view, padded on two sides
    h, w = view_sizes[b].tolist()
    with torch.no_grad():
        alone = m(low_res_view(images[b], SCALE)[None], [TensorSource(images[b])]).attention[0]
        plain = m(low, sources, generator=torch.Generator().manual_seed(0))
        assert float(plain.attention[b].sum() - plain.attention[b, :h, :w].sum()) > 0.1  # mass on the padding
        valid = torch.zeros(3, *low.shape[-2:], dtype=torch.bool)
        for i, (vh, vw) in enumerate(view_sizes.tolist()):
            valid[i, :vh, :vw] = True
        masked = m(low, sources, generator=torch.Generator().manual_seed(0), support_mask=valid).attention[b]
    assert not torch.allclose(masked[:h, :w], alone, rtol=1e-3, atol=1e-6)
    # the padding is drawn without the view sizes
    hits = sum(int((~valid.flatten(1)).gather(1, plain.indices).sum()) for plain in
               [m(low, sources, generator=torch.Generator().manual_seed(s)) for s in range(20)])
    assert hits > 0


def _padding_hits(m, low, sources, view_sizes, draws, **kwargs) -> tuple[int, int]:
    H, W = low.shape[-2:]
    exists = torch.zeros(len(view_sizes), H, W, dtype=torch.bool)
    for i, (h, w) in enumerate(view_sizes.tolist()):
        exists[i, :h, :w] = True
    gen = torch.Generator().manual_seed(11)
    hits = total = 0
    with torch.no_grad():
        for _ in range(draws):
            out = m(low, sources, generator=gen, view_sizes=view_sizes, **kwargs)
            hits += int((~exists.flatten(1)).gather(1, out.indices).sum())
            total += out.indices.numel()
    return hits, total


@pytest.mark.parametrize("replace", [False, True])
def test_padding_is_never_drawn(replace):
    m = _model(replace=replace)
    low, sources, view_sizes = _batch(_images())
    hits, total = _padding_hits(m, low, sources, view_sizes, 300)
    assert (hits, total) == (0, 300 * 3 * N)


def test_padding_is_never_drawn_even_when_an_image_has_fewer_supported_cells_than_draws():
    """A tissue mask keeping 2 cells of the smallest image, 4 draws: the 2 draws of
    probability 0 are that image's own unsupported cells (weight 0), never padding, whose
    keys tie with them at -inf without the fix."""
    m = _model()
    images = _images()
    lows = [low_res_view(img, SCALE) for img in images]
    low, view_sizes = batch_views(lows)
    masks = [None, None, torch.zeros(lows[2].shape[-2:], dtype=torch.bool)]
    masks[2][0, 0] = masks[2][3, 4] = True
    support = batch_support(masks, low.shape[-2:])
    hits, _ = _padding_hits(m, low, [TensorSource(i) for i in images], view_sizes, 50, support_mask=support)
    assert hits == 0
    out = m(low, [TensorSource(i) for i in images], generator=torch.Generator().manual_seed(1),
            view_sizes=view_sizes, support_mask=support)
    assert int((out.weights[2] > 0).sum()) == 2  # the supported cells; the two others weigh nothing


def test_more_draws_than_the_smallest_image_has_cells_is_refused_as_alone():
    m = _model()
    images = _images()
    low, sources, view_sizes = _batch(images)
    with pytest.raises(ValueError, match="from only 42 positions"):  # the 6x7 view
        m(low, sources, n_patches=43, view_sizes=view_sizes)
    with pytest.raises(ValueError, match="from only 42 positions"):
        m(low_res_view(images[2], SCALE)[None], [TensorSource(images[2])], n_patches=43)


# ------------------------------------------------- unbiasedness on a padded batch
SMALL, FRAME = (40, 56), (72, 64)  # the image (5x7 cells) and the frame it is padded to (9x8 cells)


def _exact(m, img, c):
    """<c, logits> at the full expectation sum_i a_i f_i over the image's own cells."""
    low = low_res_view(img, SCALE)[None]
    scores = m.attention_net(low)
    att = tuple(scores.shape[-2:])
    a = attention_distribution(scores)
    idx = torch.arange(a.shape[1])[None]
    offsets = positions_to_offsets(idx, att, SMALL, m.patch_size, low_size=tuple(low.shape[-2:]))
    patches = TensorSource(img).read_patches(offsets[0], m.patch_size).float() / 255.0
    f = m.patch_features(patches)[None]
    values = m.pooling.values(f, m.classifier, Where(a, att, idx, torch.tensor([SMALL]), m.patch_size))
    return (m.pooling.readout(torch.einsum("bk,bkv->bv", a, values), m.classifier) * c).sum()


def _z_padded(m, *, with_view_sizes: bool, groups: int = 30, per_group: int = 200) -> float:
    g = torch.Generator().manual_seed(0)
    img = (torch.rand(1, *SMALL, generator=g) * 255).to(torch.uint8)
    big = (torch.rand(1, *FRAME, generator=g) * 255).to(torch.uint8)
    c = torch.tensor([0.7, -1.3, 0.4])
    params = [p for p in m.parameters() if p.requires_grad]
    value = _exact(m, img, c)
    exact = torch.cat([x.flatten() for x in torch.autograd.grad(value, params)])
    # the small image padded to the frame of a larger one, as collate pads it
    low, view_sizes = batch_views([low_res_view(img, SCALE), low_res_view(big, SCALE)])
    low, view_sizes = low[:1].expand(per_group, -1, -1, -1), view_sizes[:1].expand(per_group, -1)
    sources = [TensorSource(img)] * per_group
    kwargs = {"view_sizes": view_sizes} if with_view_sizes else {}
    gen = torch.Generator().manual_seed(1)
    means, values = [], []
    for _ in range(groups):
        out = m(low, sources, generator=gen, **kwargs)
        estimate = (out.logits * c).sum(1).mean()
        values.append(float(estimate.detach()))
        means.append(torch.cat([x.flatten() for x in torch.autograd.grad(estimate, params)]))
    gm = torch.stack(means)
    z = max_z(gm.mean(0), gm.std(0) / groups ** 0.5, exact)
    v = torch.tensor(values)
    return max(z, float((v.mean() - value.detach()).abs() / (v.std() / groups ** 0.5)))


@pytest.mark.parametrize("estimator", ["threshold", "sequential"])
def test_the_estimate_on_a_padded_batch_is_unbiased_and_with_padding_drawable_it_is_not(estimator):
    m = _model(estimator=estimator)
    m.entropy_weight = 0.0
    assert _z_padded(m, with_view_sizes=True) < 5.0
    assert _z_padded(m, with_view_sizes=False) > 10.0  # the padding takes attention and is drawn


# ------------------------------------------------------------- the data loader
def test_collate_pads_the_views_and_keeps_their_sizes():
    images = _images()
    items = [(low_res_view(img, SCALE), TensorSource(img), b, b, None) for b, img in enumerate(images)]
    batch = collate(items)
    assert tuple(batch.low.shape) == (3, 1, 11, 12) and batch.view_sizes.tolist() == [[8, 12], [11, 5], [6, 7]]
    for b, (h, w) in enumerate(batch.view_sizes.tolist()):
        assert torch.equal(batch.low[b, :, :h, :w], items[b][0])
        around = torch.ones(batch.low.shape[-2:], dtype=torch.bool)
        around[:h, :w] = False
        assert (batch.low[b][:, around] == 0).all()  # zeros around it
    assert batch.views == {"view_sizes": batch.view_sizes}
    same = collate(items[:1] * 2)
    assert same.view_sizes is None and same.views == {}


# ----------------------------------------------------------- end to end, the CLI
def _photo_folder(root):
    """12 small photos in 2 class folders, PNG and JPEG, in 4 sizes and aspect ratios."""
    rng = np.random.default_rng(0)
    sizes = [(64, 96), (96, 64), (80, 80), (72, 120)]
    for i in range(12):
        cls = "bright" if i % 2 else "dark"
        h, w = sizes[i % 4]
        base = 170 if cls == "bright" else 60
        pixels = (base + 40 * rng.random((h, w, 3))).clip(0, 255).astype(np.uint8)
        (root / cls).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / cls / f"{i}.{'png' if i % 3 else 'jpg'}")


def test_a_folder_of_mixed_sizes_trains_in_batches_and_predicts(tmp_path):
    from typer.testing import CliRunner

    from ats_cli.cli import app

    _photo_folder(tmp_path / "photos")
    runner = CliRunner()
    made = runner.invoke(app, ["make-dataset", "from-folder", str(tmp_path / "photos"), str(tmp_path / "ds"),
                               "--test", "0.25"])
    assert made.exit_code == 0, made.output
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(tmp_path / "ds"), "--out", str(run), "--epochs", "1",
                                 "--n-patches", "2", "--patch-size", "16", "--scale", "0.125",
                                 "--set", "feature_width=4", "--set", "attention_width=4", "--workers", "0",
                                 "--no-prepare"])
    assert result.exit_code == 0, result.output
    # not 1: mixed sizes batch together (4: the 12 images' 16 steps an epoch, at least 4 a step)
    assert json.loads((run / "config.json").read_text())["batch_size"] == 4
    assert "4 sizes" in result.output
    out = tmp_path / "pred.csv"
    predicted = runner.invoke(app, ["predict", str(tmp_path / "ds"), "--model", str(run), "--out", str(out),
                                    "--batch-size", "3"])
    assert predicted.exit_code == 0, predicted.output
    assert len(out.read_text().splitlines()) == 1 + 4  # the header and the 4 test images

    # the predictor batches them together; each image's record has its own attention grid
    from ats_cli.predict import load_predictor
    from ats_cli.predict.inputs import InputItem
    from ats_cli.render.records import AttentionRecord

    predictor = load_predictor(run, "cpu")
    paths = sorted((tmp_path / "photos").rglob("*.*"))[:4]
    seen = []

    def record(index, row, opened, output, b):
        seen.append((b, AttentionRecord.from_output(predictor.model, opened, output, b).attention.shape,
                     tuple(opened.low.shape[-2:])))

    rows = predictor.predict([InputItem(p) for p in paths], batch_size=4, on_output=record)
    assert all(r.error is None for r in rows) and len({tuple(opened) for _, _, opened in seen}) > 1
    assert [b for b, _, _ in seen] == [0, 1, 2, 3]  # one batch of the 4 sizes
    assert all(shape == view for _, shape, view in seen)  # mnist-attention: one cell per view pixel
    assert all(len(r.probs) == 2 and abs(sum(r.probs) - 1) < 1e-5 for r in rows)
