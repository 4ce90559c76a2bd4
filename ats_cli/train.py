"""The training loop, readable top to bottom.

One run directory holds everything: ``config.json`` (the settled configuration),
``settled.json`` (what was left to the data, and why: :mod:`ats_cli.config`),
``metrics.jsonl`` (one line per epoch), ``last.pt`` and ``best.pt`` (full checkpoints),
``epochs/epoch_NNN.pt`` (weights after each epoch, for the attention-evolution figure)
and ``curves.png``; where the ``tensorboard`` package is installed, also ``tb/`` (the
same per-epoch records for TensorBoard; :class:`_TensorBoard`).

Several processes (``torchrun`` or ``ats train --devices N``; see
:mod:`ats_cli.runtime` and docs/distributed.md): ``--batch-size`` is per process, a
step consumes ``batch_size * world_size`` images of the epoch's order (each rank its own
slice), DDP averages the gradients, metrics are summed over the ranks, and rank 0 alone
logs and writes files.

Exact resumption: the data order of epoch e comes from (seed, e), and the noise that
samples the patches of a step is seeded by (seed, epoch, images already done in the
epoch, rank). Nothing random has to be saved, and a run interrupted at any step (Ctrl-C
saves at the current step) and resumed with the same number of processes gives the same
weights as a run that was never interrupted. The position is saved in images, not steps,
so a run can also be resumed with another number of processes (see docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ats_cli.augment import Augmentation
from ats_cli.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ats_cli.config import (
    GAIN_LATE_START,
    PRETRAINED_FACTS,
    TrainConfig,
    eval_view_scale,
    settle,
    settle_data,
    view_scale,
)
from ats_cli.core.source import to_device
from ats_cli.data.dataset import load_dataset
from ats_cli.data.facts import load_facts, save_settled
from ats_cli.data.features import feature_store_for, image_keys
from ats_cli.data.images import ImageReadError
from ats_cli.data.inputs import (
    Batch,
    ImageDataset,
    check_patches_fit,
    collate,
    readable,
    single_thread_worker,
    view_cache_for,
)
from ats_cli.diagnose import attention_learns, attention_moved, chance_accuracy, uniform_entropy
from ats_cli.diagnose import warnings as degenerate_warnings
from ats_cli.inference import predict_probs
from ats_cli.io import atomic_save_png, atomic_write_text
from ats_cli.models import check_patch_size, create_model, model_spec
from ats_cli.multilabel import confusion_counts, exact_matches, is_multilabel, macro_f1
from ats_cli.multilabel import loss as multilabel_loss
from ats_cli.multilabel import nll as multilabel_nll
from ats_cli.nets.encoders import apply_feature_train, freeze, load_start_weights
from ats_cli.registry import KINDS
from ats_cli.runtime import (
    Deferred,
    Dist,
    all_reduce,
    append_metrics,
    broadcast_buffers,
    check_run_data,
    claim,
    deferred_interrupts,
    failed_save,
    from_main,
    make_dirs,
    peak_memory_mb,
    process_group,
    reset_peak_memory,
    resume_state,
    rewrite_metrics,
    run_data_identity,
    settings_changed,
    shard_batches,
)

__all__ = ["train", "train_one_epoch", "train_step", "RunningSums", "evaluate", "loader_workers", "TrainingInterrupted",
           "TrainingDiverged"]

EVAL_SEED = 12345  # the test set is always sampled the same way, so epochs compare


class TrainingInterrupted(Exception):
    """Raised after Ctrl-C once the state has been saved; ``--resume`` continues."""


class TrainingDiverged(ValueError):
    """The training loss became NaN or infinite: the weights no longer mean anything, so the
    run stops there without saving them (the checkpoints of the epochs before are kept).
    Training on used to go to the last epoch with loss nan and exit 0."""


AUTO_WORKERS_CPU = 2  # --workers auto on a CPU device: the compute shares the cores with the workers
AUTO_WORKERS_MAX = 16  # --workers auto on CUDA: at most this many per process


def loader_workers(workers: int, device: torch.device, *, prepared: bool = False) -> int:
    """DataLoader workers for ``--workers`` (-1 = auto); ``prepared``: the dataset reads
    prepared entries (:mod:`ats_cli.data.prepared`).

    Auto on CUDA: the CPUs this process may use, shared among the processes of the run on
    this node (torchrun's ``LOCAL_WORLD_SIZE``), at most ``AUTO_WORKERS_MAX``. Why: reading
    source files, the GPU waits for the CPU (each worker decodes a full-size image, makes
    its low-res view and cuts its patches) and samples/s follow the workers; prepared
    images read fast enough with any count, and the workers cost little there
    (benchmarks/gpu.md, "On a GPU").
    Auto on a CPU device: none for prepared images, else ``AUTO_WORKERS_CPU``, since there
    the workers take cores from the training itself. A prepared sample costs the loader a
    stored view and the few tiles its patches touch, a small part of its share of a
    training step (benchmarks/README.md, "Loader"); workers would hide that part and cost
    more: a fork of the training process per worker for each of an epoch's three loaders
    (training, batch-norm recalibration, test), and the batches' trip between processes,
    on the cores the step runs on. A source file (``--no-prepare``, slides) costs a
    decode and a resize, which the workers do overlap with the step.
    The workers never change the result: a step's images and noise are seeded, not drawn
    by whoever reads first."""
    if workers >= 0:
        return workers
    if device.type != "cuda":
        return 0 if prepared else AUTO_WORKERS_CPU
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, min(AUTO_WORKERS_MAX, cpus // per_node))


def _loader(dataset: ImageDataset, batches: list[list[int]], cfg: TrainConfig, device: torch.device) -> DataLoader:
    workers = loader_workers(cfg.workers, device, prepared=dataset.prepared is not None)
    return DataLoader(dataset, batch_sampler=batches, num_workers=workers, collate_fn=collate,
                      pin_memory=device.type == "cuda", worker_init_fn=single_thread_worker,
                      prefetch_factor=4 if workers else None)


def _conv_layout(device: torch.device) -> torch.memory_format:
    """The memory layout of the model's convolution weights while it trains on ``device``.

    Channels-last on a CPU: oneDNN's convolutions for few channels (the attention net's 8,
    the feature net's 16-32) run in the NHWC layout, and a convolution follows its weight's
    layout, so with the weights in it every activation after the first layer is NHWC and
    no layer converts. Only the order of the sums inside a convolution changes, not what is
    computed: the estimator is the same; the figures differ from the default layout's by
    float rounding (benchmarks/README.md, "A CPU training epoch", has both runs' curves).
    Elsewhere the default layout is kept (cuDNN chooses for itself, and bf16/fp16 are another
    question). Checkpoints are unaffected: a state dict's values load into either layout."""
    return torch.channels_last if device.type == "cpu" else torch.preserve_format


def _optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """One parameter group at ``--lr``, then (``feature_lr`` other than 1) the feature
    network's at that fraction of it; with ``feature_lr 0`` the feature network is frozen
    (:func:`freeze_features`) and left out. Each group's ``lr_scale`` multiplies the schedule;
    ``patch_gain late`` puts the gain in a group of its own that starts (``from_epoch``,
    :func:`_set_lr`) at ``GAIN_LATE_START`` of the epochs."""
    features = getattr(model, "feature_net", None)
    if cfg.feature_lr != 1 and features is None:
        raise ValueError(f"feature_lr {cfg.feature_lr}: method {cfg.method!r} has no feature network")
    if cfg.feature_lr == 0:
        freeze_features(model)
    own = {id(p) for p in features.parameters()} if features is not None and cfg.feature_lr != 1 else set()
    gain = getattr(model, "gain", None)
    late = [p for p in gain.parameters() if p.requires_grad] if gain is not None and cfg.patch_gain == "late" else []
    own |= {id(p) for p in late}
    groups = [{"params": [p for p in model.parameters() if id(p) not in own and p.requires_grad], "lr_scale": 1.0}]
    if features is not None and cfg.feature_lr not in (0, 1):  # a frozen part (feature_train) holds no state
        groups.append({"params": [p for p in features.parameters() if p.requires_grad], "lr_scale": cfg.feature_lr})
    if late:
        groups.append({"params": late, "lr_scale": 1.0, "from_epoch": GAIN_LATE_START * cfg.epochs})
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


def freeze_features(model: torch.nn.Module) -> None:
    """``feature_lr 0``: the feature network as a fixed encoder (:func:`ats_cli.nets.encoders.freeze`
    says why its batch norms stay in evaluation mode, here and in :func:`recalibrate_batch_norm`)."""
    freeze(model.feature_net)


def train_mode(model: torch.nn.Module) -> None:
    """``model.train()``, except for the frozen modules (:func:`freeze_features`)."""
    model.train()
    for m in model.modules():
        if getattr(m, "frozen", False):
            m.eval()


def _set_lr(opt: torch.optim.Optimizer, cfg: TrainConfig, progress: float) -> None:
    """Each group's learning rate at ``progress`` epochs: the schedule times its ``lr_scale``,
    0 before its ``from_epoch`` (a part that trains only from there on: ``patch_gain late``).
    A function of the position alone, so a resumed run sets what the uninterrupted one did."""
    for group in opt.param_groups:
        on = progress >= group.get("from_epoch", 0.0)
        group["lr"] = _lr_at(cfg, progress) * group.get("lr_scale", 1.0) if on else 0.0


def _lr_at(cfg: TrainConfig, progress: float) -> float:
    """Learning rate at ``progress`` epochs (fractional): linear warm-up, then constant or cosine."""
    if cfg.warmup_epochs and progress < cfg.warmup_epochs:
        return cfg.lr * (progress + 1e-3) / cfg.warmup_epochs
    if cfg.schedule == "cosine":
        t = (progress - cfg.warmup_epochs) / max(cfg.epochs - cfg.warmup_epochs, 1e-9)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(max(t, 0.0), 1.0)))
    return cfg.lr


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.amp == "none" or device.type != "cuda":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast("cuda", dtype=torch.bfloat16 if cfg.amp == "bf16" else torch.float16)


def _seed(*keys: int) -> int:
    """A well-mixed 64-bit seed from a few integers: nearby keys give unrelated streams.

    Seeding the sampling noise from where it is used, instead of carrying one generator
    through the run, is what makes resumption exact without saving any RNG state (one
    per rank, under torch.distributed) and keeps it valid with another number of ranks.
    """
    return int.from_bytes(hashlib.blake2b(repr(keys).encode(), digest_size=8).digest(), "little")


# ---------------------------------------------------------------- the step
# One training step that never waits for the device, and the epoch's sums kept there.
#
# Why: on a GPU the host only queues work; every read of a device value (``float(loss)``,
# ``.item()``, ``.tolist()``, ``.cpu()``, ``if tensor:``) makes it wait until the queue has
# drained, so the next step's launches start only after this one has finished and the GPU
# idles meanwhile. A step here reads nothing back: the inputs go up pinned and
# asynchronously (:func:`~ats_cli.core.source.to_device`), sampling, the estimator, the
# patches (one extraction for the batch, on the device, for in-memory images) and the loss
# stay on the device, and the statistics the progress bar and the epoch record show
# (loss x n, correct, entropy, n) are added to a float64 vector on the device, read once
# every :data:`STATS_EVERY` steps and at the end of the epoch (:class:`RunningSums`).
#
# Lazy sources (slides, prepared entries) are read on the host at the positions the device
# drew, so their offsets cross to the host once per batch: that one transfer is the price of
# never holding the whole image, and the only one (tests/test_host_sync.py counts them).


STATS_EVERY = 50  # steps between two reads of the running sums on CUDA (each read waits for the queue)
# in-memory images of a batch up to this size go to the device whole (patches then cut there,
# in one launch); larger ones stay on the host and are cut there at the offsets the device drew
DEVICE_SOURCES_MAX_BYTES = 1 << 30


class RunningSums:
    """The epoch's sums of (loss x n, correct, entropy, n, the exploration bonus, a uniform
    attention's entropy) as a float64 vector on the device.

    ``running`` is the dict the run saves on Ctrl-C and reports per epoch; it is updated by
    :meth:`flush`. The vector starts from its values and adds each step's in order, the same
    float64 additions in the same order as adding Python floats step by step, so the
    figures are bit for bit what reading every step gave (and a resumed run's too)."""

    # bonus: the classification loss minus the loss (the exploration bonus, less the per-patch
    # loss), so the classification loss is loss + bonus;
    # uniform: ats_cli.diagnose.uniform_entropy (a run that learns nothing says so)
    KEYS = ("loss", "correct", "ent", "n", "bonus", "uniform", "moved")

    def __init__(self, running: dict[str, float], device: torch.device, *, distributed: bool = False):
        self.running = running
        self.distributed = distributed
        self.every = STATS_EVERY if torch.device(device).type == "cuda" else 1  # reading on a CPU costs nothing
        # a checkpoint saved mid-epoch before bonus and uniform were kept has neither: 0
        self.sums = to_device(torch.tensor([float(running.get(k, 0.0)) for k in self.KEYS], dtype=torch.float64),
                              device)
        self.unread = 0
        self.staged: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, correct: torch.Tensor, entropy: torch.Tensor, labels: torch.Tensor,
            bonus: torch.Tensor | None = None, uniform: torch.Tensor | None = None,
            moved: torch.Tensor | None = None) -> None:
        """Stage one step's statistics (all processes' under torch.distributed), without
        waiting; :meth:`commit` adds them once the step is counted, so that a Ctrl-C in
        between leaves sums and position in agreement (the step is redone on resume)."""
        n = labels.shape[0]
        zero = torch.zeros((), dtype=torch.float64, device=self.sums.device)
        step = torch.stack([loss.detach().double() * n, correct.double(),
                            entropy.detach().sum().double(),
                            torch.full((), float(n), dtype=torch.float64, device=self.sums.device),
                            zero if bonus is None else bonus.detach().double() * n,
                            zero if uniform is None else uniform.detach().sum().double().to(zero.device),
                            zero if moved is None else moved.detach().sum().double().to(zero.device)])
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
               generator: torch.Generator, autocast=None, augmentation=None, clip_norm: float = 0.0,
               feature_keys: list[str | None] | None = None) -> None:
    """Forward, loss, backward and optimiser step on ``batch`` (:class:`~ats_cli.data.inputs.Batch`),
    its statistics added to ``sums``; nothing is read back from the device.

    ``net`` is the model or its DistributedDataParallel wrapper, ``model`` the model itself
    (its ``loss`` and parameters); ``augmentation``: :class:`~ats_cli.augment.Augmentation` or None;
    ``feature_keys``: the images' content keys for the model's feature store (:func:`_feature_keys`)."""
    labels = to_device(batch.labels, device)
    low = to_device(batch.low, device)
    sources = batch_sources_on(batch.sources, device)
    extra = {"patch_transform": augmentation.patches} if augmentation else {}
    if feature_keys is not None:
        extra["feature_keys"] = feature_keys
    with autocast if autocast is not None else contextlib.nullcontext():
        out = net(augmentation.low(low) if augmentation else low, sources, generator=generator,
                  support_mask=to_device(batch.support, device), **batch.views, **extra)
        loss = step_loss(model, out, labels)  # multi-hot labels: a sigmoid per class
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()  # DDP averages the gradients over the ranks here
    sums.add(loss, correct(out.logits, labels), out.entropy, labels,
             bonus=label_nll(model, out, labels) - loss, uniform=(uniform := uniform_entropy(out)),
             moved=attention_moved(model, out, uniform))
    if clip_norm:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    scaler.step(opt)
    scaler.update()


def step_loss(model: Any, out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The training loss of a batch: :func:`ats_cli.multilabel.loss` for multi-hot ``labels`` (float [B,
    classes]), else the model's own (class indices [B])."""
    return multilabel_loss(model, out, labels) if labels.is_floating_point() else model.loss(out, labels)


@torch.no_grad()
def label_nll(model: Any, out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The batch's classification loss alone, what the held-out losses are: :func:`step_loss`
    without the exploration bonus and the per-patch loss (``train_ce`` in the epoch record)."""
    if labels.is_floating_point():
        return multilabel_nll(out.logits, labels)
    pooling = getattr(model, "pooling", None)
    return pooling.nll(out.logits, labels) if pooling is not None else \
        torch.nn.functional.cross_entropy(out.logits.float(), labels)


def correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Right predictions in a batch, a count on the logits' device (read by nobody here: the
    step never waits for it): the argmax for class indices, exact matches at the default
    threshold for multi-hot labels (sigmoid(z) >= 0.5 is z >= 0)."""
    if labels.is_floating_point():
        return ((logits >= 0) == (labels > 0.5)).all(dim=-1).sum()
    return (logits.argmax(1) == labels).sum()


@dataclass
class Position:
    """Where training stands in an epoch: what ``last.pt`` holds after Ctrl-C and what
    ``--resume`` continues from. ``done`` counts images of the epoch's order already
    trained on (all processes together), so it survives a change of the number of
    processes; ``running`` holds the epoch's sums so far (loss, correct, ent, n, time)."""

    epoch: int
    step: int
    done: int
    running: dict[str, float]


def train_one_epoch(cfg: TrainConfig, ctx: Dist, device: torch.device, net: torch.nn.Module,
                    opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, train_set: ImageDataset,
                    order: list[int], pos: Position, *, save: Callable[[Position], None],
                    progress: Callable[[str, int, int, dict], None] | None) -> None:
    """Train on the images of ``order`` from ``pos.done`` on, one step per global batch,
    updating ``pos`` after every step.

    The learning rate of a step comes from the fractional epoch it starts at, and its
    sampling noise from (seed, epoch, images done, rank): a step does the same thing
    whether or not the run was interrupted before it. Ctrl-C calls ``save(pos)`` with the
    last finished step and raises :class:`TrainingInterrupted`.
    """
    model = net.module if isinstance(net, DistributedDataParallel) else net
    global_batch = cfg.batch_size * ctx.world_size
    batches = shard_batches(order, pos.done, cfg.batch_size, ctx)
    loader = _loader(train_set, batches, cfg, device)
    sampling_gen = torch.Generator(device=device)
    total_steps = pos.step + len(batches)
    acc = pos.running
    sums = RunningSums(acc, device, distributed=ctx.enabled)  # read every few steps (RunningSums)
    train_mode(net)
    t_last = time.perf_counter()
    try:
        for batch in readable(loader):
            batch: Batch
            _set_lr(opt, cfg, pos.epoch + pos.done / len(train_set))
            sampling_gen.manual_seed(_seed(cfg.seed, pos.epoch, pos.done, ctx.rank))
            # ats_cli.augment: the same per-image colours for the low-res view and its patches
            # (none, the settled value for images without a tissue mask: nothing is drawn)
            aug = None if cfg.augment == "none" else Augmentation.draw(
                cfg.augment, len(batch.labels), _seed(cfg.seed, pos.epoch, pos.done, ctx.rank, "augment"))
            train_step(net, model, opt, scaler, batch, device, sums, generator=sampling_gen,
                       autocast=_autocast(cfg, device), augmentation=aug, clip_norm=cfg.clip_norm,
                       feature_keys=None if aug is not None else _feature_keys(model, train_set, batch))
            # the step counted with its statistics (no waiting), so Ctrl-C saves a consistent state
            pos.step += 1
            pos.done = min(pos.done + global_batch, len(train_set))
            sums.commit()
            if sums.due() or pos.step == total_steps or not acc["n"]:
                sums.flush()
                if not math.isfinite(acc["loss"]):  # read with the sums: no extra wait for the device
                    raise TrainingDiverged(
                        f"the training loss became {acc['loss'] / max(acc['n'], 1)} at epoch {pos.epoch + 1}, step "
                        f"{pos.step}; stopped without saving these weights (the last finished epoch is in "
                        f"{Path(cfg.out) / 'last.pt'}, if any): check the starting weights and the images, or lower "
                        "--lr")
            now = time.perf_counter()
            acc["time"] += now - t_last  # wall time (the ranks run in lockstep)
            t_last = now
            if progress:  # the loss and accuracy as last read (every step on a CPU)
                progress("train", pos.step, total_steps,
                         {"epoch": pos.epoch + 1, "loss": acc["loss"] / acc["n"], "acc": acc["correct"] / acc["n"]})
    except KeyboardInterrupt:
        sums.flush()
        _flush_features(model)  # what was encoded is kept: a resumed run reads it back
        save(pos)
        raise TrainingInterrupted(f"interrupted at epoch {pos.epoch + 1}, step {pos.step}; state saved to "
                                  f"{Path(cfg.out) / 'last.pt'}; continue with --resume") from None


def _feature_keys(model: Any, dataset: Any, batch: Batch) -> list[str | None] | None:
    """The content keys of ``batch``'s images for ``model``'s feature store
    (:mod:`ats_cli.data.features`), None without one (or without a dataset to key them by:
    batches handed over as a list)."""
    store = getattr(model, "feature_store", None)
    return None if store is None or dataset is None else image_keys(store.keys_of, dataset, batch.indices,
                                                                     batch.sources)


def _flush_features(model: Any) -> None:
    store = getattr(model, "feature_store", None)
    if store is not None:
        store.flush()


def check_finite_weights(model: torch.nn.Module, when: str, run: Path) -> None:
    """Raise :class:`TrainingDiverged` when a weight or buffer of ``model`` holds NaN or
    infinity: the last step of an epoch can make them so with a finite loss (and batch-norm
    statistics recalibrated on huge activations), and saving them would make checkpoints
    that predict nothing (and that loading refuses). One read per epoch."""
    tensors = [*model.named_parameters(), *model.named_buffers()]  # batch-norm statistics too
    bad = [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise TrainingDiverged(f"the weights became NaN or infinite {when} ({bad[0]}"
                               f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); stopped without saving them "
                               f"(the last finished epoch is in {run / 'last.pt'}, if any): check the starting weights "
                               "and the images, or lower --lr")


BN_BATCHES = 16  # training batches whose statistics become the batch norms' running statistics after an epoch


@torch.no_grad()
def recalibrate_batch_norm(model: torch.nn.Module, loader: DataLoader, device: torch.device, seed: int) -> int:
    """Replace every batch norm's running mean and variance by the average over the batches
    of ``loader`` of the statistics the current weights produce (model in training mode,
    no gradient, nothing else changed). Returns the number of batches used (0: no batch norm).

    Why: training normalises with each batch's own statistics, evaluation and prediction
    with the running averages, which follow the weights with a lag of ~1/momentum = 10
    steps. On a large dataset that lag is a small part of an epoch; on a small one it is
    all of it: synthetic slides (240 images, batch 32) take 8 steps an epoch, and a model
    that trained well evaluated at chance (every slide one class) until the cosine
    schedule slowed the weights down (docs/training.md has the run). Training
    never reads these buffers, so the weights, the optimiser and exact resumption are
    untouched; what changes is what evaluation, ``best.pt`` and the released model see.
    The draws are seeded from ``seed``, so a resumed run computes the same statistics from
    the same batches as an uninterrupted one."""
    frozen = {id(m) for f in model.modules() if getattr(f, "frozen", False) for m in f.modules()}
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats and id(m) not in frozen]
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches below
    was_training = model.training
    train_mode(model)
    gen = torch.Generator(device=device)
    used = 0
    try:
        for batch in readable(loader):
            gen.manual_seed(_seed(seed, used))
            model(batch.low.to(device), batch.sources, generator=gen, support_mask=batch.support_on(device),
                  **batch.views)
            used += 1
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        if was_training:
            train_mode(model)
        else:
            model.eval()
    return used


def _label_nll(model, probs: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The batch's mean negative log-likelihood of its labels, as the training loss measures
    it: the pooling's own (``Pooling.nll``: ``-log P(y)`` for the rule poolings, whose logits
    are log-probabilities that leave out "nothing present", so the softmax of ``probs``
    would measure another quantity), or for a model without a pooling (the baselines) the
    cross-entropy of its probabilities. ``probs`` and ``logits`` come from one sampling."""
    pooling = getattr(model, "pooling", None)
    if pooling is not None:
        return pooling.nll(logits, labels)
    return torch.nn.functional.nll_loss(probs.clamp_min(1e-12).log(), labels)


@torch.no_grad()
def evaluate(model, loader: DataLoader, device: torch.device, *, n_patches: int | None = None,
             ctx: Dist | None = None) -> dict[str, float]:
    """Test loss (the training loss's likelihood term, :func:`_label_nll`), accuracy and mean
    attention entropy; for multi-hot labels the loss is the binary cross-entropy, the
    accuracy the exact match ratio, and ``macro_f1`` is added (:mod:`ats_cli.multilabel`).

    Each batch's sampling is seeded by (EVAL_SEED, index of its first image), so the
    numbers do not depend on the epoch or on which process evaluated which batch: with
    several processes each one evaluates its share of the batches and the sums are
    reduced (``ctx``)."""
    ctx = ctx or Dist()
    model.eval()
    gen = torch.Generator(device=device)
    loss = right = ent = count = 0.0
    # multi-label: true/false positives, false negatives per class, on every rank (even one
    # without a batch: all of them take part in the reduction below)
    counts = torch.zeros(3, model.classifier.out_features, dtype=torch.float64) if is_multilabel(model) else None
    for batch in readable(loader):
        gen.manual_seed(_seed(EVAL_SEED, int(batch.indices[0])))
        labels = batch.labels.to(device)
        keys = _feature_keys(model, getattr(loader, "dataset", None), batch)
        probs, out = predict_probs(model, batch.low.to(device), batch.sources, n_patches=n_patches, generator=gen,
                                   support_mask=batch.support_on(device), **batch.views,
                                   **({} if keys is None else {"feature_keys": keys}))
        if labels.is_floating_point():
            p = probs.clamp(1e-12, 1 - 1e-12)
            loss += float(torch.nn.functional.binary_cross_entropy(p, labels, reduction="sum"))  # as in training
            right += exact_matches(probs, labels)
            counts += confusion_counts(probs, labels).cpu()
        else:
            loss += float(_label_nll(model, probs, out.logits, labels)) * len(labels)
            right += float((probs.argmax(1) == labels).sum())
        ent += float(out.entropy.sum())
        count += len(labels)
    train_mode(model)
    loss, right, ent, count = all_reduce([loss, right, ent, count], ctx, device)
    result = {"loss": loss / max(count, 1), "acc": right / max(count, 1), "entropy": ent / max(count, 1)}
    if counts is not None:
        summed = all_reduce(counts.flatten().tolist(), ctx, device)
        result["macro_f1"] = macro_f1(torch.tensor(summed, dtype=torch.float64).view(counts.shape))
    return result


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    progress: Callable[[str, int, int, dict], None] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train per ``cfg``; returns the metrics of every epoch (also in metrics.jsonl).

    ``progress(phase, step, total, info)`` is called after every training step (the CLI
    draws a progress bar with it); ``log`` receives the settled values with their reasons
    at the start (:mod:`ats_cli.config`), then one line per epoch. Both are called on rank
    0 only. Under torchrun (``WORLD_SIZE`` > 1) this joins the process group itself,
    unless the caller already did.
    """
    # the run directory is this run's alone while it trains (ats_cli.runtime): rank 0 holds its lock
    with process_group(cfg.device) as (ctx, device), claim(cfg.out, resume=resume, enabled=ctx.is_main), \
            _TensorBoard(Path(cfg.out) / "tb", log, enabled=ctx.is_main) as board:
        return _train(cfg, ctx, device, resume=resume, board=board, progress=progress if ctx.is_main else None,
                      log=log if ctx.is_main else lambda s: None)


def _init_from(model: torch.nn.Module, path: str, spec: dict[str, Any], classes: list[str], ctx: Dist) -> str:
    """Load another run's weights into ``model``; returns what was taken, in words.

    Used to fine-tune a released model on one's own data, as a curriculum (train where the
    task is easy, continue where it is hard), or to transfer to another task. The networks
    must be the same (names and arguments): they are what is transferred. The classifier is
    taken when the classes are the same; for other classes (another label rule, another
    task) it starts from its own initialisation, as a pretrained backbone's head does. An
    extension's parameters are taken where this model has the same ones (a ``counts``
    pooling's "none" logit is not used by a ``features`` pooling). Only the weights are
    taken: optimizer, schedule and epoch count start afresh.
    """
    ckpt = from_main(lambda: load_checkpoint(path), ctx)
    nets = ("attention_net", "attention_kwargs", "feature_net", "feature_kwargs", "channels")
    theirs = {k: ckpt.get("spec", {}).get(k) for k in nets}
    ours = {k: spec[k] for k in nets}
    if theirs != ours:
        raise CheckpointError(f"{path}: networks {theirs} differ from this run's {ours}")
    same_classes = list(ckpt.get("classes", [])) == list(classes)
    weights, own = ckpt["model"], model.state_dict()
    take = {k: w for k, w in weights.items()
            if k in own and w.shape == own[k].shape and (same_classes or not k.startswith("classifier."))}
    networks = ("attention_net.", "coarse_net.", "feature_net.")
    unfit = [k for k in own if k.startswith(networks) and k not in take]
    if unfit:
        raise CheckpointError(f"{path}: weights do not fit this run's networks ({', '.join(unfit[:3])}"
                              f"{', ...' if len(unfit) > 3 else ''})")
    model.load_state_dict(take, strict=False)

    def parts(keys) -> str:  # "attention_net, classifier, pooling.none": modules, an extension slot's by its part
        def part(key: str) -> str:
            head, *rest = key.split(".")
            return f"{head}.{rest[0]}" if head in (*KINDS, "position") and rest else head

        return ", ".join(dict.fromkeys(part(k) for k in keys))

    fresh = [k for k in own if k not in take]
    unused = [k for k in weights if k not in take]
    why = "" if same_classes else f" (its classes {ckpt.get('classes')} are not the dataset's)"
    return (f"took {parts(take)}" + (f"; from their own initialisation: {parts(fresh)}{why}" if fresh else "")
            + (f"; not used: {parts(unused)}" if unused else ""))


def _train(cfg: TrainConfig, ctx: Dist, device: torch.device, *, resume: bool, board: _TensorBoard,
           progress: Callable[[str, int, int, dict], None] | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    run = Path(cfg.out)
    if ctx.is_main:  # other ranks write nothing, anywhere
        make_dirs(run / "epochs")
    amp = cfg.amp if device.type == "cuda" else "none"
    if amp != cfg.amp:
        log(f"warning: --amp {cfg.amp} needs a CUDA device; training in float32 on {device}")

    # ---- data: every rank reads the dataset (same path on every node)
    data = load_dataset(cfg.data)
    train_identity = run_data_identity(data)  # a resume must find the same classes and splits (runtime)
    if resume:  # checked before anything is prepared: last.pt, or a newer best.pt
        state, ckpt = from_main(lambda: resume_state(run, load_checkpoint), ctx)
        check_run_data(state, ckpt, train_identity, data.root)
    cache = view_cache_for(run)  # slides' low-res views and tissue masks: made once (ats_cli.data.inputs)
    # ---- the values left to the data (ats_cli.config); a resumed run's were settled when it started
    # (settled once: the look at the images, where one is needed, happens inside the one settle)
    saved = load_facts(run) if resume else None
    def agree(facts):  # the weights' cache and network as rank 0 found them: every rank settles alike
        return replace(facts, **from_main(lambda: {k: getattr(facts, k) for k in PRETRAINED_FACTS}, ctx))

    # with init, --feature-net auto is that checkpoint's feature net (ats_cli.config._feature_net)
    init_net = str(load_checkpoint(cfg.init).get("spec", {}).get("feature_net", "")) \
        if cfg.init and cfg.feature_net == "auto" and cfg.method != "cnn" and not saved else ""
    settled, reasons = settle(cfg, saved) if saved else settle_data(
        cfg, data, view_cache=cache, agree=agree if ctx.enabled else None, init_feature_net=init_net)
    cfg, facts = settled.config, settled.facts
    if saved is None:
        log(f"settled from the data ({run / 'settled.json'}):")
        for reason in reasons:
            log(f"  {reason}")
        for line in facts.ignored_hints:
            log(f"warning: {line}")
        if ctx.is_main:
            save_settled(run, settled, reasons)
    reading = {"channels": facts.channels, "scale": view_scale(cfg, settled.mpp),  # a two-level model's: coarse
               "patch_size": (cfg.patch_size, cfg.patch_size), "view_cache": cache, **cfg.input_options()}
    from ats_cli.data.prepared import prepare_for_run  # ordinary images: decoded once, then read by patch

    # a patch larger than an image: one line now, not after decoding the whole dataset
    check_patches_fit([r for split in data.splits.values() for r in split], reading["patch_size"],
                      reader=reading["reader"], level=reading["level"])

    # a validation split, when the dataset has one, chooses best.pt (selection_score)
    held_out = ("val", "test") if data.splits.get("val") else ("test",)
    # preparing decodes every image once, in processes of its own that pass no tensors: at
    # least the auto count even when --workers 0 keeps the loader in this process
    # (benchmarks/gpu.md, "On a GPU")
    prepare_workers = max(cfg.workers, loader_workers(-1, device))
    # evaluation reads the view the model reads in evaluation: a two-level model's given
    # eval_coarse_px may make it finer than training's (its own prepared entries, then)
    eval_reading = {**reading, "scale": eval_view_scale(cfg, settled.mpp)}
    same_view = eval_reading["scale"] == reading["scale"]
    prepared = prepare_for_run(cfg.prepare, data, reading, workers=prepare_workers, log=log,
                               splits=("train", *held_out) if same_view else ("train",))
    train_set = ImageDataset(data["train"], prepared=prepared, **reading)
    loaders = _held_out_loaders(cfg, ctx, device, data, held_out, eval_reading,
                                prepared if same_view else None, workers=prepare_workers, log=log)

    # ---- model, optimizer, state (the same initial weights on every rank: same seed)
    torch.manual_seed(cfg.seed)
    spec = model_spec(cfg, n_classes=data.num_classes, channels=facts.channels, mpp=settled.mpp)
    if data.multilabel:  # one sigmoid per class (ats_cli.multilabel); absent: the spec of a single-label run
        spec["multilabel"] = True
    model = create_model(spec)
    check_patch_size(model, spec)  # a patch the feature net cannot read: one line, before any step
    features = getattr(model, "feature_net", None)
    if features is not None:  # a resumed or init run takes every weight from its checkpoint
        loaded = None if resume or cfg.init else load_start_weights(features, cfg.feature_net, cfg.feature_weights,
                                                                     spec["feature_kwargs"])
        apply_feature_train(features, cfg.feature_train)
        if loaded or cfg.feature_train != "all":
            log(f"feature net {cfg.feature_net}: {f'weights from {loaded}' if loaded else 'its weights'}, "
                f"feature_train {cfg.feature_train}")
    model = model.to(device, memory_format=_conv_layout(device))
    store = _feature_store(cfg, model, spec, run, log, writes=ctx.is_main)
    opt = _optimizer(cfg, model)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")  # fp16 only: bf16 has float32's range
    start_epoch, start_done, history, running = 0, 0, [], {}
    if cfg.init and not resume:  # a resumed run already holds its (fine-tuned) weights
        log(f"initialised the model from {cfg.init}: {_init_from(model, cfg.init, spec, data.classes, ctx)}")
    if resume:
        try:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:  # another --method or network: one line, not a dump
            raise settings_changed(state, ckpt.get("spec"), spec, e) from None
        if ckpt.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, history = ckpt["epoch"], ckpt["history"]
        # position in images (survives a change of world size); old checkpoints count steps
        start_done = ckpt.get("samples", ckpt["step"] * cfg.batch_size)
        running = ckpt.get("running", {})
        if ctx.is_main:  # metrics.jsonl := the epochs last.pt vouches for (no duplicates, none lost)
            rewrite_metrics(run, history)
        log(f"resuming {run} at epoch {start_epoch + 1}, image {start_done} of {len(train_set)}"
            + (f", {ctx.world_size} processes" if ctx.enabled else ""))
    if ctx.is_main:
        atomic_write_text(run / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
    best_acc = max((selection_score(h) for h in history), default=(-1.0, 0))
    last_plot = time.monotonic()  # when curves.png was last drawn, or training started (plot_due)
    # Every parameter takes part in every forward pass (the attention net through the
    # sampled probabilities and the entropy, even when its zero-initialised last layer
    # makes the gradient zero), so DDP needs no find_unused_parameters (tested).
    net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if ctx.enabled else model

    def save(path: Path, epoch: int, step: int, done: int, running_state: dict) -> None:
        save_checkpoint(path, spec=spec, classes=data.classes, model=model, optimizer=opt.state_dict(),
                        scaler=scaler.state_dict(), epoch=epoch, step=step, samples=done,
                        world_size=ctx.world_size, history=history, running=running_state, config=cfg.to_dict(),
                        train_set=train_identity)

    def save_position(pos: Position) -> None:  # Ctrl-C: last.pt at the step reached; --resume continues there
        if ctx.is_main:
            save(run / "last.pt", pos.epoch, pos.step, pos.done, pos.running)

    # ---- the epochs
    global_batch = cfg.batch_size * ctx.world_size
    # a run that learns nothing says so (ats_cli.diagnose); multi-label data has no one chance
    chance = {} if data.multilabel else {split: chance_accuracy([r.label for r in data[split]])
                                         for split in ("train", *held_out)}
    warned: set[str] = set()
    for epoch in range(start_epoch, cfg.epochs):
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
                               ).tolist()
        done = start_done if epoch == start_epoch else 0  # images of this epoch already trained on
        acc = running if (epoch == start_epoch and running) else {"loss": 0.0, "correct": 0.0, "ent": 0.0,
                                                                     "n": 0.0, "bonus": 0.0, "uniform": 0.0,
                                                                     "moved": 0.0, "time": 0.0}
        pos = Position(epoch, step=done // global_batch, done=done, running=acc)
        reset_peak_memory(device)
        if store is not None:  # the segments other processes wrote meanwhile; this epoch's own counts
            store.refresh()
            store.hits = store.misses = 0
        train_one_epoch(cfg, ctx, device, net, opt, scaler, train_set, order, pos, save=save_position,
                        progress=progress)

        try:
            # the running statistics of the weights as they are now (recalibrate_batch_norm),
            # from the first batches of this epoch's order, then rank 0's everywhere
            first = shard_batches(order[:BN_BATCHES * global_batch], 0, cfg.batch_size, ctx)
            with _autocast(cfg, device):
                recalibrate_batch_norm(model, _loader(train_set, first, cfg, device), device,
                                       _seed(cfg.seed, epoch, "batch-norm", ctx.rank))
            broadcast_buffers(model, ctx)  # e.g. batch-norm statistics: evaluate and save rank 0's
            check_finite_weights(model, f"at the end of epoch {epoch + 1}", run)  # before anything saves them
            train_hits = None if store is None else (store.hits, store.hits + store.misses)
            scores = {split: evaluate(model, loader, device, ctx=ctx)  # the model's eval_n_patches
                      for split, loader in loaders.items()}
            _flush_features(model)
        except KeyboardInterrupt:  # the epoch's steps are done: keep them, --resume evaluates
            save_position(pos)
            raise TrainingInterrupted(f"interrupted while evaluating epoch {epoch + 1}; its {pos.step} training steps "
                                      f"are saved to {run / 'last.pt'}; continue with --resume") from None

        # ---- the epoch's record
        (peak_mb,) = all_reduce([peak_memory_mb(device)], ctx, device, op="max")
        record = {
            "epoch": epoch + 1,
            "train_loss": acc["loss"] / acc["n"],
            "train_acc": acc["correct"] / acc["n"],
            **{f"{split}_{key}": value for split, score in scores.items()
               for key, value in score.items() if key in ("loss", "acc", "macro_f1")},
            # the loss without the exploration bonus: what the held-out losses are
            "train_ce": (acc["loss"] + acc.get("bonus", 0.0)) / acc["n"],
            "entropy": acc["ent"] / acc["n"],
            "entropy_uniform": acc.get("uniform", 0.0) / acc["n"],  # ats_cli.diagnose
            # KL (nats) from where the attention started; None where it cannot learn
            "attention_moved": acc.get("moved", 0.0) / acc["n"] if attention_learns(model) else None,
            "samples": int(acc["n"]),
            "samples_per_s": acc["n"] / max(acc["time"], 1e-9),  # all processes together
            "ms_per_sample": 1000 * acc["time"] / acc["n"],
            "peak_mem_mb": peak_mb,  # the largest of the processes
            "lr": opt.param_groups[0]["lr"],
            "device": str(device),
            "world_size": ctx.world_size,
            "amp": amp,
        }
        if train_hits is not None:  # the training steps' patches read back from the feature store
            hits, total = all_reduce(list(train_hits), ctx, device)
            record["feature_hit_rate"] = hits / total if total else 0.0
        history.append(record)
        stop = Deferred()
        if ctx.is_main:  # checkpoints first, last.pt marks the epoch done, its metrics line last (ats_cli.runtime)
            with deferred_interrupts() as stop:  # a stop signal during the saves: finish them, then stop (below)
                try:
                    save_checkpoint(run / "epochs" / f"epoch_{epoch + 1:03d}.pt", spec=spec, classes=data.classes,
                                    model=model, epoch=epoch + 1)
                    if selection_score(record) > best_acc:
                        save(run / "best.pt", epoch + 1, 0, 0, {})
                    save(run / "last.pt", epoch + 1, 0, 0, {})
                    append_metrics(run, record)
                    if plot_due(last_plot, epoch + 1 == cfg.epochs or stop.stopped):
                        _plot_curves(history, run / "curves.png")
                        last_plot = time.monotonic()
                except OSError as e:  # a full disk, a directory gone read-only: one line, then --resume
                    raise failed_save(run, epoch + 1, e) from None
            board.add(record)
        best_acc = max(best_acc, selection_score(record))
        log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {record['train_loss']:.4f} acc {record['train_acc']:.3f} | "
            + "".join(f"{split} loss {record[f'{split}_loss']:.4f} acc {record[f'{split}_acc']:.3f} | "
                      for split in loaders) + f"entropy {record['entropy']:.2f} | "
            f"{record['samples_per_s']:.1f} samples/s | peak {record['peak_mem_mb']:.0f} MB")
        for kind, line in degenerate_warnings(record, chance, steps=math.ceil(len(train_set) / global_batch),
                                              previous=history[-2] if len(history) > 1 else None).items():
            if kind not in warned:  # each kind once a run: the curves show the rest
                warned.add(kind)
                log(line)
        if stop.stopped:
            raise TrainingInterrupted(f"interrupted at the end of epoch {epoch + 1}; state saved to {run / 'last.pt'}; "
                                      "continue with --resume")
    if cfg.levels == 2 and cfg.eval_coarse_px == -1 and history:
        choose_coarse_view(cfg, ctx, device, model, run, data, held_out[0], reading, history,
                           workers=prepare_workers, log=log)
    return history


def _feature_store(cfg: TrainConfig, model: torch.nn.Module, spec: dict[str, Any], run: Path,
                   log: Callable[[str], None], *, writes: bool = True) -> Any:
    """The feature store of a run with ``feature_store on`` (:mod:`ats_cli.data.features`),
    set on the model; None when off, or when ``ATS_FEATURE_STORE=off`` or the cap is 0.
    ``writes`` False (every rank but 0, which alone writes files): it reads what rank 0
    stored and stores nothing."""
    if cfg.feature_store != "on":
        return None
    if "feature_keys" not in inspect.signature(model.forward).parameters:  # two levels: not for this model
        return None
    store = feature_store_for(run, model.feature_net, spec["feature_net"], spec["feature_kwargs"],
                              cap_gb=cfg.feature_store_gb)
    if store is not None:
        store.writable = writes
        model.feature_store = store
        log(f"feature store: {store.folder} (at most {cfg.feature_store_gb:g} GiB; docs/training.md#the-feature-store)")
    return store


def _held_out_loaders(cfg: TrainConfig, ctx: Dist, device: torch.device, data: Any, splits: Sequence[str],
                      reading: dict[str, Any], prepared: Any, *, workers: int,
                      log: Callable[[str], None]) -> dict[str, DataLoader]:
    """A loader for each held-out split in ``splits``, reading as ``reading`` says; from the
    ``prepared`` store, else from one prepared now at that reading's scale where preparing
    applies. Each rank gets whole batches, dealt round-robin (evaluate() explains why whole
    ones)."""
    if prepared is None:
        from ats_cli.data.prepared import prepare_for_run

        prepared = prepare_for_run(cfg.prepare, data, reading, workers=workers, log=log, splits=tuple(splits))
    loaders = {}
    for split in splits:
        split_set = ImageDataset(data[split], prepared=prepared, **reading)
        batches = shard_batches(range(len(split_set)), 0, cfg.batch_size, Dist())[ctx.rank::ctx.world_size]
        loaders[split] = _loader(split_set, batches, cfg, device)
    return loaders


def choose_coarse_view(cfg: TrainConfig, ctx: Dist, device: torch.device, model: torch.nn.Module, run: Path,
                       data: Any, split: str, reading: dict[str, Any], history: list[dict[str, Any]], *,
                       workers: int, log: Callable[[str], None]) -> None:
    """``eval_coarse_px`` auto, after the last epoch: evaluate ``best.pt`` on the held-out
    ``split`` (the one that chose it) with a coarse view twice as fine as training's, and
    record that view in best.pt (spec ``eval_coarse_scale``, read by ats predict and
    visualize) only where its accuracy is higher than the epoch's own at training's view;
    on a tie, training's view, which costs a quarter of the pixels. best.pt keeps what was
    tried (``coarse_view``), so a resumed run does not try again.

    Why: the coarse attention of a two-level model on slides is mostly its prior's, a fixed
    function of the pixels, and the deciding object (a tumour nest) may be about one coarse
    pixel, where it looks no more unusual than its look-alikes; at twice the pixels it
    gains contrast, while the fine attention, features and gain, which read the region
    views, are unchanged, and the estimate stays unbiased for any coarse attention
    (:mod:`ats_cli.core.nested`); figures: benchmarks/slides.md#accuracy-at-100k². Why
    tried, not assumed: a coarse net that learned its ranking at one scale
    need not keep it at another, so a held-out check decides, at the cost of one pass over
    the split at four times the coarse pixels. Training itself never reads the finer view."""
    best_path = run / "best.pt"
    ckpt = from_main(lambda: load_checkpoint(best_path) if best_path.is_file() else None, ctx)
    if ckpt is None or "coarse_view" in ckpt:
        return
    from ats_cli.core.nested_model import coarse_scale_for

    finer_px = 2 * cfg.coarse_px
    finer = coarse_scale_for(ckpt["spec"]["region_size"], finer_px)
    trained = next(h for h in history if h["epoch"] == ckpt["epoch"])
    log(f"trying a coarse view of {finer_px} px a region at evaluation (best.pt, epoch {ckpt['epoch']}, "
        f"on the {split} split)")
    loader = _held_out_loaders(cfg, ctx, device, data, (split,), {**reading, "scale": finer}, None,
                               workers=workers, log=log)[split]
    model.load_state_dict(ckpt["model"])
    model.eval_coarse_scale = finer
    try:
        score = evaluate(model, loader, device, ctx=ctx)
    except (ImageReadError, torch.OutOfMemoryError) as e:  # a view over the pixel budget, or the device's memory
        score = {"acc": math.nan, "loss": math.nan, "problem": str(e).splitlines()[0]}
        log(f"could not read the finer view: {score['problem']}")
    finally:
        model.eval_coarse_scale = 0.0
    kept = score["acc"] > trained[f"{split}_acc"]  # never where it could not be read (NaN)
    tried = {"px": finer_px, "trained_px": cfg.coarse_px, "split": split, "acc": score["acc"], "loss": score["loss"],
             "trained_acc": trained[f"{split}_acc"], "trained_loss": trained[f"{split}_loss"], "kept": kept,
             **({"problem": score["problem"]} if "problem" in score else {})}
    if ctx.is_main:  # the model holds best.pt's weights: written back with the choice, atomically
        spec = {**ckpt["spec"], "eval_coarse_scale": finer if kept else 0.0}
        state = {k: v for k, v in ckpt.items() if k not in ("format", "version", "spec", "classes", "model")}
        save_checkpoint(best_path, spec=spec, classes=ckpt["classes"], model=model, **{**state, "coarse_view": tried})
    px = finer_px if kept else cfg.coarse_px
    log(f"best.pt reads a coarse view of {px} px a region at prediction: {split} accuracy {score['acc']:.3f} at "
        f"{finer_px} px against {trained[f'{split}_acc']:.3f} at {cfg.coarse_px} px as trained"
        + ("" if kept else " (unread: as trained)" if "problem" in score else " (not better: as trained)"))


def selection_score(record: dict[str, Any]) -> tuple[float, int]:
    """What chooses ``best.pt`` among the epochs: the validation accuracy when the dataset has
    a ``val.csv``, else the test accuracy; among epochs of equal accuracy, the later one. Why
    another split: an epoch chosen for its test accuracy makes that accuracy an optimistic
    estimate (the maximum of noisy figures); chosen on another split, the test figure of the
    chosen epoch stays an honest one. Why the later: on a small split accuracy moves in
    coarse steps (one of 40 slides is 2.5 points), so ties are common, and a later epoch has
    had more training at a lower learning rate. Not the loss: on a small split it is set by
    the few examples a model gets wrong, and a model that grows surer (the late patch gain)
    raises it on those while it gets more of the others right: on 100k² slides a two-level
    run's lowest test loss came before its gain trained, and its last epoch, tied with it on
    the test split, read better on fresh slides (benchmarks/slides.md#accuracy-at-100k²)."""
    split = "val" if "val_acc" in record else "test"
    return record[f"{split}_acc"], record["epoch"]


PLOT_EVERY_S = 30.0  # curves.png is redrawn at most this often while a run goes on (plot_due)


def plot_due(last: float, final: bool) -> bool:
    """Whether this epoch redraws ``curves.png``: the last one (or one a stop ends), and
    otherwise one ending at least PLOT_EVERY_S seconds after the last drawing (or the start
    of training: a long run's first epoch is drawn). Why: a drawing costs about a third of
    a second of CPU, more than a whole epoch of a small run (a dataset of a few dozen
    images, the tests' runs); metrics.jsonl records every epoch as it ends, and the figure
    is drawn from it."""
    return final or time.monotonic() - last >= PLOT_EVERY_S


def _plot_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Classification loss, error rate and the attention's entropy per epoch, train,
    validation (when there is one) and test, as a PNG (written atomically). The training
    loss drawn is the classification loss alone (``train_ce``; records from before it was
    kept: the loss with its exploration bonus), so that it compares with the held-out
    losses; the entropy is drawn against a uniform attention's, where a run whose attention
    has not moved sits (:mod:`ats_cli.diagnose`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    ax1.plot(epochs, [h.get("train_ce", h["train_loss"]) for h in history], "o-", label="train")
    held_out = [split for split in ("val", "test") if f"{split}_acc" in history[-1]]
    for split in held_out:
        ax1.plot(epochs, [h.get(f"{split}_loss", math.nan) for h in history], "o-", label=split)
    ax1.set(xlabel="epoch", ylabel="classification loss", title="Classification loss")
    ax2.plot(epochs, [1 - h["train_acc"] for h in history], "o-", label="train")
    for split in held_out:
        ax2.plot(epochs, [1 - h.get(f"{split}_acc", math.nan) for h in history], "o-", label=split)
    ax2.set(xlabel="epoch", ylabel="error", title="Error rate", ylim=(0, 1))
    ax3.plot(epochs, [h["entropy"] for h in history], "o-", label="attention (train)")
    if any(h.get("entropy_uniform") for h in history):
        ax3.plot(epochs, [h.get("entropy_uniform") or math.nan for h in history], "--", color="gray",
                 label="uniform attention")
    ax3.set(xlabel="epoch", ylabel="entropy (nats)", title="Attention entropy")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    fig.tight_layout()
    atomic_save_png(fig, path)


class _TensorBoard:
    """The epoch records as TensorBoard scalars in ``RUN/tb``, written by rank 0 when the
    ``tensorboard`` package is installed (``pip install 'ats[tensorboard]'``); else nothing.

    ``metrics.jsonl`` stays the record of the run and this only a view of it, so a failure
    here (a broken install, a full disk) costs one warning line and never the training.
    The writer opens at the first record this process writes and hides, from that epoch on,
    what an interrupted run wrote before (``purge_step``): a resumed run shows each epoch once.
    """

    SCALARS = {"loss/train": "train_loss", "loss/test": "test_loss", "accuracy/train": "train_acc",
               "accuracy/test": "test_acc", "loss/val": "val_loss", "accuracy/val": "val_acc",
               "loss/train_classification": "train_ce",
               "attention/entropy": "entropy", "lr": "lr", "samples_per_s": "samples_per_s"}

    def __init__(self, folder: Path, log: Callable[[str], None], *, enabled: bool = True):
        self.folder, self.log, self.enabled = folder, log, enabled
        self.writer = None

    def __enter__(self) -> _TensorBoard:
        return self

    def add(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            if self.writer is None:
                from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it is used

                self.writer = SummaryWriter(str(self.folder), purge_step=record["epoch"])
            for tag, key in self.SCALARS.items():
                if key in record:  # val_*: a dataset with a val.csv
                    self.writer.add_scalar(tag, record[key], record["epoch"])
            self.writer.flush()
        except Exception as e:
            self.enabled = False  # one warning, then no more tries
            writer, self.writer = self.writer, None
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()
            if not (isinstance(e, ModuleNotFoundError) and e.name == "tensorboard"):  # not installed: say nothing
                self._warn(e)

    def __exit__(self, *exc: object) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as e:
                self._warn(e)

    def _warn(self, e: Exception) -> None:
        self.log(f"warning: TensorBoard logging stopped ({type(e).__name__}: {e}); metrics.jsonl has every epoch")
