"""A training step never waits for the device (issue 39): nothing in it reads a value back.

On CUDA the step runs under ``torch.cuda.set_sync_debug_mode("error")``; on a CPU a
counting shim (tests/hostsync.py) counts the synchronising calls our code makes during a
forward + loss + backward + optimiser step. Both fail as soon as a sync is added.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ats_cli
from ats_cli import nets
from ats_cli.augment import Augmentation
from ats_cli.core import ATSModel, TensorSource, low_res_view
from ats_cli.core import model as model_module
from ats_cli.data.inputs import Batch, batch_sources
from ats_cli.train import RunningSums, train_step
from tests.hostsync import HostSyncCounter

DATA_CODE = Path(ats_cli.__file__).parent / "data"  # the lazy readers: host offsets in, host pixels out


def make_model(channels=1, **slots):
    return ATSModel(nets.create("mnist-attention", in_channels=channels, width=8),
                    nets.create("mnist-features", in_channels=channels, width=8), 3,
                    n_patches=4, patch_size=(16, 16), scale=0.25, **slots)


def make_batch(model, B=4, channels=1, lazy=False, support=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (B, channels, 64, 72), dtype=torch.uint8, generator=g)
    sources = [TensorSource(im) for im in images] if lazy else batch_sources([TensorSource(im) for im in images])
    low = low_res_view(images, model.scale)
    mask = (low[:, 0] > 0.2) if support else None
    return Batch(low, sources, torch.arange(B) % 3, torch.arange(B), mask)


def run_step(model, batch, device="cpu", optimizer=torch.optim.Adam, clip_norm=1.0, augment="none"):
    """A step of ``train_step`` to call (the same model, optimiser and batch each time)."""
    opt = optimizer(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    sums = RunningSums({"loss": 0.0, "correct": 0.0, "ent": 0.0, "n": 0.0}, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)
    def step():
        train_step(model, model, opt, scaler, batch, torch.device(device), sums, generator=gen, clip_norm=clip_norm,
                   augmentation=Augmentation.draw(augment, len(batch.labels), 0))
        sums.commit()
    return step, sums


SLOTS = {
    "thesis": {},
    "counts pooling": {"pooling": {"name": "counts", "floor": 0.1}},
    "votes pooling": {"pooling": {"name": "votes", "none_class": True}},
    "bright support": {"support": {"name": "bright", "threshold": 0.3}},
    "rarity prior": {"prior": {"name": "rarity", "weight": 1.0}},
    "learned gain": {"gain": {"name": "learned"}},
}


@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SGD], ids=["adam", "sgd"])
def test_a_step_on_in_memory_images_reads_nothing_back(slots, optimizer):
    torch.manual_seed(0)
    model = make_model(**slots)
    step, sums = run_step(model, make_batch(model, support=True), optimizer=optimizer)
    step()  # warm (lazy builds, first-use paths)
    with HostSyncCounter() as counter:
        step()
    assert counter.calls == []
    assert sums.unread == 2  # the statistics are waiting on the device, not read


def test_lazy_sources_cross_to_the_host_once_per_batch():
    """Slides and prepared entries are read on the host at the drawn positions: one transfer
    of the batch's offsets, not one per image."""
    torch.manual_seed(0)
    model = make_model()
    step, _ = run_step(model, make_batch(model, B=5, lazy=True))
    step()
    with HostSyncCounter(exclude=[DATA_CODE]) as counter:
        step()
    assert counter.counts == {"cpu": 1}, counter.calls


def test_the_shim_catches_an_injected_item(monkeypatch):
    """Negative control: one ``.item()`` added to the forward pass is counted, with its place."""
    torch.manual_seed(0)
    model = make_model()
    step, _ = run_step(model, make_batch(model))
    entropy = model_module.entropy

    def entropy_read_back(probs):
        out = entropy(probs)
        if out.sum().item() < 0:  # the kind of check that slips into a hot path
            raise AssertionError
        return out

    monkeypatch.setattr(model_module, "entropy", entropy_read_back)
    with HostSyncCounter() as counter:
        step()
    assert counter.counts == {"item": 1}
    assert __file__ in counter.calls[0][1]


@pytest.mark.parametrize("call", ["tolist", "bool", "cpu", "mask"])
def test_the_shim_catches_each_kind_of_read(call):
    x = torch.arange(4.0)
    with HostSyncCounter() as counter:
        {"tolist": lambda: x.tolist(), "bool": lambda: bool(x.sum()), "cpu": lambda: x.to("cpu"),
         "mask": lambda: x[x > 1]}[call]()
    assert len(counter.calls) == 1
    assert torch.Tensor.tolist is not None and x.tolist() == [0.0, 1.0, 2.0, 3.0]  # restored after


def test_the_running_sums_are_those_of_reading_every_step():
    """Adding on the device in float64, in step order, gives bit for bit the Python sums the
    epoch record and a resumed run used to get by reading every step."""
    g = torch.Generator().manual_seed(1)
    start = {"loss": 12.345678901, "correct": 7.0, "ent": 3.25, "n": 9.0, "time": 1.0}
    sums = RunningSums(dict(start), torch.device("cpu"))
    expected = {**start, "bonus": 0.0, "uniform": 0.0, "moved": 0.0}  # none given: zeros
    for _ in range(7):
        labels = torch.randint(0, 3, (5,), generator=g)
        loss, logits = torch.rand((), generator=g) * 3, torch.randn(5, 3, generator=g)
        ent = torch.rand(5, generator=g)
        sums.add(loss, (logits.argmax(1) == labels).sum(), ent, labels)
        sums.commit()
        read = [float(loss) * 5, float((logits.argmax(1) == labels).sum()), float(ent.sum()), 5]
        for key, value in zip(("loss", "correct", "ent", "n"), read, strict=True):
            expected[key] += value
    assert sums.flush() == expected
    sums.add(loss, (logits.argmax(1) == labels).sum(), ent, labels)  # interrupted before counted: not summed
    assert sums.flush() == expected


@pytest.mark.uses_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lazy", [False, True], ids=["in-memory", "lazy"])
@pytest.mark.parametrize("augment", ["none", "colour+flips"])
def test_a_cuda_step_does_not_synchronise(lazy, augment):
    """The real thing: CUDA raises at any synchronising call (a read back, a copy from
    pageable memory). The lazy path's one transfer of the offsets is the only one."""
    torch.manual_seed(0)
    model = make_model(channels=3, support={"name": "bright", "threshold": 0.3}).cuda()
    batch = make_batch(model, channels=3, lazy=lazy, support=True).pin_memory()
    step, sums = run_step(model, batch, device="cuda", augment=augment)
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # "error" would stop at the first; these are counted
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # the sync warning itself: torch's one-time notice on entering the mode ("... does not yet
    # detect all synchronizing operations") also says "synchroniz", and the first test of a
    # process to enter it would count it (seen on an H100: the first parameter failed alone)
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == (1 if lazy else 0), syncs
    assert sums.flush()["n"] == 2 * len(batch.labels)
