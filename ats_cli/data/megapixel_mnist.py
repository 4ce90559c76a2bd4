"""Megapixel MNIST: the synthetic benchmark of attention sampling (thesis §3.4.2).

Each image is a black ``height x width`` canvas with ``n_digits`` MNIST digits
(``n_target`` of the target class, the rest of other classes) at random, pairwise
non-overlapping positions, and ``n_noise`` noise patches of digit size from one or more
noise families (:mod:`ats_cli.data.noise`). The label is the majority digit, or with
``task`` one of IPS's other three labels of the same image (:data:`TASKS`). At the
recommended low-resolution scale (0.12) a digit covers about 3x3 pixels: the attention
network can see *where* something is but has to fetch the full-resolution patch to read
it, which is the point of the benchmark. The low-resolution view is not made here:
``ats train`` computes it from the PNG.

Design choices, and why:

* **Per-image seeding.** Image ``i`` of a split draws everything from
  ``numpy.random.SeedSequence(entropy=split_seed, spawn_key=(i,))`` with
  ``split_seed = seed + 1`` for train and ``seed`` for test (the reference's convention).
  An image therefore does not depend on which worker made it or in what order, so any
  number of workers gives byte-identical files, and a resumed run can recompute the
  metadata of images it skips without re-rendering them.
* **Disjoint digit pools.** Train images use only the source's train digits, test images
  only its test digits, so no test digit was ever seen in training.
* **A validation split on unseen noise** (``n_val``: 1,000 in the paper preset, none in
  ``small``). The paper has no val split, and ``ats train`` chooses ``best.pt`` on the test
  split when there is none, so the test figure it reports is the best of 20 looks at it.
  The test split's 50 patterns are one draw, and which epoch reads best depends on the draw
  (an epoch the test split chose can read lower on unseen pattern sets than the one a val
  split chose: benchmarks/accuracy.md#val-split). So each
  ``val`` image draws its own 50 patterns, from ``SeedSequence(entropy=seed,
  spawn_key=(3, i))``, and ``ats train`` chooses ``best.pt`` on the average over many
  pattern sets, none of them the test's or the training's. Its digits come from the
  source's train pool, so no choice made on ``val`` has looked at a test digit and the
  test split stays untouched by every choice
  (a val digit may have appeared in a training image, which makes val accuracy slightly
  optimistic but compares epochs fairly). Image ``i`` draws the rest from
  ``SeedSequence(entropy=seed, spawn_key=(2, i))``: three words, like the test patterns'
  ``(seed, 0, 1)`` and unlike every train or test image's two. The val images are added
  beside the paper's, whose train and test images stay byte for byte what they were; the
  ``small`` preset (the demo and CI) goes without, for speed, and chooses on test.
* **The paper's noise by default.** Both presets use the ``reference`` family: the 2019
  reference generator's noise (idiap/attention-sampling, ``scripts/make_mnist.py``),
  50 thin-line patterns per split, pasted after the digits at positions independent of
  them, so a noise patch may cover part of a digit as in the paper's data. Other
  families (``--noise``) are placed where they cannot cover a digit unless asked
  (``--noise-overlap``); :mod:`ats_cli.data.noise` says why. Version 1 of this generator
  drew the ``strokes`` family only; ``noise="strokes"`` still gives its images.
* **Split-level noise patterns.** The reference's patterns belong to a split, not an
  image: they come from ``SeedSequence(entropy=split_seed, spawn_key=(0, 1))`` (a
  two-word key, which no image's one-word key can equal), so every worker and every
  resumed run derives the same 50 patterns without sharing state.
* **Four tasks, one set of images.** IPS (Bergner et al., ICLR 2023) trains four labels
  on the same images; ``task`` only chooses which one fills ``label`` (every row carries
  all four: ``majority``, ``max``, ``top``, ``present``), never a pixel, so a seed gives
  the same PNGs for every task. Each label is defined for every image: ``majority`` by
  construction (the other classes stay below ``n_target`` copies each), ``max`` as the
  largest class present, ``top`` as the class of the digit whose box has the smallest top
  edge; two digit boxes can share a top edge (their columns then differ by a whole
  digit's width), and that tie goes to the left-most of them, which is unique since two
  boxes that do not overlap cannot share both edges. ``multilabel``: the set of classes
  present, ``;``-separated (:mod:`ats_cli.multilabel`).
* **Atomic, resumable output.** Each PNG is written to a temporary file and renamed; a
  rerun skips PNGs that are already complete, refuses to mix in a run with different
  parameters (``.ats-generate.json`` records them while the run is in progress), and
  writes the CSVs and ``dataset.json`` last.
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ats_cli.data import generation
from ats_cli.data.generation import GenerationReport, run_generation
from ats_cli.data.mnist import DigitSet
from ats_cli.data.noise import FAMILIES, REFERENCE_MARGIN, NoiseContext, parse_families, reference_patterns
from ats_cli.io import atomic_write_bytes

__all__ = [
    "GENERATOR_NAME",
    "TASKS",
    "PRESETS",
    "GenerationReport",
    "Layout",
    "MegapixelMNISTConfig",
    "box_fractions",
    "check_output",
    "generate_megapixel_mnist",
    "image_layout",
    "make_config",
    "noise_block",
    "recommended_hints",
    "TASK_RECIPES",
    "render_image",
    "split_patterns",
    "split_sizes",
]

GENERATOR_NAME = "megapixel-mnist"
# Bump whenever the same parameters would produce different pixels or CSV rows, so a
# resumed run never mixes images from two versions of the generator.
# Version 2: noise families (default: the reference's); version 1 = noise="strokes".
GENERATOR_VERSION = 2
PNG_COMPRESS_LEVEL = 6  # fixed: the PNG bytes must not depend on Pillow's defaults
MAX_PLACEMENT_TRIES = 10_000  # per object; beyond that the canvas is too crowded
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"


# The label rules of IPS's four Megapixel MNIST tasks (its config/mnist_config.yml), each
# the name of the CSV column that always holds it ("present" for multilabel).
TASKS = {"majority": "majority", "max": "max", "top": "top", "multilabel": "present"}


class PlacementError(ValueError):
    """The canvas is too crowded to place all objects without overlap."""


@dataclass(frozen=True)
class MegapixelMNISTConfig:
    """Everything that determines the generated files (the worker count does not)."""

    n_train: int = 5000
    n_test: int = 1000
    n_val: int = 1000  # validation images on unseen noise (module docstring); 0: no val split
    width: int = 1500
    height: int = 1500
    n_digits: int = 5
    n_target: int = 3
    n_noise: int = 50
    seed: int = 0
    noise: str = "reference"  # family, or comma-separated families mixed per patch
    noise_overlap: bool | None = None  # None: each family's default (reference: True, others: False)
    task: str = "majority"  # which label fills the label column (TASKS); never changes the images

    @property
    def families(self) -> tuple[str, ...]:
        return parse_families(self.noise)

    def overlaps(self, family: str) -> bool:
        """Whether ``family``'s patches are placed independently of the digits (and may cover them)."""
        return FAMILIES[family].overlap if self.noise_overlap is None else self.noise_overlap

    def summary(self) -> str:
        """What this config makes, in the words ``ats make-dataset`` prints before it starts."""
        rules = {self.overlaps(f) for f in self.families}
        where = "may cover digits" if rules == {True} else "never on digits" if rules == {False} else "per family"
        val = f" + {self.n_val} val" if self.n_val else ""
        return (f"{self.n_train} train{val} + {self.n_test} test images, {self.width}x{self.height}, {self.n_digits} "
                f"digits ({self.n_target} target), {self.n_noise} noise ({'+'.join(self.families)}, {where}), "
                f"seed {self.seed}, task {self.task}")

    def validate(self, digit_shape: tuple[int, int] = (28, 28)) -> None:
        """Raise ``ValueError`` naming the first impossible parameter."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "noise":
                if not isinstance(value, str):
                    raise ValueError(f"noise must be a string, got {value!r}")
                parse_families(value)
            elif f.name == "task":
                if value not in TASKS:
                    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {value!r}")
            elif f.name == "noise_overlap":
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"noise_overlap must be True, False or None, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
        if self.n_train < 1 or self.n_test < 1:
            raise ValueError("n_train and n_test must be at least 1 (both splits are required)")
        if self.n_val < 0:
            raise ValueError(f"n_val must be >= 0, got {self.n_val}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        h, w = digit_shape
        if self.height < h or self.width < w:
            raise ValueError(f"the canvas {self.width}x{self.height} is smaller than a digit ({w}x{h})")
        if not 1 <= self.n_target <= self.n_digits:
            raise ValueError(f"n_target must be in 1..n_digits ({self.n_digits}), got {self.n_target}")
        others = self.n_digits - self.n_target
        # Every other class may appear at most n_target - 1 times, so the target stays the
        # strict majority; with 9 other classes that caps the number of other digits.
        if others > 9 * (self.n_target - 1):
            raise ValueError(
                f"{others} non-target digits cannot all stay below the {self.n_target} target digits "
                f"(at most {9 * (self.n_target - 1)} fit); raise n_target or lower n_digits"
            )
        if self.n_noise < 0:
            raise ValueError(f"n_noise must be >= 0, got {self.n_noise}")
        overlapping = [self.overlaps(f) for f in self.families]
        if self.n_noise and any(overlapping) and min(self.height - h, self.width - w) < REFERENCE_MARGIN + 1:
            raise ValueError(
                f"overlapping noise is placed in [{REFERENCE_MARGIN}, size - {REFERENCE_MARGIN}) per axis, which "
                f"is empty on a {self.width}x{self.height} canvas; enlarge it or use --n-noise 0"
            )
        # only digits and non-overlapping noise need room of their own
        objects = self.n_digits + (self.n_noise if not all(overlapping) else 0)
        if objects * h * w > 0.5 * self.height * self.width:
            raise ValueError(
                f"{objects} objects of {w}x{h} would cover over half of a {self.width}x{self.height} canvas; "
                "random non-overlapping placement needs more room (enlarge the canvas or lower n_noise)"
            )

    def params(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, MegapixelMNISTConfig] = {
    # Thesis §3.4.2 / the reference generator, its noise included; plus 1,000 val images
    # on noise of their own, so best.pt is not chosen on the test split (module docstring).
    "paper": MegapixelMNISTConfig(),
    # Demo and CI: a quarter megapixel and 1,200 images, same digit size and the same
    # low-resolution scale, so a digit is still ~3x3 low-res pixels (unreadable there).
    # Same (reference) noise as the paper, so a demo model meets the paper's distractors;
    # with 10 patches on 500x500, few images have a digit partly covered.
    # No val split: the demo's minutes go to training.
    "small": MegapixelMNISTConfig(n_train=1000, n_test=200, n_val=0, width=500, height=500, n_noise=10),
}


def make_config(preset: str = "paper", **overrides: Any) -> MegapixelMNISTConfig:
    """The preset's parameters with every non-``None`` override applied, validated.

    ``n_val`` not given with an ``n_train`` other than the preset's: the preset's share of
    val images to train images (paper: 0.2), at least one; the preset's own (paper: 1,000)
    when ``n_train`` is not changed.

    ``noise`` may be a comma-separated string or a list of family names; it is stored as
    ``"a,b"``. ``noise_overlap=None`` keeps the per-family default (it cannot be
    overridden back to ``None``, which is the presets' value anyway).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    known = {f.name for f in fields(MegapixelMNISTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}")
    values = {k: v for k, v in overrides.items() if v is not None}
    if "noise" in values:
        values["noise"] = ",".join(parse_families(values["noise"]))
    base = PRESETS[preset]
    if "n_val" not in values and values.get("n_train", base.n_train) != base.n_train and base.n_val:
        # a val split in the preset's proportion to the training images asked for (paper:
        # 0.2, 1,000 for 5,000), at least one: --n-train 16 asks for a quick set, and a
        # fixed 1,000 val images would be most of its time and disk
        values["n_val"] = max(1, round(values["n_train"] * base.n_val / base.n_train))
    config = replace(base, **values)
    config.validate()
    return config


# The recipe (ats_cli/recipes/NAME.toml) ats train uses for each task's data: majority and
# multilabel read the paper's spec; max and top are rules over the digits present, which a
# counting readout applies (the recipes say why each value).
TASK_RECIPES = {"majority": "megapixel-mnist", "multilabel": "megapixel-mnist", "max": "megapixel-mnist-max",
                "top": "megapixel-mnist-top"}


def recommended_hints(config: MegapixelMNISTConfig) -> dict[str, Any]:
    """The facts of the images ``dataset.json`` records as hints: one channel and the image
    size. What training reads them with is the task's recipe (:data:`TASK_RECIPES`)."""
    return {"channels": 1, "image_size": [config.height, config.width]}


# ---------------------------------------------------------------------------- one image


@dataclass(frozen=True)
class Layout:
    """Every random choice for one image; rendering it is deterministic.

    ``digit_boxes``/``noise_boxes`` hold top-left corners (row, col); all boxes have the
    digit's size ``box``. ``digit_index`` indexes the split's digit pool. Noise patch ``k``
    is ``noise_patches[k]`` (already rendered by its family ``noise_families[k]``), pasted
    in order after the digits.
    """

    target: int
    digit_classes: np.ndarray  # [n_digits] int
    digit_index: np.ndarray  # [n_digits] int, into the split's images
    digit_boxes: np.ndarray  # [n_digits, 2] int (row, col)
    noise_boxes: np.ndarray  # [n_noise, 2] int (row, col)
    noise_families: tuple[str, ...]  # [n_noise]
    noise_patches: np.ndarray  # [n_noise, h, w] uint8
    box: tuple[int, int]  # (h, w)

    def digits_json(self) -> str:
        """``[[class, row, col, h, w], ...]`` sorted top to bottom, left to right."""
        h, w = self.box
        order = np.lexsort((self.digit_boxes[:, 1], self.digit_boxes[:, 0]))
        items = [[int(self.digit_classes[i]), int(self.digit_boxes[i, 0]), int(self.digit_boxes[i, 1]), h, w]
                 for i in order]
        return json.dumps(items, separators=(",", ":"))

    def labels(self) -> dict[str, str]:
        """The four IPS labels of the image, by :data:`TASKS` column: the majority class,
        the largest class, the class of the top-most box (ties on the top edge: the
        left-most; see the module docstring), the classes present (sorted, ``;``-joined)."""
        top = int(np.lexsort((self.digit_boxes[:, 1], self.digit_boxes[:, 0]))[0])
        return {
            "majority": str(self.target),
            "max": str(int(self.digit_classes.max())),
            "top": str(int(self.digit_classes[top])),
            "present": ";".join(str(c) for c in sorted(set(self.digit_classes.tolist()))),
        }

    def row(self, path: str, task: str = "majority") -> dict[str, str]:
        """The CSV row: ``task``'s label, the boxes, and the other IPS labels (``majority``
        gets a column of its own when another task holds ``label``)."""
        labels = self.labels()
        row = {"path": path, "label": labels[TASKS[task]], "digits": self.digits_json()}
        if task != "majority":
            row["majority"] = labels["majority"]
        return row | {k: labels[k] for k in ("max", "top", "present")}


def box_fractions(corners: Any, boxes: Any, patch_size: tuple[int, int]) -> np.ndarray:
    """[k, m]: the share of each box's area inside each patch. ``corners`` [k, 2]: the
    patches' top-left (row, col); ``boxes`` [m, 4]: (row, col, h, w), e.g. the ``digits``
    column's boxes without their class. 1 = the patch holds the digit whole; how the
    feature-net pretraining labels its patches and how tests/test_noise.py tells which digit
    a draw holds."""
    c = np.asarray(corners, dtype=np.float64).reshape(-1, 2)
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    (ph, pw), top, left = patch_size, c[:, :1], c[:, 1:]
    dr = np.clip(np.minimum(top + ph, b[:, 0] + b[:, 2]) - np.maximum(top, b[:, 0]), 0, None)
    dc = np.clip(np.minimum(left + pw, b[:, 1] + b[:, 3]) - np.maximum(left, b[:, 1]), 0, None)
    return dr * dc / (b[:, 2] * b[:, 3])


SPLITS = ("train", "val", "test")
_VAL_IMAGE, _VAL_PATTERNS = 2, 3  # first word of a val image's spawn key, and of its patterns' key


def _split_seed(seed: int, split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return seed + 1 if split == "train" else seed


def _image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    key = (_VAL_IMAGE, index) if split == "val" else (index,)
    return np.random.default_rng(np.random.SeedSequence(entropy=_split_seed(seed, split), spawn_key=key))


@functools.lru_cache(maxsize=8)
def split_patterns(seed: int, split: str) -> np.ndarray:
    """The 50 ``reference`` noise patterns of ``split`` (read-only; depends on nothing but seed and split).

    ``val`` has none of its own: each of its images draws its own (:func:`_val_patterns`).
    """
    if split == "val":
        raise ValueError("the val split has no split-level patterns: each val image draws its own")
    rng = np.random.default_rng(np.random.SeedSequence(entropy=_split_seed(seed, split), spawn_key=(0, 1)))
    patterns = reference_patterns(rng)
    patterns.flags.writeable = False
    return patterns


def _val_patterns(seed: int, index: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(_VAL_PATTERNS, index)))
    return reference_patterns(rng)


def _noise_context(config: MegapixelMNISTConfig, split: str, images: np.ndarray, index: int = 0) -> NoiseContext:
    """The noise material of image ``index`` of ``split``: its split's patterns, or for val its own."""
    if not (config.n_noise > 0 and "reference" in config.families):
        return NoiseContext(patterns=None, digits=images)
    if split == "val":
        return NoiseContext(patterns=_val_patterns(config.seed, index), digits=images)
    return NoiseContext(patterns=split_patterns(config.seed, split), digits=images)


def _place(rng: np.random.Generator, n: int, placed: list[tuple[int, int]], config: MegapixelMNISTConfig,
           box: tuple[int, int]) -> list[tuple[int, int]]:
    """Rejection-sample ``n`` top-left corners whose boxes overlap neither each other nor ``placed``."""
    h, w = box
    taken = np.array(placed, dtype=np.int64).reshape(-1, 2)
    new: list[tuple[int, int]] = []
    for k in range(n):
        for _ in range(MAX_PLACEMENT_TRIES):
            r = int(rng.integers(0, config.height - h + 1))
            c = int(rng.integers(0, config.width - w + 1))
            if not np.any((np.abs(taken[:, 0] - r) < h) & (np.abs(taken[:, 1] - c) < w)):
                break
        else:
            raise PlacementError(
                f"could not place object {len(placed) + k + 1} of {config.n_digits + config.n_noise} without "
                f"overlap on a {config.width}x{config.height} canvas; enlarge it or lower n_noise"
            )
        new.append((r, c))
        taken = np.vstack([taken, [[r, c]]])
    return new


def _sample_layout(rng: np.random.Generator, pools: Sequence[np.ndarray], config: MegapixelMNISTConfig,
                   box: tuple[int, int], context: NoiseContext) -> Layout:
    target = int(rng.integers(10))
    classes = [target] * config.n_target
    counts = dict.fromkeys(range(10), 0)
    for _ in range(config.n_digits - config.n_target):
        # Other classes differ from the target and stay below n_target copies each, so
        # the target is the strict majority (with the paper's 3+2 this is "any two others").
        allowed = [c for c in range(10) if c != target and counts[c] < config.n_target - 1]
        other = allowed[int(rng.integers(len(allowed)))]
        counts[other] += 1
        classes.append(other)
    digit_classes = np.array(classes, dtype=np.int64)
    digit_index = np.empty(len(classes), dtype=np.int64)
    for c in sorted(set(classes)):
        slots = np.flatnonzero(digit_classes == c)
        pool = pools[c]
        picks = rng.choice(len(pool), size=len(slots), replace=len(pool) < len(slots))
        digit_index[slots] = pool[picks]
    digit_boxes = _place(rng, config.n_digits, [], config, box)

    # Noise, in a fixed draw order: each patch's family (only when several are mixed),
    # the non-overlapping boxes, the overlapping boxes, then the patches. With the single
    # family "strokes" this is exactly version 1's order, hence its exact images.
    n, families = config.n_noise, config.families
    if len(families) == 1:
        chosen = [families[0]] * n
    else:
        chosen = [families[int(k)] for k in rng.integers(len(families), size=n)]
    free = [k for k in range(n) if not config.overlaps(chosen[k])]
    boxes = np.zeros((n, 2), dtype=np.int64)
    boxes[free] = np.array(_place(rng, len(free), digit_boxes, config, box), dtype=np.int64).reshape(-1, 2)
    over = [k for k in range(n) if config.overlaps(chosen[k])]
    if over:
        # the reference's rule: top-left corner uniform in [28, size - 28), digits ignored
        boxes[over, 0] = rng.integers(REFERENCE_MARGIN, config.height - REFERENCE_MARGIN, size=len(over))
        boxes[over, 1] = rng.integers(REFERENCE_MARGIN, config.width - REFERENCE_MARGIN, size=len(over))
    if len(families) == 1:
        patches = FAMILIES[families[0]].many(rng, context, n)
    else:
        patches = [FAMILIES[f].render(rng, context) for f in chosen]
    return Layout(
        target=target,
        digit_classes=digit_classes,
        digit_index=digit_index,
        digit_boxes=np.array(digit_boxes, dtype=np.int64).reshape(-1, 2),
        noise_boxes=boxes,
        noise_families=tuple(chosen),
        noise_patches=np.array(patches, dtype=np.uint8).reshape(n, *box),
        box=box,
    )


def _render(layout: Layout, images: np.ndarray, config: MegapixelMNISTConfig) -> np.ndarray:
    canvas = np.zeros((config.height, config.width), dtype=np.uint8)
    h, w = layout.box
    for (r, c), idx in zip(layout.digit_boxes, layout.digit_index, strict=True):
        canvas[r : r + h, c : c + w] = images[idx]
    # after the digits, whole boxes (black included), as the reference pastes its noise
    for (r, c), patch in zip(layout.noise_boxes, layout.noise_patches, strict=True):
        canvas[r : r + h, c : c + w] = patch
    return canvas


def _pools(labels: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(labels == c) for c in range(10)]


def _split_arrays(digits: DigitSet, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The digit pool of ``split``: val draws from the train pool (module docstring: why)."""
    return (digits.x_test, digits.y_test) if split == "test" else (digits.x_train, digits.y_train)


def image_layout(config: MegapixelMNISTConfig, digits: DigitSet, split: str, index: int) -> Layout:
    """The layout of image ``index`` of ``split`` (what :func:`generate_megapixel_mnist` writes)."""
    images, labels = _split_arrays(digits, split)
    return _sample_layout(_image_rng(config.seed, split, index), _pools(labels), config, images.shape[1:3],
                          _noise_context(config, split, images, index))


def render_image(config: MegapixelMNISTConfig, digits: DigitSet, split: str, index: int) -> tuple[np.ndarray, Layout]:
    """Image ``index`` of ``split`` as a uint8 array [height, width], with its layout."""
    layout = image_layout(config, digits, split, index)
    return _render(layout, _split_arrays(digits, split)[0], config), layout


def encode_png(image: np.ndarray) -> bytes:
    """8-bit grayscale PNG with fixed settings, so identical pixels give identical bytes."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def _is_complete_png(path: Path) -> bool:
    """A file that starts with the PNG signature and ends with the IEND chunk (cheap: 20 bytes read)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            fh.seek(0, os.SEEK_END)
            if fh.tell() < len(_PNG_SIGNATURE) + len(_PNG_IEND):
                return False
            fh.seek(-len(_PNG_IEND), os.SEEK_END)
            return head == _PNG_SIGNATURE and fh.read() == _PNG_IEND
    except OSError:
        return False


# ---------------------------------------------------------------------------- the run


@dataclass
class _Job:
    """What a worker needs: parameters, output folder and the digit pools (sent once per worker)."""

    config: MegapixelMNISTConfig
    out: Path
    arrays: dict[str, tuple[np.ndarray, list[np.ndarray]]]  # split -> (images, per-class pools)
    name_width: int

    def name(self, index: int) -> str:
        return f"{index:0{self.name_width}d}.png"

    def run_chunk(self, split: str, indices: Sequence[int]) -> list[tuple[int, dict[str, str], bool]]:
        images, pools = self.arrays[split]
        box = images.shape[1:3]
        results = []
        for index in indices:
            layout = _sample_layout(_image_rng(self.config.seed, split, index), pools, self.config, box,
                                    _noise_context(self.config, split, images, index))
            rel = f"{split}/{self.name(index)}"
            path = self.out / rel
            wrote = False
            if not _is_complete_png(path):
                # No fsync: a file cut short by a power loss fails _is_complete_png on the
                # next run and is rewritten, so durability is checked rather than forced.
                atomic_write_bytes(path, encode_png(_render(layout, images, self.config)), fsync=False)
                wrote = True
            results.append((index, layout.row(rel, self.config.task), wrote))
        return results


_TASK_TEXT = {
    "majority": "label = majority digit",
    "max": "label = largest digit present (IPS task max)",
    "top": "label = top-most digit, by the box's top edge, ties to the left-most (IPS task top)",
    "multilabel": "label = the digits present, ';'-separated (IPS multi-label task)",
}


def split_sizes(config: MegapixelMNISTConfig) -> dict[str, int]:
    """Images per split, in generation order; val only when asked for."""
    return {"train": config.n_train, **({"val": config.n_val} if config.n_val else {}), "test": config.n_test}


def fingerprint(config: MegapixelMNISTConfig, digits: DigitSet) -> dict[str, Any]:
    """The generator block of ``dataset.json``; its parameters decide whether a rerun may resume."""
    return {
        "name": GENERATOR_NAME,
        "version": GENERATOR_VERSION,
        "params": config.params(),
        "seeding": "image i of a split: numpy SeedSequence(entropy=seed+1 for train / seed for test, spawn_key=(i,)); "
                   "of val: SeedSequence(entropy=seed, spawn_key=(2, i)), digits from the train pool",
        "noise": noise_block(config),
        "png_compress_level": PNG_COMPRESS_LEVEL,
        "digits": digits.summary(),
    }


def noise_block(config: MegapixelMNISTConfig) -> dict[str, Any]:
    """What ``dataset.json`` says about the noise: families, their parameters, placement, mixing."""
    families = config.families
    return {
        "families": list(families),
        "mixing": "one family per patch, uniform over the list" if len(families) > 1 else "single family",
        "overlap": {f: config.overlaps(f) for f in families},
        "placement": {
            "overlapping": f"top-left corner uniform in [{REFERENCE_MARGIN}, size - {REFERENCE_MARGIN}) per axis, "
                           "independent of the digits; the whole box pasted after the digits",
            "non_overlapping": "rejection-sampled so the box meets no digit box and no other such noise box",
        },
        "params": {f: dict(FAMILIES[f].params) for f in families},
        "pattern_seeding": "reference patterns of a split: numpy SeedSequence(entropy=split seed, spawn_key=(0, 1)); "
                           "val image i draws its own: SeedSequence(entropy=seed, spawn_key=(3, i))",
    }


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    diffs = generation.default_differences(old, new)
    if old.get("name") != new["name"]:
        return diffs  # another generator: nothing else to compare
    if old.get("params", {}).get("task", "majority") == new["params"]["task"]:  # before tasks: majority
        diffs = [d for d in diffs if not d.startswith("task: None ->")]
    # A run begun before val splits existed has none: it is an n_val 0 run.
    diffs = [d.replace("n_val: None ->", "n_val: 0 ->") for d in diffs if d != "n_val: None -> 0"]
    diffs = [f"{d} (it was made without a val split: --n-val 0 resumes it as it was)"
             if d.startswith("n_val: 0 ->") else d for d in diffs]
    old_sha = (old.get("digits") or {}).get("sha256")
    if old_sha != new["digits"]["sha256"]:
        diffs.append(f"digit source: {(old.get('digits') or {}).get('description')} -> {new['digits']['description']}")
    return diffs


def check_output(out: str | os.PathLike[str], config: MegapixelMNISTConfig, digits: DigitSet) -> None:
    """Raise :class:`DatasetError` unless ``out`` is new, empty, or holds a run with the same parameters.

    Called by :func:`generate_megapixel_mnist`; public so a caller can refuse early.
    """
    generation.check_output(out, fingerprint(config, digits), _differences)


def generate_megapixel_mnist(
    out: str | os.PathLike[str],
    config: MegapixelMNISTConfig,
    digits: DigitSet,
    *,
    workers: int | None = None,
    chunk_size: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> GenerationReport:
    """Generate (or finish generating) a Megapixel MNIST dataset in ``out``.

    ``workers`` defaults to the CPU count; 1 runs in this process. ``progress(split, done,
    total)`` is called in this process as images finish (skipped ones included); an
    exception raised from it stops the run cleanly, which is how tests simulate an
    interruption. Returns a :class:`GenerationReport`; the dataset is in the common format
    (see :mod:`ats_cli.data.dataset`), with extra columns ``digits``, ``max``, ``top``,
    ``present`` (and ``majority`` when ``config.task`` puts another label in ``label``);
    ``dataset.json`` records the task.
    """
    out = Path(out).expanduser()
    digit_shape = digits.x_train.shape[1:3]
    if digits.x_test.shape[1:3] != digit_shape:
        raise ValueError(f"train digits are {digit_shape}, test digits {digits.x_test.shape[1:3]}")
    if digit_shape != (28, 28):
        raise ValueError(f"digits must be 28x28 like the noise patches, got {digit_shape}")
    config.validate(digit_shape)
    sizes = split_sizes(config)
    job = _Job(
        config=config,
        out=out,
        arrays={s: (_split_arrays(digits, s)[0], _pools(_split_arrays(digits, s)[1])) for s in sizes},
        name_width=max(5, len(str(max(sizes.values()) - 1))),
    )
    return run_generation(
        out, fingerprint(config, digits), job, sizes,
        dataset={
            "classes": [str(d) for d in range(10)],
            "hints": recommended_hints(config),
            "recipe": TASK_RECIPES[config.task],
            "description": f"Megapixel MNIST ({config.width}x{config.height}, {config.n_digits} digits of which "
            f"{config.n_target} of the target class, {config.n_noise} noise patches ({config.noise})); "
            + _TASK_TEXT[config.task],
            "task": config.task,
        },
        workers=workers, chunk_size=chunk_size, progress=progress, differences=_differences,
        source=digits.description,
    )
