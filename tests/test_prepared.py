"""Prepared images (ats_cli.data.prepared): what a user relies on.

The prepared path gives bit for bit the views and patches of the source files (so a
training run gives the same metrics), a source changed, truncated or deleted after
preparing is never read stale, an interrupted preparation resumes without redoing what
it did, and two preparers of one dataset neither corrupt nor duplicate each other's work.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ats_cli.core.source import gather_patches
from ats_cli.data.dataset import load_dataset, write_dataset
from ats_cli.data.inputs import ImageDataset, Unreadable, collate, open_input
from ats_cli.data.prepared import PreparedSource, PreparedStore, prepare, preparer_lock, store_folder
from ats_cli.recipes import resolve_config
from ats_cli.train import train

ROOT = Path(__file__).resolve().parents[1]


def _image(rng, h, w, channels):
    """Mostly black with bright blobs and noise, like Megapixel MNIST (zero tiles and busy ones)."""
    img = np.zeros((h, w, channels), np.uint8)
    for _ in range(6):
        r, c = rng.integers(0, h), rng.integers(0, w)
        img[r:r + 20, c:c + 30] = rng.integers(0, 256, (min(20, h - r), min(30, w - c), channels))
    return img[..., 0] if channels == 1 else img


def _dataset(root: Path, sizes=((97, 131), (64, 64), (130, 65), (300, 260)), channels=1, fmt="png", seed=0):
    rng = np.random.default_rng(seed)
    rows = {"train": [], "test": []}
    for i, (h, w) in enumerate(sizes):
        split = "test" if i == len(sizes) - 1 else "train"
        (root / split).mkdir(parents=True, exist_ok=True)
        name = f"{split}/{i}.{fmt}"
        Image.fromarray(_image(rng, h, w, channels)).save(root / name, quality=90)
        rows[split].append({"path": name, "label": "ab"[i % 2]})
    write_dataset(root, ["a", "b"], rows, hints={"channels": channels})
    return load_dataset(root)


def _sources(data):
    return [r.path for records in data.splits.values() for r in records]


def _store(data, channels=1, scale=0.25):
    return PreparedStore(data.root / ".ats-prepared", data.root, channels=channels, scale=scale)


def _border_offsets(h, w, ph, pw, rng):
    """Corners, edges, wholly outside, and random positions, some partly outside."""
    fixed = [(0, 0), (-ph + 1, -pw + 1), (h - ph, w - pw), (h - 1, w - 1), (-ph, 0), (h, w), (h - 3, -5),
             (-7, w - 9), (h // 2, w // 2)]
    rand = rng.integers([-ph, -pw], [h + 1, w + 1], size=(40, 2)).tolist()
    return torch.tensor(fixed + rand, dtype=torch.long)


@pytest.mark.parametrize("channels,fmt,model_channels,scale", [
    (1, "png", 1, 0.25), (3, "png", 3, 0.12), (3, "jpg", 3, 0.5), (1, "png", 3, 0.3), (1, "jpg", 1, 0.07)])
def test_prepared_views_and_patches_are_bit_identical_to_the_source(tmp_path, channels, fmt, model_channels, scale):
    data = _dataset(tmp_path / "d", channels=channels, fmt=fmt)
    store = _store(data, model_channels, scale)
    report = prepare(store, _sources(data), log=lambda s: None)
    assert report.prepared == len(_sources(data)) and not report.failed
    rng = np.random.default_rng(1)
    for source in _sources(data):
        plain = open_input(source, channels=model_channels, scale=scale, patch_size=(7, 9))
        prepared = store.open_input(source, patch_size=(7, 9))
        assert isinstance(prepared.source, PreparedSource)
        assert prepared.low.dtype == plain.low.dtype and torch.equal(prepared.low, plain.low)
        assert prepared.source.size == plain.source.size and prepared.source.channels == model_channels
        for ph, pw in ((7, 9), (50, 50), (1, 1), (65, 70)):
            offsets = _border_offsets(*plain.source.size, ph, pw, rng)
            got = prepared.source.read_patches(offsets, (ph, pw))
            assert got.dtype == torch.uint8 and torch.equal(got, plain.source.read_patches(offsets, (ph, pw)))


def test_the_loader_hands_out_the_stored_view_and_a_small_picklable_source(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((120, 90),) * 4)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    plain = ImageDataset(data["train"], channels=1, scale=0.25, patch_size=(16, 16))
    fast = ImageDataset(data["train"], channels=1, scale=0.25, patch_size=(16, 16), prepared=store)
    a, b = collate([plain[i] for i in range(3)]), collate([fast[i] for i in range(3)])
    assert torch.equal(a.low, b.low) and torch.equal(a.labels, b.labels)
    assert isinstance(b.sources, list)  # never the stacked full-resolution images
    travelled = [pickle.loads(pickle.dumps(s)) for s in b.sources]  # as a DataLoader worker hands them over
    assert all(len(pickle.dumps(s)) < 1000 for s in b.sources)
    offsets = torch.randint(-8, 120, (3, 5, 2))
    assert torch.equal(gather_patches(travelled, offsets, (16, 16)), gather_patches(a.sources, offsets, (16, 16)))


def test_a_source_changed_after_preparing_is_read_as_it_is_now_and_prepared_again(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 3)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    source = Path(data["train"][0].path)
    img = np.asarray(Image.open(source)).copy()
    img[5:25, 5:25] = 255 - img[5:25, 5:25]
    Image.fromarray(img).save(source)
    dataset = ImageDataset(data["train"], channels=1, scale=0.25, patch_size=(8, 8), prepared=store)
    fresh = open_input(source, channels=1, scale=0.25, patch_size=(8, 8))
    assert store.open_input(source, patch_size=(8, 8)) is None  # the entry is stale: not used
    assert torch.equal(dataset[0][0], fresh.low)
    report = prepare(store, _sources(data), log=lambda s: None)
    assert (report.prepared, report.fresh) == (1, 2)
    assert torch.equal(store.open_input(source, patch_size=(8, 8)).low, fresh.low)


def test_same_size_and_mtime_still_counts_as_changed(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 3)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    source = Path(data["train"][1].path)
    st = source.stat()
    img = np.asarray(Image.open(source)).copy()
    img[0, 0] ^= 0xFF
    buf = source.with_suffix(".new.png")
    Image.fromarray(img).save(buf)
    content = buf.read_bytes()
    buf.unlink()
    with open(source, "r+b") as fh:  # same length, other bytes (a valid PNG or not: it must not be trusted)
        fh.write(content[: st.st_size].ljust(st.st_size, b"\0"))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (source.stat().st_size, source.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert store.open_input(source, patch_size=(8, 8)) is None
    assert not store.is_fresh(source)


def test_touching_a_source_restamps_its_entry_without_decoding_it_again(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 2)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    source = Path(data["train"][0].path)
    time.sleep(0.01)
    source.touch()
    assert store.open_input(source, patch_size=(8, 8)) is None
    report = prepare(store, _sources(data), log=lambda s: None)
    assert (report.restamped, report.prepared) == (1, 0)
    assert torch.equal(store.open_input(source, patch_size=(8, 8)).low,
                       open_input(source, channels=1, scale=0.25, patch_size=(8, 8)).low)


def test_a_truncated_or_deleted_source_fails_by_name_never_from_its_entry(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((60, 60),) * 3)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    truncated, deleted = Path(data["train"][0].path), Path(data["train"][1].path)
    truncated.write_bytes(truncated.read_bytes()[:100])
    deleted.unlink()
    dataset = ImageDataset(data["train"], channels=1, scale=0.25, patch_size=(8, 8), prepared=store)
    for i, path in enumerate((truncated, deleted)):
        item = dataset[i]
        assert isinstance(item, Unreadable) and item.path == str(path)
    report = prepare(store, _sources(data), log=lambda s: None)
    assert {Path(p) for p, _ in report.failed} == {truncated, deleted}


def test_an_interrupted_preparation_resumes_without_redoing_finished_files(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((50, 70),) * 8)
    store = _store(data)
    store.folder.mkdir(parents=True)
    (store.folder / ".abc.atsp.4242.tmp").write_bytes(b"half")  # what a killed writer leaves

    def stop_after_three(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(store, _sources(data), progress=stop_after_three, log=lambda s: None)
    done = {s: store.entry_path(s).stat() for s in _sources(data) if store.entry_path(s).exists()}
    assert len(done) == 3
    report = prepare(store, _sources(data), log=lambda s: None)
    assert (report.fresh, report.prepared) == (3, 5)
    for s, st in done.items():  # the same files, not rewritten
        now = store.entry_path(s).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert all(store.is_fresh(s) for s in _sources(data))
    assert not list(store.folder.glob(".*.tmp"))


def test_a_preparation_killed_mid_way_resumes_with_whole_entries_only(tmp_path):
    """kill -9 of the command and its worker processes: what they finished is kept and
    whole, their half-written files are swept, the rerun prepares only the rest."""
    import signal

    data = _dataset(tmp_path / "d", sizes=((400, 400),) * 40)
    store = _store(data)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ats_cli", "make-dataset", "prepare", str(data.root), "--scale",
                             "0.25", "--workers", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(store.folder.glob("*.atsp"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and its preparing processes, at once
        proc.wait()
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in store.folder.glob("*.atsp")}
    assert 3 <= len(before) < 40, "the preparation was not caught mid-way"
    report = prepare(store, _sources(data), log=lambda s: None)
    assert report.fresh == len(before) and report.prepared == 40 - len(before)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before  # not redone
    assert all(store.is_fresh(s) for s in _sources(data)) and not list(store.folder.glob(".*.tmp"))


def test_a_second_preparer_waits_for_the_first(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 3)
    store = _store(data)
    said, result = [], {}
    with preparer_lock(store.folder, log=lambda s: None):
        t = threading.Thread(target=lambda: result.update(r=prepare(store, _sources(data), log=said.append)))
        t.start()
        for _ in range(200):
            if said:
                break
            time.sleep(0.01)
        assert said and "waiting for another preparation" in said[0]
        assert not any(store.entry_path(s).exists() for s in _sources(data))  # nothing written while it waits
    t.join(30)
    assert result["r"].prepared == 3


def test_two_preparers_of_one_dataset_at_once_leave_every_entry_whole_and_prepare_each_once(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((200, 220),) * 12)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "ats_cli", "make-dataset", "prepare", str(data.root), "--scale", "0.25",
           "--workers", "2"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    counts = [int(o.split(": ", 1)[1].split(" prepared")[0]) for o in (o.split("prepared images in ")[-1]
                                                                          for o in outs)]
    assert sorted(counts) == [0, 12], outs
    store = _store(data)
    for s in _sources(data):
        assert torch.equal(store.open_input(s, patch_size=(8, 8)).low,
                           open_input(s, channels=1, scale=0.25, patch_size=(8, 8)).low)


def test_preparing_stops_before_the_disk_fills_and_the_loader_reads_the_sources(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 3)
    store = _store(data)
    report = prepare(store, _sources(data), log=lambda s: None, min_free=1 << 62)
    assert report.no_room == 3 and not list(store.folder.glob("*.atsp"))
    assert "left unprepared" in report.line()
    item = ImageDataset(data["train"], channels=1, scale=0.25, patch_size=(8, 8), prepared=store)[0]
    assert torch.equal(item[0], open_input(data["train"][0].path, channels=1, scale=0.25, patch_size=(8, 8)).low)


def test_an_entry_made_by_other_library_versions_is_prepared_again(tmp_path, monkeypatch):
    """Pillow decodes and torch resizes: another version may give other bits."""
    import ats_cli.data.prepared as store_module

    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 2)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    monkeypatch.setattr(store_module, "_MADE_BY", "format 1, Pillow 99, torch 99")
    assert store.open_input(data["train"][0].path, patch_size=(8, 8)) is None
    assert prepare(store, _sources(data), log=lambda s: None).prepared == 2


def test_a_damaged_entry_is_not_used(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((40, 40),) * 2)
    store = _store(data)
    prepare(store, _sources(data), log=lambda s: None)
    source = data["train"][0].path
    entry = store.entry_path(source)
    entry.write_bytes(entry.read_bytes()[:-10])
    assert store.open_input(source, patch_size=(8, 8)) is None
    assert prepare(store, _sources(data), log=lambda s: None).prepared == 1


def test_where_entries_go(tmp_path, monkeypatch):
    monkeypatch.delenv("ATS_PREPARED", raising=False)
    assert store_folder(tmp_path)[0] == tmp_path / ".ats-prepared"
    monkeypatch.setenv("ATS_PREPARED", str(tmp_path / "elsewhere"))
    assert store_folder(tmp_path)[0].parent == tmp_path / "elsewhere"
    monkeypatch.setenv("ATS_PREPARED", "off")
    assert store_folder(tmp_path)[0] is None
    monkeypatch.delenv("ATS_PREPARED")
    if os.geteuid() != 0:  # root writes anywhere
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o555)
        try:
            folder, why = store_folder(locked)
            assert folder.is_relative_to(tmp_path / "cache") and "not writable" in why
        finally:
            locked.chmod(0o755)


def test_a_folder_another_preparer_creates_meanwhile_is_still_the_one_beside_the_dataset(tmp_path, monkeypatch):
    """Two preparers start at once: the first looks, finds no folder, and the second creates
    it right then. The first must still go beside the dataset, not to the cache as if the
    dataset were read-only (what made two preparers of one dataset prepare it twice)."""
    monkeypatch.delenv("ATS_PREPARED", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    beside = tmp_path / "d" / ".ats-prepared"
    beside.parent.mkdir()
    real_stat, looked = os.stat, []

    def stat_then_created(path, *args, **kwargs):
        if Path(path) == beside and not looked:  # the first look: absent, then the other one creates it
            looked.append(path)
            beside.mkdir()
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_then_created)
    folder, why = store_folder(tmp_path / "d")
    monkeypatch.undo()
    assert looked and (folder, why) == (beside, "beside the dataset")


def test_training_with_and_without_preparing_gives_the_same_metrics(tmp_path):
    data = _dataset(tmp_path / "d", sizes=((96, 96),) * 10, channels=3)
    base = dict(data=str(data.root), n_patches=2, patch_size=16, scale=0.125, feature_width=8, batch_size=4,
                epochs=1, workers=0, seed=0, eval_n_patches=2)
    runs = {}
    for mode in (False, True):
        said = []
        train(resolve_config(None, out=str(tmp_path / str(mode)), prepare=mode, **base), log=said.append)
        runs[mode] = [json.loads(x) for x in (tmp_path / str(mode) / "metrics.jsonl").read_text().splitlines()]
        if mode:
            assert any("10 prepared" in s for s in said), said
    keys = ("train_loss", "train_acc", "test_loss", "test_acc", "entropy")
    assert [[r[k] for k in keys] for r in runs[False]] == [[r[k] for k in keys] for r in runs[True]]
