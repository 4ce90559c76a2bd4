"""The Monte Carlo check that an attention-sampling model's estimate is unbiased, in value
and in the gradient of every parameter: what every extension's test runs (tests/test_extensions.py).

The whole model runs (attention net -> prior, support -> sampling -> patches -> feature net,
gain -> pooling -> estimator -> readout) on one image, many times; the mean of a function
linear in the pooled estimate, and the mean of its gradient, are compared with their exact
values under the full expectation over every cell: |z| < Z_MAX for the value and every
parameter, the standard error taken from groups of draws. A biased variant must fail the
same check by far (each test beside its negative control), so that a pass means something.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ats_cli.core.model import ATSModel
from ats_cli.core.patches import extract_patches
from ats_cli.core.sampling import attention_distribution
from ats_cli.core.source import low_res_view, positions_to_offsets
from ats_cli.extensions.pooling import FeaturePooling, Where
from ats_cli.extensions.position import patch_centres
from ats_cli.nets import create

__all__ = ["Z_MAX", "SIZE", "PATCH", "SCALE", "N", "TinyFeatures", "tiny_model", "image", "cell_patches",
           "cell_positions", "exact_attention", "max_z", "z_of_estimate"]

Z_MAX = 5.0
SIZE, PATCH, SCALE, N = 48, 8, 0.125, 6  # 6x6 = 36 positions, 6 draws without replacement


class TinyFeatures(nn.Module):
    """No batch norm: a patch's feature must not depend on which other patches were drawn,
    or no pooling could be unbiased (the test would measure the net, not the estimator)."""

    out_features = 6  # the default width

    def __init__(self, width: int = out_features):
        super().__init__()
        self.out_features = width
        self.conv = nn.Conv2d(1, width, 3, padding=1)

    def forward(self, x):
        return torch.amax(torch.tanh(self.conv(x)), dim=(2, 3))


def tiny_model(estimator: str = "auto", *, patch: int = PATCH, **extensions) -> ATSModel:
    """A small model with a non-uniform attention, and ``extensions`` (pooling=, support=,
    prior=, gain=: specs or built extensions) in its slots; in training mode."""
    torch.manual_seed(3)
    m = ATSModel(create("mnist-attention", in_channels=1, width=4), TinyFeatures(), n_classes=3, n_patches=N,
                 patch_size=(patch, patch), scale=SCALE, entropy_weight=0.0, feature_scale=3.0,
                 estimator=estimator, **extensions)
    nn.init.normal_(m.attention_net.score.weight, std=0.5)  # the last layer is zero-initialised
    return m.train()


def image() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.rand(1, 1, SIZE, SIZE, generator=g) * 255).to(torch.uint8)


def exact_attention(m: ATSModel, img: torch.Tensor) -> torch.Tensor:
    """[1, K]: the model's attention on ``img``, its prior and support included."""
    low = low_res_view(img, SCALE)
    scores = m.attention_net(low)
    att = tuple(scores.shape[-2:])
    prior = m.log_prior(low, att)
    if prior is not None:
        scores = scores + prior[:, None]
    return attention_distribution(scores, m.sampling_support(low, att))


def _linear(m: ATSModel, logits: torch.Tensor) -> torch.Tensor:
    """A function of the logits linear in the pooled estimate, so that its mean over draws
    must equal its value at the exact expectation: the logits for pooled features (the
    classifier is linear; for ``highest``, ``highest-counts`` and ``topmost-counts``, what their
    readout read), their exp for the poolings read out as a log (votes, counts)."""
    if getattr(m.pooling, "read", None) is not None:  # tests/test_extensions.py _Seen: what the readout read
        return m.pooling.read
    return logits if isinstance(m.pooling, FeaturePooling) else logits.exp()


def cell_patches(m: ATSModel, img: torch.Tensor) -> torch.Tensor:
    """[K, C, ph, pw]: the patch of every cell of the attention grid, in [0, 1]."""
    low = low_res_view(img, SCALE)
    att = tuple(m.attention_net(low).shape[-2:])
    idx = torch.arange(att[0] * att[1])[None]
    offsets = positions_to_offsets(idx, att, (SIZE, SIZE), m.patch_size, low_size=tuple(low.shape[-2:]))
    return extract_patches(img, offsets, m.patch_size).float().flatten(0, 1) / 255.0


def cell_positions(m: ATSModel, img: torch.Tensor) -> torch.Tensor:
    """[1, K, 2]: the normalised centre of every cell's patch (what the position features see)."""
    low = low_res_view(img, SCALE)
    att = tuple(m.attention_net(low).shape[-2:])
    idx = torch.arange(att[0] * att[1])[None]
    offsets = positions_to_offsets(idx, att, (SIZE, SIZE), m.patch_size, low_size=tuple(low.shape[-2:]))
    return patch_centres(offsets, torch.tensor([[SIZE, SIZE]]), m.patch_size)


def exact_value(m: ATSModel, img: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """<c, _linear(logits)> at the full expectation sum_i a_i v_i over every cell."""
    low = low_res_view(img, SCALE)
    a = exact_attention(m, img)
    att = tuple(m.attention_net(low).shape[-2:])
    idx = torch.arange(a.shape[1])[None]
    f = m.patch_features(cell_patches(m, img))[None]  # [1, K, D]
    if m.position is not None:
        f = m.position(f, cell_positions(m, img))
    values = m.pooling.values(f, m.classifier, Where(a, att, idx, torch.tensor([[SIZE, SIZE]]), m.patch_size))
    logits = m.pooling.readout(torch.einsum("bk,bkv->bv", a, values), m.classifier)
    return (_linear(m, logits) * c).sum()


def _grads(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def max_z(mean: torch.Tensor, se: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest |mean - truth| / se. A component whose estimate does not vary beyond
    float rounding (a bias gradient, constant in every draw; a score bias, which a softmax
    ignores: zero by construction, ~1e-8 of rounding on both sides, whose z would be noise
    over noise) is compared with the truth to rounding instead: off it, infinitely biased."""
    scale = 1.0 + truth.abs()
    diff = (mean - truth).abs()
    varies = se > 1e-6 * scale
    return float(torch.where(varies, diff / se.clamp_min(1e-12), torch.where(diff > 1e-5 * scale, torch.inf, 0.0))
                 .max())


def z_of_estimate(m: ATSModel, groups: int = 40, per_group: int = 400) -> float:
    """The largest |z| of the Monte Carlo mean against the exact value, over the value and
    the gradient of every parameter (attention net, feature net, classifier, extensions)."""
    img = image()
    c = torch.tensor([0.7, -1.3, 0.4])
    params = [p for p in m.parameters() if p.requires_grad]
    value = exact_value(m, img, c)
    exact = _grads(value, params)
    low = low_res_view(img, SCALE).expand(per_group, -1, -1, -1)
    source = img.expand(per_group, -1, -1, -1)
    gen = torch.Generator().manual_seed(1)
    means, values = [], []
    for _ in range(groups):
        out = m(low, source, generator=gen)
        estimate = (_linear(m, out.logits) * c).flatten(1).sum(1).mean()  # [N, ..., classes]: per draw
        values.append(float(estimate.detach()))
        means.append(_grads(estimate, params))
    g = torch.stack(means)
    z = max_z(g.mean(0), g.std(0) / groups ** 0.5, exact)
    v = torch.tensor(values)
    return max(z, float((v.mean() - value.detach()).abs() / (v.std() / groups ** 0.5)))
