"""Training configuration: plain values, overridable from a TOML file and the command line,
and settled from the data in one place.

Precedence: defaults < ``--config FILE`` < flags. Values left to the data (0, -1, auto)
are decided when the run starts (:func:`settle`, below), and the settled values are
written to ``RUN_DIR/config.json`` so every run records exactly what it did. One module,
because it is one concern: what the run is configured to do, and why. The fields (with
their help and allowed values) come first, then the settling.

**Settling: every value left to the data, decided in one place.** Some training
settings mean "decide from the data": the sizes at 0 (dataset.json's hint, else
:data:`DATA_DEFAULTS`), ``--patch-um`` / ``--low-res-um`` (microns, turned into
pixels at the model's microns per pixel), ``eval_n_patches -1`` and the four that look
at the training images (``min_brightness``, ``rarity_prior``, ``--augment``,
``patch_gain``), with ``rarity_cap`` and, for two levels, ``region_temperature``,
which follow from them. Two steps decide them:

* the data layer reads what the rules need from the dataset (:mod:`ats_cli.data.facts`:
  the hints, the microns per pixel and sizes the training files' headers record, and a
  look at the first training images; :class:`~ats_cli.data.facts.DataFacts`, a plain record).
* :func:`settle` decides, from the flags and the facts alone: no I/O, nothing mutated, the
  same answer every time. It returns the settled configuration (no auto value left) and
  one :class:`Reason` per value, "scale 0.12: dataset.json hint". The look at the images
  needs the sizes settled from the headers (the images are read as training reads them),
  so settle takes it as a function it calls once they are decided: :func:`settle_data`
  runs the whole, and settle runs once a run.

``ats train`` prints the reasons, saves them with the facts in ``RUN/settled.json`` and
builds the model from the settled configuration, which ``RUN/config.json`` holds.
``--resume`` settles the saved configuration against the saved facts: nothing is left to
decide, so the run continues with exactly what it started with, without looking again.

A value the user gives (flag, ``--config`` file, a resumed config.json) always wins.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ats_cli.data.facts import DataFacts, probe_images, read_facts
from ats_cli.registry import PRETRAINED_FEATURE_NET, RANDOM_FEATURE_NET, discover_extensions, extension_choices

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ats_cli.data.dataset import Dataset

__all__ = ["TrainConfig", "ConfigError", "allowed_values", "load_config_file", "typed_values",
           "AUTO_MIN_BRIGHTNESS", "AUTO_VIEW_PIXELS", "AUTO_RARITY_PRIOR", "DATA_DEFAULTS",
           "TWO_LEVEL_RARITY_CAP", "TWO_LEVEL_RARITY_PRIOR", "TWO_LEVEL_REGION_TEMPERATURE", "Reason",
           "Settled", "looks_at_images", "settle", "settle_data",
           "usable_hints", "levels_spec", "rarity_cap", "view_scale"]


class ConfigError(ValueError):
    """A configuration file or value that cannot be used."""


# The panels of `ats train --help` the fields are listed under.
METHOD_PANEL = "Attention sampling"
READ_PANEL = "Reading slides (saved in the model; predict and visualize read alike)"
NET_PANEL = "Networks"
OPT_PANEL = "Optimisation"
RUN_PANEL = "Running"


# The poolings with a per-patch vote (so a none logit: none_class) and those that count
# objects (so a floor, and one attention grid): ats_cli.extensions.pooling_votes, pooling_counts
# and their subclasses. Named here, not read from the classes, so that flags and their checks
# stay free of torch.
VOTING_POOLINGS = ("votes", "counts", "highest-counts", "topmost-counts")
COUNTING_POOLINGS = ("counts", "highest-counts", "topmost-counts")
# a rule for one label per image: ats_cli.extensions.pooling_highest, pooling_topmost
RULE_POOLINGS = ("highest", "highest-counts", "topmost-counts")


def none_class_refusal(pooling: str, flag: str) -> str | None:
    """Why a none logit (``flag`` on: ``none_class``, ``--none-class``) cannot go with
    ``pooling``, or None where it can. The none logit is one more output of each patch's
    vote, read as "no class here"; a pooling without per-patch votes has nowhere to put it.
    One wording for train, export and pretrain."""
    if pooling in VOTING_POOLINGS:
        return None
    return f"{flag} on needs pooling {', '.join(VOTING_POOLINGS)} (pooling {pooling} has no per-patch vote)"


def _key(default: Any, help: str, panel: str | None = None, *, choices: dict[str, str] | None = None,
         means: str | None = None, flag: bool = False) -> Any:
    """A TrainConfig field that also describes itself, so that ``ats train``'s flags, their
    help, the key reference (docs/configuration.md) and :meth:`TrainConfig.validate`'s
    allowed values come from one place (ats_cli/cli/options.py builds the flags).
    ``help``: the key's help without the default, which is added from ``default``;
    ``{choices}`` in it is replaced by the allowed values (``choices``: value -> a note on
    it, "" for none) joined by " | ". ``means``: what the default value stands for ("auto",
    "off"). ``panel``: the group it is listed under; None for a field the command declares
    itself (DATA, --out). ``flag``: ``ats train`` has a flag for it, for the settings a
    user of any dataset may need; every other key is set in a recipe or a ``--config``
    file (or ``--set KEY=VALUE``), so that the command's options stay few."""
    return field(default=default, metadata={"help": help, "panel": panel, "choices": choices, "means": means,
                                            "flag": flag})


@dataclass
class TrainConfig:
    data: str = _key("", "Dataset directory (train.csv, test.csv, dataset.json)")
    out: str = _key("", "Run directory for checkpoints, metrics and plots")
    # the recipe the settings start from (ats_cli.recipes), recorded in config.json
    recipe: str = _key("", "The recipe the run's settings start from: a name (ats train --recipes) or a .toml file; "
                       "without one, the one DATA/dataset.json names")
    # the method (see ats_cli.models)
    method: str = _key("ats", "{choices}", METHOD_PANEL, choices={
        "ats": "", "uniform": "fixed uniform attention", "deepmil": "gated attention over all grid patches",
        "cnn": "ResNet-18 on the low-res view",
        "ips": "iterative patch selection, Bergner et al. 2023",
        "tile-mil": "every tissue tile encoded once by a frozen encoder, gated attention-MIL on the stored "
                    "features (CLAM-SB)"}, flag=True)
    # --method ips (ats_cli.baselines_ips); defaults: the paper's Megapixel MNIST configuration
    ips_memory: int = _key(100, "With --method ips: patches the memory buffer keeps, M, the top-scoring of the grid, "
                           "then encoded with gradients and pooled", METHOD_PANEL)
    ips_iter: int = _key(100, "With --method ips: grid patches read and scored per no-gradient step, I", METHOD_PANEL)
    ips_stride: int = _key(0, "With --method ips: the grid's stride in full-res pixels; 0 = --patch-size "
                           "(non-overlapping, the paper's)", METHOD_PANEL)
    # 0 = the dataset's hint (dataset.json "hints"), else ats_cli.config.DATA_DEFAULTS (the paper's Megapixel MNIST)
    n_patches: int = _key(0, "Patches sampled per image", METHOD_PANEL, flag=True)
    patch_size: int = _key(0, "Patch side, full-res pixels", METHOD_PANEL, flag=True)
    scale: float = _key(0.0, "Scale of the low-res view", METHOD_PANEL, flag=True)
    # the same two in microns, for slides (ats_cli.data.inputs): converted at the
    # model's mpp (--mpp, else the training slides' own) into patch_size and scale
    patch_um: float = _key(0.0, "Slides: patch side in microns, instead of --patch-size (at --mpp, else the training "
                           "slides' microns per pixel)", METHOD_PANEL, means="off", flag=True)
    low_res_um: float = _key(0.0, "Slides: microns per low-res pixel, instead of --scale (scale = mpp / this)",
                             METHOD_PANEL, means="off", flag=True)
    replace: bool = _key(False, "Sample with replacement", METHOD_PANEL)
    # auto | threshold | sequential: the unbiased estimator without replacement (same expectation,
    # different variance: ats_cli.core.sampling)
    estimator: str = _key("auto", "Unbiased estimator without replacement: {choices}", METHOD_PANEL, choices={
        "auto": "training: per image, threshold when n >= the attention's perplexity, else sequential; evaluation "
                "and prediction: threshold",
        "threshold": "", "sequential": "the thesis's, appendix B.3"})
    entropy: float = _key(0.01, "Entropy regulariser weight lambda", METHOD_PANEL, flag=True)
    # > 0: the support extension "bright" (ats_cli.extensions.support_bright; black backgrounds);
    # 0 = off; -1 = auto: AUTO_MIN_BRIGHTNESS when the training images have a black background (ats_cli.config)
    min_brightness: float = _key(-1.0, "Never sample low-res cells darker than this; 0 = off; -1 = auto: 0.15 when "
                                 "the training images have a black background, else off", METHOD_PANEL, means="auto")
    # > 0: the prior extension "rarity", the attention starts where the image looks unusual
    # (ats_cli.extensions.prior_rarity); -1 = auto
    rarity_prior: float = _key(-1.0, "Weight beta of the attention's starting prior exp(beta r), r = how unusual a "
                               "low-res cell's colour is in its image (1 = typical); 0 = off (the thesis); -1 = auto: "
                               "on for slides (tissue mask): 2, or 10 with levels 2; else off", METHOD_PANEL,
                               means="auto")
    rarity_cap: float = _key(-1.0, "With rarity_prior: cells at least this unusual (r >= cap) start alike, so "
                             "that a large weight does not hand all the mass to the single most unusual cell; 0 = no "
                             "cap; -1 = auto: 4.5 with levels 2, else none", METHOD_PANEL, means="auto")
    # each drawn patch's own logits against its image's label (ATSModel.patch_nll says why)
    patch_loss: float = _key(-1.0, "Weight of the per-patch loss: each drawn patch classified alone against its "
                             "image's label, so that the few patches showing a small object teach the feature net "
                             "at full strength; 0 = off (the thesis); -1 = auto: 1 for photographs (no tissue mask, "
                             "no black background), else off", METHOD_PANEL, means="auto")
    # multiplies the L2-normalised features (1 = the paper; see ATSModel)
    feature_scale: float = _key(10.0, "Multiplies the L2-normalised features; >1 lets the classifier become "
                                "confident sooner (docs/training.md; 1 = the paper)", METHOD_PANEL)
    # on: the gain extension "learned", a per-patch gain on the unit-norm features
    # (ats_cli.extensions.gain_learned); auto = on for slides, where one small region decides the
    # label; late: the same model, the gain trained from GAIN_LATE_START of the epochs (train._optimizer)
    patch_gain: str = _key("auto", "Learned per-patch feature gain: {choices}; docs/training.md", METHOD_PANEL,
                           choices={"auto": "on for slides, i.e. a tissue mask: with one level; late with two; "
                                            "else off",
                                    "on": "one patch showing the class can outweigh look-alikes",
                                    "late": "on, trained from half-way, once the feature net tells the class apart",
                                    "off": "every patch weighed by its attention alone, the thesis"})
    # the pooling extension: what the estimator averages (ats_cli.extensions.pooling*); none_class
    # and count_floor are its options (ats_cli.models.extension_specs)
    pooling: str = _key("auto", "What attention sampling averages over the patches: {choices}; "
                        "docs/training.md", METHOD_PANEL,
                        choices={"auto": "an older dataset.json's hint, else features; a recipe names the "
                                         "others, as megapixel-mnist-max: highest-counts",
                                 **extension_choices("pooling")}, flag=True)
    none_class: str = _key("auto", "A per-patch logit for no class here, with pooling votes, counts, "
                           "highest-counts or topmost-counts: {choices}",
                           METHOD_PANEL, choices={"auto": "the dataset.json hint none_class; else off",
                                                  "off": "every patch spreads a whole vote over the classes",
                                                  "on": "a patch read as none votes little"})
    count_floor: float = _key(-1.0, "With pooling counts, highest-counts or topmost-counts: an object with less "
                              "than this share of the attention counts in proportion to it, not once (0 = every "
                              "object once, 1 = votes; -1 = auto: the dataset.json hint count_floor, else 0)",
                              METHOD_PANEL)
    # the floor evaluation and prediction read at (the model records it; why: ats_cli.extensions.pooling_counts)
    eval_count_floor: float = _key(-1.0, "The count floor at evaluation and prediction (the model records it; "
                                   "-1 = auto: the dataset.json hint eval_count_floor, else count_floor's)",
                                   METHOD_PANEL)
    # on: each patch's position in the image goes into its feature (ats_cli.extensions.position)
    position_features: str = _key("auto", "Each patch's position in the image in its feature and the attention's "
                                  "input: {choices}; "
                                  "docs/training.md", METHOD_PANEL,
                                  choices={"auto": "the dataset.json hint position_features, which "
                                                   "make-dataset --task top writes; else off",
                                           "off": "what a patch shows, not where: the thesis",
                                           "on": "for labels that depend on where, as the top-most digit"})
    # more patches at evaluation cost no memory for gradients and cut the estimator's noise;
    # -1 = auto = twice the training count, recorded in the model
    eval_n_patches: int = _key(-1, "Patches sampled at evaluation and prediction (the model records it); 0 = as "
                               "many as in training; -1 = auto: twice the training count", METHOD_PANEL, means="auto")
    # two levels (ats_cli.core.nested_model): a coarse attention over regions of the whole
    # image draws `regions` of them, each drawn region's view (at --scale) draws --n-patches
    levels: int = _key(1, "Attention levels: 1, or 2 = a coarse attention over the image's regions draws some "
                       "(the key regions), then --n-patches in each region's own view at --scale (docs/slides.md)",
                       METHOD_PANEL)
    regions: int = _key(4, "With levels 2: regions drawn per image", METHOD_PANEL)
    # as eval_n_patches: more regions at evaluation cost no gradient memory and keep the estimate
    # unbiased; where regions look alike at the coarse scale, k of them can miss the one that decides
    eval_regions: int = _key(-1, "With levels 2: regions drawn at evaluation and prediction (the model records "
                             "it); 0 = as many as in training; -1 = auto: twice the key regions", METHOD_PANEL,
                             means="auto")
    region_size: int = _key(0, "With levels 2: region side in full-res pixels (a multiple of --patch-size)",
                            METHOD_PANEL, means="off")
    region_um: float = _key(0.0, "With levels 2, slides: region side in microns, instead of region_size (at "
                            "--mpp, else the training slides' microns per pixel)", METHOD_PANEL, means="off")
    # 4: the coarse view of a 200k slide in 4096-pixel regions stays 195², less than the four
    # region views together, so a step costs the same from 25k to 200k slides (benchmarks/
    # slides.md#cost-as-slides-grow); a pixel of 1/1024 still tells tissue from glass. At 8 the
    # coarse view (391²) outgrows the region views and the step grows with the slide
    coarse_px: int = _key(4, "With levels 2: coarse-view pixels per region side (the coarse attention's "
                          "resolution; the coarse view of an H-pixel slide is H / region_size x this)", METHOD_PANEL)
    # auto: a coarse view twice as fine, tried on the held-out split after the last epoch and
    # kept only where it scores better (ats_cli.train.choose_coarse_view says why)
    eval_coarse_px: int = _key(-1, "With levels 2: coarse-view pixels per region side at evaluation and "
                               "prediction (the model records it); 0 = as in training; -1 = auto: twice "
                               "coarse_px where the held-out split scores better with it after the last epoch, "
                               "else as in training (docs/slides.md)", METHOD_PANEL, means="auto")
    region_temperature: float = _key(-1.0, "With levels 2: a region's score is t x the log-mean-exp of its "
                                     "coarse cells' scores / t: 1 = the log-mean-exp, towards 0 its largest cell "
                                     "(docs/slides.md); -1 = auto: 0.1", METHOD_PANEL, means="auto")
    # reading slides and TIFFs (saved in the model, so predict and visualize read alike; their
    # reader/level/--mpp/tissue_mask are these fields too: ats_cli/cli/options.py)
    reader: str = _key("auto", "Force a reader: {choices}", READ_PANEL, choices={
        "auto": "TIFFs and slide formats are read lazily, other images whole", "openslide": "", "tifffile": "",
        "pillow": ""})
    level: int = _key(0, "Slides: pyramid level patches are read from", READ_PANEL)
    mpp: float = _key(0.0, "Slides: read patches at this many microns per pixel (from the level at or below it, "
                      "resampled); the model records it, else the training slides' own when they agree",
                      READ_PANEL, means="off", flag=True)
    tissue_mask: str = _key("auto", "{choices}: sample only tissue (Otsu on saturation)", READ_PANEL, choices={
        "auto": "on for slides and TIFFs, off for other images", "on": "", "off": ""})
    # networks (names from ats_cli.nets)
    attention_net: str = _key("mnist-attention", "Attention network name", NET_PANEL, flag=True)
    feature_net: str = _key("auto", "Feature network name (mnist-features: the paper's), timm:NAME, "
                            "torchvision:NAME, or a DIR from ats export --encoder; auto: timm:convnext_atto.d2_in1k "
                            "(ImageNet weights) for RGB images when its weights are in the cache or can be "
                            "downloaded now, else small-cnn (random weights) (docs/training.md)", NET_PANEL,
                            flag=True)
    attention_width: int = _key(8, "Attention net channels", NET_PANEL)
    feature_width: int = _key(32, "Feature net channels (encoders: the width of feature_train head's projection)",
                              NET_PANEL)
    # pretrained encoders (ats_cli.nets.encoders): where the feature net's weights start, what trains
    feature_weights: str = _key("auto", "Starting weights of the feature net: auto (timm:/torchvision: the library's "
                                "pretrained ones, from its cache or downloaded; an exported encoder: its own; our "
                                "nets: random) | none (random) | FILE (safetensors, or a state dict)", NET_PANEL,
                                flag=True)
    feature_train: str = _key("auto", "What of the feature net trains: {choices}; docs/training.md", NET_PANEL,
                              choices={"auto": "none when it starts from pretrained weights or for method "
                                               "tile-mil, else all",
                                       "none": "frozen: no gradients, no optimizer state",
                                       "head": "a frozen encoder under a trainable linear+ReLU projection to "
                                               "feature_width", "all": ""})
    # ats_cli.data.features: a frozen encoder's feature of a patch computed once per run (or per
    # ATS_FEATURE_STORE=DIR, shared), then read back bit for bit
    feature_store: str = _key("auto", "Keep a frozen feature net's patch features on disk (RUN/cache/features, or "
                              "$ATS_FEATURE_STORE) and read them back instead of encoding a patch again: {choices}; "
                              "docs/training.md#the-feature-store", NET_PANEL, choices={
                                  "auto": "on when feature_train is none, the encoder pretrained or exported, and "
                                          "augment none; always for method tile-mil", "on": "", "off": ""})
    feature_store_gb: float = _key(4.0, "The feature store's cap on disk (GiB, all encoders' features together); "
                                   "past it the oldest are deleted", NET_PANEL)
    # optimisation
    optimizer: str = _key("adam", "{choices}", OPT_PANEL, choices={"adam": "", "adamw": "", "sgd": ""})
    # docs/training.md: faster off the plateau than the reference's 1e-3, same budget
    lr: float = _key(3e-3, "Learning rate", OPT_PANEL, flag=True)
    weight_decay: float = _key(0.0, "Weight decay", OPT_PANEL)
    # fine-tuning a pretrained encoder (init) gently, or not at all: CLAM-style frozen
    # features. Frozen also keeps its batch norms' statistics as init left them (train.py)
    feature_lr: float = _key(1.0, "Feature network's learning rate, relative to --lr; 0 = frozen: its weights and "
                             "batch-norm statistics stay as they start (init's, or the pretrained ones)", OPT_PANEL)
    schedule: str = _key("cosine", "{choices}", OPT_PANEL, choices={"constant": "", "cosine": ""})
    warmup_epochs: int = _key(0, "Linear warm-up epochs", OPT_PANEL)
    clip_norm: float = _key(1.0, "Gradient norm clip, 0 = off", OPT_PANEL)
    # training only (ats_cli.augment; never saved in the model): per-image colour jitter of the
    # low-res view and its patches alike, optionally each patch in a random orientation
    augment: str = _key("auto", "Training augmentation: {choices}; docs/training.md", OPT_PANEL, choices={
        "auto": "colour+flips for RGB slides, i.e. a tissue mask, else none",
        "none": "", "colour": "HED stain jitter, brightness and contrast",
        "colour+flips": "and every patch flipped or rotated by a multiple of 90 degrees"}, flag=True)
    batch_size: int = _key(0, "Images per step, per process; 0 = auto: 32, or fewer when 32 low-res views (padded "
                           "to the largest height and width when the images differ in size) would exceed 8 M pixels",
                           OPT_PANEL, flag=True)
    epochs: int = _key(20, "Epochs", OPT_PANEL, flag=True)
    # running; "" = random init
    init: str = _key("", "Start from the weights of this checkpoint (fine-tuning, or a curriculum from easier "
                     "data); same networks and classes. Also a run directory, a model directory from ats export "
                     "--hub-ready, or hf-hub:ORG/NAME", RUN_PANEL)
    seed: int = _key(0, "Random seed", RUN_PANEL, flag=True)
    device: str = _key("auto", "auto (CUDA when present, else CPU) | cpu | cuda | cuda:N", RUN_PANEL, flag=True)
    workers: int = _key(-1, "DataLoader worker processes per process; -1 = auto: on CUDA the CPUs this process may "
                              "use, shared among the run's processes on the node (at most 16), on CPU 2", RUN_PANEL,
                              flag=True)
    amp: str = _key("none", "{choices} mixed precision, CUDA only (on CPU: a warning, float32)", RUN_PANEL,
                    choices={"none": "", "bf16": "", "fp16": ""}, flag=True)
    # ordinary images decoded once into tiles + view before the first epoch (ats_cli.data.prepared)
    prepare: bool = _key(True, "Decode PNG/JPEG/... images once before the first epoch into DATA/.ats-prepared (or "
                         "$ATS_PREPARED) and read them patch by patch; the same results; --no-prepare: decode every "
                         "image at every read", RUN_PANEL, flag=True)

    def validate(self) -> TrainConfig:
        problems = []
        positive = ("epochs", "lr", "feature_scale")
        problems += [f"{k} must be > 0 (got {getattr(self, k)})" for k in positive if not getattr(self, k) > 0]
        non_negative = ("batch_size", "entropy", "weight_decay", "clip_norm", "warmup_epochs",
                        "level", "mpp", "feature_lr", "n_patches", "patch_size", "scale", "patch_um",
                        "low_res_um")  # 0: from the data
        problems += [f"{k} must be >= 0" for k in non_negative if getattr(self, k) < 0]
        if self.feature_lr != 1 and self.method == "cnn":
            problems.append(f"feature_lr {self.feature_lr}: method cnn has no feature network (it trains one ResNet)")
        if not 0 <= self.count_floor <= 1 and self.count_floor != -1:
            problems.append(f"count_floor must be in [0, 1], or -1 for auto (got {self.count_floor})")
        if not 0 <= self.eval_count_floor <= 1 and self.eval_count_floor != -1:
            problems.append(f"eval_count_floor must be in [0, 1], or -1 for auto (got {self.eval_count_floor})")
        if self.none_class == "on" and self.pooling != "auto":  # auto: settled below
            if refusal := none_class_refusal(self.pooling, "none_class"):
                problems.append(refusal)
        if self.pooling not in ("features", "auto") and self.method in ("cnn", "deepmil", "ips", "tile-mil"):
            problems.append(f"pooling {self.pooling}: method {self.method} does not pool by attention sampling")
        if self.position_features == "on" and self.method in ("cnn", "deepmil", "ips", "tile-mil"):
            problems.append(f"position_features on: method {self.method} does not pool sampled patches")
        if self.ips_memory < 1 or self.ips_iter < 1 or self.ips_stride < 0:
            problems.append(f"ips_memory and ips_iter must be >= 1 and ips_stride >= 0 (got {self.ips_memory}, "
                            f"{self.ips_iter}, {self.ips_stride})")
        if self.patch_loss < 0 and self.patch_loss != -1:
            problems.append(f"patch_loss must be >= 0, or -1 for auto (got {self.patch_loss})")
        if self.rarity_prior < 0 and self.rarity_prior != -1:
            problems.append(f"rarity_prior must be >= 0, or -1 for auto (got {self.rarity_prior})")
        if self.rarity_cap not in (0, -1) and not self.rarity_cap > 1:
            problems.append(f"rarity_cap must be > 1 (a typical cell's r), 0 for none or -1 for auto (got "
                            f"{self.rarity_cap})")
        if self.feature_store == "on" and self.feature_train not in ("none", "auto"):
            problems.append(f"feature_store on needs a frozen feature net (feature_train none, got "
                            f"{self.feature_train})")
        if self.feature_store == "on" and (self.method not in ("ats", "uniform", "tile-mil")
                                           or (self.levels != 1 and self.method != "ats")):
            problems.append(f"feature_store on: method {self.method} with {self.levels} level(s) has no store "
                            "(ats has, with one level or two; uniform with one; and tile-mil)")
        if self.method == "tile-mil":  # ats_cli.baselines_tilemil: features computed once, of a frozen encoder
            if self.feature_train not in ("none", "auto"):
                problems.append(f"feature_train {self.feature_train}: method tile-mil trains on a frozen encoder's "
                                "stored features (feature_train none)")
            if self.augment not in ("none", "auto"):
                problems.append(f"augment {self.augment}: method tile-mil encodes each tile once and cannot augment "
                                "its tiles (augment none)")
        if self.feature_store_gb < 0:
            problems.append(f"feature_store_gb must be >= 0 (got {self.feature_store_gb})")
        if self.workers < -1:
            problems.append(f"workers must be >= 0, or -1 for auto (got {self.workers})")
        if self.eval_n_patches < 0 and self.eval_n_patches != -1:
            problems.append(f"eval_n_patches must be >= 0, or -1 for auto (got {self.eval_n_patches})")
        if self.min_brightness < 0 and self.min_brightness != -1:
            problems.append(f"min_brightness must be >= 0, or -1 for auto (got {self.min_brightness})")
        if self.scale > 1:
            problems.append(f"scale is the low-res view's scale and must be <= 1 (got {self.scale})")
        if self.level and self.mpp:
            problems.append("give level or mpp, not both")
        problems += self._levels_problems()
        if self.pooling not in allowed_values()["pooling"]:  # a file added to ats_cli/extensions
            discover_extensions()                            # registers it when imported
        for key, allowed in allowed_values().items():
            if getattr(self, key) not in allowed:
                problems.append(f"{key} must be one of {', '.join(allowed)} (got {getattr(self, key)!r})")
        if problems:
            raise ConfigError("invalid configuration: " + "; ".join(problems))
        return self

    def _levels_problems(self) -> list[str]:
        """What is wrong with levels/regions/region_size (ats_cli.core.nested_model)."""
        if self.levels == 1:
            return []
        if self.levels != 2:
            return [f"levels must be 1 or 2 (got {self.levels})"]
        problems = []
        if self.method != "ats":
            problems.append(f"levels 2 needs method ats (got {self.method})")
        if self.regions < 1:
            problems.append(f"regions must be >= 1 (got {self.regions})")
        if self.eval_regions < -1:
            problems.append(f"eval_regions must be >= 0, or -1 for auto (got {self.eval_regions})")
        if self.coarse_px < 1:
            problems.append(f"coarse_px must be >= 1 (got {self.coarse_px})")
        if self.eval_coarse_px < -1:
            problems.append(f"eval_coarse_px must be >= 0, or -1 for auto (got {self.eval_coarse_px})")
        if not self.region_temperature > 0 and self.region_temperature != -1:
            problems.append(f"region_temperature must be > 0, or -1 for auto (got {self.region_temperature})")
        if self.region_size < 0 or self.region_um < 0:
            problems.append("region_size and region_um must be >= 0")
        elif bool(self.region_size) == bool(self.region_um):
            problems.append("levels 2 needs region_size (pixels) or region_um (microns), one of them")
        if self.pooling in COUNTING_POOLINGS:
            problems.append(f"pooling {self.pooling} needs one attention grid; use features, highest or votes with "
                            "levels 2")
        return problems

    @property
    def settled_eval_n_patches(self) -> int:
        """``eval_n_patches`` with auto (-1) read as twice ``n_patches``, as
        :func:`ats_cli.config.settle` settles it (a settled configuration has no -1)."""
        return _at_evaluation(self.eval_n_patches, self.n_patches, "n_patches")[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def input_options(self) -> dict[str, Any]:
        """:func:`ats_cli.data.inputs.open_input`'s reading options (None = its default)."""
        return {"reader": None if self.reader == "auto" else self.reader, "level": self.level or None,
                "mpp": self.mpp or None, "tissue": {"auto": None, "on": True, "off": False}[self.tissue_mask]}


def allowed_values() -> dict[str, tuple[str, ...]]:
    """The fields that take one of a few values, and those values (from the fields' metadata;
    the poolings as registered now: a module may have registered one since)."""
    allowed = {f.name: tuple(f.metadata["choices"]) for f in fields(TrainConfig) if f.metadata.get("choices")}
    allowed["pooling"] = tuple(dict.fromkeys((*allowed["pooling"], *extension_choices("pooling"))))
    return allowed


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON, e.g. a previous run's config.json) file of TrainConfig keys,
    at the top or in a ``[train]`` table (a recipe's form: ats_cli.recipes); a top-level
    ``description`` is a recipe's, not a key."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a readable config file ({e})") from None
    return config_values(text, str(path), json_text=path.suffix == ".json")


def config_values(text: str, where: str, *, json_text: bool = False) -> dict[str, Any]:
    """The TrainConfig keys of a config file's ``text`` (:func:`load_config_file`), each of
    its field's type (an int where a float is wanted is taken); ``where`` names the file in
    the one-line :class:`ConfigError` for a file that is no TOML, an unknown key or a value
    of the wrong type."""
    try:
        values = json.loads(text) if json_text else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: not a valid config file ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: not a valid config file (not a table of keys)")
    values = values.get("train", values)  # allow a [train] table
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: [train] must be a table of keys")
    values = {k: v for k, v in values.items() if k != "description"}
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))} "
                          "(docs/configuration.md)")
    try:
        return typed_values(values)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def typed_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each of its field's type (an int where a float is wanted becomes one);
    raises ConfigError naming the first key of another type."""
    types = {f.name: type(f.default) for f in fields(TrainConfig)}
    out = dict(values)
    for k, v in values.items():
        want = types[k]
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            out[k] = float(v)
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"config key {k!r} must be {want.__name__}, got {v!r}")
    return out


# ================================================ settling: the values left to the data
# what n_patches, patch_size and scale become when neither the user nor the dataset says: the paper's Megapixel MNIST
DATA_DEFAULTS: dict[str, Any] = {"n_patches": 10, "patch_size": 50, "scale": 0.12}
AUTO_MIN_BRIGHTNESS = 0.15  # min_brightness auto on a black background (docs/training.md)
AUTO_RARITY_PRIOR = 2.0  # rarity_prior auto on slides and photographs (docs/training.md)
AUTO_PATCH_LOSS = 1.0  # patch_loss auto on photographs (_patch_loss)
PRETRAINED_FACTS = ("pretrained", "no_pretrained", "init_feature_net")  # DataFacts of the weights (_pretrained_facts)
GAIN_LATE_START = 0.5  # patch_gain late: the gain trains from this fraction of --epochs (_patch_gain says why)
# levels 2: rarity_prior (on slides), rarity_cap and region_temperature auto (and
# patch_gain late: _patch_gain). Where a two-level model's coarse attention starts decides
# whether training gets a signal at all: at initialisation the coarse net adds nothing (its
# last layer is zero), so the coarse attention is the prior's, and on a large slide the
# region that decides the label is one of thousands, its object perhaps one coarse pixel.
# The one-level auto (prior 2, a region scored by the log-mean-exp of its cells, t = 1)
# leaves that region a share of the mass among thousands; t = 0.1 scores a region near its
# most unusual cell, and a prior of 10 moves more mass there, but uncapped it hands nearly
# all of it to the single most unusual region (the estimate is then one region's and
# training stalls); capped at 4.5 (every cell at least 4.5 times as unusual as the typical
# one starts alike) the mass spreads over the slide's unusual regions, the nests' among them.
# Figures: benchmarks/slides.md#the-coarse-attentions-start-rarity-prior-cap-and-region-temperature.
TWO_LEVEL_RARITY_PRIOR, TWO_LEVEL_RARITY_CAP, TWO_LEVEL_REGION_TEMPERATURE = 10.0, 4.5, 0.1


@dataclass(frozen=True)
class Reason:
    """One settled value and why: ``str()`` is the line ``ats train`` prints."""

    key: str
    value: Any
    why: str

    def __str__(self) -> str:
        value = f"{self.value:g}" if isinstance(self.value, float) else self.value
        return f"{self.key} {value}: {self.why}"


@dataclass(frozen=True)
class Settled:
    """``config``: the flags with every value left to the data decided (the model spec is
    made from it); ``mpp``: the microns per pixel of the model's patches, None when unknown
    (predict then reads slides by level); ``facts``: what they were decided from, with the
    look at the images when :func:`settle` took one (``RUN/settled.json`` saves them)."""

    config: TrainConfig
    mpp: float | None
    facts: DataFacts


def settle(flags: TrainConfig, facts: DataFacts, *,
           probe: Callable[[DataFacts, float, int], DataFacts] | None = None) -> tuple[Settled, list[Reason]]:
    """Decide every value ``flags`` leaves to the data from ``facts``; pure. The reasons
    come in the order decided, a value given by the user as "given". Raises ConfigError
    for settings that cannot hold together (microns without a microns per pixel, two
    forms of one setting that disagree).

    ``probe``: where the facts do not hold the look at the first training images yet and
    a value is left to them (:func:`looks_at_images`), ``probe(facts, scale, patch_size)``
    gives the facts with it (:func:`ats_cli.data.facts.probe_images`), called once the
    sizes are decided from the headers, at the view scale and patch size they give: the
    images are read as training will read them. The rules after it see its facts, which
    :attr:`Settled.facts` returns (:func:`settle_data`)."""
    mpp, reasons = _model_mpp(flags, facts)
    out: dict[str, Any] = {}

    def decide(key: str, value: Any, why: str) -> None:
        out[key] = value
        reasons.append(Reason(key, value, why))

    for key in DATA_DEFAULTS:
        decide(key, *_size(key, flags, facts, mpp))
    decide("batch_size", *_batch_size(flags, facts, _settled_view_scale(replace(flags, **out), mpp)))
    decide("eval_n_patches", *_at_evaluation(flags.eval_n_patches, out["n_patches"], "n_patches"))
    if flags.levels == 2:
        decide("eval_regions", *_at_evaluation(flags.eval_regions, flags.regions, "regions"))
        decide("eval_coarse_px", *_eval_coarse_px(flags))
    if probe is not None and looks_at_images(flags):
        sized = replace(flags, **out)
        facts = probe(facts, view_scale(sized, mpp), sized.patch_size)
    decide("min_brightness", *_min_brightness(flags, facts))
    decide("augment", *_augment(flags, facts))
    decide("rarity_prior", *_rarity_prior(flags, facts))
    decide("rarity_cap", *_rarity_cap(flags, out["rarity_prior"]))
    decide("patch_loss", *_patch_loss(flags, facts))
    if flags.levels == 2:
        decide("region_temperature", *_region_temperature(flags))
    decide("patch_gain", *_patch_gain(flags, facts))
    decide("feature_net", *_feature_net(flags, facts))
    decide("feature_train", *_feature_train(flags, facts))
    decide("feature_store", *_feature_store(flags, facts, out["feature_train"], out["augment"]))
    decide("position_features", *_position_features(flags, facts))
    decide("pooling", *_pooling(flags, facts))
    decide("none_class", *_none_class(flags, facts, out["pooling"]))
    decide("count_floor", *_count_floor(flags, facts, out["pooling"]))
    decide("eval_count_floor", *_eval_count_floor(flags, facts, out["pooling"], out["count_floor"]))
    return Settled(replace(flags, **out).validate(), mpp, facts), reasons


def _pretrained_facts(flags: TrainConfig, channels: int, init_feature_net: str = "") -> dict[str, str]:
    """``pretrained``, ``no_pretrained`` and ``init_feature_net`` of :class:`DataFacts`: where
    the feature net's pretrained weights come from. For ``--feature-net auto`` on RGB images,
    whether :data:`PRETRAINED_FEATURE_NET`'s can be had now: the cache is read, and the
    network asked at most once, for :data:`ats_cli.nets.encoders.PROBE_SECONDS`. A
    ``timm:``/``torchvision:`` name whose own weights cannot be had is refused here
    (:class:`~ats_cli.nets.encoders.HubUnavailableError`), before the data is prepared."""
    from ats_cli.nets.encoders import check_weights_can_be_had, pretrained_availability, pretrained_source

    if flags.feature_net != "auto":
        if flags.feature_weights == "auto" and not flags.init:  # a timm/torchvision name's own: refused now if
            check_weights_can_be_had(flags.feature_net)          # they cannot be had, not after preparing the data
        return {"pretrained": pretrained_source(flags.feature_net, flags.feature_weights)}
    if flags.init and flags.method != "cnn":  # read from the checkpoint by the caller (ats_cli.train)
        return {"init_feature_net": init_feature_net}
    if flags.feature_weights != "auto":
        return {"pretrained": pretrained_source(RANDOM_FEATURE_NET, flags.feature_weights)}
    if channels != 3 or flags.method == "cnn":
        return {}
    where, why_not = pretrained_availability(PRETRAINED_FEATURE_NET)
    return {"pretrained": where, "no_pretrained": why_not}


def settle_data(flags: TrainConfig, data: Dataset, *, view_cache: Any = None,
                agree: Callable[[DataFacts], DataFacts] | None = None, init_feature_net: str = ""
                ) -> tuple[Settled, list[Reason]]:
    """:func:`settle` ``flags`` on ``data``: its hints and headers read
    (:func:`ats_cli.data.facts.read_facts`), then the one settle, which looks at the first
    training images where a value is left to them (:func:`ats_cli.data.facts.probe_images`,
    through ``view_cache``, where a slide's low-res view is then ready for training).
    Deterministic, so every process of a run settles alike, but for where the pretrained
    weights can be had (the cache, the network): ``agree`` hands every process rank 0's.
    ``init_feature_net``: with ``init``, the feature net that checkpoint's spec names."""
    hinted, ignored = read_hints(data.hints)
    facts = read_facts(flags, data, hinted=hinted, ignored_hints=ignored)
    facts = replace(facts, **_pretrained_facts(flags, hinted.get("channels", 1), init_feature_net))
    if agree is not None:
        facts = agree(facts)

    def probe(facts: DataFacts, scale: float, patch_size: int) -> DataFacts:
        return probe_images(facts, flags, data, scale=scale, patch_size=patch_size, view_cache=view_cache)

    return settle(flags, facts, probe=probe)


# ---------------------------------------------------------------------------- the rules


def _um(v: float) -> str:
    return f"{v:.3g} µm/px"


def _model_mpp(flags: TrainConfig, facts: DataFacts) -> tuple[float | None, list[Reason]]:
    """The microns per pixel the model records (ats_cli.data.inputs says what for):
    --mpp, every training file is then read at it; else the training files' own when all
    record one and they agree; else none. Nothing to say for images without microns.
    A --mpp outside the plausible range is refused by name (:func:`check_mpp_flag`)."""
    check_mpp_flag(flags.mpp)
    unknown = f"scale unknown: {facts.scale_unknown}" if facts.scale_unknown else ""
    if flags.mpp:
        if facts.no_mpp:
            raise ConfigError(f"{facts.no_mpp}: records no microns per pixel, so it cannot be read at --mpp "
                              f"{flags.mpp:g} ({facts.files - len(facts.mpps)} of {facts.files} training files do "
                              "not" + (f"; {unknown}" if unknown else "") + ")")
        return flags.mpp, [Reason("mpp", _um(flags.mpp), "given: every training slide is read at it")]
    if facts.mpps_agree:
        mpp = facts.mpps[len(facts.mpps) // 2]
        return mpp, [Reason("mpp", _um(mpp), f"the training slides' own ({facts.files} of {facts.files} record it)")]
    if not facts.mpps:
        if not facts.unscaled:  # images that are not slides: pixels are all they have, nothing to say
            return None, []
        # slides or TIFFs without a scale (a tool's 72 dpi: ats_cli.data.tiff_meta.not_a_microscope_scale):
        # said once, as ats info says it, so a user who expected microns learns they are pixels
        why = unknown or "the training slides and TIFFs record no microns per pixel"
        return None, [Reason("mpp", "none", f"{why}; read as pixels ({facts.unscaled} of {facts.files} training "
                                            "files record no scale); predict reads slides by level")]
    if facts.no_mpp:
        why = f"{facts.files - len(facts.mpps)} of {facts.files} training files record no microns per pixel" + \
            (f" ({unknown})" if unknown else "")
    else:
        why = (f"the training slides range from {_um(facts.mpps[0])} to {_um(facts.mpps[-1])} (give --mpp to "
               "train at one physical scale; slides are resampled to it)")
    return None, [Reason("mpp", "none", why + "; predict reads slides by level")]


def _size(key: str, flags: TrainConfig, facts: DataFacts, mpp: float | None) -> tuple[Any, str]:
    """n_patches, patch_size, scale: given, else (patch_size, scale) from microns, else the
    dataset's hint (a generator knows its images), else DATA_DEFAULTS. With the microns per
    pixel known, the reason says what the pixels cover."""
    given = getattr(flags, key)
    microns = {"patch_size": flags.patch_um, "scale": flags.low_res_um}.get(key, 0.0)
    if microns:
        value, why = _from_microns(key, microns, given, mpp)
    elif given:
        value, why = given, "given"
    elif key in facts.hints:
        value, why = type(DATA_DEFAULTS[key])(facts.hints[key]), "dataset.json hint"
    elif facts.long_side:
        value, why = sizes_for(facts.long_side)[key]
    else:
        value, why = DATA_DEFAULTS[key], "default (the paper's Megapixel MNIST)"
    if mpp is not None and key == "patch_size":
        why += f"; {value * mpp:.3g} µm"
    if mpp is not None and key == "scale":
        why += f"; a low-res pixel is {_um(mpp / value)}"
    return value, why


# where neither the user nor the dataset says (sizes_for): a 180-pixel low-res view, the paper's
# (1500 px at 0.12, thesis 3.4.1); patches of 1/16 of the long side, within 32-128 px; 32 of them
VIEW_SIDE, PATCH_SHARE, PATCH_MIN, PATCH_MAX, AUTO_N_PATCHES = 180, 16, 32, 128, 32


def sizes_for(long_side: int) -> dict[str, tuple[Any, str]]:
    """n_patches, patch_size and scale, each with its reason, for images whose long side is
    typically ``long_side`` pixels, where neither the user nor the dataset says.

    The view: 180 pixels on the long side, what the paper's attention net reads (its cost
    grows with the view). The patches: what they cover decides whether training starts at
    all. The attention starts near uniform, so at first the share of the image the drawn
    patches cover is the share of small objects they show, and the feature net learns the
    objects only from those (ats_cli.diagnose; ATSModel.patch_nll): the paper's 10 patches
    of 1/30 of the side cover under 2% of an image, too little to start on small objects
    (benchmarks/README.md#first-tries-on-real-pixels). So: patches of 1/16 of the side, rounded to 8 pixels, from 32
    (smaller shows too little to classify) to 128 (a CPU step grows with the patch's area),
    and 32 of them: 32/16² = 12.5% of a square image. ``ats info`` prints the same values
    for a file or a folder, and ``ats train`` settles them."""
    scale = min(1.0, round(VIEW_SIDE / long_side, 4))
    patch = min(long_side, int(min(PATCH_MAX, max(PATCH_MIN, 8 * round(long_side / PATCH_SHARE / 8)))))
    typical = f"the training images' typical long side is {long_side} px"
    return {"n_patches": (AUTO_N_PATCHES, f"{AUTO_N_PATCHES} patches of 1/{PATCH_SHARE} of the side cover "
                                          f"{AUTO_N_PATCHES / PATCH_SHARE ** 2:.1%} of a square image"),
            "patch_size": (patch, f"{typical}: 1/{PATCH_SHARE} of it (within {PATCH_MIN}-{PATCH_MAX})"),
            "scale": (scale, f"{typical}: a {round(long_side * scale)}-px low-res view, as the paper's 180 of 1500")}


def _from_microns(key: str, microns: float, given: float, mpp: float | None) -> tuple[int | float, str]:
    """A patch side in microns as pixels, or a low-res pixel in microns as a scale, at
    ``mpp``. The pixel form may be given too when the two agree (a resumed run's
    config.json holds both)."""
    flag = {"patch_size": "--patch-um", "scale": "--low-res-um"}[key]
    if mpp is None:
        raise ConfigError(f"{flag} {microns:g} needs the microns per pixel: give --mpp, or train on slides that all "
                          "record the same one")
    if key == "patch_size":
        size = patch_pixels(microns, mpp)  # under one pixel or over the pixel budget: refused by name
        if given and given != size:
            raise ConfigError(f"{flag} {microns:g} is {size} pixels at {_um(mpp)}, --patch-size is {given}: give one "
                              "of them")
        return size, f"{flag} {microns:g} at {_um(mpp)}"
    scale = mpp / microns
    if scale > 1:
        raise ConfigError(f"{flag} {microns:g} is finer than the patches' {_um(mpp)}: the low-res view cannot have "
                          "more detail than the patches")
    if given and abs(given - scale) > 1e-6 * scale:
        raise ConfigError(f"{flag} {microns:g} is a scale of {scale:.6g} at {_um(mpp)}, --scale is {given:g}: give "
                          "one of them")
    return scale, f"{flag} {microns:g} at {_um(mpp)}"


AUTO_BATCH = 32  # --batch-size auto for images of one size
AUTO_VIEW_PIXELS = 8_000_000  # --batch-size auto: at most this many low-res view pixels a step
# --batch-size auto on a small dataset: at least this many steps an epoch (in batches of at
# least MIN_STEP_BATCH). At 32 a step, 144 training images make 5 steps an epoch: the
# attention of a small-object task needs tens of steps to leave its start
# (benchmarks/README.md#first-tries-on-real-pixels), which a small dataset must not also lack.
AUTO_MIN_STEPS, MIN_STEP_BATCH = 16, 4


def _batch_size(flags: TrainConfig, facts: DataFacts, scale: float) -> tuple[int, str]:
    """AUTO_BATCH (the thesis's 32 at the paper spec), unless the dataset is small (at least
    AUTO_MIN_STEPS steps an epoch) or the views are large: the
    attention net's activations grow with the view (a step's memory at 1/64 of a 100k slide,
    1,562² views, two levels or one: benchmarks/slides.md#how-coarse-a-view-may-be-and-still-show-a-nest),
    so 32 such views in one step would not fit a workstation; at most AUTO_VIEW_PIXELS view
    pixels a step keeps a step's memory bounded whatever the slide's size. (The size is the
    header's, before any resampling to --mpp: an overestimate for slides read coarser.)

    Images of different sizes and aspect ratios share a step: their views are padded
    bottom/right to the largest height and width, and the model keeps the padding out of
    the attention and runs the attention net on each image's own view, so each image gets
    what it gets alone (:meth:`ats_cli.core.model.ATSModel.forward`). The bound then counts
    the padded views: the largest height times the largest width (more than any one image
    when one is tall and another wide). A two-level model, Deep MIL and the CNN take views
    of one size only: with them a dataset of mixed sizes still trains one image per step."""
    if flags.batch_size:
        return flags.batch_size, "given"
    shown = ", ".join(facts.sizes) + (", ..." if facts.n_sizes > len(facts.sizes) else "")
    if facts.n_sizes > 1 and (flags.levels != 1 or flags.method not in ("ats", "uniform")):
        who = "two levels" if flags.levels != 1 else f"method {flags.method}"
        return 1, (f"the training images come in {facts.n_sizes} sizes ({shown}) and {who} stacks views of one size "
                   "only: one image per step")
    if facts.n_sizes < 1:
        return AUTO_BATCH, "the default"
    if facts.n_sizes == 1:
        what = f"every training image is {facts.sizes[0]}"
        frame = facts.pixels
    else:  # an older settled.json has no frame: the largest image stands for it
        frame = facts.frame_h * facts.frame_w or facts.pixels
        what = (f"the training images come in {facts.n_sizes} sizes ({shown}), their views padded to the largest "
                f"height and width" + (f" ({facts.frame_h}x{facts.frame_w})" if facts.frame_h else ""))
    view = frame * scale * scale
    fits = int(AUTO_VIEW_PIXELS // view) if view else AUTO_BATCH
    steps = max(MIN_STEP_BATCH, facts.files // AUTO_MIN_STEPS) if facts.files else AUTO_BATCH
    if min(fits, steps) >= AUTO_BATCH:
        return AUTO_BATCH, what
    if steps < fits:
        return steps, (f"{what}; {facts.files} training images: {AUTO_MIN_STEPS} steps an epoch (a small dataset "
                       "would otherwise train in a few steps)")
    return max(1, fits), (f"{what}, its low-res view {view / 1e6:.2g} M pixels: at most "
                          f"{AUTO_VIEW_PIXELS / 1e6:g} M a step (memory)")


def _settled_view_scale(sizes: TrainConfig, mpp: float | None) -> float:
    """:func:`view_scale` of a configuration whose sizes are settled; ``--scale`` where the
    levels cannot be read yet (their error is raised when the model is made)."""
    try:
        return view_scale(sizes, mpp)
    except ValueError:
        return sizes.scale


def _at_evaluation(given: int, trained: int, name: str) -> tuple[int, str]:
    """Draws at evaluation and prediction (``eval_n_patches``, ``eval_regions``), auto (-1)
    twice the training count ``trained``: more draws cost no memory for gradients and cut
    the estimator's noise, and the estimate stays unbiased for any count; for patches,
    twice is where docs/training.md found the gain to end; for a two-level model's regions,
    where a slide holds more look-alike regions than k, more draws find the one that
    decides the label."""
    if given != -1:
        return given, "given" + (" (as many as in training)" if given == 0 else "")
    return 2 * trained, f"twice {name}"


def _baseline(flags: TrainConfig) -> str:
    """Why a baseline (--method other than ats) gets the thesis's settings: it samples and
    trains as the thesis's did, everywhere (ips as its own paper's, tile-mil as CLAM-SB's); "" for ats."""
    if flags.method == "ips":
        return "method ips selects and trains as its paper (Bergner et al. 2023) does"
    if flags.method == "tile-mil":
        return "method tile-mil tiles, encodes and trains as CLAM-SB (Lu et al. 2021) does"
    return f"method {flags.method} samples and trains as the thesis's baselines" if flags.method != "ats" else ""


def _looked(facts: DataFacts) -> str:
    """Slides or not, and what says so."""
    if not facts.probed:
        return "not slides: no training image was looked at"
    kind = "slides" if facts.slides else "not slides"
    return f"{kind}: a tissue mask on {facts.masked} of the first {facts.probed} training images"


def _min_brightness(flags: TrainConfig, facts: DataFacts) -> tuple[float, str]:
    """A black background (most low-res pixels dark, as in Megapixel MNIST, astronomy or
    fluorescence) gets a brightness support, so the attention never wastes draws on empty
    canvas; anything else (photographs, slides on white glass, which the tissue mask
    handles) none."""
    if flags.min_brightness != -1:
        return flags.min_brightness, "given"
    if _baseline(flags):
        return 0.0, _baseline(flags)
    if not facts.probed:
        return 0.0, "no training image was looked at"
    dark = f"{facts.dark:.0%} of the low-res pixels dark in the first {facts.probed} training images (median)"
    if facts.dark > 0.5:
        return AUTO_MIN_BRIGHTNESS, f"a black background, {dark}: only brighter cells are sampled"
    return 0.0, f"no black background, {dark}"


def _augment(flags: TrainConfig, facts: DataFacts) -> tuple[str, str]:
    """RGB slides get colour+flips: stain and exposure vary between slides and tissue has
    no "up". Anything else none: turning a patch changes what a digit means (6 and 9), and
    other images have no stain to jitter."""
    if flags.augment != "auto":
        return flags.augment, "given"
    if _baseline(flags):
        return "none", _baseline(flags)
    if facts.slides and facts.channels == 3:
        return "colour+flips", f"RGB {_looked(facts)}; stain, exposure and orientation vary"
    return "none", ("grey " if facts.slides else "") + _looked(facts)


def _rarity_prior(flags: TrainConfig, facts: DataFacts) -> tuple[float, str]:
    """Slides: the few regions that decide a label are lost among thousands of cells, and
    uniform draws never meet them, so the attention starts on the tissue's unusual cells
    (ATSModel.prior); with two levels more strongly (TWO_LEVEL_RARITY_PRIOR). On a
    black canvas the brightness support already does that job."""
    if flags.rarity_prior != -1:
        return flags.rarity_prior, "given"
    if _baseline(flags):
        return 0.0, _baseline(flags)
    if facts.slides and flags.levels == 2:
        return TWO_LEVEL_RARITY_PRIOR, f"{_looked(facts)}; two levels: the coarse attention starts on the regions " \
                                       "holding unusual cells"
    if facts.slides:
        return AUTO_RARITY_PRIOR, f"{_looked(facts)}; the attention starts on the unusual cells"
    if _photos(facts):
        return AUTO_RARITY_PRIOR, f"{_looked(facts)}, no black background: the attention starts on the cells " \
                                  "unusual in their image, where small objects stand out"
    return 0.0, _looked(facts) + ("; a black background: the brightness support finds the objects"
                                  if facts.probed else "")


def _photos(facts: DataFacts) -> bool:
    """Images looked at that are neither slides (a tissue mask) nor on a black canvas (the
    brightness support, :func:`_min_brightness`): photographs, where the few objects that
    decide a label are lost among thousands of cells of texture, and nothing else brings the
    first draws to them: a uniform attention's patches rarely show them, and with neither the
    rarity prior nor the per-patch loss (:func:`_patch_loss`) the attention stayed uniform
    at chance (benchmarks/README.md#first-tries-on-real-pixels)."""
    return bool(facts.probed) and not facts.slides and facts.dark <= 0.5


def _patch_loss(flags: TrainConfig, facts: DataFacts) -> tuple[float, str]:
    """patch_loss auto: AUTO_PATCH_LOSS on photographs (:func:`_photos` says why;
    ATSModel.patch_nll what it does), else off: on a black canvas and on slides the support
    and the tissue mask already bring most draws to the objects, and their figures were
    made without it."""
    if flags.patch_loss != -1:
        return flags.patch_loss, "given"
    if _baseline(flags):
        return 0.0, _baseline(flags)
    if _photos(facts):
        return AUTO_PATCH_LOSS, "photographs: each drawn patch also learns its image's label, so the few patches " \
                                "that show a small object teach the feature net at full strength"
    return 0.0, _looked(facts) + ("" if facts.slides or not facts.probed else "; a black background")


def _rarity_cap(flags: TrainConfig, prior: float) -> tuple[float, str]:
    """rarity_cap auto: TWO_LEVEL_RARITY_CAP with two levels, else none: the one-level
    prior of 2 is not large enough to hand one cell the mass."""
    if flags.rarity_cap != -1:
        return flags.rarity_cap, "given"
    if not prior:
        return 0.0, "no rarity prior"
    if flags.levels == 2:
        return TWO_LEVEL_RARITY_CAP, "two levels: every cell at least this unusual starts alike, so the coarse " \
                                     "attention spreads over the unusual regions instead of the single most unusual"
    return 0.0, "none: one level"


def _eval_coarse_px(flags: TrainConfig) -> tuple[int, str]:
    """eval_coarse_px: given, or auto (-1, left for the end of training to settle: it
    needs the trained model; ats_cli.train.choose_coarse_view)."""
    if flags.eval_coarse_px != -1:
        return flags.eval_coarse_px, "given" + (" (as in training)" if flags.eval_coarse_px == 0 else "")
    return -1, (f"auto: after the last epoch best.pt is evaluated with a coarse view of {2 * flags.coarse_px} px a "
                "region (twice coarse_px) and keeps it where the held-out split scores better so")


def _region_temperature(flags: TrainConfig) -> tuple[float, str]:
    """region_temperature auto: TWO_LEVEL_REGION_TEMPERATURE, a region scored near its
    largest coarse cell (ats_cli.core.nested.region_scores)."""
    if flags.region_temperature != -1:
        return flags.region_temperature, "given"
    return TWO_LEVEL_REGION_TEMPERATURE, "a region is scored near its most telling coarse cell, not the mean of " \
                                         "its thousands"


def _patch_gain(flags: TrainConfig, facts: DataFacts) -> tuple[str, str]:
    """Slides: a label decided by one small region among look-alikes the attention cannot
    tell apart (ATSModel's docstring), so one patch that shows the class may outweigh them.
    Anything else off, so that a label that counts objects weighs each alike.

    Two levels on slides: late. Where the signal comes late (a nest of a 100k² slide is a
    tenth of the pooled weight at the start), the cheapest way to lower a loss that has
    nothing to say yet is to shrink every logit, and a gain trained from the start does it
    at once: it falls towards 0 for every patch in the first epoch, scaling the feature
    net's gradient with it, and the run stays at chance (a floor under the gain only leaves
    it on the floor). Trained once the feature net tells nests apart, the gain rises on
    nests and stays near 1 elsewhere: the coarse attention, which cannot tell a nest's
    region from a decoy's, leaves a nest a fraction of the estimate, and the gain lifts it.
    Half of the epochs: at 100k² the feature net told nests apart well before that. Figures,
    with the gain off for comparison: benchmarks/slides.md#accuracy-at-100k²."""
    if flags.patch_gain != "auto":
        return flags.patch_gain, "given"
    if _baseline(flags):
        return "off", _baseline(flags)
    if facts.slides and flags.levels == 2:
        return "late", f"{_looked(facts)}; two levels: trained from the start, the gain switched every patch " \
                       "off before the first signal (100k² slides); from half-way it lifts the patches that " \
                       "show the class"
    if facts.slides:
        return "on", f"{_looked(facts)}; one region showing the class can outweigh the look-alikes"
    return "off", f"{_looked(facts)}; each object weighs alike"


# ---------------------------------------------------------------------------- reading and recording


def looks_at_images(flags: TrainConfig) -> bool:
    """Whether settling ``flags`` needs the look at the first training images."""
    auto = flags.min_brightness == -1 or flags.rarity_prior == -1 or flags.patch_loss == -1 or \
        "auto" in (flags.augment, flags.patch_gain)
    return auto and flags.method == "ats"


def usable_hints(hints: Mapping[str, Any]) -> dict[str, float]:
    """dataset.json's n_patches, patch_size and scale hints that are positive numbers;
    of a list (``patch_size: [64, 64]``) the first value."""
    usable = {}
    for key in DATA_DEFAULTS:
        hint = hints.get(key)
        hint = hint[0] if isinstance(hint, list) and hint else hint
        if _is_number(hint) and hint > 0:
            usable[key] = hint
    return usable


# the hints ats train reads (read_hints), and those a dataset.json may carry for people to read
HINT_KEYS = (*DATA_DEFAULTS, "channels", "position_features", "pooling", "none_class", "count_floor",
             "eval_count_floor")
INFORMATIVE_HINTS = ("image_size", "mpp")


def read_hints(hints: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """:class:`DataFacts`' hint fields from dataset.json's ``hints``, and one line for each
    hint read as no hint: a key ats train does not know (a misspelt ``poolng`` would else
    leave the run at the default without a word) or a value it cannot use."""
    usable = usable_hints(hints)
    position, pooling = hints.get("position_features"), hints.get("pooling")
    none_class = hints.get("none_class")
    out = {"hints": usable,
           "position_hint": position if position in ("on", "off") else "",
           "pooling_hint": pooling if pooling in extension_choices("pooling") else "",
           "none_class_hint": none_class if none_class in ("on", "off") else "",
           **{f"{key}_hint": _share_hint(hints.get(key)) for key in ("count_floor", "eval_count_floor")}}
    wants = {**{key: "a positive number" for key in DATA_DEFAULTS if key not in usable},
             **({} if out["position_hint"] else {"position_features": '"on" or "off"'}),
             **({} if out["pooling_hint"] else {"pooling": "one of " + ", ".join(extension_choices("pooling"))}),
             **({} if out["none_class_hint"] else {"none_class": '"on" or "off"'}),
             **{key: "a number in [0, 1]" for key in ("count_floor", "eval_count_floor") if out[f"{key}_hint"] < 0}}
    channels = hints.get("channels", 1)
    if _is_number(channels) and channels == int(channels) and channels >= 1:
        out["channels"] = int(channels)
    else:
        wants["channels"] = "a whole number >= 1"
    ignored = []
    for key, value in hints.items():
        if key not in (*HINT_KEYS, *INFORMATIVE_HINTS):
            ignored.append(f"dataset.json hint {key!r} ignored: not one ats train reads ({', '.join(HINT_KEYS)})")
        elif key in wants:
            ignored.append(f"dataset.json hint {key} {json.dumps(value)} ignored: not {wants[key]}")
    return out, tuple(ignored)


def _share_hint(value: Any) -> float:
    """A hint that is a share of the attention (a count floor): the number in [0, 1], else -1 (no hint)."""
    return float(value) if _is_number(value) and 0 <= value <= 1 else -1.0


def _is_number(value: Any) -> bool:
    """A JSON number (not a bool, which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _feature_net(flags: TrainConfig, facts: DataFacts) -> tuple[str, str]:
    """--feature-net auto: RGB images start from :data:`PRETRAINED_FEATURE_NET`, an encoder
    pretrained on ImageNet, when its weights can be had (in the cache, or downloadable now:
    :func:`settle_data` asks, :func:`ats_cli.nets.encoders.pretrained_availability`), as
    the peers start (IPS and CLAM from ImageNet-pretrained ResNets): a random feature net
    gives the attention's first gradients little to go on. Else :data:`RANDOM_FEATURE_NET`
    from random weights, the default before, which is what runs offline (the tests, the
    demo, CI), and on grey images (Megapixel MNIST), for which the ImageNet encoders are not
    made. With ``init`` the checkpoint's net (its weights are taken); with
    ``--feature-weights`` other than auto, the random-initialised net they load into.

    Why ConvNeXt-atto (timm ``convnext_atto.d2_in1k``): the smallest of the usual
    ImageNet encoders that transfer well, for CPU and GPU users alike: 3.4 M parameters (a
    14 MB download, 320 features), better on ImageNet than ResNet-18 at a third of its size
    and cheaper a patch on a CPU; layer norms, so no batch-norm statistics tie a patch's
    feature to the others drawn."""
    if flags.feature_net != "auto":
        return flags.feature_net, "given"
    if flags.method == "cnn":
        return RANDOM_FEATURE_NET, "method cnn has no feature net (a ResNet-18 reads the low-res view)"
    if flags.init:
        return facts.init_feature_net or RANDOM_FEATURE_NET, f"the feature net of init {flags.init}"
    if flags.feature_weights != "auto":
        return RANDOM_FEATURE_NET, f"--feature-weights {flags.feature_weights} are loaded into it"
    if facts.channels != 3:
        return RANDOM_FEATURE_NET, (f"{facts.channels}-channel images, not RGB: random weights (the pretrained "
                                    "encoders are ImageNet's, for photographs)")
    if facts.pretrained:
        return PRETRAINED_FEATURE_NET, f"RGB images, and {facts.pretrained}: a pretrained encoder"
    why = facts.no_pretrained or f"no pretrained weights for {PRETRAINED_FEATURE_NET} were looked for"
    return RANDOM_FEATURE_NET, (f"{why}: starting the feature net from random weights; to use them, run once "
                                "where huggingface.co can be reached (they are then cached) or give "
                                f"--feature-net {PRETRAINED_FEATURE_NET} --feature-weights FILE "
                                "(docs/training.md#pretrained-encoders)")


def _feature_train(flags: TrainConfig, facts: DataFacts) -> tuple[str, str]:
    """feature_train auto: frozen (none) when the feature net starts from pretrained
    weights (hundreds of labels cannot move millions of weights well, and a frozen net costs
    no gradient memory: docs/training.md), else all of it trains (from ``init``'s weights
    at ``feature_lr``, when given)."""
    if flags.feature_train != "auto":
        return flags.feature_train, "given"
    if flags.method == "tile-mil":
        return "none", "method tile-mil: a frozen encoder's features, computed once per tile"
    if facts.pretrained:
        return "none", f"the feature net starts from pretrained weights ({facts.pretrained}): frozen"
    if flags.init:  # fine-tuning or a curriculum: feature_lr sets how fast it moves
        pace = "frozen (feature_lr 0)" if flags.feature_lr == 0 else f"trains at {flags.feature_lr:g} x --lr"
        return "all", f"the feature net starts from init {flags.init}: {pace}"
    return "all", "the feature net starts from random weights: all of it trains"


def _feature_store(flags: TrainConfig, facts: DataFacts, feature_train: str, augment: str) -> tuple[str, str]:
    """feature_store auto: on when what it keeps can be read back. The feature net must be
    frozen (a trained one computes another feature every step); pretrained or exported,
    because a frozen random net is an experiment, not a recipe worth disk; and no
    augmentation, whose new pixels at every draw would never be met again
    (:mod:`ats_cli.data.features`)."""
    if flags.feature_store != "auto":
        return flags.feature_store, "given"
    if flags.method == "tile-mil":  # the method's point: every tile encoded once, whatever the encoder
        return "on", "method tile-mil: each tile's feature is computed once, then read back"
    if flags.method not in ("ats", "uniform") or (flags.levels != 1 and flags.method != "ats"):
        return "off", (f"method {flags.method}" if flags.method not in ("ats", "uniform") else "two levels") + \
            ": not for this model"
    if feature_train != "none":
        return "off", f"feature_train {feature_train}: the features change as the net trains"
    if not facts.pretrained:
        return "off", "the frozen feature net is not a pretrained or exported one"
    if augment != "none":
        return "off", f"augment {augment}: augmented patches are new pixels at every draw"
    return "on", "a frozen pretrained encoder and no augmentation: each patch is encoded once"


def _position_features(flags: TrainConfig, facts: DataFacts) -> tuple[str, str]:
    """position_features auto: the dataset's hint, which only its maker can know (a label
    that depends on where things are, as IPS's top-most digit, cannot be read from what the
    patches show: benchmarks/accuracy.md#what-each-default-brought), else off, the thesis's model."""
    if flags.position_features != "auto":
        return flags.position_features, "given"
    if _baseline(flags):
        return "off", _baseline(flags)
    if facts.position_hint:
        return facts.position_hint, "dataset.json hint (the label depends on where things are)"
    return "off", "no dataset.json hint: what a patch shows, not where"


def _pooling(flags: TrainConfig, facts: DataFacts) -> tuple[str, str]:
    """--pooling auto: the dataset's hint, which only its maker can know (a label that is
    the highest class present, as IPS's largest digit, is a rule the readouts of ``highest``
    and ``highest-counts`` apply: :mod:`ats_cli.extensions.pooling_highest`; the class of the
    top-most object, as IPS's top-most digit, one ``topmost-counts`` applies:
    :mod:`ats_cli.extensions.pooling_topmost`), else features, the thesis's. Those rules read
    one label per image, so a multi-label dataset refuses them (:data:`RULE_POOLINGS`)."""
    if flags.pooling != "auto":
        value, why = flags.pooling, "given"
    elif _baseline(flags):
        return "features", _baseline(flags)
    elif facts.pooling_hint:
        value, why = facts.pooling_hint, "dataset.json hint (the label is a rule over the objects present)"
    else:
        return "features", "no dataset.json hint: the pooled features, then the classifier (the thesis)"
    if value in RULE_POOLINGS and facts.multilabel:
        raise ConfigError(f"pooling {value} ({why}) reads one label per image, and the labels hold several; "
                          "use --pooling features")
    return value, why


def _none_class(flags: TrainConfig, facts: DataFacts, pooling: str) -> tuple[str, str]:
    """none_class auto: the dataset's hint where the pooling has a per-patch vote (a
    generator knows its images hold objects of no class: Megapixel MNIST's noise), else off."""
    if flags.none_class != "auto":
        return flags.none_class, "given"
    if pooling not in VOTING_POOLINGS:
        return "off", f"pooling {pooling} has no per-patch vote"
    if facts.none_class_hint:
        return facts.none_class_hint, "dataset.json hint (objects of no class among those that count)"
    return "off", "no dataset.json hint: every patch votes for the classes"


def _count_floor(flags: TrainConfig, facts: DataFacts, pooling: str) -> tuple[float, str]:
    """count_floor auto: the dataset's hint where the pooling counts objects, else 0.
    Why a dataset says: the share of the attention one object that matters should hold
    (about one over the number of such objects, less a margin) is a fact of its images."""
    if flags.count_floor != -1:
        return flags.count_floor, "given"
    if pooling not in COUNTING_POOLINGS:
        return 0.0, f"pooling {pooling} counts no objects"
    if facts.count_floor_hint >= 0:
        return facts.count_floor_hint, "dataset.json hint (the share of the attention one object should hold)"
    return 0.0, "no dataset.json hint: every object counts once"


def _eval_count_floor(flags: TrainConfig, facts: DataFacts, pooling: str, floor: float) -> tuple[float, str]:
    """eval_count_floor auto: the dataset's hint where the pooling counts objects, else the
    training floor ``floor``. Why a floor of its own for reading:
    :mod:`ats_cli.extensions.pooling_counts` (``eval_floor``). How low is a fact of the
    images (benchmarks/accuracy.md#reading-floor), so a dataset says."""
    if flags.eval_count_floor != -1:
        return flags.eval_count_floor, "given"
    if pooling not in COUNTING_POOLINGS:
        return floor, f"pooling {pooling} counts no objects"
    if facts.eval_count_floor_hint >= 0:
        return facts.eval_count_floor_hint, "dataset.json hint (the floor to read at: training's teaches the attention)"
    return floor, "no dataset.json hint: the training floor"


def levels_spec(cfg: TrainConfig, mpp: float | None) -> dict[str, Any]:
    """A two-level model's keys (:class:`~ats_cli.core.nested_model.NestedATSModel`), none
    for one level, whose spec stays as it was: ``levels`` 2, ``regions`` (k), ``region_size``
    (full-resolution pixels: ``region_size``, or ``region_um`` at ``mpp`` rounded to a
    multiple of the patch side), ``coarse_scale`` (the coarse view's, ``coarse_px``
    pixels per region side; ``scale`` stays the region views'), ``region_temperature``
    (``eval_regions`` and ``region_temperature`` at auto as :func:`settle` settles them, which
    needs no data) and ``eval_coarse_scale`` (a given ``eval_coarse_px``, else 0: as
    trained, until the end of training settles the auto one). Raises ValueError in one line
    for a region that cannot be cut into patches or microns without a pixel size."""
    if cfg.levels == 1:
        return {}
    from ats_cli.core.nested_model import coarse_scale_for

    region = cfg.region_size
    if cfg.region_um:
        if not mpp:
            raise ValueError(f"region_um {cfg.region_um:g}: the microns per pixel are unknown (give --mpp, or "
                             "slides that record it), so give region_size in pixels (--set region_size=N)")
        region = max(1, round(cfg.region_um / mpp / cfg.patch_size)) * cfg.patch_size
    elif region % cfg.patch_size:
        raise ValueError(f"region_size {region} is not a multiple of --patch-size {cfg.patch_size}: the patches "
                         "of a region would not tile it")
    return {"levels": 2, "regions": cfg.regions,
            "eval_regions": _at_evaluation(cfg.eval_regions, cfg.regions, "regions")[0], "region_size": region,
            "coarse_scale": coarse_scale_for(region, cfg.coarse_px), "region_temperature": _region_temperature(cfg)[0],
            "eval_coarse_scale": coarse_scale_for(region, cfg.eval_coarse_px) if cfg.eval_coarse_px > 0 else 0.0}


def rarity_cap(cfg: TrainConfig) -> float:
    """``rarity_cap`` with auto (-1) read as :func:`settle` settles it (from the prior and
    the levels, no data needed); 0: none."""
    return _rarity_cap(cfg, cfg.rarity_prior)[0]


def view_scale(cfg: TrainConfig, mpp: float | None) -> float:
    """The scale of the low-res view a model of ``cfg`` reads of each image: a two-level
    model's coarse view (:func:`levels_spec`), else ``--scale``. Training and the settling
    probe read views at it, so the views the probe makes are those training finds cached."""
    return levels_spec(cfg, mpp).get("coarse_scale", cfg.scale)


def eval_view_scale(cfg: TrainConfig, mpp: float | None) -> float:
    """The scale of the low-res view a model of ``cfg`` reads in evaluation: a two-level
    model's given ``eval_coarse_px`` (:func:`levels_spec`), else :func:`view_scale`.
    Training's held-out evaluation reads at it, as ats predict does."""
    return levels_spec(cfg, mpp).get("eval_coarse_scale") or view_scale(cfg, mpp)


def check_mpp_flag(value: float, flag: str = "--mpp") -> None:
    """Refuse ``flag`` ``value`` (0: off, accepted) outside the plausible range with a one-line
    :class:`ConfigError` naming the flag and the value."""
    from ats_cli.data.dataset import mpp_problem

    if value and (problem := mpp_problem(value)):
        raise ConfigError(f"{flag} {value:g} µm/px is {problem} (0 = off)")


def patch_pixels(patch_um: float, mpp: float, max_pixels: int | None = None) -> int:
    """The patch side in pixels that ``--patch-um`` ``patch_um`` is at ``mpp`` µm/px.
    Raises :class:`ConfigError` (one line, naming the flag, the value and
    the pixels) when that is less than one pixel, or a patch of more pixels than the
    pixel budget (``max_pixels``, default :func:`ats_cli.data.images.max_pixels_limit`)."""
    from ats_cli.data.images import max_pixels_limit

    limit = max_pixels_limit(max_pixels)
    side = patch_um / mpp
    if not side >= 0.5:  # it rounds to no pixel at all
        raise ConfigError(f"--patch-um {patch_um:g} is {side:.3g} pixels at {mpp:.4g} µm/px, less than one pixel: "
                          "give a larger --patch-um (or --patch-size in pixels)")
    size = round(side)
    if size * size > limit:
        raise ConfigError(f"--patch-um {patch_um:g} is {size:,} pixels at {mpp:.4g} µm/px, a patch of "
                          f"{size * size:,} pixels, over the limit of {limit:,} pixels decoded at once: give a "
                          "smaller --patch-um (or --patch-size in pixels)")
    return size
