"""ATSModel end to end: shapes, gradients to both networks, lazy patch reads, learning."""

from __future__ import annotations

import pytest
import torch

from ats_cli import nets
from ats_cli.core import ATSModel, TensorSource, low_res_view
from ats_cli.core.sampling import estimator_weights
from ats_cli.extensions.pooling import FeaturePooling, Where


def make_model(n_patches=4, patch=(16, 16), scale=0.25, channels=1, classes=3, attention="mnist-attention",
               attention_width=8, **kw):
    return ATSModel(
        nets.create(attention, in_channels=channels, width=attention_width),
        nets.create("mnist-features", in_channels=channels, width=8),
        classes,
        n_patches=n_patches,
        patch_size=patch,
        scale=scale,
        **kw,
    )


def test_shapes_and_outputs():
    torch.manual_seed(0)
    model = make_model()
    images = torch.randint(0, 256, (2, 1, 64, 80), dtype=torch.uint8)
    out = model(low_res_view(images, model.scale), images, return_patches=True)
    assert out.logits.shape == (2, 3)
    assert out.attention.shape == (2, 16, 20)
    torch.testing.assert_close(out.attention.sum((1, 2)), torch.ones(2))
    assert out.indices.shape == (2, 4) and out.offsets.shape == (2, 4, 2)
    assert out.sampled_probs.shape == (2, 4) and out.entropy.shape == (2,)
    assert out.patches.shape == (2, 4, 1, 16, 16)
    # the returned patches are the image regions at the returned offsets
    r, c = out.offsets[0, 0].tolist()
    region = images[0, 0, max(r, 0):r + 12, max(c, 0):c + 12].float() / 255
    patch = out.patches[0, 0, 0, max(-r, 0):max(-r, 0) + region.shape[0], max(-c, 0):max(-c, 0) + region.shape[1]]
    torch.testing.assert_close(patch, region)
    # more patches at prediction than at training
    assert model(low_res_view(images, model.scale), images, n_patches=7).indices.shape == (2, 7)


def test_both_networks_receive_gradients():
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images = torch.randint(0, 256, (4, 1, 64, 64), dtype=torch.uint8)
    target = torch.tensor([0, 1, 2, 0])
    low = low_res_view(images, model.scale)
    # The attention's last layer starts at zero (uniform attention), so its first step
    # moves only that layer; from the second step on every parameter has a gradient.
    for _ in range(2):
        opt.zero_grad()
        model.loss(model(low, images), target).backward()
        opt.step()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


class CountingSource:
    """A patch source that is not a tensor and records what is read from it."""

    def __init__(self, image):
        self._inner = TensorSource(image)
        self.reads = []

    @property
    def size(self):
        return self._inner.size

    @property
    def channels(self):
        return self._inner.channels

    def read_patches(self, offsets, size):
        self.reads.append((offsets.clone(), size))
        return self._inner.read_patches(offsets, size)


def test_patch_sources_are_read_lazily_and_match_the_tensor_path():
    torch.manual_seed(0)
    model = make_model(n_patches=5)
    images = torch.randint(0, 256, (2, 1, 96, 96), dtype=torch.uint8)
    low = low_res_view(images, model.scale)
    sources = [CountingSource(im) for im in images]
    out_src = model(low, sources, generator=torch.Generator().manual_seed(3))
    out_ten = model(low, images, generator=torch.Generator().manual_seed(3))
    for s in sources:  # one read per image, of exactly the sampled patches
        assert len(s.reads) == 1
        offsets, size = s.reads[0]
        assert offsets.shape == (5, 2) and size == (16, 16)
    torch.testing.assert_close(out_src.logits, out_ten.logits)


def _stripes_batch(g, B, size=64, box=12):
    """A bright square at a random place; its class (horizontal / vertical / checker
    stripes) is invisible in a 1/8 view, which only shows where the square is."""
    images = torch.zeros(B, 1, size, size, dtype=torch.uint8)
    labels = torch.randint(0, 3, (B,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(box), torch.arange(box), indexing="ij")
    patterns = [(yy % 2 == 0), (xx % 2 == 0), ((yy + xx) % 2 == 0)]
    for b in range(B):
        r, c = torch.randint(0, size - box, (2,), generator=g).tolist()
        images[b, 0, r:r + box, c:c + box] = 80 + 175 * patterns[labels[b]].to(torch.uint8)
    return images, labels


@pytest.mark.parametrize("attention,width,scale,steps", [("mnist-attention", 8, 0.125, 150),
                                                         ("block-attention", 16, 0.25, 250)])
def test_learns_where_to_look_and_what_it_sees(attention, width, scale, steps):
    """A small task where success needs the attention gradient: with 2 patches out of 64
    positions (paper net, 8x8 view) or 256 (block-attention: a 16x16 view scored in 3x3
    blocks), uniform sampling seldom sees the square. block-attention gets more steps: it
    has four times the positions to search."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = make_model(n_patches=2, patch=(16, 16), scale=scale, entropy_weight=0.0, attention=attention,
                       attention_width=width)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        images, labels = _stripes_batch(g, 32)
        opt.zero_grad()
        model.loss(model(low_res_view(images, model.scale), images), labels).backward()
        opt.step()
    images, labels = _stripes_batch(g, 256)
    with torch.no_grad():
        out = model(low_res_view(images, model.scale), images)
    acc = (out.logits.argmax(1) == labels).float().mean().item()
    assert acc > 0.9, acc


def test_registry_builds_every_network_with_the_promised_shapes():
    low = torch.rand(2, 1, 30, 40)
    for name in nets.available("attention"):
        net = nets.create(name, in_channels=1)
        m = getattr(net, "margin", 0)
        assert net(low).shape == (2, 1, 30 - 2 * m, 40 - 2 * m), name
    patches = torch.rand(6, 1, 50, 50)
    for name in nets.available("features"):
        net = nets.create(name, in_channels=1, width=16)
        assert net(patches).shape == (6, net.out_features) == (6, 16), name
    try:
        nets.create("no-such-net")
    except nets.UnknownNetworkError as e:
        assert "mnist-features" in str(e)
    else:
        raise AssertionError("unknown network accepted")


def test_feature_scale_multiplies_the_normalised_features_before_the_classifier():
    torch.manual_seed(0)
    base = make_model()
    scaled = make_model(feature_scale=10.0)
    scaled.load_state_dict(base.state_dict())
    images = torch.randint(0, 256, (2, 1, 64, 80), dtype=torch.uint8)
    low = low_res_view(images, base.scale)
    out_1 = base(low, images, generator=torch.Generator().manual_seed(1))
    out_10 = scaled(low, images, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out_1.indices, out_10.indices)  # the attention is untouched
    bias = base.classifier.bias
    torch.testing.assert_close(out_10.logits - bias, 10 * (out_1.logits - bias))


def test_more_patches_than_supported_cells_keeps_the_support():
    """The bright support leaves a few bright cells; asking for more patches than that must not
    spread the attention over the dark background (it once fell back to the whole map)."""
    torch.manual_seed(0)
    model = make_model(n_patches=4, support={"name": "bright", "threshold": 0.3}).eval()
    images = torch.zeros(2, 1, 64, 80, dtype=torch.uint8)
    images[0, 0, 8:14, 10:30] = 255  # image 0: two bright blobs -> a few supported cells
    images[0, 0, 40:46, 60:70] = 200
    # image 1 stays blank: no supported cell at all
    low = low_res_view(images, model.scale)
    keep = model.sampling_support(low, (16, 20))
    n_kept = int(keep[0].sum())
    assert 0 < n_kept < 40 and bool(keep[1].all())  # blank image -> the whole map
    with torch.no_grad():
        out = model(low, images, n_patches=n_kept + 5, generator=torch.Generator().manual_seed(0))
    att = out.attention.flatten(1)
    assert float(att[0][~keep[0].flatten()].sum()) == 0.0  # no mass on the background
    # every supported cell is drawn first; the extra draws have probability 0
    assert set(out.indices[0, :n_kept].tolist()) == set(torch.nonzero(keep[0].flatten()).flatten().tolist())
    assert bool((out.sampled_probs[0, n_kept:] == 0).all())
    assert bool((estimator_weights(out.sampled_probs[:1])[0, n_kept:] == 0).all())  # ... and weight 0


def test_auto_estimator_is_the_per_image_rule_in_training_and_threshold_in_prediction():
    """Same weights, same draws (same seed): in eval mode ``auto`` gives exactly the
    ``threshold`` logits; in training mode it follows the per-image perplexity rule, which
    for an untrained (flat) attention over 320 cells and 4 patches is ``sequential``."""
    torch.manual_seed(0)
    model = make_model()
    images = torch.randint(0, 256, (2, 1, 64, 80), dtype=torch.uint8)
    low = low_res_view(images, model.scale)

    def logits(estimator, training):
        model.estimator = estimator
        model.train(training)
        with torch.no_grad():
            return model(low, images, generator=torch.Generator().manual_seed(3)).logits

    torch.testing.assert_close(logits("auto", False), logits("threshold", False))
    assert not torch.allclose(logits("auto", False), logits("sequential", False))
    # batch norm behaves differently in train mode, so compare within train mode
    torch.testing.assert_close(logits("auto", True), logits("sequential", True))
    assert not torch.allclose(logits("auto", True), logits("threshold", True))


@pytest.mark.parametrize("kw", [{}, {"gain": {"name": "learned"}}, {"pooling": {"name": "votes", "none_class": True}},
                                {"pooling": {"name": "counts", "floor": 0.02}}])
def test_the_output_carries_the_estimator_weights_and_each_draws_contribution(kw):
    """Consumers (figures, GeoJSON) read what the model did from its output: the weights must
    be the ones the estimate used (rebuilding the pooled estimate from them gives the logits),
    and each contribution the weight times the size of what the draw pooled."""
    from ats_cli.core.sampling import estimator_threshold, sample

    torch.manual_seed(0)
    model = make_model(n_patches=6, **kw).eval()
    if model.gain is not None:  # gains other than 1, so that the test can tell them from the weights
        torch.nn.init.normal_(model.gain.linear.weight, std=0.5)
    images = torch.randint(0, 256, (2, 1, 64, 80), dtype=torch.uint8)
    with torch.no_grad():
        out = model(low_res_view(images, model.scale), images, return_patches=True,
                    generator=torch.Generator().manual_seed(3))
        unit, gain = model.patch_parts(out.patches.flatten(0, 1))
        feats = (unit if gain is None else gain * unit).view(2, 6, -1)
    # the same draw again, from the same seed: the threshold estimator's weights of it
    probs = out.attention.flatten(1)
    draw = sample(probs, 6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draw.indices, out.indices)
    threshold = estimator_threshold(model.active_estimator, draw, probs)
    assert torch.allclose(out.weights, estimator_weights(out.sampled_probs, threshold=threshold))
    if isinstance(model.pooling, FeaturePooling):
        assert torch.allclose(model.classifier(torch.einsum("bn,bnd->bd", out.weights, feats)), out.logits, atol=1e-5)
        size = torch.ones(2, 6) if gain is None else gain.view(2, 6)
        assert gain is None or not torch.allclose(size, torch.ones(2, 6))
    else:
        where = Where(out.attention.flatten(1), tuple(out.attention.shape[-2:]), out.indices,
                      torch.tensor([[64, 80]] * 2), model.patch_size)
        values = model.pooling.values(feats, model.classifier, where)
        assert torch.allclose(torch.einsum("bn,bnc->bc", out.weights, values).log(), out.logits, atol=1e-5)
        size = values.sum(-1)
    assert torch.allclose(out.contributions, out.weights.double() * size.double(), atol=1e-6)


def test_the_patch_loss_teaches_the_features_and_leaves_the_estimate_and_the_attention_as_they_were():
    """--patch-loss adds each drawn patch's own cross-entropy against its image's label
    (ATSModel.patch_nll): its value is that mean; the forward pass (logits, attention,
    draws) is the same with or without it, and so is the attention net's gradient, so the
    sampled estimate and its unbiased gradients are untouched; the feature net's gradient
    changes. Negative control: the entropy weight, a term that does reach the attention,
    changes the attention net's gradient in the same comparison."""
    images = torch.randint(0, 256, (4, 1, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 1, 2, 0])

    def grads(**kw):
        torch.manual_seed(0)
        model = make_model(**kw)
        with torch.no_grad():  # a non-uniform attention, so that the attention net's whole gradient is in play
            model.attention_net.score.weight.normal_(0, 0.5)
        low = low_res_view(images, model.scale)
        out = model(low, images, generator=torch.Generator().manual_seed(3))
        loss = model.loss(out, target)
        loss.backward()
        att = torch.cat([p.grad.flatten() for p in model.attention_net.parameters()])
        feat = torch.cat([p.grad.flatten() for p in model.feature_net.parameters()])
        return out, loss, att, feat

    out0, loss0, att0, feat0 = grads()
    out1, loss1, att1, feat1 = grads(patch_loss=1.0)
    torch.testing.assert_close(out1.logits, out0.logits)
    torch.testing.assert_close(out1.attention, out0.attention)
    assert torch.equal(out1.indices, out0.indices)
    expected = torch.nn.functional.cross_entropy(out0.patch_logits.flatten(0, 1), target.repeat_interleave(4))
    torch.testing.assert_close(loss1 - loss0, expected)
    torch.testing.assert_close(att1, att0)  # the attention learns from the estimate alone
    assert not torch.allclose(feat1, feat0)  # the features learn from each patch too
    _, _, att_entropy, _ = grads(entropy_weight=0.5)  # negative control: a term that reaches the attention
    assert not torch.allclose(att_entropy, att0)


def test_the_patch_loss_of_a_multi_label_model_is_each_patchs_binary_cross_entropy():
    """Multi-hot labels: the per-patch term is each patch's per-class binary cross-entropy
    against its image's label set, summed over classes as the image's is (ats_cli.multilabel)."""
    from ats_cli.multilabel import loss as multilabel_loss

    images = torch.randint(0, 256, (2, 1, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    torch.manual_seed(0)
    model = make_model(patch_loss=1.0)
    out = model(low_res_view(images, model.scale), images, generator=torch.Generator().manual_seed(3))
    model.patch_weight = 0.0
    without = multilabel_loss(model, out, target)
    model.patch_weight = 1.0
    per_patch = torch.nn.functional.binary_cross_entropy_with_logits(
        out.patch_logits, target[:, None].expand_as(out.patch_logits), reduction="none").sum(-1).mean()
    torch.testing.assert_close(multilabel_loss(model, out, target) - without, per_patch)
