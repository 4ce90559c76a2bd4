"""The feature store (ats_cli.data.features): a frozen encoder's features computed once and
read back bit for bit; a changed source or encoder never served stale features; bounded on
disk; segments of other processes seen, damaged ones refused; augmentation bypasses it; a
run with it trains exactly as one without."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from ats_cli.checkpoint import load_checkpoint
from ats_cli.config import TrainConfig, settle
from ats_cli.core.model import ATSModel
from ats_cli.core.source import TensorSource
from ats_cli.data import features
from ats_cli.data.facts import DataFacts
from ats_cli.data.features import FeatureStore, ImageKeys, encoder_identity
from ats_cli.nets import create
from ats_cli.train import train
from tests.test_train import _cfg, _write_squares_dataset

DIM = 8


def _keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [bytes(rng.integers(0, 256, 15, dtype=np.uint8)) + b"\1" for _ in range(n)]


def _store(folder, encoder: str = "e" * 64, cap: int = 1 << 30) -> FeatureStore:
    return FeatureStore(folder, encoder, DIM, cap_bytes=cap)


def test_stored_features_come_back_bit_for_bit_in_a_later_process_and_only_for_their_encoder(tmp_path):
    feats = torch.randn(5, DIM).numpy()
    keys = _keys(5)
    store = _store(tmp_path)
    store.add(keys, feats)
    got, found = store.lookup(keys)  # from the buffer
    assert found.all() and np.array_equal(got, feats)
    store.flush()
    again = _store(tmp_path)  # a new run on the same store: reads the segment
    got, found = again.lookup([keys[3], None, _keys(1, seed=9)[0], keys[0]])
    assert found.tolist() == [True, False, False, True]
    assert np.array_equal(got[0], feats[3]) and np.array_equal(got[3], feats[0])
    other = _store(tmp_path, encoder="f" * 64)  # another encoder: nothing of the first's
    assert not other.lookup(keys)[1].any()


def test_processes_sharing_a_store_see_each_others_segments_after_a_refresh(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    ka, kb = _keys(3, 1), _keys(3, 2)
    a.add(ka, np.ones((3, DIM), np.float32))
    a.flush()
    b.add(kb, np.zeros((3, DIM), np.float32))
    b.flush()
    assert not b.lookup(ka)[1].any()
    b.refresh()
    a.refresh()
    assert b.lookup(ka)[1].all() and a.lookup(kb)[1].all()


def test_the_store_stays_within_its_cap_by_deleting_the_oldest_segments(tmp_path):
    rows = 200
    one = 8 + 4 + 100 + rows * (16 + 4 + 4 * DIM)  # a segment of 200 rows, about
    store = _store(tmp_path, cap=int(2.5 * one))
    batches = [_keys(rows, seed) for seed in range(5)]
    for seed, keys in enumerate(batches):
        store.add(keys, np.full((rows, DIM), seed, np.float32))
        store.flush()
        os.utime(sorted(store.folder.glob("*.seg"))[-1], ns=(seed * 10**9, seed * 10**9))
    on_disk = sum(p.stat().st_size for p in store.folder.glob("*.seg"))
    assert on_disk <= int(2.5 * one) and len(list(store.folder.glob("*.seg"))) == 2
    later = _store(tmp_path, cap=int(2.5 * one))
    assert later.lookup(batches[-1])[1].all() and not later.lookup(batches[0])[1].any()
    # the process that wrote the evicted ones reads them as missing, not as anything else
    got, found = store.lookup(batches[0])
    assert not found.any()


def test_a_damaged_row_is_said_and_encoded_again_never_served(tmp_path, capsys):
    keys = _keys(4)
    store = _store(tmp_path)
    store.add(keys, np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM))
    store.flush()
    [seg] = store.folder.glob("*.seg")
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF  # a bit flip in the last row
    seg.write_bytes(bytes(data))
    got, found = _store(tmp_path).lookup(keys)
    assert not found[3]
    assert "damaged feature segment" in capsys.readouterr().err and not seg.exists()


def test_a_buffer_is_written_once_it_reaches_a_segment(tmp_path, monkeypatch):
    monkeypatch.setattr(features, "SEGMENT_BYTES", 4096)  # memory holds at most this much unwritten
    n = 4096 // (4 * DIM + 20) + 1
    store = _store(tmp_path)
    store.add(_keys(n), np.zeros((n, DIM), np.float32))
    assert len(list(store.folder.glob("*.seg"))) == 1 and not store._pending


def test_a_rewritten_source_gets_a_new_key_even_with_its_size_and_mtime_restored(tmp_path):
    path = tmp_path / "a.raw"
    path.write_bytes(bytes(1000))
    time.sleep(0.1)  # times that prove the file unchanged (ats_cli.io.settled)
    keys = ImageKeys()
    first = keys.key(path, None)
    assert first is not None and keys.key(path, None) == first
    before = os.stat(path)
    path.write_bytes(bytes(500) + b"\7" + bytes(499))  # same size, one byte other
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back (cp -p, rsync -t)
    assert os.stat(path).st_size == before.st_size
    assert keys.key(path, None) != first  # None while too recent to trust: encoded, not stored
    time.sleep(0.1)
    assert keys.key(path, None) not in (None, first)
    assert ImageKeys().key(tmp_path, None) is None  # a directory (OME-Zarr) has no key


def test_another_encoder_weight_or_normalisation_is_another_identity():
    torch.manual_seed(0)
    net = create("small-cnn", kind="features", in_channels=3, width=8)
    kwargs = {"in_channels": 3, "width": 8}
    base = encoder_identity(net, "small-cnn", kwargs)
    assert encoder_identity(net, "small-cnn", kwargs) == base
    assert encoder_identity(net, "small-cnn", {**kwargs, "input_size": [224, 224]}) != base
    with torch.no_grad():
        next(net.parameters()).view(-1)[0] += 1e-6
    assert encoder_identity(net, "small-cnn", kwargs) != base
    buffers = [b for _, b in net.named_buffers() if b.is_floating_point()]
    with torch.no_grad():
        next(net.parameters()).view(-1)[0] -= 1e-6
        buffers[0].view(-1)[0] += 1  # e.g. a batch norm's statistics, an encoder's mean
    assert encoder_identity(net, "small-cnn", kwargs) != base


def _model(store):
    torch.manual_seed(0)
    attention = create("mnist-attention", kind="attention", in_channels=1, width=4)
    features = create("small-cnn", kind="features", in_channels=1, width=8).eval().requires_grad_(False)
    model = ATSModel(attention, features, 2, n_patches=6, patch_size=(8, 8), scale=0.25)
    model.feature_store = store
    return model.eval()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_forward_with_the_store_equals_one_without_and_reads_back_what_it_encoded(tmp_path, lazy):
    images = torch.randint(0, 256, (3, 1, 48, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    low = images.float().div(255)[:, :, ::4, ::4].contiguous()
    sources = [TensorSource(im) for im in images] if lazy else images
    plain = _model(None)
    store = _store(tmp_path, cap=1 << 30)
    store.dim = plain.feature_net.out_features
    stored = _model(store)
    keys = ["img-a", None, "img-c"]  # the second image has no key: encoded, never stored
    for seed in (0, 0, 1):
        a = plain(low, sources, generator=torch.Generator().manual_seed(seed))
        b = stored(low, sources, generator=torch.Generator().manual_seed(seed), feature_keys=keys)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.patch_logits, b.patch_logits)
    # the second call drew the first's patches: every keyed one was read back
    assert store.hits >= 2 * 6 and store.misses >= 6 * 3


def test_a_two_level_forward_with_the_store_equals_one_without_and_reads_back(tmp_path):
    """Two levels: the fine patches' features come from the store as one level's do (their
    offsets are the image's own pixels); logits and gradients equal the plain model's, so the
    nested estimator is the same; the same draws again read every keyed patch back."""
    from tests.test_nested import SIZE, tiny_nested

    images = torch.randint(0, 256, (2, 1, SIZE, SIZE), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    low = images.float().div(255)[:, :, ::2, ::2].contiguous()
    plain, stored = tiny_nested().eval(), tiny_nested().eval()
    for m in (plain, stored):
        m.feature_net.requires_grad_(False)
    store = _store(tmp_path)
    store.dim = 5  # TinyFeatures(5)
    stored.feature_store = store
    for seed in (0, 0, 1):
        a = plain(low, images, generator=torch.Generator().manual_seed(seed))
        b = stored(low, images, generator=torch.Generator().manual_seed(seed), feature_keys=["img-a", "img-b"])
        assert torch.equal(a.logits, b.logits)
        ga = torch.autograd.grad(a.logits.sum(), list(plain.attention_net.parameters()))
        gb = torch.autograd.grad(b.logits.sum(), list(stored.attention_net.parameters()))
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))  # the fine attention's gradient
    drawn = plain.regions * plain.n_patches * 2  # patches a forward draws over both images
    assert store.misses <= 2 * drawn and store.hits >= drawn  # the repeated draw read back whole


def test_a_two_level_run_with_the_store_trains_exactly_as_one_without(tmp_path):
    data = _write_squares_dataset(tmp_path / "sq", n_train=16, n_test=8)
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = train(_cfg(data, tmp_path / mode, feature_train="none", feature_store=mode, levels=2,
                                regions=2, region_size=32, scale=0.25, rarity_prior=0),
                           log=lambda s: None)
    for key in ("train_loss", "test_loss", "train_acc", "test_acc"):
        assert [h[key] for h in runs["on"]] == [h[key] for h in runs["off"]], key
    assert runs["on"][1]["feature_hit_rate"] > 0 and "feature_hit_rate" not in runs["off"][0]


def _rgb_squares(tmp_path):
    return _write_squares_dataset(tmp_path / "rgb", n_train=16, n_test=8, channels=3)


def test_a_run_with_the_store_trains_exactly_as_one_without_and_reads_features_back(tmp_path):
    """The estimator is unchanged: same losses and weights bit for bit (small-cnn on a CPU
    computes a patch's feature alike in any batch), and the second epoch reads back features."""
    data = _write_squares_dataset(tmp_path / "sq", n_train=16, n_test=8)
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = train(_cfg(data, tmp_path / mode, feature_train="none", feature_store=mode, scale=0.0625),
                           log=lambda s: None)
    for key in ("train_loss", "test_loss", "train_acc", "test_acc"):
        assert [h[key] for h in runs["on"]] == [h[key] for h in runs["off"]], key
    on, off = (load_checkpoint(tmp_path / m / "last.pt")["model"] for m in ("on", "off"))
    assert all(torch.equal(on[k], off[k]) for k in off)
    assert runs["on"][1]["feature_hit_rate"] > 0 and "feature_hit_rate" not in runs["off"][0]
    assert list((tmp_path / "on" / "cache" / "features").glob("*/*.seg"))


def test_augmented_training_steps_bypass_the_store(tmp_path, monkeypatch):
    """Augmented patches are new pixels at every draw: such steps look nothing up (and store
    nothing), and train as without the store; evaluation, never augmented, still uses it."""
    import ats_cli.train as train_module

    data = _rgb_squares(tmp_path)
    step, looked_up = train_module.train_step, []

    def watched(*args, **kwargs):
        looked_up.append(kwargs.get("feature_keys") is not None)
        return step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", watched)
    runs = {name: train(_cfg(data, tmp_path / name, epochs=1, feature_train="none", feature_store=store,
                             augment=aug), log=lambda s: None)
            for name, store, aug in (("off", "off", "colour"), ("on", "on", "colour"), ("plain", "on", "none"))}
    steps = len(looked_up) // 3
    assert steps and not any(looked_up[:2 * steps]) and all(looked_up[2 * steps:])  # off, on+augment, on alone
    assert runs["plain"][0]["feature_hit_rate"] == 0.0
    for key in ("train_loss", "test_loss"):
        assert runs["on"][0][key] == runs["off"][0][key]


@pytest.mark.parametrize(("flags", "pretrained", "want"), [
    ({}, "timm:x's own", "on"),
    ({}, "", "off"),  # a frozen random net
    ({"augment": "colour"}, "timm:x's own", "off"),
    ({"feature_train": "all"}, "timm:x's own", "off"),
    ({"feature_store": "off"}, "timm:x's own", "off"),
])
def test_feature_store_auto_is_on_for_a_frozen_pretrained_encoder_without_augmentation(flags, pretrained, want):
    cfg = TrainConfig(data="d", out="o", n_patches=4, patch_size=16, scale=0.1, batch_size=4,
                      feature_train=flags.get("feature_train", "none"), augment=flags.get("augment", "none"),
                      feature_store=flags.get("feature_store", "auto"), min_brightness=0, rarity_prior=0,
                      patch_gain="off", patch_loss=0, feature_net="small-cnn")
    facts = DataFacts(channels=3, pretrained=pretrained)
    settled, reasons = settle(cfg, facts)
    assert settled.config.feature_store == want
    assert any(r.key == "feature_store" for r in reasons)


def test_feature_store_on_refuses_a_feature_net_that_trains():
    from ats_cli.config import ConfigError

    with pytest.raises(ConfigError, match="feature_store on needs a frozen feature net"):
        TrainConfig(data="d", out="o", feature_train="all", feature_store="on").validate()
