"""``ats pretrain``'s two stages on a dataset: read the patches and views, train the feature
net and its head (stage 1), fit the attention (stage 1b), write the checkpoint.

The checkpoint is the model ``ats train`` builds with the same network flags: the feature
network as trained here; the classifier's rows are the patch head's rows for the classes,
its last row the "no class here" logit when the model has one (``--none-class on``); the
attention network as stage 1b left it (at its fresh initialisation with 0 attention
epochs). ``pretrain`` in the file records what was done, ``none_share`` among it: the share
of "none" among the training patches, the prior ``ats export --none-prior`` corrects from.

Randomness: torch's global RNG is seeded once (``seed``) before the model is built, then
draws the head's initialisation; image ``i`` of the training split cuts its patches with
its own numpy generator (``seed * 1_000_003 + i``; the test split's from ``seed + 1``), and
each stage shuffles with a generator of ``seed``. The same data and options give the same
checkpoint, whatever the number of workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from ats_cli.config import TrainConfig, none_class_refusal
from ats_cli.pretrain import PretrainError
from ats_cli.pretrain.attention import attention_report, attention_shape, attention_targets, train_attention
from ats_cli.pretrain.examples import read_all
from ats_cli.pretrain.internals import attention_margin, set_head
from ats_cli.pretrain.patches import NONE, SMALL_PATCHES
from ats_cli.pretrain.stage1 import NONE_UNIFORM, train_features

if TYPE_CHECKING:
    from ats_cli.data.dataset import Dataset

ATTENTION_EPOCHS = 5
ATTENTION_BATCH = 32


@dataclass
class PretrainOptions:
    """What ``ats pretrain`` takes; the defaults are the released Megapixel MNIST recipe's
    (models/megapixel-mnist-ats.md, "How it was trained")."""

    data: str
    out: str
    regions: str = "digits"  # the CSV column holding each row's regions (ats_cli.pretrain.regions)
    images: int = 12000  # training images patches are cut from
    test_images: int = 300  # test images whose patches are scored after each epoch
    epochs: int = 3
    attention_epochs: int = ATTENTION_EPOCHS
    batch_size: int = 256
    lr: float = 3e-3
    seed: int = 0
    workers: int = 2
    device: str = "auto"
    shrunken: int = SMALL_PATCHES
    none_uniform: float = NONE_UNIFORM
    scale: float = 0.2
    attention_net: str = "block-attention"
    attention_width: int = 32
    feature_net: str = "small-cnn"
    feature_width: int = 32
    feature_scale: float = 10.0
    pooling: str = "counts"
    none_class: str = "on"

    def check(self) -> None:
        """Refuse impossible combinations in one line, before anything is read."""
        if self.none_class == "on" and (refusal := none_class_refusal(self.pooling, "--none-class")):
            raise PretrainError(refusal)
        if not self.lr > 0:
            raise PretrainError(f"--lr must be > 0 (got {self.lr})")
        if self.none_uniform < 0:
            raise PretrainError(f"--none-uniform must be >= 0 (got {self.none_uniform})")
        for name in ("images", "test_images", "epochs", "attention_epochs", "batch_size", "workers", "shrunken"):
            least = 1 if name in ("images", "test_images", "batch_size") else 0
            if getattr(self, name) < least:
                raise PretrainError(f"--{name.replace('_', '-')} must be >= {least} (got {getattr(self, name)})")


def pretrain_config(opts: PretrainOptions, data: Dataset) -> TrainConfig:
    """The TrainConfig ``opts`` pretrain with on ``data`` (a Dataset), before settling: the
    recipe its dataset.json names (ats_cli.recipes: the sizes and readout options ats train
    reads this data with), under pretrain's own options. Raises ConfigError for a recipe
    that cannot be read."""
    from ats_cli.recipes import dataset_recipe, load_recipe

    name = dataset_recipe(data.root)
    recipe = load_recipe(name).values if name else {}
    return TrainConfig(**{**recipe, "recipe": name, "data": opts.data, "attention_net": opts.attention_net,
                          "attention_width": opts.attention_width, "feature_net": opts.feature_net,
                          "feature_width": opts.feature_width, "feature_scale": opts.feature_scale,
                          "seed": opts.seed, "patch_gain": "off", "scale": opts.scale, "pooling": opts.pooling,
                          "none_class": opts.none_class})


def pretrain(opts: PretrainOptions, log: Callable[[str], None] = print) -> dict:
    """Run both stages and write ``opts.out``; returns what the checkpoint records under
    ``pretrain``. Raises :class:`PretrainError` (one line, naming the file) for a dataset
    that cannot be read or has no usable regions."""
    opts.check()
    import torch

    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import ConfigError, settle_data
    from ats_cli.data.dataset import DatasetError, load_dataset
    from ats_cli.models import check_patch_size, create_model, model_spec

    try:
        data = load_dataset(opts.data)
    except DatasetError as e:
        raise PretrainError(str(e)) from None
    if data.multilabel:  # its patch labels come from one class per region; a set of classes has none
        raise PretrainError(f"{opts.data}: a multi-label dataset; ats pretrain needs one class per image "
                            "(train it with ats train)")
    try:
        cfg = pretrain_config(opts, data)
        cfg.validate()
        # sizes, support and the rest settled as ats train settles them on this data (a black
        # canvas: only bright cells are sampled), so the attention is taught over the cells
        # that ats train and ats predict draw from
        cfg = settle_data(cfg, data)[0].config
    except ConfigError as e:
        raise PretrainError(str(e).splitlines()[0]) from None
    size = cfg.patch_size
    torch.manual_seed(opts.seed)
    channels = int(data.hints.get("channels") or 1)
    if channels != 1 and opts.shrunken:
        raise PretrainError(f"{opts.data}: --shrunken pastes shrunken objects on a dark canvas, for one-channel "
                            f"images (Megapixel MNIST); these have {channels} channels: give --shrunken 0")
    spec = model_spec(cfg, n_classes=data.num_classes, channels=channels)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device)
    try:
        model = create_model(spec)
        check_patch_size(model, spec)  # a patch the feature net cannot read: one line, before any step
        model = model.to(device)
    except (KeyError, ValueError) as e:  # an unknown network name, a width it cannot take
        raise PretrainError(str(e).splitlines()[0]) from None

    t0 = time.time()
    view = None
    if opts.attention_epochs > 0 and len(data["train"]):  # stage 1b's views, read with the patches
        view = (cfg.scale, attention_shape(model, str(data["train"][0].path), cfg.scale, device, channels),
                attention_margin(model))
    train_rows, test_rows = data["train"][: opts.images], data["test"][: opts.test_images]
    x, y, train_views, train_cells = read_all(train_rows, data.classes, size, opts.seed, opts.workers,
                                              str(data.root / "train.csv"), opts.shrunken, view, opts.regions,
                                              str(data.root), channels)
    xt, yt, test_views, test_cells = read_all(test_rows, data.classes, size, opts.seed + 1, opts.workers,
                                              str(data.root / "test.csv"), opts.shrunken,
                                              view if len(test_rows) else None, opts.regions, str(data.root),
                                              channels)
    if not len(y) or not len(yt):
        raise PretrainError(f"{opts.data}: no readable training or test image gave a patch")
    n = data.num_classes
    log(f"{len(y)} training patches ({(y < n).sum()} objects, {(y == n).sum()} {NONE}) from "
        f"{len(train_rows)} images, {len(yt)} test patches, {time.time() - t0:.0f}s")

    head, accuracy = train_features(model, x, y, xt, yt, n_classes=n, epochs=opts.epochs,
                                    batch_size=opts.batch_size, lr=opts.lr, seed=opts.seed,
                                    none_uniform=opts.none_uniform, device=device, log=log, t0=t0)
    if view is not None:
        _attention_stage(model, [("train", train_views, train_cells), ("test", test_views, test_cells)],
                         view[1], cfg.scale, opts, device, log, str(data.root))
    set_head(model, head.weight, head.bias)
    record = {"images": len(train_rows), "patches": int(len(y)), "epochs": opts.epochs, "shrunken": opts.shrunken,
              "none_share": float((y == n).mean()),  # ats export --none-prior
              "test_patch_accuracy": accuracy, "attention_epochs": opts.attention_epochs,
              "none_uniform": opts.none_uniform, "regions": opts.regions,
              "options": {k: v for k, v in asdict(opts).items() if k not in ("data", "out", "device")}}
    save_checkpoint(opts.out, spec=spec, classes=data.classes, model=model.cpu(), pretrain=record)
    log(f"wrote {opts.out}: ats export {opts.out} MODEL.pt to predict with it, or "
        f"ats train {opts.data} --set init={opts.out} (same networks) to fine-tune it")
    return record


def _attention_stage(model, views: list[tuple[str, np.ndarray | None, list | None]], att_shape: tuple[int, int],
                     scale: float, opts: PretrainOptions, device, log: Callable[[str], None], where: str) -> None:
    """Stage 1b on ``views`` = (split, views, object cells), the training split first: the
    attention net taught each object's cells on the training views, then its mass on the
    objects of the test split reported."""
    t0 = time.time()
    model.cpu()
    views = [v for v in views if v[1] is not None]
    targets = [attention_targets(model, v, cells, att_shape) for _, v, cells in views]
    model.to(device)
    log(f"attention: {len(views[0][1])} training views ({scale} scale, {att_shape[0]}x{att_shape[1]} cells), "
        f"targets {time.time() - t0:.0f}s")
    train_attention(model, views[0][1], targets[0], att_shape, epochs=opts.attention_epochs, lr=opts.lr,
                    batch_size=ATTENTION_BATCH, seed=opts.seed, device=device, log=log)
    for (name, v, _), t in list(zip(views, targets, strict=True))[1:]:
        if len(v):
            log(f"attention on {where} ({name} split): {attention_report(model, v, t, att_shape, device)}")
