"""After every epoch, ats train recomputes the batch norms' running statistics from the
current weights (ats_cli.train.recalibrate_batch_norm): evaluation, best.pt and the
released model then see the network as it trained, not as it was ~10 steps earlier."""

from __future__ import annotations

import torch

from ats_cli.core.model import ATSModel
from ats_cli.core.source import low_res_view
from ats_cli.data.inputs import Batch
from ats_cli.nets import create
from ats_cli.train import recalibrate_batch_norm


def _model() -> ATSModel:
    torch.manual_seed(0)
    return ATSModel(create("mnist-attention", in_channels=1, width=4), create("small-cnn", in_channels=1, width=8),
                    n_classes=2, n_patches=6, patch_size=(16, 16), scale=0.25)


def _batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    images = (torch.rand(8, 1, 64, 64, generator=g) * 255).to(torch.uint8)
    return Batch(low_res_view(images, 0.25), images, torch.zeros(8, dtype=torch.long), torch.arange(8))


def _norms(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def test_stale_statistics_are_replaced_by_what_the_current_weights_produce():
    model = _model()
    for m in _norms(model):  # statistics of some other network: what a lagging average holds
        m.running_mean.fill_(5.0)
        m.running_var.fill_(0.01)
    features = model.feature_net
    patches = torch.rand(48, 1, 16, 16, generator=torch.Generator().manual_seed(2))  # patches of the same kind

    def eval_vs_train() -> float:
        with torch.no_grad():
            features.train()
            as_trained = features(patches)
            features.eval()
            as_evaluated = features(patches)
        model.train()
        return float((as_evaluated - as_trained).norm() / as_trained.norm())

    stale = eval_vs_train()
    assert recalibrate_batch_norm(model, [_batch(0), _batch(1)], torch.device("cpu"), seed=1) == 2
    assert all(m.momentum == 0.1 for m in _norms(model)) and model.training  # restored
    fresh = eval_vs_train()
    assert stale > 0.9 and fresh < 0.2, (stale, fresh)


def test_eval_equals_training_mode_on_the_batch_the_statistics_came_from():
    """With the statistics of exactly the patches being evaluated, eval mode normalises as
    training mode does (up to the unbiased/biased variance of the running estimate)."""
    model = _model()
    batch = _batch(3)
    gen = torch.Generator()
    recalibrate_batch_norm(model, [batch], torch.device("cpu"), seed=7)
    # the same draws: recalibrate_batch_norm seeds its k-th batch with _seed(seed, k)
    from ats_cli.train import _seed

    model.train()
    with torch.no_grad():
        train_out = model(batch.low, batch.sources, generator=gen.manual_seed(_seed(7, 0)))
    model.eval()
    model.estimator = "sequential"  # the training-mode estimator choice of this attention (uniform, n < K)
    with torch.no_grad():
        eval_out = model(batch.low, batch.sources, generator=gen.manual_seed(_seed(7, 0)))
    assert torch.equal(train_out.indices, eval_out.indices)
    assert torch.allclose(train_out.logits, eval_out.logits, atol=0.05)


def test_a_model_without_batch_norm_is_left_alone():
    model = ATSModel(create("mnist-attention", in_channels=1, width=4), create("mnist-features", in_channels=1),
                     n_classes=2, n_patches=4, patch_size=(16, 16), scale=0.25)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert recalibrate_batch_norm(model, [_batch(0)], torch.device("cpu"), seed=0) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
