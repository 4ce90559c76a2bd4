"""Pooling votes and counts (``--pooling``, ats_cli.extensions.pooling_votes and
pooling_counts): a confident patch cannot outvote several, a patch of equal logits does not
vote, counts weigh every object once whatever its attention mass, and the flags become the
pooling's spec. Their unbiasedness: tests/test_extensions.py."""

from __future__ import annotations

import pytest
import torch

from ats_cli.config import ConfigError, TrainConfig
from ats_cli.extensions import ExtensionError, UnknownExtensionError
from ats_cli.extensions.pooling import FeaturePooling
from ats_cli.extensions.pooling_counts import CountPooling, local_mass
from ats_cli.extensions.pooling_votes import VotePooling
from ats_cli.models import create_model, extension_specs, model_spec
from ats_cli.recipes import resolve_config


def test_counts_weigh_every_object_once_where_votes_follow_the_attention_mass():
    """Two objects on a 20x20 attention grid (cells of 5 px, patches of 16 px: windows of
    5 cells): class 0 under 0.8 of the mass, spread over 4 cells; class 1 under 0.2, on
    one cell. The exact vote follows the mass; the exact count is one of each."""
    m = create_model({**_spec(pooling="counts"), "patch_size": [16, 16]})
    pooling = m.pooling
    a = torch.zeros(1, 20, 20)
    a[0, 3:5, 3:5] = 0.2
    a[0, 14, 12] = 0.2
    a = a.view(1, -1)
    p = torch.zeros(400, 3)
    p[:, 2] = 1.0  # cells without mass: their value never counts
    p[a[0] > 0.1] = torch.tensor([0.0, 0.0, 1.0])
    p[torch.tensor([3 * 20 + 3, 3 * 20 + 4, 4 * 20 + 3, 4 * 20 + 4])] = torch.tensor([1.0, 0.0, 0.0])
    p[14 * 20 + 12] = torch.tensor([0.0, 1.0, 0.0])
    mass = local_mass(a, (20, 20), torch.tensor([[100, 100]]), m.patch_size)[0]
    assert torch.allclose(mass[a[0] > 0], torch.tensor([0.8, 0.8, 0.8, 0.8, 0.2]))
    votes, counts = a[0] @ p, a[0] @ (p / mass.clamp_min(1e-30)[:, None])
    assert torch.allclose(votes, torch.tensor([0.8, 0.2, 0.0]))
    assert torch.allclose(counts, torch.tensor([1.0, 1.0, 0.0]))
    # --count-floor 0.5: the heavy object still counts once, the light one 0.2 / 0.5 of a count;
    # a floor of 1 is the vote
    for floor, expected in ((0.5, [1.0, 0.4, 0.0]), (1.0, [0.8, 0.2, 0.0])):
        assert torch.allclose(a[0] @ (p / mass.clamp_min(floor)[:, None]), torch.tensor(expected))
    # ... which is what the pooling divides each vote by
    feats, some = torch.randn(6, 8), torch.tensor([0.05, 0.2, 0.5, 0.7, 0.9, 1.0])
    pooling.floor = 0.5
    probs = m.classifier(feats).softmax(-1)
    assert torch.allclose(pooling.count(pooling.probabilities(feats, m.classifier), some),
                          probs / some.clamp_min(0.5)[:, None])
    with pytest.raises(ValueError, match="needs the attention around the draws"):
        pooling.values(feats[None], m.classifier)


def _spec(**kw):
    settings = {"patch_size": 16, "scale": 0.25, "n_patches": 4, "feature_width": 8, "min_brightness": 0.0,
                "rarity_prior": 0.0, **kw}
    return model_spec(TrainConfig(**settings), n_classes=3, channels=1)


def test_votes_give_each_patch_at_most_its_share_where_features_let_a_confident_one_win():
    """Three patches read class 0 a little, one reads class 1 strongly, equal attention:
    the average of logits (what pooled features amount to) follows the confident patch,
    the vote the three."""
    m = create_model(_spec(pooling="votes")).eval()
    logits = torch.tensor([[1.0, 0.0, 0.0]] * 3 + [[0.0, 8.0, 0.0]])
    votes = logits.softmax(-1).mean(0, keepdim=True)
    assert logits.mean(0).argmax() == 1 and m.pooling.readout(votes, m.classifier).argmax() == 0
    # a patch of equal logits adds the same to every class: the vote's order is unchanged
    flat = torch.cat([logits.softmax(-1), torch.full((5, 3), 1 / 3)]).mean(0, keepdim=True)
    read = m.pooling.readout
    assert read(flat, m.classifier).argsort().tolist() == read(votes, m.classifier).argsort().tolist()


def test_the_pooling_is_in_the_spec_and_a_class_without_votes_stays_finite():
    m = create_model(_spec(pooling="votes"))
    assert isinstance(m.pooling, VotePooling) and isinstance(create_model(_spec()).pooling, FeaturePooling)
    out = m.pooling.readout(torch.tensor([[0.5, 0.5, 0.0]]), m.classifier)
    assert torch.isfinite(out).all() and out[0, 2] < -80
    with pytest.raises(UnknownExtensionError, match="unknown pooling 'mean'"):
        create_model({**_spec(), "pooling": {"name": "mean"}})


def test_a_count_floor_outside_0_1_is_refused():
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="count_floor must be in"):
            resolve_config(None, pooling="counts", count_floor=bad)


def test_a_rarity_cap_is_in_the_spec_only_when_given_and_at_most_1_is_refused():
    assert "cap" not in extension_specs(resolve_config(None, rarity_prior=2.0))["prior"]
    assert extension_specs(resolve_config(None, rarity_prior=2.0, rarity_cap=4.5))["prior"] == {
        "name": "rarity", "weight": 2.0, "cap": 4.5}
    for bad in (-2.0, 0.5, 1.0):  # -1 is auto (ats_cli.config.settle)
        with pytest.raises(ConfigError, match="rarity_cap must be > 1"):
            resolve_config(None, rarity_cap=bad)


def test_a_none_logit_is_refused_where_patches_do_not_vote():
    with pytest.raises(ConfigError, match="none_class on needs pooling votes, counts, highest-counts"):
        resolve_config(None, none_class="on", pooling="features")
    with pytest.raises(ExtensionError, match="pooling 'features': .*none_class"):
        create_model({**_spec(), "pooling": {"name": "features", "none_class": True}})
    m = create_model(_spec(pooling="votes", none_class="on"))
    feats = torch.randn(4, 8)
    with torch.no_grad():
        m.pooling.none.weight.zero_()
        m.pooling.none.bias.fill_(30.0)  # every patch sure it shows no class: it votes (almost) nothing
        assert float(m.pooling.values(feats[None], m.classifier).sum(-1).max()) < 1e-6


def test_votes_are_refused_where_nothing_is_pooled_by_attention():
    for method in ("cnn", "deepmil"):
        with pytest.raises(ConfigError, match=f"pooling votes: method {method}"):
            resolve_config(None, method=method, pooling="votes")


def test_the_flags_become_the_extension_specs_the_model_is_built_from():
    """--pooling counts --none-class on --count-floor 0.02 --min-brightness 0.15, the prior and
    the gain off: the spec of the released Megapixel MNIST model, with its extensions nested."""
    spec = _spec(pooling="counts", none_class="on", count_floor=0.02, min_brightness=0.15)
    assert {k: spec[k] for k in ("pooling", "support", "prior", "gain")} == {
        "pooling": {"name": "counts", "none_class": True, "floor": 0.02},
        "support": {"name": "bright", "threshold": 0.15}, "prior": None, "gain": None}
    m = create_model(spec)
    assert isinstance(m.pooling, CountPooling) and m.pooling.floor == 0.02 and m.pooling.none is not None
    slides = _spec(rarity_prior=2.0, patch_gain="on")
    assert (slides["pooling"], slides["support"], slides["prior"], slides["gain"]) == (
        {"name": "features"}, None, {"name": "rarity", "weight": 2.0}, {"name": "learned"})
    assert _spec(rarity_prior=2.0, method="uniform")["prior"] is None  # U-N's attention is uniform by definition


def test_highest_reads_the_highest_class_present_whatever_the_mass_on_each():
    """Presence logits of a 2 and a 7 (class 2 under more attention, so more strongly
    present) read 7 with ``highest``; the same logits read as the thesis's classifier's read
    2 (negative control). The readout is ``log q_k + sum_{j > k} log(1 - q_j)``, and its
    probabilities sum to ``1 - prod (1 - q)``."""
    from ats_cli.extensions.pooling_highest import highest_logits

    z = torch.full((1, 10), -6.0)
    z[0, 2], z[0, 7] = 9.0, 4.0
    assert int(highest_logits(z).argmax()) == 7 and int(z.argmax()) == 2
    z = torch.randn(5, 4, dtype=torch.float64)
    q = z.sigmoid()
    expected = torch.stack([q[:, k] * (1 - q[:, k + 1:]).prod(-1) for k in range(4)], -1)
    assert torch.allclose(highest_logits(z).exp().double(), expected, atol=1e-6)
    assert torch.allclose(expected.sum(-1), 1 - (1 - q).prod(-1))
    # nothing above class 3 present: class 3's logit is its presence alone
    assert torch.allclose(highest_logits(z)[:, 3].double(), torch.nn.functional.logsigmoid(z[:, 3]), atol=1e-6)


def test_highest_counts_reads_presence_as_a_poisson_count():
    """Counts of one 7 and three 2s read 7, where their log (counts' own readout) reads 2
    (negative control); ``P(label = k) = (1 - e^-c_k) prod_{j > k} e^-c_j``, a count of 0
    floored to a finite logit."""
    from ats_cli.extensions.pooling_highest import highest_count_logits

    c = torch.zeros(1, 10)
    c[0, 2], c[0, 7] = 3.0, 1.0
    assert int(highest_count_logits(c).argmax()) == 7 and int(c.clamp_min(1e-30).log().argmax()) == 2
    c = torch.rand(5, 4, dtype=torch.float64) * 3
    expected = torch.stack([(1 - (-c[:, k]).exp()) * (-c[:, k + 1:].sum(-1)).exp() for k in range(4)], -1)
    assert torch.allclose(highest_count_logits(c).exp().double(), expected, rtol=1e-5)
    assert torch.isfinite(highest_count_logits(torch.zeros(2, 4))).all()


def test_topmost_counts_reads_the_class_of_the_top_most_object():
    """A 7 in row 2 above three 2s in row 5 reads 7, where the same counts summed over the
    rows (``highest-counts``' reading) read 2 and their log (counts') reads 2: negative
    controls; a 2 above the 7 reads 2. ``P(label = k) = sum_r (1 - e^-c_rk) e^-(counts in the
    rows above r)``, a count of 0 floored to a finite logit."""
    from ats_cli.extensions.pooling_highest import highest_count_logits
    from ats_cli.extensions.pooling_topmost import topmost_count_logits

    c = torch.zeros(1, 8, 10)
    c[0, 2, 7], c[0, 5, 2] = 1.0, 3.0
    assert int(topmost_count_logits(c).argmax()) == 7
    assert int(c.sum(1).log().argmax()) == 2
    c[0, 2, 7], c[0, 5, 2], c[0, 6, 7] = 0.0, 3.0, 1.0  # the 7 now below the 2s
    assert int(topmost_count_logits(c).argmax()) == 2 and int(highest_count_logits(c.sum(1)).argmax()) == 7
    c = torch.rand(3, 6, 4, dtype=torch.float64) * 2
    above = c.sum(-1).cumsum(-1) - c.sum(-1)
    expected = ((1 - (-c).exp()) * (-above[..., None]).exp()).sum(1)
    assert torch.allclose(topmost_count_logits(c).exp().double(), expected, rtol=1e-5)
    assert torch.isfinite(topmost_count_logits(torch.zeros(2, 5, 4))).all()


def test_topmost_counts_places_each_count_in_its_row():
    """A model made from its flags pools counts' values, each in the slot of its cell's
    attention row: summed over the rows they are counts' values, and nothing lies in
    another row."""
    from ats_cli.extensions.pooling import Where
    from ats_cli.extensions.pooling_counts import CountPooling
    from ats_cli.extensions.pooling_topmost import TopmostCountPooling

    spec = extension_specs(TrainConfig(pooling="topmost-counts", none_class="on", count_floor=0.15))["pooling"]
    assert spec == {"name": "topmost-counts", "none_class": True, "floor": 0.15}
    m = create_model(_spec(pooling="topmost-counts", none_class="on", count_floor=0.15))
    assert isinstance(m.pooling, TopmostCountPooling)
    h, w, n = 6, 5, 7
    probs = torch.rand(2, h * w).softmax(-1)
    idx = torch.randint(0, h * w, (2, n))
    where = Where(probs, (h, w), idx, torch.tensor([[600, 500]] * 2), (50, 50))
    feats = torch.randn(2, n, m.classifier.in_features)
    placed = m.pooling.values(feats, m.classifier, where).view(2, n, h, -1)
    counts = CountPooling.values(m.pooling, feats, m.classifier, where)
    assert torch.allclose(placed.sum(2), counts)
    rows = idx // w
    for b in range(2):
        for i in range(n):
            others = [r for r in range(h) if r != int(rows[b, i])]
            assert placed[b, i, others].abs().sum() == 0


def test_highest_is_a_pooling_of_features_with_its_own_readout():
    """The flags make its spec, a model made from it pools as ``features`` does and reads
    the classifier's logits through :func:`highest_logits`."""
    from ats_cli.extensions.pooling_highest import HighestPooling, highest_logits

    assert extension_specs(TrainConfig(pooling="highest"))["pooling"] == {"name": "highest"}
    m = create_model(_spec(pooling="highest"))
    assert isinstance(m.pooling, HighestPooling)
    feats = torch.randn(2, 5, 8)
    assert torch.equal(m.pooling.values(feats, m.classifier), feats)
    pooled = feats.mean(1)
    assert torch.allclose(m.pooling.readout(pooled, m.classifier), highest_logits(m.classifier(pooled)))
    # auto, unsettled (a spec made without ats train): the thesis's pooling
    assert extension_specs(TrainConfig())["pooling"] == {"name": "features"}
    # highest-counts takes counts' options
    spec = extension_specs(TrainConfig(pooling="highest-counts", none_class="on", count_floor=0.02))["pooling"]
    assert spec == {"name": "highest-counts", "none_class": True, "floor": 0.02}
    m = create_model(_spec(pooling="highest-counts", none_class="on", count_floor=0.02))
    assert m.pooling.none is not None and m.pooling.floor == 0.02


@pytest.mark.parametrize("pooling", ["highest", "highest-counts", "topmost-counts"])
def test_rule_poolings_train_on_the_label_probability_itself(pooling):
    """The rule poolings' loss is ``-log P(label = y)`` of their readout, not the
    cross-entropy that divides it by the probability that something is present; the model's
    loss takes it; the thesis's pooling keeps the cross-entropy."""
    m = create_model(_spec(pooling=pooling, none_class="off" if pooling == "highest" else "on"))
    logits = torch.randn(4, m.classifier.out_features).clamp(max=-0.1)
    y = torch.tensor([0, 2, 1, 2])  # three classes
    assert torch.allclose(m.pooling.nll(logits, y), -logits[torch.arange(4), y].mean())
    assert not torch.allclose(m.pooling.nll(logits, y), torch.nn.functional.cross_entropy(logits, y))
    plain = create_model(_spec())
    assert torch.allclose(plain.pooling.nll(logits, y), torch.nn.functional.cross_entropy(logits, y))
    from ats_cli.core.model import exploration
    from ats_cli.core.source import low_res_view

    torch.manual_seed(0)
    images = torch.rand(4, 1, 64, 64)
    for model in (m, plain):
        out = model(low_res_view(images, model.scale), images)
        expected = model.pooling.nll(out.logits, y) - model.entropy_weight * exploration(out).mean()
        assert torch.allclose(model.loss(out, y), expected)


def test_the_rule_likelihood_sees_the_scale_of_the_counts_where_the_cross_entropy_does_not():
    """Why the rule poolings do not train on the cross-entropy (RuleLikelihood): with every
    count small, dividing all of them by ten leaves the cross-entropy almost where it was
    (negative control: it cannot tell a model that counts a tenth of an object from one
    that counts one), where the label's own probability drops about tenfold. And the label
    then says nothing of the classes below it: their gradient is exactly 0, where the
    cross-entropy pushes them down."""
    from ats_cli.extensions.pooling_highest import HighestCountPooling, highest_count_logits

    pool = HighestCountPooling(8, 10, none_class=True, floor=0.15)
    y = torch.tensor([7])
    c = torch.zeros(1, 10, dtype=torch.float64)
    c[0, 2], c[0, 7] = 0.03, 0.01  # three 2s and one 7, each counted a hundredth: 7 already wins
    ce = [float(torch.nn.functional.cross_entropy(highest_count_logits(s * c), y)) for s in (1.0, 0.1)]
    nll = [float(pool.nll(highest_count_logits(s * c), y)) for s in (1.0, 0.1)]
    assert abs(ce[1] - ce[0]) < 0.02, ce
    assert nll[1] - nll[0] > 2.0, nll  # log 10 = 2.3
    for loss, below in ((pool.nll, 0.0), (torch.nn.functional.cross_entropy, None)):
        counts = (c + 0.5).requires_grad_()
        loss(highest_count_logits(counts), y).backward()
        g = counts.grad[0]
        assert g[7] < 0 and (g[8:] > 0).all()  # the label's class up, those above it down
        if below is not None:
            assert (g[:7] == below).all(), g
        else:
            assert (g[:7] > 1e-3).all(), g  # the control: the cross-entropy also pushes lower classes down


@pytest.mark.parametrize("pooling", ["features", "highest-counts"])
def test_the_test_loss_measures_what_training_minimises(pooling):
    """``ats train``'s printed test loss is the pooling's own likelihood term on the sampling
    evaluate() draws: ``-log P(y)`` for a rule pooling, the cross-entropy for the thesis's.
    Negative control: with small counts the rule pooling's softmax cross-entropy of the same
    logits (the test loss before) is another number: it conditions on something present."""
    from ats_cli.core.source import low_res_view
    from ats_cli.data.inputs import Batch
    from ats_cli.train import EVAL_SEED, _seed, evaluate

    torch.manual_seed(0)
    rule = {} if pooling == "features" else {"none_class": "on", "count_floor": 1.0}  # floor 1: at most one count
    m = create_model(_spec(pooling=pooling, **rule))
    images, y = torch.rand(4, 1, 64, 64), torch.tensor([0, 2, 1, 2])
    batch = Batch(low=low_res_view(images, m.scale), sources=images, labels=y, indices=torch.arange(4))
    got = evaluate(m, [batch], torch.device("cpu"))["loss"]
    m.eval()
    gen = torch.Generator().manual_seed(_seed(EVAL_SEED, 0))
    with torch.no_grad():
        logits = m(batch.low, images, generator=gen).logits
    assert got == pytest.approx(float(m.pooling.nll(logits, y)), rel=1e-5)
    ce = float(torch.nn.functional.cross_entropy(logits, y))
    if pooling == "features":
        assert got == pytest.approx(ce, rel=1e-5)
    else:
        assert abs(got - ce) > 1e-2, (got, ce)
