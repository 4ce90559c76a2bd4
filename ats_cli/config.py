"""Training configuration: plain values, overridable from a TOML file and the command line.

Precedence: defaults < ``--config FILE`` < flags. Values left to the data (0, -1, auto)
are decided when the run starts (:mod:`ats_cli.settle`), and the settled values are written
to ``RUN_DIR/config.json`` so every run records exactly what it did.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["TrainConfig", "ConfigError", "allowed_values", "load_config_file", "resolve_config"]


class ConfigError(ValueError):
    """A configuration file or value that cannot be used."""


# The panels of `ats train --help` the fields are listed under.
METHOD_PANEL = "Attention sampling"
READ_PANEL = "Reading slides (saved in the model; predict and visualize read alike)"
NET_PANEL = "Networks"
OPT_PANEL = "Optimisation"
RUN_PANEL = "Running"


def _key(default: Any, help: str, panel: str | None = None, *, choices: dict[str, str] | None = None,
         means: str | None = None) -> Any:
    """A TrainConfig field that also describes itself, so that ``ats train``'s flags, their
    help and :meth:`TrainConfig.validate`'s allowed values come from one place
    (ats_cli/cli/options.py builds the flags). ``help``: the flag's help without the
    default, which is added from ``default``; ``{choices}`` in it is replaced by the
    allowed values (``choices``: value -> a note on it, "" for none) joined by " | ".
    ``means``: what the default value stands for ("auto", "off"). ``panel``: the help
    panel; None for a field the command declares itself (DATA, --out)."""
    return field(default=default, metadata={"help": help, "panel": panel, "choices": choices, "means": means})


@dataclass
class TrainConfig:
    data: str = _key("", "Dataset directory (train.csv, test.csv, dataset.json)")
    out: str = _key("", "Run directory for checkpoints, metrics and plots")
    # the method (see ats_cli.models)
    method: str = _key("ats", "{choices}", METHOD_PANEL, choices={
        "ats": "", "uniform": "fixed uniform attention", "deepmil": "gated attention over all grid patches",
        "cnn": "ResNet-18 on the low-res view"})
    # 0 = the dataset's hint (dataset.json "hints"), else ats_cli.settle.DATA_DEFAULTS (the paper's Megapixel MNIST)
    n_patches: int = _key(0, "Patches sampled per image", METHOD_PANEL)
    patch_size: int = _key(0, "Patch side, full-res pixels", METHOD_PANEL)
    scale: float = _key(0.0, "Scale of the low-res view", METHOD_PANEL)
    # the same two in microns, for slides (ats_cli.data.magnification): converted at the
    # model's mpp (--mpp, else the training slides' own) into patch_size and scale
    patch_um: float = _key(0.0, "Slides: patch side in microns, instead of --patch-size (at --mpp, else the training "
                           "slides' microns per pixel)", METHOD_PANEL, means="off")
    low_res_um: float = _key(0.0, "Slides: microns per low-res pixel, instead of --scale (scale = mpp / this)",
                             METHOD_PANEL, means="off")
    replace: bool = _key(False, "Sample with replacement", METHOD_PANEL)
    # auto | threshold | sequential: the unbiased estimator without replacement (same expectation,
    # different variance: ats_cli.core.sampling)
    estimator: str = _key("auto", "Unbiased estimator without replacement: {choices}", METHOD_PANEL, choices={
        "auto": "training: per image, threshold when n >= the attention's perplexity, else sequential; evaluation "
                "and prediction: threshold",
        "threshold": "", "sequential": "the thesis's, appendix B.3"})
    entropy: float = _key(0.01, "Entropy regulariser weight lambda", METHOD_PANEL)
    # > 0: the support extension "bright" (ats_cli.extensions.support_bright; black backgrounds);
    # 0 = off; -1 = auto: AUTO_MIN_BRIGHTNESS when the training images have a black background (ats_cli.settle)
    min_brightness: float = _key(-1.0, "Never sample low-res cells darker than this; 0 = off; -1 = auto: 0.15 when "
                                 "the training images have a black background, else off", METHOD_PANEL, means="auto")
    # > 0: the prior extension "rarity", the attention starts where the image looks unusual
    # (ats_cli.extensions.prior_rarity); -1 = auto
    rarity_prior: float = _key(-1.0, "Weight beta of the attention's starting prior exp(beta r), r = how unusual a "
                               "low-res cell's colour is in its image (1 = typical); 0 = off (the thesis); -1 = auto: "
                               "on for slides (tissue mask), else off", METHOD_PANEL, means="auto")
    # multiplies the L2-normalised features (1 = the paper; see ATSModel)
    feature_scale: float = _key(10.0, "Multiplies the L2-normalised features; >1 lets the classifier become "
                                "confident sooner (docs/training.md; 1 = the paper)", METHOD_PANEL)
    # on: the gain extension "learned", a per-patch gain on the unit-norm features
    # (ats_cli.extensions.gain_learned); auto = on for slides, where one small region decides the label
    patch_gain: str = _key("auto", "Learned per-patch feature gain: {choices}; docs/training.md", METHOD_PANEL,
                           choices={"auto": "on for slides, i.e. a tissue mask, else off",
                                    "on": "one patch showing the class can outweigh look-alikes",
                                    "off": "every patch weighed by its attention alone, the thesis"})
    # the pooling extension: what the estimator averages (ats_cli.extensions.pooling*); none_class
    # and count_floor are its options (ats_cli.models.extension_specs)
    pooling: str = _key("features", "What attention sampling averages over the patches: {choices}; "
                        "docs/training.md", METHOD_PANEL,
                        choices={"features": "their features, then the classifier: the thesis",
                                 "votes": "each patch's class probabilities: a soft vote",
                                 "counts": "those over the attention mass around each patch: each object counts "
                                           "once"})
    none_class: str = _key("off", "A per-patch logit for no class here, with --pooling votes or counts: {choices}",
                           METHOD_PANEL, choices={"off": "every patch spreads a whole vote over the classes",
                                                  "on": "a patch read as none votes little"})
    count_floor: float = _key(0.0, "With --pooling counts: an object with less than this share of the attention "
                              "counts in proportion to it, not once (0 = every object once, 1 = votes)", METHOD_PANEL)
    # on: each patch's position in the image goes into its feature (ats_cli.extensions.position)
    position_features: str = _key("off", "Each patch's position in the image in its feature: {choices}; "
                                  "docs/training.md", METHOD_PANEL,
                                  choices={"off": "what a patch shows, not where: the thesis",
                                           "on": "for labels that depend on where (the top-most digit)"})
    # more patches at evaluation cost no memory for gradients and cut the estimator's noise;
    # -1 = auto = twice the training count, recorded in the model
    eval_n_patches: int = _key(-1, "Patches sampled at evaluation and prediction (the model records it); 0 = as "
                               "many as in training; -1 = auto: twice the training count", METHOD_PANEL, means="auto")
    # reading slides and TIFFs (saved in the model, so predict and visualize read alike; their
    # --reader/--level/--mpp/--tissue-mask are these fields too: ats_cli/cli/options.py)
    reader: str = _key("auto", "Force a reader: {choices}", READ_PANEL, choices={
        "auto": "TIFFs and slide formats are read lazily, other images whole", "openslide": "", "tifffile": "",
        "pillow": ""})
    level: int = _key(0, "Slides: pyramid level patches are read from", READ_PANEL)
    mpp: float = _key(0.0, "Slides: read patches at this many microns per pixel (from the level at or below it, "
                      "resampled); the model records it, else the training slides' own when they agree",
                      READ_PANEL, means="off")
    tissue_mask: str = _key("auto", "{choices}: sample only tissue (Otsu on saturation)", READ_PANEL, choices={
        "auto": "on for slides and TIFFs, off for other images", "on": "", "off": ""})
    # networks (names from ats_cli.nets)
    attention_net: str = _key("mnist-attention", "Attention network name", NET_PANEL)
    feature_net: str = _key("small-cnn", "Feature network name (mnist-features: the paper's)", NET_PANEL)
    attention_width: int = _key(8, "Attention net channels", NET_PANEL)
    feature_width: int = _key(32, "Feature net channels", NET_PANEL)
    # optimisation
    optimizer: str = _key("adam", "{choices}", OPT_PANEL, choices={"adam": "", "adamw": "", "sgd": ""})
    # docs/training.md: faster off the plateau than the reference's 1e-3, same budget
    lr: float = _key(3e-3, "Learning rate", OPT_PANEL)
    weight_decay: float = _key(0.0, "Weight decay", OPT_PANEL)
    # fine-tuning a pretrained encoder (--init) gently, or not at all: CLAM-style frozen
    # features. Frozen also keeps its batch norms' statistics as --init left them (train.py)
    feature_lr: float = _key(1.0, "Feature network's learning rate, relative to --lr; 0 = frozen: its weights and "
                             "batch-norm statistics stay as --init left them", OPT_PANEL)
    schedule: str = _key("cosine", "{choices}", OPT_PANEL, choices={"constant": "", "cosine": ""})
    warmup_epochs: int = _key(0, "Linear warm-up epochs", OPT_PANEL)
    clip_norm: float = _key(1.0, "Gradient norm clip, 0 = off", OPT_PANEL)
    # training only (ats_cli.augment; never saved in the model): per-image colour jitter of the
    # low-res view and its patches alike, optionally each patch in a random orientation
    augment: str = _key("auto", "Training augmentation: {choices}; docs/training.md", OPT_PANEL, choices={
        "auto": "colour+flips for RGB slides, i.e. a tissue mask, else none",
        "none": "", "colour": "HED stain jitter, brightness and contrast",
        "colour+flips": "and every patch flipped or rotated by a multiple of 90 degrees"})
    batch_size: int = _key(32, "Images per step, per process", OPT_PANEL)
    epochs: int = _key(20, "Epochs", OPT_PANEL)
    # running; "" = random init
    init: str = _key("", "Start from the weights of this checkpoint (fine-tuning, or a curriculum from easier "
                     "data); same networks and classes", RUN_PANEL)
    seed: int = _key(0, "Random seed", RUN_PANEL)
    device: str = _key("auto", "auto (CUDA when present, else CPU) | cpu | cuda | cuda:N", RUN_PANEL)
    workers: int = _key(-1, "DataLoader worker processes per process; -1 = auto: on CUDA the CPUs this process may "
                              "use, shared among the run's processes on the node (at most 16), on CPU 2", RUN_PANEL)
    amp: str = _key("none", "{choices} mixed precision, CUDA only (on CPU: a warning, float32)", RUN_PANEL,
                    choices={"none": "", "bf16": "", "fp16": ""})
    # ordinary images decoded once into tiles + view before the first epoch (ats_cli.data.prepared)
    prepare: bool = _key(True, "Decode PNG/JPEG/... images once before the first epoch into DATA/.ats-prepared (or "
                         "$ATS_PREPARED) and read them patch by patch; the same results; --no-prepare: decode every "
                         "image at every read", RUN_PANEL)

    def validate(self) -> TrainConfig:
        problems = []
        positive = ("batch_size", "epochs", "lr", "feature_scale")
        problems += [f"{k} must be > 0 (got {getattr(self, k)})" for k in positive if not getattr(self, k) > 0]
        non_negative = ("entropy", "weight_decay", "clip_norm", "warmup_epochs", "level", "mpp",
                        "feature_lr", "n_patches", "patch_size", "scale", "patch_um",
                        "low_res_um")  # 0: from the data
        problems += [f"{k} must be >= 0" for k in non_negative if getattr(self, k) < 0]
        if self.feature_lr != 1 and self.method == "cnn":
            problems.append(f"feature_lr {self.feature_lr}: method cnn has no feature network (it trains one ResNet)")
        if not 0 <= self.count_floor <= 1:
            problems.append(f"count_floor must be in [0, 1] (got {self.count_floor})")
        if self.none_class == "on" and self.pooling == "features":
            problems.append("none_class on needs pooling votes or counts (pooled features have no per-patch vote)")
        if self.pooling != "features" and self.method in ("cnn", "deepmil"):
            problems.append(f"pooling {self.pooling}: method {self.method} does not pool by attention sampling")
        if self.position_features == "on" and self.method in ("cnn", "deepmil"):
            problems.append(f"position_features on: method {self.method} does not pool sampled patches")
        if self.rarity_prior < 0 and self.rarity_prior != -1:
            problems.append(f"rarity_prior must be >= 0, or -1 for auto (got {self.rarity_prior})")
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
        for key, allowed in allowed_values().items():
            if getattr(self, key) not in allowed:
                problems.append(f"{key} must be one of {', '.join(allowed)} (got {getattr(self, key)!r})")
        if problems:
            raise ConfigError("invalid configuration: " + "; ".join(problems))
        return self

    @property
    def settled_eval_n_patches(self) -> int:
        """``eval_n_patches`` with auto (-1) read as twice ``n_patches``, as
        :func:`ats_cli.settle.settle` settles it (a settled configuration has no -1)."""
        return 2 * self.n_patches if self.eval_n_patches == -1 else self.eval_n_patches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def input_options(self) -> dict[str, Any]:
        """:func:`ats_cli.data.inputs.open_input`'s reading options (None = its default)."""
        return {"reader": None if self.reader == "auto" else self.reader, "level": self.level or None,
                "mpp": self.mpp or None, "tissue": {"auto": None, "on": True, "off": False}[self.tissue_mask]}


def allowed_values() -> dict[str, tuple[str, ...]]:
    """The fields that take one of a few values, and those values (from the fields' metadata)."""
    return {f.name: tuple(f.metadata["choices"]) for f in fields(TrainConfig) if f.metadata.get("choices")}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON, e.g. a previous run's config.json) file of TrainConfig keys."""
    path = Path(path)
    try:
        text = path.read_text()
        values = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a valid config file ({e})") from None
    values = values.get("train", values)  # allow a [train] table
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
    return values


def resolve_config(file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the file (a TOML file, or a run's config.json when it is resumed),
    then the overrides that are not None: the flags of a run. What they leave to the data
    is settled when the run starts (:mod:`ats_cli.settle`)."""
    values: dict[str, Any] = load_config_file(file) if file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    types = {f.name: type(f.default) for f in fields(TrainConfig)}
    for k, v in values.items():
        want = types[k]
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            values[k] = float(v)
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"config key {k!r} must be {want.__name__}, got {v!r}")
    return TrainConfig(**values).validate()
