"""`--method ips`, iterative patch selection (Bergner et al. 2023): the memory buffer keeps
exactly the top M patches of the image whatever the chunk size, the image is read chunk by
chunk, and the method trains, predicts and visualises from the command line."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.baselines_ips import IPSModel, keep_top
from ats_cli.checkpoint import load_model
from ats_cli.cli import app
from ats_cli.config import ConfigError, TrainConfig
from ats_cli.core.source import TensorSource, low_res_view
from ats_cli.models import create_model, model_spec
from ats_cli.nets import create
from tests.test_train import _write_squares_dataset

runner = CliRunner()

# 20 scores with ties: 0.9 three times (indices 3, 7, 15), 0.5 four times (1, 5, 9, 18)
SCORES = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.0, 0.5, 0.3, 0.9, 0.2, 0.5,
                       0.8, 0.1, 0.4, 0.6, 0.7, 0.9, 0.0, 0.3, 0.5, 0.1])


def _top(scores: torch.Tensor, m: int) -> list[int]:
    """The top m indices of ``scores`` by (score descending, index ascending), in that order."""
    return sorted(range(len(scores)), key=lambda k: (-float(scores[k]), k))[:m]


@pytest.mark.parametrize("m", [1, 4, 6, 20, 25])
@pytest.mark.parametrize("chunk", [1, 3, 7, 20])
def test_the_buffer_ends_with_exactly_the_top_m_of_the_scores_whatever_the_chunks(m, chunk):
    mem_scores, mem_index = torch.empty(1, 0), torch.empty(1, 0, dtype=torch.long)
    for start in range(0, len(SCORES), chunk):
        index = torch.arange(start, min(start + chunk, len(SCORES)))[None]
        mem_scores, mem_index = keep_top(mem_scores, mem_index, SCORES[index], index, m)
        assert mem_index.shape[1] == min(m, index[0, -1] + 1)  # never more than m held
    assert mem_index[0].tolist() == _top(SCORES, m)  # ties: the earlier patch, every time
    assert torch.equal(mem_scores[0], SCORES[mem_index[0]])


class _Recording:
    """A patch source over a tensor that records how many patches each read asked for."""

    def __init__(self, image: torch.Tensor):
        self.inner = TensorSource(image)
        self.reads: list[int] = []

    size = property(lambda self: self.inner.size)
    channels = property(lambda self: self.inner.channels)

    def read_patches(self, offsets, size):
        self.reads.append(int(offsets.shape[0]))
        return self.inner.read_patches(offsets, size)


def _known_image(values: torch.Tensor, grid: tuple[int, int], side: int = 8) -> torch.Tensor:
    """A one-channel image of a grid of ``side`` px patches, patch k (raster order) filled with values[k]."""
    rows, cols = grid
    return values.view(rows, cols).repeat_interleave(side, 0).repeat_interleave(side, 1)[None].float()


def test_the_model_selects_the_top_m_of_the_whole_image_reading_it_i_patches_at_a_time():
    """The selection a forward pass runs, with a scoring head that returns each patch's
    mean pixel: the patches kept are the top M of a known score array over a 4x5 grid,
    the reads of the no-gradient pass never exceed I patches, and the image is read once
    through plus the M kept patches."""
    model = IPSModel(create("small-cnn", in_channels=1, width=4), 2, patch_size=(8, 8), memory=6, iteration=3)
    model.scores = lambda patches: patches.float().mean((2, 3, 4))  # the known array, as scores
    images = [_Recording(_known_image(SCORES, (4, 5))), _Recording(_known_image(SCORES.flip(0), (4, 5)))]
    out = model(torch.zeros(2, 1, 4, 5), images, return_patches=True)
    assert out.indices[0].tolist() == _top(SCORES, 6)
    assert out.indices[1].tolist() == _top(SCORES.flip(0), 6)
    for src in images:
        assert src.reads[:-1] == [3] * 6 + [2] and sum(src.reads[:-1]) == 20  # the grid, I at a time
        assert src.reads[-1] == 6  # then the M kept, for the gradient pass
    # the kept patches are where the grid says: index 3 is row 0, column 3
    assert out.offsets[0, 0].tolist() == [0, 24] and torch.allclose(out.patches[0, 0], torch.full((1, 8, 8), 0.9))
    # the attention lies on the kept cells only, and sums to 1
    assert out.attention.shape == (2, 4, 5) and torch.allclose(out.attention.sum((1, 2)), torch.ones(2))
    assert (out.attention[0].flatten() > 0).nonzero().flatten().tolist() == sorted(_top(SCORES, 6))


def test_selection_runs_without_gradients_in_evaluation_mode_and_the_modes_come_back():
    model = IPSModel(create("small-cnn", in_channels=1, width=4), 2, patch_size=(8, 8), memory=2, iteration=2)
    model.train()
    model.feature_net.eval()  # a frozen encoder keeps its batch norms in evaluation mode: kept so
    seen = []
    score = model.scores
    model.scores = lambda p: seen.append((torch.is_grad_enabled(), model.pool.training)) or score(p)
    image = torch.randint(0, 255, (1, 1, 16, 24), dtype=torch.uint8)
    out = model(low_res_view(image, 0.25), image)
    assert seen and all(s == (False, False) for s in seen)
    assert model.training and model.pool.training and not model.feature_net.training
    model.loss(out, torch.tensor([1])).backward()  # the gradient pass reaches the encoder and the pooling
    assert model.pool.q.weight.grad.abs().sum() > 0 and model.feature_net.body[0].weight.grad.abs().sum() > 0


def test_a_grid_no_larger_than_the_memory_is_kept_whole_without_scoring():
    """The paper's shortcut: with M >= N there is nothing to choose, so no scoring pass."""
    model = IPSModel(create("small-cnn", in_channels=1, width=4), 2, patch_size=(8, 8), memory=6, iteration=2)
    model.scores = lambda patches: pytest.fail("scored a grid the memory holds whole")
    source = _Recording(torch.rand(1, 16, 24))  # a 2x3 grid
    out = model(torch.zeros(1, 1, 4, 6), [source])
    assert out.indices[0].tolist() == list(range(6)) and source.reads == [6]


def test_ips_settings_reach_the_spec_and_bad_ones_are_refused_in_one_line():
    spec = model_spec(TrainConfig(method="ips", patch_size=16, scale=0.25, ips_memory=7, ips_iter=9, ips_stride=8),
                      n_classes=2, channels=1)
    assert (spec["ips_memory"], spec["ips_iter"], spec["ips_stride"]) == (7, 9, 8)
    model = create_model(spec)
    assert (model.memory, model.iteration, model.stride) == (7, 9, (8, 8))
    assert "ips_memory" not in model_spec(TrainConfig(patch_size=16, scale=0.25), n_classes=2, channels=1)
    for bad, message in (({"ips_memory": 0}, "ips_memory and ips_iter must be >= 1"),
                         ({"ips_iter": -1}, "ips_memory and ips_iter must be >= 1"),
                         ({"pooling": "votes"}, "method ips does not pool by attention sampling"),
                         ({"position_features": "on"}, "method ips does not pool sampled patches")):
        with pytest.raises(ConfigError, match=message) as e:
            TrainConfig(method="ips", **bad).validate()
        assert "\n" not in str(e.value)


def test_ips_trains_predicts_and_visualises_from_the_command_line(tmp_path):
    data = _write_squares_dataset(tmp_path / "squares", n_train=16, n_test=4)
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--method", "ips", "--epochs", "1",
                                 "--patch-size", "16", "--batch-size", "8", "--workers", "0", "--feature-net",
                                 "small-cnn", "--set", "feature_width=4", "--set", "ips_memory=5",
                                 "--set", "ips_iter=6"])
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    assert (config["method"], config["ips_memory"], config["ips_iter"]) == ("ips", 5, 6)
    model, ckpt = load_model(run / "last.pt")
    assert isinstance(model, IPSModel) and (model.memory, model.iteration) == (5, 6)
    image = str(data / "test" / "0.png")
    predicted = runner.invoke(app, ["predict", image, "--model", str(run / "last.pt")])
    assert predicted.exit_code == 0, predicted.output
    assert "horizontal" in predicted.output or "vertical" in predicted.output
    drawn = runner.invoke(app, ["visualize", image, "--model", str(run / "last.pt"), "--out", str(tmp_path / "a.png")])
    assert drawn.exit_code == 0, drawn.output
    assert (tmp_path / "a.png").stat().st_size > 0
