"""Every extension (ats_cli.extensions) keeps the estimate and its gradients unbiased, and a
biased variant of it fails the same check (tests/montecarlo.py); extensions are created by
name from plain specs, and a spec that is wrong is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ats_cli.core import model as model_module
from ats_cli.core.source import low_res_view
from ats_cli.extensions import (
    KINDS,
    ExtensionError,
    UnknownExtensionError,
    available_extensions,
    create_extension,
)
from ats_cli.extensions.gain_learned import LearnedGain
from ats_cli.extensions.pooling_counts import CountPooling, local_mass
from ats_cli.extensions.pooling_highest import HighestCountPooling, HighestPooling
from ats_cli.extensions.pooling_topmost import TopmostCountPooling
from ats_cli.extensions.pooling_votes import VotePooling
from ats_cli.extensions.prior_rarity import RarityPrior
from ats_cli.extensions.support_bright import BrightSupport
from tests.montecarlo import (
    SCALE,
    Z_MAX,
    TinyFeatures,
    cell_patches,
    exact_attention,
    exact_value,
    image,
    tiny_model,
    z_of_estimate,
)

D, CLASSES = TinyFeatures.out_features, 3
REJECTED = 3 * Z_MAX  # what a biased variant must reach: far past the bound, not near it
QUICK = {"groups": 20, "per_group": 200}  # a negative control needs less to be rejected by far


# ---------------------------------------------------------------- pooling "features" (the thesis)
@pytest.mark.parametrize("estimator", ["sequential", "threshold"])
def test_pooled_features_are_unbiased(estimator):
    assert z_of_estimate(tiny_model(estimator)) < Z_MAX


def test_the_check_rejects_a_biased_estimator(monkeypatch):
    """The sampled features weighted by their attention, renormalised over the draws: it
    over-weights the favoured positions twice."""
    monkeypatch.setattr(model_module, "expectation",
                        lambda feats, probs, **_: (probs[..., None] * feats).sum(1) / probs.sum(1, keepdim=True))
    assert z_of_estimate(tiny_model("sequential"), **QUICK) > REJECTED


# ------------------------------------------------------- poolings "highest", "highest-counts", "topmost-counts"
def _seen(pooling):
    """The pooling, keeping what its readout read, which tests/montecarlo.py then checks:
    the presence logits ``classifier(E_a[f])`` (``highest``) or the counts ``E_a[c]``
    (``highest-counts``; ``topmost-counts``: per attention row, [B, rows, classes]), linear
    in the estimate where the logits are not."""
    readout = pooling.readout

    def reading(pooled, classifier):
        pooling.read = (classifier(pooled) if isinstance(pooling, HighestPooling)
                        else pooled.view(pooled.shape[0], -1, classifier.out_features))
        return readout(pooled, classifier)

    pooling.readout = reading
    return pooling


def _sharp(pooling, factor: float = 4.0, **kw):
    """A classifier ``factor`` times as sharp as at random: presence logits (and votes) that
    vary across draws by several units, where the readout bends them most."""
    m = tiny_model("sequential", pooling=pooling, **kw)
    with torch.no_grad():
        m.classifier.weight.mul_(factor)
    return m


def test_the_highest_class_present_is_unbiased():
    """Its pooled values are the features, so what its readout reads, the presence logits,
    is estimated without bias in value and gradient."""
    assert z_of_estimate(_sharp(_seen(HighestPooling(D, CLASSES)))) < Z_MAX


def test_the_check_rejects_the_highest_readout_averaged_as_if_linear():
    """The readout is nonlinear: the mean of its logits over draws is not their value at the
    expectation, which the same check, reading the logits, sees. Its log-sigmoids are nearly
    linear where the presence logits lie at 4x (z ~6 with the full check), so 16x, where
    they bend: z ~28."""
    assert z_of_estimate(_sharp(HighestPooling(D, CLASSES), factor=16.0)) > REJECTED


@pytest.mark.parametrize("floor", [0.0, 0.3])
def test_the_highest_class_counted_is_unbiased(floor):
    """Its pooled values are counts (with a none logit; a floor of 0.3 is reached by some
    cells): what its Poisson readout reads is estimated without bias, as counts' are."""
    pooling = _with_none_head(HighestCountPooling(D, CLASSES, none_class=True, floor=floor))
    assert z_of_estimate(_sharp(_seen(pooling), patch=16)) < Z_MAX


def test_the_check_rejects_the_highest_count_readout_averaged_as_if_linear():
    """exp of its logits, P(label = k), is not linear in the counts, and the check sees it
    (with no floor, where the counts vary most across draws)."""
    pooling = _with_none_head(HighestCountPooling(D, CLASSES, none_class=True, floor=0.0))
    assert z_of_estimate(_sharp(pooling, patch=16), **QUICK) > REJECTED


@pytest.mark.parametrize("floor", [0.0, 0.3])
def test_the_topmost_class_counted_is_unbiased(floor):
    """Its pooled values are counts placed in their cell's attention row: what its readout
    reads, the counts per row, is estimated without bias in value and gradient."""
    pooling = _with_none_head(TopmostCountPooling(D, CLASSES, none_class=True, floor=floor))
    m = _sharp(_seen(pooling), patch=16)
    assert m.attention_net(low_res_view(image(), SCALE)).shape[-2] > 2  # rows to keep apart
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_the_topmost_count_readout_averaged_as_if_linear():
    """exp of its logits is not linear in the counts per row, and the check sees it."""
    pooling = _with_none_head(TopmostCountPooling(D, CLASSES, none_class=True, floor=0.0))
    assert z_of_estimate(_sharp(pooling, patch=16), **QUICK) > REJECTED


class _ReadingFloorFromTheDraws(TopmostCountPooling):
    """In eval mode, each draw counted over the largest mass among the drawn cells: a
    reading floor that depends on which cells were drawn."""

    def count(self, votes, mass):
        if self.training:
            return super().count(votes, mass)
        return votes / mass.float().amax(1, keepdim=True)[..., None]


def test_the_reading_floor_is_the_one_eval_mode_reads_and_is_unbiased():
    """``eval_floor``: the floor evaluation and prediction read at, ``floor`` training's.
    The exact expectation differs between the modes (the switch is real), and in eval mode
    the estimate of what the readout reads stays unbiased in value and gradient."""
    pooling = _with_none_head(TopmostCountPooling(D, CLASSES, none_class=True, floor=0.3, eval_floor=0.0))
    m = _sharp(_seen(pooling), patch=16)
    img, c = image(), torch.tensor([0.7, -1.3, 0.4])
    trained = exact_value(m, img, c)
    m.eval()
    assert pooling.floor_now == 0.0 and not torch.allclose(trained, exact_value(m, img, c))
    assert z_of_estimate(m) < Z_MAX
    m.train()
    assert pooling.floor_now == 0.3


def test_the_check_rejects_a_reading_floor_taken_from_the_draws():
    pooling = _with_none_head(_ReadingFloorFromTheDraws(D, CLASSES, none_class=True, floor=0.3, eval_floor=0.0))
    assert z_of_estimate(_sharp(_seen(pooling), patch=16).eval(), **QUICK) > REJECTED


# ---------------------------------------------------------------- pooling "votes"
class _VotesOverTheDraws(VotePooling):
    """Each vote over the attention the draws hold: a vote normalised over what was drawn."""

    def values(self, feats, classifier, where=None):
        drawn = where.probs.gather(1, where.indices).sum(1)
        return super().values(feats, classifier, where) / drawn[:, None, None]


def _with_none_head(pooling):
    torch.manual_seed(5)
    nn.init.normal_(pooling.none.weight, std=0.5)  # a patch-dependent none logit, not a constant
    return pooling


def test_votes_with_a_none_logit_are_unbiased():
    m = tiny_model("threshold", pooling=_with_none_head(VotePooling(D, CLASSES, none_class=True)), patch=16)
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_votes_normalised_over_the_draws():
    assert z_of_estimate(tiny_model("sequential", pooling=_VotesOverTheDraws(D, CLASSES), patch=16), **QUICK) > REJECTED


# ---------------------------------------------------------------- pooling "counts"
class _CountsOverTheDrawnMass(CountPooling):
    """M from the attention of the drawn cells only: a mass that depends on the draw."""

    def values(self, feats, classifier, where=None):
        kept = where.probs.gather(1, where.indices)
        drawn = torch.zeros_like(where.probs).scatter(1, where.indices, kept)
        mass = local_mass(drawn, where.att_shape, where.sizes, where.patch_size).gather(1, where.indices)
        return self.count(self.probabilities(feats, classifier), mass)


@pytest.mark.parametrize("estimator, floor, none_class", [("threshold", 0.0, False), ("sequential", 0.3, True)])
def test_counts_are_unbiased(estimator, floor, none_class):
    """Patches of 16 px on cells of 8: M sums 3x3 cells, so it moves with the attention (with
    one cell a_i p_i / M_i = p_i and the attention's exact gradient is 0: nothing to test).
    A floor of 0.3 is reached by most cells here, not all."""
    pooling = CountPooling(D, CLASSES, none_class=none_class, floor=floor)
    m = tiny_model(estimator, pooling=_with_none_head(pooling) if none_class else pooling, patch=16)
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_counts_over_the_drawn_mass():
    m = tiny_model("sequential", pooling=_CountsOverTheDrawnMass(D, CLASSES), patch=16)
    assert z_of_estimate(m, **QUICK) > REJECTED


# ---------------------------------------------------------------- support "bright"
class _RedrawnSupport(BrightSupport):
    """Each bright pixel kept with probability 1/2, redrawn at every call: not a fixed
    function of the input."""

    def forward(self, low):
        return super().forward(low) & (torch.rand(low[:, :1].shape) < 0.5)


def test_the_bright_support_is_unbiased():
    m = tiny_model("auto", support={"name": "bright", "threshold": 0.5})
    kept = int((exact_attention(m, image()) > 0).sum())
    assert 6 < kept < 36  # the support does leave out cells
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_a_support_that_is_not_a_function_of_the_input():
    torch.manual_seed(0)
    assert z_of_estimate(tiny_model("auto", support=_RedrawnSupport(threshold=0.5)), **QUICK) > REJECTED


# ---------------------------------------------------------------- prior "rarity"
class _RedrawnPrior(RarityPrior):
    """The rarity prior plus noise redrawn at every call: not a fixed function of the input."""

    def forward(self, low, keep):
        prior = super().forward(low, keep)
        return prior + 1.5 * torch.randn(prior.shape)


def test_the_rarity_prior_is_unbiased():
    """Strong enough to matter: the prior does reshape the attention."""
    m = tiny_model("auto", prior={"name": "rarity", "weight": 1.5})
    low = low_res_view(image(), SCALE)
    a = torch.softmax((m.attention_net(low) + m.log_prior(low, (6, 6))[:, None]).flatten(1), 1)
    assert float((a.max() / a.min()).detach()) > 5
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_a_prior_that_is_not_a_function_of_the_input():
    torch.manual_seed(0)
    assert z_of_estimate(tiny_model("auto", prior=_RedrawnPrior(weight=1.5)), **QUICK) > REJECTED


def test_a_capped_rarity_prior_starts_the_most_unusual_cells_alike_and_is_unbiased():
    """The cap binds (several cells at weight x cap, none above; below it the prior is the
    uncapped one) and the estimate stays unbiased; control: the same capped prior redrawn
    at every call is rejected."""
    m = tiny_model("auto", prior={"name": "rarity", "weight": 3.0, "cap": 1.5})
    low = low_res_view(image(), SCALE)
    capped = m.log_prior(low, (6, 6))
    plain = tiny_model("auto", prior={"name": "rarity", "weight": 3.0}).log_prior(low, (6, 6))
    assert float(capped.max()) == pytest.approx(4.5) and int((capped > 4.5 - 1e-6).sum()) >= 2
    assert float(plain.max()) > 4.5 + 0.1
    torch.testing.assert_close(capped, plain.clamp(max=4.5))
    a = torch.softmax((m.attention_net(low) + capped[:, None]).flatten(1), 1)
    assert float((a.max() / a.min()).detach()) > 2  # still reshapes the attention
    assert z_of_estimate(m) < Z_MAX
    torch.manual_seed(0)
    assert z_of_estimate(tiny_model("auto", prior=_RedrawnPrior(weight=3.0, cap=1.5)), **QUICK) > REJECTED


# ---------------------------------------------------------------- gain "learned"
class _GainOverTheDraws(LearnedGain):
    """Each gain over the mean gain of the patches drawn with it: depends on the draw."""

    def forward(self, raw):
        g = super().forward(raw)
        return g / g.mean()


def _spread(gain):
    torch.manual_seed(7)
    nn.init.normal_(gain.linear.weight, std=8.0)  # start: every gain 1; here: far from it, and unequal
    nn.init.constant_(gain.linear.bias, -4.0)
    return gain


def test_the_learned_gain_is_unbiased():
    """With gains that differ a lot between patches, the gain's own parameters included."""
    m = tiny_model("threshold", gain=_spread(LearnedGain(D)))
    gains = m.gain(m.feature_net(cell_patches(m, image()))).detach()
    assert float(gains.max() / gains.min()) > 3
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_a_gain_normalised_over_the_draws():
    assert z_of_estimate(tiny_model("sequential", gain=_spread(_GainOverTheDraws(D))), **QUICK) > REJECTED


# ---------------------------------------------------------------- specs and registries
def test_each_kind_has_its_registry_and_builds_from_a_plain_spec():
    assert {k: available_extensions(k) for k in KINDS} == {
        "pooling": ["features", "votes", "counts", "highest", "highest-counts", "topmost-counts"],
        "support": ["bright"],
        "prior": ["rarity"], "gain": ["learned"]}
    counts = create_extension("pooling", {"name": "counts", "none_class": True, "floor": 0.02}, features=D,
                              n_classes=CLASSES)
    assert isinstance(counts, CountPooling) and counts.floor == 0.02 and counts.none.out_features == 1
    assert create_extension("support", {"name": "bright", "threshold": 0.15}).threshold == 0.15
    assert create_extension("prior", {"name": "rarity", "weight": 2.0}).weight == 2.0
    assert isinstance(create_extension("gain", {"name": "learned"}, features=D), LearnedGain)


def test_a_model_takes_specs_in_its_slots_and_none_is_the_thesis():
    m = tiny_model(pooling={"name": "votes", "none_class": True}, support={"name": "bright", "threshold": 0.2})
    assert isinstance(m.pooling, VotePooling) and isinstance(m.support, BrightSupport)
    assert set(m.state_dict()) >= {"pooling.none.weight", "pooling.none.bias", "classifier.weight"}
    plain = tiny_model()
    assert plain.pooling.none is None and plain.support is plain.prior is plain.gain is None
    assert not any(k.startswith(("pooling.", "gain.")) for k in plain.state_dict())


@pytest.mark.parametrize("kind, spec, dims, message", [
    ("pooling", {"name": "mean"}, {"features": D, "n_classes": 3}, "unknown pooling 'mean'; available: features, "
                                                                   "votes, counts, highest, highest-counts, "
                                                                   "topmost-counts"),
    ("pooling", {"name": "counts", "flor": 0.1}, {"features": D, "n_classes": 3}, "pooling 'counts': .*'flor'"),
    ("pooling", {"name": "counts", "floor": 1.5}, {"features": D, "n_classes": 3}, "floor must be in"),
    ("support", {"name": "bright"}, {}, "support 'bright': .*threshold"),
    ("support", {"name": "bright", "threshold": 0.0}, {}, "threshold must be in"),
    ("prior", {"name": "rarity", "weight": -1.0}, {}, "weight must be > 0"),
    ("prior", {"name": "rarity", "weight": 1.0, "cap": 0.5}, {}, "cap must be > 1"),
    ("gain", "learned", {"features": D}, "a gain spec is a dict with a 'name'"),
    ("mask", {"name": "x"}, {}, "unknown kind of extension 'mask'"),
])
def test_a_wrong_spec_is_refused_in_one_line(kind, spec, dims, message):
    with pytest.raises((ExtensionError, UnknownExtensionError, ValueError), match=message) as e:
        create_extension(kind, spec, **dims)
    assert "\n" not in str(e.value)
