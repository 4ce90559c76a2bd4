"""`ats benchmark`: time and peak memory per sample of one training step, per method.

What one measurement is (thesis §3.4, "time and memory per sample"): at batch size 1
(``batch_size`` copies of the image per step, the figures divided by it), from the uint8
full-resolution image on the host to the updated gradients -- the host-to-device copy
of the image (pinned, asynchronous: :func:`ats_cli.core.source.to_device`), the low-res view (on
the step's device, where the image then is), the patch extraction, the forward pass, the
loss and the backward pass. The first step is a warm-up (one-time library
set-up), the second the memory step (below); the time is the median of ``repeats``
further steps.

Peak memory per sample:

* CUDA: ``torch.cuda.max_memory_allocated`` during the step minus what was allocated
  before it (weights, image): the memory the step itself needs.
* CPU: the growth of the process's resident set during the memory step. tracemalloc
  does not see torch's allocations, and ``ru_maxrss`` cannot be reset, so each
  (method, n_patches) runs in a *fresh* process (multiprocessing "spawn") that resets
  the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5, Linux) just before the
  step and reads ``VmHWM - VmRSS`` around it. The children run with glibc's
  ``MALLOC_MMAP_THRESHOLD_=65536``: every large tensor is its own mapping, returned to
  the system when freed, so the warm-up's freed memory cannot be silently reused by
  the measured step (which would hide its peak). Where clear_refs is not available (not
  Linux) it falls back to ``ru_maxrss`` after the step minus the RSS before it, which
  can only under-count. A fresh process per row also keeps one method's freed-but-kept
  allocator pages from hiding another's peak; all rows still come from one command
  run, on the same image, so their ratios compare.

A row whose process dies (e.g. killed for memory) is reported with the reason instead
of numbers: the paper, too, reports where Deep MIL did not fit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ats_cli import nets
from ats_cli.config import TrainConfig
from ats_cli.io import end_process
from ats_cli.models import available_methods, create_model, model_spec

__all__ = ["BenchSpec", "benchmark_image", "dataset_defaults", "plan", "run_benchmark", "ratio_to_ats"]

ALL_METHODS = tuple(available_methods())
SAMPLED = ("ats", "uniform")  # the methods whose cost depends on n_patches


@dataclass
class BenchSpec:
    """One row's settings; :meth:`train_config` says which model they mean."""

    method: str
    n_patches: int | None
    patch_size: int = 50
    scale: float = 0.12
    attention_net: str = "mnist-attention"
    feature_net: str = "mnist-features"
    attention_width: int = 8
    feature_width: int = 32
    device: str = "cpu"
    repeats: int = 3
    batch_size: int = 1

    def train_config(self) -> TrainConfig:
        """The training configuration whose model this row measures: ``ats train``'s
        defaults for everything the row does not set, except the brightness support: it is
        off, so that every method samples the whole low-res view as the thesis's models did."""
        return TrainConfig(method=self.method, n_patches=self.n_patches or 1, patch_size=self.patch_size,
                           scale=self.scale, attention_net=self.attention_net, feature_net=self.feature_net,
                           attention_width=self.attention_width, feature_width=self.feature_width,
                           min_brightness=0.0)


# Per dataset: the settings a row uses unless the command line gives them.
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "megapixel-mnist": {"image_size": 1500, "patch_size": 50, "scale": 0.12, "feature_net": "mnist-features",
                        "feature_width": 32},
    "synthetic-slides": {"image_size": 3072, "patch_size": 64, "scale": 1 / 32, "feature_net": "small-cnn",
                         "feature_width": 32},
}


def dataset_defaults(dataset: str) -> dict[str, Any]:
    """:data:`DATASET_DEFAULTS` for a generated dataset; for a dataset directory, the patch
    size and scale of the recipe its dataset.json names (else of its hints, an older
    dataset's) over the Megapixel MNIST settings."""
    if dataset in DATASET_DEFAULTS:
        return dict(DATASET_DEFAULTS[dataset])
    from ats_cli.data.dataset import load_dataset
    from ats_cli.recipes import dataset_values

    hints = {**load_dataset(dataset).hints, **dataset_values(dataset)}
    out = dict(DATASET_DEFAULTS["megapixel-mnist"])
    if "patch_size" in hints:
        out["patch_size"] = int(np.atleast_1d(hints["patch_size"])[0])
    if "scale" in hints:
        out["scale"] = float(hints["scale"])
    return out


def benchmark_image(dataset: str, image_size: int, seed: int = 0) -> np.ndarray:
    """The image every row is measured on, uint8 [C, H, W].

    ``megapixel-mnist``: a Megapixel MNIST canvas of ``image_size`` squared rendered from
    the bundled digits (5 digits, and as many of the paper's 50 noise scribbles as fit).
    ``synthetic-slides``: a synthetic slide (RGB) of ``image_size`` squared, as
    ``ats make-dataset synthetic-slides`` renders them. Anything else is a dataset
    directory: its first test image (``image_size`` ignored).
    """
    if dataset == "synthetic-slides":
        from ats_cli.data.synthetic_slides import SyntheticSlidesConfig, render_slide

        image, _ = render_slide(SyntheticSlidesConfig(size=image_size, seed=seed).validate(), "test", 1)
        return np.ascontiguousarray(image.transpose(2, 0, 1))
    if dataset == "megapixel-mnist":
        from ats_cli.data.megapixel_mnist import make_config, render_image
        from ats_cli.data.mnist import load_bundled_digits

        fits = int(0.5 * image_size * image_size / (28 * 28)) - 5 - 1
        config = make_config("paper", width=image_size, height=image_size, n_train=1, n_test=1,
                             n_noise=max(0, min(50, fits)), seed=seed)
        image, _ = render_image(config, load_bundled_digits(), "test", 0)
        return image[None]
    from ats_cli.data.dataset import load_dataset
    from ats_cli.data.images import read_image

    data = load_dataset(dataset)
    return read_image(data["test"][0].path, int(data.hints.get("channels", 1))).numpy()


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(spec: BenchSpec, image: np.ndarray, threads: int, stage=None) -> dict[str, float]:
    """Runs in the fresh process: build the model, one memory step, then timed steps.
    ``stage(text)`` is told as each part begins (the command prints it)."""
    stage = stage or (lambda text: None)
    from ats_cli.core.source import low_res_view, to_device

    if threads:
        torch.set_num_threads(threads)
    device = torch.device(spec.device)
    torch.manual_seed(0)
    # 10 classes, as Megapixel MNIST: the classifier is a small part of a step's cost
    model = create_model(model_spec(spec.train_config(), n_classes=10, channels=image.shape[0])).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    B = spec.batch_size
    full = torch.from_numpy(image)[None].expand(B, *image.shape).contiguous()  # [B, C, H, W] uint8 on the host
    if device.type == "cuda":
        full = full.pin_memory()  # as the training loader hands it over
    target = torch.zeros(B, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        images = to_device(full, device)
        out = model(low_res_view(images, spec.scale), images, generator=gen)
        opt.zero_grad(set_to_none=True)
        model.loss(out, target).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    stage("warm-up step")
    step()  # warm-up: lazy initialisation of kernels and autograd is not the method's cost
    stage("memory step")
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        peak_mb = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    elif _reset_cpu_peak():
        before = _rss_kb("VmRSS")
        step()
        peak_mb = (_rss_kb("VmHWM") - before) / 1024
    else:  # no resettable peak: ru_maxrss after minus RSS before (an under-count at worst)
        before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mb = max(0, after - before_kb) / (2**20 if sys.platform == "darwin" else 1024)
    stage(f"{spec.repeats} timed step{'s' if spec.repeats > 1 else ''}")
    times = []
    for _ in range(spec.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"time_ms_per_sample": 1000 * statistics.median(times) / B, "peak_mem_mb_per_sample": peak_mb / B}


def _child(spec: BenchSpec, image_path: str, threads: int, queue) -> None:
    try:
        queue.put(("stage", "started, building the model"))
        queue.put(("ok", _measure(spec, np.load(image_path), threads, lambda text: queue.put(("stage", text)))))
    except Exception as e:  # reported in the row; the other rows go on
        queue.put(("error", f"{type(e).__name__}: {e}"))
    # The row is sent: the child ends here, once the queue has handed it over, without the
    # interpreter's teardown, which with torch loaded costs about a second that the parent
    # would wait for at every row (ats_cli.cli.exit_now says why).
    queue.close()
    queue.join_thread()
    end_process(0)


def _run_isolated(spec: BenchSpec, image_path: str, threads: int,
                  stage=None) -> tuple[dict[str, float] | None, str]:
    """One row in a fresh process; ``stage(text)`` hears the child's progress as it comes."""
    import queue as queues

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(spec, image_path, threads, queue))
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # see the module docstring: freed tensors leave the RSS
    try:
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    outcome = None
    while outcome is None:
        alive = proc.is_alive()  # before the read: a child that put its result and exited is still read
        try:
            kind, value = queue.get(timeout=0.2)
        except queues.Empty:
            if alive:
                continue
            break
        if kind == "stage":
            if stage:
                stage(value)
        else:
            outcome = (kind, value)
    proc.join()
    if outcome is not None:
        status, value = outcome
        return (value, "") if status == "ok" else (None, value)
    reason = "killed (out of memory?)" if proc.exitcode in (-9, 137) else f"exit code {proc.exitcode}"
    return None, reason


def plan(methods: list[str], n_patches: list[int]) -> list[tuple[str, int | None]]:
    """The rows :func:`run_benchmark` measures, in order: ``(method, n_patches or None)``."""
    return [(m, n) for m in methods for n in (n_patches if m in SAMPLED else [None])]


def run_benchmark(image: np.ndarray, methods: list[str], n_patches: list[int], *, tmp_dir: str | os.PathLike[str],
                  threads: int = 0, progress=None, stage=None, finished=None, **settings: Any) -> list[dict[str, Any]]:
    """One row per method (per ``n_patches`` for ATS and U-N), each in a fresh process.

    Rows: ``{method, n_patches, device, image_size, time_ms_per_sample,
    peak_mem_mb_per_sample}`` plus ``error`` when the row could not run. Callbacks, so
    that a caller can say what is going on: ``progress(spec)`` as a row starts,
    ``stage(spec, text)`` as its process reaches each part (started, warm-up, memory
    step, timed steps) and ``finished(spec, row, seconds)`` when it is done. An unknown
    method raises ``ValueError``, an unknown network :class:`ats_cli.nets.UnknownNetworkError`,
    before any process starts."""
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(ALL_METHODS)}")
    # a wrong network name fails here, once, not as a failed row in each child process
    nets.check(settings.get("attention_net", BenchSpec.attention_net), "attention")
    nets.check(settings.get("feature_net", BenchSpec.feature_net), "features")
    image_path = Path(tmp_dir) / "benchmark_image.npy"
    np.save(image_path, image)
    rows = []
    for method, n in plan(methods, n_patches):
        spec = BenchSpec(method, n, **settings)
        if progress:
            progress(spec)
        t0 = time.perf_counter()
        result, error = _run_isolated(spec, str(image_path), threads,
                                      stage=(lambda text, spec=spec: stage(spec, text)) if stage else None)
        row = {"method": method, "n_patches": n, "device": spec.device, "batch_size": spec.batch_size,
               "image_size": [int(image.shape[1]), int(image.shape[2])],
               "time_ms_per_sample": None, "peak_mem_mb_per_sample": None}
        row.update(result or {"error": error})
        rows.append(row)
        if finished:
            finished(spec, row, time.perf_counter() - t0)
    return rows


def ratio_to_ats(rows: list[dict[str, Any]], reference: int) -> dict[str, Any] | None:
    """The ATS row the ratios are taken against: ATS with ``reference`` patches, else the first ATS row."""
    ats = [r for r in rows if r["method"] == "ats" and r["time_ms_per_sample"] is not None]
    return next((r for r in ats if r["n_patches"] == reference), ats[0] if ats else None)
