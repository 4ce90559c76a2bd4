"""`--method tile-mil` (CLAM-SB on a frozen encoder's stored features): the tissue mask
decides the tiles, the tiles are read and encoded in bounded chunks, a second pass reads
every tile's feature from the store without calling the encoder and gives what recomputing
gives, a changed source or encoder recomputes, a trainable encoder is refused, and the
method trains, predicts and visualises (PNG and GeoJSON) from the command line."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ats_cli import baselines_tilemil
from ats_cli.baselines_tilemil import TileMIL, tissue_tiles
from ats_cli.checkpoint import load_model
from ats_cli.cli import app
from ats_cli.config import ConfigError, TrainConfig
from ats_cli.data.features import FeatureStore, encoder_identity
from ats_cli.nets import create
from ats_cli.predict import load_predictor
from ats_cli.predict.inputs import InputItem
from ats_cli.train import train
from tests.test_ips import _Recording  # a source that counts its reads
from tests.test_train import _cfg, _write_squares_dataset

runner = CliRunner()


def test_the_tissue_mask_decides_the_tiles_and_no_mask_gives_every_tile():
    # a 40x56 image in 16 px tiles: a 3x4 grid, the last row and column padded; its view is 10x14
    assert tissue_tiles(None, (40, 56), 16).all() and tissue_tiles(None, (40, 56), 16).shape == (3, 4)
    mask = torch.zeros(10, 14, dtype=torch.bool)
    mask[9, 13] = True  # the view's last pixel: in the last (padded) tile only
    mask[4, 0] = True  # view row 4 = image rows 16-19: tile row 1 (rows 16-31 -> view rows 4-7), column 0
    want = torch.zeros(3, 4, dtype=torch.bool)
    want[2, 3] = want[1, 0] = True
    assert torch.equal(tissue_tiles(mask, (40, 56), 16), want)
    assert tissue_tiles(torch.zeros(10, 14, dtype=torch.bool), (40, 56), 16).all()  # no tissue at all: every tile


def _model(seed: int = 0) -> TileMIL:
    torch.manual_seed(seed)
    return TileMIL(create("small-cnn", kind="features", in_channels=1, width=8), 2, tile_size=8, scale=0.25).eval()


def _calls(model: TileMIL) -> list[int]:
    """Tiles the encoder is asked for, one entry per call."""
    seen: list[int] = []
    model.feature_net.register_forward_hook(lambda m, args, out: seen.append(int(args[0].shape[0])))
    return seen


def _store(folder, model: TileMIL) -> FeatureStore:
    return FeatureStore(folder, encoder_identity(model.feature_net, "small-cnn", {"width": 8}),
                        model.feature_net.out_features, cap_bytes=1 << 30)


def test_tiles_are_read_in_chunks_and_a_second_pass_reads_every_feature_back_without_the_encoder(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setattr(baselines_tilemil, "TILE_CHUNK", 5)
    images = torch.randint(0, 256, (2, 1, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    low = images.float().div(255)[:, :, ::4, ::4].contiguous()  # 10x12 views
    mask = torch.zeros(2, 10, 12, dtype=torch.bool)
    mask[0] = True  # every one of the 5x6 tiles
    mask[1, :4, :6] = True  # tiles of rows 0-1, columns 0-2: 6 tiles
    plain = _model()
    recomputed = plain(low, images, support_mask=mask)
    assert (recomputed.attention[0] > 0).sum() == 30 and (recomputed.attention[1] > 0).sum() == 6
    assert torch.equal(recomputed.attention[1, 2:].sum(), torch.tensor(0.0))  # no attention off the tissue

    first = _model()
    first.feature_store = _store(tmp_path, first)
    sources = [_Recording(im) for im in images]
    calls = _calls(first)
    out = first(low, sources, support_mask=mask, feature_keys=["a", "b"])
    assert [s.reads for s in sources] == [[5] * 6, [5, 1]]  # never more than a chunk read at once
    assert sum(calls) == 36 and max(calls) <= 5
    assert torch.equal(out.logits, recomputed.logits)
    first.feature_store.flush()

    later = _model()  # a later epoch, run or predict: a new process on the same store
    later.feature_store = _store(tmp_path, later)
    calls = _calls(later)
    sources = [_Recording(im) for im in images]
    again = later(low, sources, support_mask=mask, feature_keys=["a", "b"])
    assert calls == [] and all(s.reads == [] for s in sources)  # no tile read, no encoder call
    assert later.feature_store.hits == 36 and later.feature_store.misses == 0
    assert torch.equal(again.logits, recomputed.logits) and torch.equal(again.attention, recomputed.attention)

    # a changed source (another content key) or another encoder: encoded again, never served stale
    changed = later(low, images, support_mask=mask, feature_keys=["a", "b, rewritten"])
    assert sum(calls) == 6 and torch.equal(changed.logits, recomputed.logits)
    other = _model(seed=1)
    other.feature_store = _store(tmp_path, other)
    assert other.feature_store.encoder != later.feature_store.encoder
    calls = _calls(other)
    other(low, images, support_mask=mask, feature_keys=["a", "b"])
    assert sum(calls) == 36 and other.feature_store.hits == 0


def test_the_second_epoch_reads_every_tile_back_and_trains_as_recomputing_would(tmp_path):
    """Through ats train: the second epoch's training tiles all come from the store, and a
    run with the store gives the losses and weights of one without, bit for bit."""
    data = _write_squares_dataset(tmp_path / "sq", n_train=8, n_test=4, size=32)
    runs = {mode: train(_cfg(data, tmp_path / mode, method="tile-mil", feature_store=mode, batch_size=4,
                             scale=0.25), log=lambda s: None) for mode in ("off", "on")}
    assert runs["on"][0]["feature_hit_rate"] == 0.0 and runs["on"][1]["feature_hit_rate"] == 1.0
    for key in ("train_loss", "test_loss", "train_acc", "test_acc"):
        assert [h[key] for h in runs["on"]] == [h[key] for h in runs["off"]], key
    on, off = (load_model(tmp_path / m / "last.pt")[0].state_dict() for m in ("on", "off"))
    assert all(torch.equal(on[k], off[k]) for k in off)


@pytest.mark.parametrize(("bad", "message"), [
    ({"feature_train": "all"}, "feature_train all: method tile-mil trains on a frozen encoder's stored features"),
    ({"feature_train": "head"}, "feature_train head: method tile-mil"),
    ({"augment": "colour"}, "augment colour: method tile-mil encodes each tile once"),
    ({"pooling": "votes"}, "method tile-mil does not pool by attention sampling"),
])
def test_a_trainable_encoder_or_augmentation_is_refused_in_one_line(bad, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(method="tile-mil", **bad).validate()
    assert "\n" not in str(e.value)


def test_the_command_refuses_a_trainable_encoder_before_reading_data(tmp_path):
    data = _write_squares_dataset(tmp_path / "sq", n_train=4, n_test=2, size=32)
    result = runner.invoke(app, ["train", str(data), "--out", str(tmp_path / "run"), "--method", "tile-mil",
                                 "--set", "feature_train=all", "--workers", "0"])
    assert result.exit_code != 0 and "method tile-mil trains on a frozen encoder" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run" / "last.pt").exists()


def test_tile_mil_trains_predicts_and_visualises_from_the_command_line(tmp_path, monkeypatch):
    data = _write_squares_dataset(tmp_path / "squares", n_train=8, n_test=4, size=48)
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--method", "tile-mil", "--epochs", "1",
                                 "--patch-size", "16", "--batch-size", "4", "--workers", "0", "--feature-net",
                                 "small-cnn", "--set", "feature_width=4"])
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    assert (config["method"], config["feature_train"], config["feature_store"]) == ("tile-mil", "none", "on")
    assert list((run / "cache" / "features").glob("*/*.seg"))
    model, _ = load_model(run / "last.pt")
    assert isinstance(model, TileMIL) and model.tile_size == 16
    image = str(data / "test" / "0.png")
    predicted = runner.invoke(app, ["predict", image, "--model", str(run / "last.pt")])
    assert predicted.exit_code == 0, predicted.output
    assert "horizontal" in predicted.output or "vertical" in predicted.output

    # predict reads back what it (or training) stored: the run's store, beside the checkpoint
    predictor = load_predictor(run / "last.pt", "cpu")
    assert predictor.model.feature_store is not None
    calls = _calls(predictor.model)
    rows = predictor.predict([InputItem(data / "test" / "1.png")])
    assert rows[0].ok and sum(calls) == 9  # 48x48 in 16 px tiles
    again = load_predictor(run / "last.pt", "cpu")
    calls = _calls(again.model)
    assert again.predict([InputItem(data / "test" / "1.png")])[0].probs == rows[0].probs and calls == []

    drawn = runner.invoke(app, ["visualize", image, "--model", str(run / "last.pt"), "--out", str(tmp_path / "a.png")])
    assert drawn.exit_code == 0, drawn.output
    assert (tmp_path / "a.png").stat().st_size > 0
    geo = runner.invoke(app, ["visualize", image, "--model", str(run / "last.pt"), "--out",
                              str(tmp_path / "a.geojson")])
    assert geo.exit_code == 0, geo.output
    collection = json.loads((tmp_path / "a.geojson").read_text())
    cells = [f for f in collection["features"] if f["properties"]["name"].startswith("cell ")]
    assert len(cells) == 9 and collection["properties"]["cells"]["tile"]["size_level"] == 16  # every tile
    assert sum(c["properties"]["measurements"]["attention"] for c in cells) == pytest.approx(1, abs=1e-3)
    boxes = {c["properties"]["name"]: c["geometry"]["coordinates"][0] for c in cells}
    assert boxes["cell 1,2"] == [[32, 16], [48, 16], [48, 32], [32, 32], [32, 16]]  # tile (1, 2): its own pixels
