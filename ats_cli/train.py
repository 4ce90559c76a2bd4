"""The training loop, readable top to bottom.

One run directory holds everything: ``config.json`` (resolved configuration),
``metrics.jsonl`` (one line per epoch), ``last.pt`` and ``best.pt`` (full checkpoints),
``epochs/epoch_NNN.pt`` (weights after each epoch, for the attention-evolution figure)
and ``curves.png``.

Exact resumption: the data order of epoch e comes from (seed, e) and the sampling
generator's state is saved with every checkpoint, so a run interrupted at any step
(Ctrl-C saves at the current step) and resumed gives the same weights as a run that was
never interrupted.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ats_cli.checkpoint import build_model, load_checkpoint, model_spec, save_checkpoint
from ats_cli.config import TrainConfig
from ats_cli.data.dataset import atomic_write_text, load_dataset
from ats_cli.data.loader import Batch, ImageDataset, collate, single_thread_worker
from ats_cli.inference import predict_probs
from ats_cli.runtime import peak_memory_mb, reset_peak_memory, resolve_device

__all__ = ["train", "evaluate", "TrainingInterrupted"]

EVAL_SEED = 12345  # the test set is always sampled the same way, so epochs compare


class TrainingInterrupted(Exception):
    """Raised after Ctrl-C once the state has been saved; ``--resume`` continues."""


def _loader(dataset: ImageDataset, order: list[int], cfg: TrainConfig, device: torch.device) -> DataLoader:
    return DataLoader(dataset, batch_size=cfg.batch_size, sampler=order, num_workers=cfg.workers,
                      collate_fn=collate, pin_memory=device.type == "cuda", worker_init_fn=single_thread_worker,
                      prefetch_factor=4 if cfg.workers else None)


def _optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


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


@torch.no_grad()
def evaluate(model, loader: DataLoader, device: torch.device, *, n_patches: int | None = None) -> dict[str, float]:
    """Test loss, accuracy and mean attention entropy, with a fixed sampling seed."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(EVAL_SEED)
    loss = correct = ent = count = 0.0
    for batch in loader:
        labels = batch.labels.to(device)
        probs, out = predict_probs(model, batch.low.to(device), batch.sources, n_patches=n_patches, generator=gen)
        loss += float(torch.nn.functional.nll_loss(probs.clamp_min(1e-12).log(), labels, reduction="sum"))
        correct += float((probs.argmax(1) == labels).sum())
        ent += float(out.entropy.sum())
        count += len(labels)
    model.train()
    return {"loss": loss / max(count, 1), "acc": correct / max(count, 1), "entropy": ent / max(count, 1)}


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    progress: Callable[[str, int, int, dict], None] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train per ``cfg``; returns the metrics of every epoch (also in metrics.jsonl).

    ``progress(phase, step, total, info)`` is called after every training step (the CLI
    draws a progress bar with it); ``log`` receives one line per epoch.
    """
    run = Path(cfg.out)
    run.mkdir(parents=True, exist_ok=True)
    (run / "epochs").mkdir(exist_ok=True)
    device = resolve_device(cfg.device)

    # ---- data
    data = load_dataset(cfg.data)
    channels = int(data.hints.get("channels", 1))
    train_set = ImageDataset(data["train"], channels=channels, scale=cfg.scale)
    test_set = ImageDataset(data["test"], channels=channels, scale=cfg.scale)
    test_loader = _loader(test_set, list(range(len(test_set))), cfg, device)

    # ---- model, optimizer, state
    torch.manual_seed(cfg.seed)
    spec = model_spec(cfg, n_classes=data.num_classes, channels=channels)
    model = build_model(spec).to(device)
    opt = _optimizer(cfg, model)
    sampling_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    start_epoch, start_step, history, running = 0, 0, [], {}
    if resume:
        ckpt = load_checkpoint(run / "last.pt", map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sampling_gen.set_state(ckpt["sampling_rng"].cpu())
        start_epoch, start_step, history = ckpt["epoch"], ckpt["step"], ckpt["history"]
        running = ckpt.get("running", {})
        log(f"resuming {run} at epoch {start_epoch + 1}, step {start_step}")
    atomic_write_text(run / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
    best_acc = max((h["test_acc"] for h in history), default=-1.0)

    def save(path: Path, epoch: int, step: int, running_state: dict) -> None:
        save_checkpoint(path, spec=spec, classes=data.classes, model=model, optimizer=opt.state_dict(),
                        epoch=epoch, step=step, sampling_rng=sampling_gen.get_state(), history=history,
                        running=running_state, config=cfg.to_dict())

    steps_per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    model.train()
    for epoch in range(start_epoch, cfg.epochs):
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
        skip = start_step if epoch == start_epoch else 0
        loader = _loader(train_set, order[skip * cfg.batch_size:].tolist(), cfg, device)
        acc = running if (epoch == start_epoch and running) else {"loss": 0.0, "correct": 0.0, "ent": 0.0,
                                                                     "n": 0.0, "time": 0.0}
        reset_peak_memory(device)
        step = skip
        t_last = time.perf_counter()
        try:
            for batch in loader:
                batch: Batch
                for group in opt.param_groups:
                    group["lr"] = _lr_at(cfg, epoch + step / steps_per_epoch)
                labels = batch.labels.to(device)
                with _autocast(cfg, device):
                    out = model(batch.low.to(device, non_blocking=True), batch.sources, generator=sampling_gen)
                    loss = model.loss(out, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.clip_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                opt.step()
                step += 1
                now = time.perf_counter()
                n = len(labels)
                acc["loss"] += float(loss.detach()) * n
                acc["correct"] += float((out.logits.argmax(1) == labels).sum())
                acc["ent"] += float(out.entropy.detach().sum())
                acc["n"] += n
                acc["time"] += now - t_last
                t_last = now
                if progress:
                    progress("train", step, steps_per_epoch,
                             {"epoch": epoch + 1, "loss": acc["loss"] / acc["n"], "acc": acc["correct"] / acc["n"]})
        except KeyboardInterrupt:
            save(run / "last.pt", epoch, step, acc)
            raise TrainingInterrupted(f"interrupted at epoch {epoch + 1}, step {step}; state saved to "
                                      f"{run / 'last.pt'}; continue with --resume") from None

        test = evaluate(model, test_loader, device, n_patches=cfg.eval_n_patches or None)
        record = {
            "epoch": epoch + 1,
            "train_loss": acc["loss"] / acc["n"],
            "train_acc": acc["correct"] / acc["n"],
            "test_loss": test["loss"],
            "test_acc": test["acc"],
            "entropy": acc["ent"] / acc["n"],
            "samples_per_s": acc["n"] / max(acc["time"], 1e-9),
            "ms_per_sample": 1000 * acc["time"] / acc["n"],
            "peak_mem_mb": peak_memory_mb(device),
            "lr": opt.param_groups[0]["lr"],
            "device": str(device),
        }
        history.append(record)
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        save_checkpoint(run / "epochs" / f"epoch_{epoch + 1:03d}.pt", spec=spec, classes=data.classes,
                        model=model, epoch=epoch + 1)
        save(run / "last.pt", epoch + 1, 0, {})
        if test["acc"] > best_acc:
            best_acc = test["acc"]
            save(run / "best.pt", epoch + 1, 0, {})
        log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {record['train_loss']:.4f} acc {record['train_acc']:.3f} | "
            f"test loss {record['test_loss']:.4f} acc {record['test_acc']:.3f} | entropy {record['entropy']:.2f} | "
            f"{record['samples_per_s']:.1f} samples/s | peak {record['peak_mem_mb']:.0f} MB")
        _plot_curves(history, run / "curves.png")
    return history


def _plot_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Loss and accuracy per epoch, train and test, as a PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    ax1.plot(epochs, [h["test_loss"] for h in history], "o-", label="test")
    ax1.set(xlabel="epoch", ylabel="loss", title="Loss")
    ax2.plot(epochs, [1 - h["train_acc"] for h in history], "o-", label="train")
    ax2.plot(epochs, [1 - h["test_acc"] for h in history], "o-", label="test")
    ax2.set(xlabel="epoch", ylabel="error", title="Error rate", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
