"""A run that learns nothing says so (ats_cli.diagnose): the attention that never leaves
uniform, held-out accuracy at chance while training accuracy climbs; and no warning on a
run that learns."""

from __future__ import annotations

import math

import torch

from ats_cli.core.model import ATSModel
from ats_cli.core.source import low_res_view
from ats_cli.diagnose import attention_moved, chance_accuracy, uniform_entropy, warnings
from ats_cli.nets import create


def _record(**kw):
    base = {"epoch": 3, "train_acc": 0.55, "val_acc": 0.52, "test_acc": 0.5, "entropy": 6.0,
            "entropy_uniform": 9.1, "attention_moved": 3.1}
    return {**base, **kw}


CHANCE = {"train": 0.5, "val": 0.5, "test": 0.5}


def test_uniform_attention_is_named_with_what_to_try():
    found = warnings(_record(entropy=9.09, attention_moved=0.01), CHANCE, steps=5)
    assert set(found) == {"uniform"}
    line = found["uniform"]
    assert "epoch 3" in line and "has not moved" in line and "9.09" in line and "5 an epoch" in line
    assert "--n-patches" in line and "\n" not in line


def test_chance_while_training_climbs_is_named():
    found = warnings(_record(train_acc=1.0, val_acc=0.5), CHANCE, steps=5)
    assert set(found) == {"chance"}
    assert "val accuracy 0.500" in found["chance"] and "train accuracy is 1.000" in found["chance"]


def test_test_split_is_judged_without_a_val_split():
    rec = _record(train_acc=0.95, test_acc=0.52)
    del rec["val_acc"]
    assert set(warnings(rec, {"train": 0.5, "test": 0.5}, steps=5)) == {"chance"}


def test_a_uniform_attention_on_a_run_that_learns_is_not_named():
    """Whole photos of two kinds: any patch shows the class, a uniform attention suffices."""
    assert warnings(_record(attention_moved=0.0, train_acc=1.0, val_acc=1.0), CHANCE, steps=5) == {}
    assert set(warnings(_record(attention_moved=0.0, val_acc=0.55), CHANCE, steps=5)) == {"uniform"}
    # an attention that cannot learn (method uniform, the CNN) is never named
    assert warnings(_record(attention_moved=None), CHANCE, steps=5) == {}


def test_a_run_that_learns_gets_no_warning():
    # negative controls: the attention has moved; held-out accuracy is above chance; train at chance too
    assert warnings(_record(attention_moved=0.6, train_acc=0.99, val_acc=0.9), CHANCE, steps=5) == {}
    assert warnings(_record(train_acc=0.6, val_acc=0.5), CHANCE, steps=5) == {}
    assert warnings(_record(train_acc=1.0, val_acc=0.5), {}, steps=5) == {}  # multi-label: not judged


def test_chance_is_the_largest_class_share():
    assert chance_accuracy([0, 0, 0, 1]) == 0.75
    assert chance_accuracy([]) == 0.0


def test_uniform_entropy_counts_the_cells_that_may_be_drawn():
    """A uniform attention's entropy equals the one computed by the model; with a support
    mask, it is the log of the kept cells, not of all of them (negative control: the
    unmasked count)."""
    torch.manual_seed(0)
    model = ATSModel(create("mnist-attention", in_channels=1, width=4), create("small-cnn", in_channels=1, width=8),
                     n_classes=2, n_patches=3, patch_size=(8, 8), scale=0.25)
    images = (torch.rand(2, 1, 64, 64) * 255).to(torch.uint8)
    low = low_res_view(images, 0.25)
    mask = torch.zeros(2, 16, 16, dtype=torch.bool)
    mask[:, :8] = True  # half of each view
    out = model(low, images, support_mask=mask)
    u = uniform_entropy(out)
    assert torch.allclose(u, torch.full((2,), math.log(128), dtype=torch.float64))
    assert torch.allclose(out.entropy.double(), u, atol=1e-5)  # zero-initialised scores: uniform on the support
    assert not torch.allclose(u, torch.full((2,), math.log(256), dtype=torch.float64))


def test_how_far_the_attention_moved_is_measured_from_its_start():
    """KL to uniform without a prior (0 at the zero-initialised start), KL to the prior's own
    attention with one (0 at the start too, though its entropy is far below uniform); a
    moved attention is measured as moved (negative control)."""
    torch.manual_seed(0)
    images = (torch.rand(2, 1, 64, 64) * 255).to(torch.uint8)
    low = low_res_view(images, 0.25)
    for prior in (None, {"name": "rarity", "weight": 2.0}):
        model = ATSModel(create("mnist-attention", in_channels=1, width=4), create("small-cnn", in_channels=1, width=8),
                         n_classes=2, n_patches=3, patch_size=(8, 8), scale=0.25, prior=prior)
        out = model(low, images)
        assert torch.allclose(attention_moved(model, out), torch.zeros(2, dtype=torch.float64), atol=1e-5)
        with torch.no_grad():
            model.attention_net.score.weight.normal_(0, 1.0)
        assert (attention_moved(model, model(low, images)) > 0.05).all()


def test_a_warning_waits_for_a_second_epoch_when_there_was_one_before():
    """A small val split swings: one epoch at chance after one above it is not named; two
    running are (negative control)."""
    at_chance = _record(attention_moved=0.0, val_acc=0.5)
    learning = _record(attention_moved=0.0, val_acc=0.9)
    assert warnings(at_chance, CHANCE, steps=5, previous=learning) == {}
    assert set(warnings(at_chance, CHANCE, steps=5, previous=at_chance)) == {"uniform"}


def test_what_to_try_names_only_flags_ats_train_has():
    """Each fix a warning suggests is one a user can give now: a flag ``ats train --help``
    lists (the recipes made most settings keys, which a suggestion would name as such)."""
    from tests.test_settle import _train_flags, named_flags

    found = {**warnings(_record(entropy=9.09, attention_moved=0.01), CHANCE, steps=5),
             **warnings(_record(train_acc=1.0, val_acc=0.5), CHANCE, steps=5)}
    assert set(found) == {"uniform", "chance"}
    named = set().union(*(named_flags(line) for line in found.values()))
    assert named and named <= _train_flags(), named - _train_flags()
