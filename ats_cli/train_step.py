"""One training step that never waits for the device, and the epoch's sums kept there.

Why: on a GPU the host only queues work; every read of a device value (``float(loss)``,
``.item()``, ``.tolist()``, ``.cpu()``, ``if tensor:``) makes it wait until the queue has
drained, so the next step's launches start only after this one has finished and the GPU
idles meanwhile. A step here reads nothing back: the inputs go up pinned and
asynchronously (:func:`~ats_cli.core.source.to_device`), sampling, the estimator, the
patches (one extraction for the batch, on the device, for in-memory images) and the loss
stay on the device, and the statistics the progress bar and the epoch record show
(loss x n, correct, entropy, n) are added to a float64 vector on the device, read once
every :data:`STATS_EVERY` steps and at the end of the epoch (:class:`RunningSums`).

Lazy sources (slides, prepared entries) are read on the host at the positions the device
drew, so their offsets cross to the host once per batch: that one transfer is the price of
never holding the whole image, and the only one (tests/test_host_sync.py counts them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ats_cli.core.source import to_device
from ats_cli.multilabel import correct, step_loss

__all__ = ["DEVICE_SOURCES_MAX_BYTES", "STATS_EVERY", "RunningSums", "train_step"]

STATS_EVERY = 50  # steps between two reads of the running sums on CUDA (each read waits for the queue)
# in-memory images of a batch up to this size go to the device whole (patches then cut there,
# in one launch); larger ones stay on the host and are cut there at the offsets the device drew
DEVICE_SOURCES_MAX_BYTES = 1 << 30


class RunningSums:
    """The epoch's sums of (loss x n, correct, entropy, n) as a float64 vector on the device.

    ``running`` is the dict the run saves on Ctrl-C and reports per epoch; it is updated by
    :meth:`flush`. The vector starts from its values and adds each step's in order, the same
    float64 additions in the same order as adding Python floats step by step, so the
    figures are bit for bit what reading every step gave (and a resumed run's too)."""

    KEYS = ("loss", "correct", "ent", "n")

    def __init__(self, running: dict[str, float], device: torch.device, *, distributed: bool = False):
        self.running = running
        self.distributed = distributed
        self.every = STATS_EVERY if torch.device(device).type == "cuda" else 1  # reading on a CPU costs nothing
        self.sums = to_device(torch.tensor([float(running[k]) for k in self.KEYS], dtype=torch.float64), device)
        self.unread = 0
        self.staged: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, correct: torch.Tensor, entropy: torch.Tensor, labels: torch.Tensor) -> None:
        """Stage one step's statistics (all processes' under torch.distributed), without
        waiting; :meth:`commit` adds them once the step is counted, so that a Ctrl-C in
        between leaves sums and position in agreement (the step is redone on resume)."""
        n = labels.shape[0]
        step = torch.stack([loss.detach().double() * n, correct.double(),
                            entropy.detach().sum().double(),
                            torch.full((), float(n), dtype=torch.float64, device=self.sums.device)])
        if self.distributed:
            dist.all_reduce(step)  # on the device: queued like any kernel
        self.staged = step

    def commit(self) -> None:
        """Add the staged step to the sums (queued, no waiting)."""
        if self.staged is not None:
            self.sums += self.staged
            self.staged = None
            self.unread += 1

    def due(self) -> bool:
        return self.unread >= self.every

    def flush(self) -> dict[str, float]:
        """Read the sums into ``running`` (one wait for the device) and return it."""
        if self.unread:
            self.running.update(zip(self.KEYS, self.sums.tolist(), strict=True))
            self.unread = 0
        return self.running


def batch_sources_on(sources, device: torch.device):
    """The batch's sources where the step reads its patches: an in-memory batch on the
    device (up to :data:`DEVICE_SOURCES_MAX_BYTES`), lazy sources where they are."""
    if isinstance(sources, torch.Tensor) and sources.numel() * sources.element_size() <= DEVICE_SOURCES_MAX_BYTES:
        return to_device(sources, device)
    return sources


def train_step(net: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, batch, device: torch.device, sums: RunningSums, *,
               generator: torch.Generator, autocast=None, augmentation=None, clip_norm: float = 0.0) -> None:
    """Forward, loss, backward and optimiser step on ``batch`` (:class:`~ats_cli.data.inputs.Batch`),
    its statistics added to ``sums``; nothing is read back from the device.

    ``net`` is the model or its DistributedDataParallel wrapper, ``model`` the model itself
    (its ``loss`` and parameters); ``augmentation``: :class:`~ats_cli.augment.Augmentation` or None."""
    labels = to_device(batch.labels, device)
    low = to_device(batch.low, device)
    sources = batch_sources_on(batch.sources, device)
    extra = {"patch_transform": augmentation.patches} if augmentation else {}
    with autocast if autocast is not None else contextlib.nullcontext():
        out = net(augmentation.low(low) if augmentation else low, sources, generator=generator,
                  support_mask=to_device(batch.support, device), **extra)
        loss = step_loss(model, out, labels)  # multi-hot labels: a sigmoid per class
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()  # DDP averages the gradients over the ranks here
    sums.add(loss, correct(out.logits, labels), out.entropy, labels)
    if clip_norm:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    scaler.step(opt)
    scaler.update()
