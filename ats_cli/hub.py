"""Models in the Hugging Face Hub's form: a directory of safetensors weights, a JSON config
and a model card, written by ``ats export RUN DIR --hub-ready`` and read wherever a
checkpoint is taken (``--model``, ``ats train --init``, ``ats export``), as ``DIR`` or as
``hf-hub:ORG/NAME[@REVISION]``.

Why this form: it is what the Hub shows as a model (the card's front matter names the
library, the task and the licence), what its client downloads and caches, and it holds no
code: the weights are safetensors (tensors only, read by any safetensors reader), the
config is JSON holding the model *spec* -- the plain values :func:`ats_cli.models.create_model`
rebuilds the model from, as a checkpoint holds them -- and the class names. Nothing in
the directory is unpickled; a directory without weights, or whose config is not an ats
model's (another library's, an encoder's, a later version's), is refused in one line
naming it.

The files (:data:`CONFIG`, :data:`WEIGHTS`, :data:`CARD`):

* ``model.safetensors`` -- the model's state dict;
* ``config.json`` -- ``{"format": "ats-model", "version": 1, "spec": {...}, "classes": [...]}``
  and, for the card and for ``ats export`` from it, the checkpoint's plain records (the
  epoch, the training configuration, the per-epoch history, what export did);
* ``README.md`` -- the model card: YAML front matter (``library_name: ats``, tags, licence,
  ``pipeline_tag: image-classification``), how to use it, the training data and the
  metrics of the epoch the checkpoint holds, with the split each was measured on.

``hf-hub:ORG/NAME`` is fetched by huggingface_hub's ``snapshot_download`` into its own cache
(``HF_HOME`` / ``HF_HUB_CACHE``), only the two files a model needs. Offline -- an offline
variable set, or the Hub's host not answering one TCP connection within
:data:`ats_cli.nets.encoders.PROBE_SECONDS` -- the cache is read without asking the
network; a model not in it is refused in one line naming the local form (``--model DIR``),
where the client alone would retry for tens of seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from ats_cli.checkpoint import FORMAT as CHECKPOINT_FORMAT
from ats_cli.checkpoint import VERSION as CHECKPOINT_VERSION
from ats_cli.checkpoint import CheckpointError

__all__ = ["CARD", "CONFIG", "FORMAT", "HUB_PREFIX", "VERSION", "WEIGHTS", "HubError", "HubOfflineError",
           "check_license", "download", "is_hub_ref", "is_model_dir", "locate", "model_card", "read_model_dir",
           "write_model_dir"]

FORMAT = "ats-model"
VERSION = 1
CONFIG, WEIGHTS, CARD = "config.json", "model.safetensors", "README.md"
HUB_PREFIX = "hf-hub:"
EXTRA = 'pip install -e ".[hub]"'
RUN_CHECKPOINTS = ("best.pt", "last.pt")  # what a run directory given as a model stands for, in order
MAX_CONFIG_BYTES = 64 << 20  # a model's config is a few kB; a larger file is not one, and is not read whole
# the records of a checkpoint that config.json carries besides the spec and the classes
RECORDS = ("epoch", "config", "history", "export", "release", "pretrain", "train_set")
_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
PLACEHOLDER_LICENSE = "unknown"


class HubError(CheckpointError):
    """A model directory or ``hf-hub:`` name that cannot be used; one line naming it."""


class HubOfflineError(HubError):
    """An ``hf-hub:`` model neither in the cache nor downloadable now; names the local form."""


def is_hub_ref(path: str | os.PathLike[str]) -> bool:
    return str(path).startswith(HUB_PREFIX)


def is_model_dir(path: str | os.PathLike[str]) -> bool:
    """A directory in the Hub's form, or meant to be one (it holds the config or the weights)."""
    path = Path(path)
    return path.is_dir() and ((path / CONFIG).is_file() or (path / WEIGHTS).is_file())


def locate(model: str | os.PathLike[str]) -> Path:
    """Where the model ``model`` names is on this machine: for ``hf-hub:ORG/NAME`` the
    snapshot directory in the Hugging Face cache (:func:`download`); for a run directory
    its ``best.pt``, else ``last.pt``; a directory in the Hub's form and a file as given.
    Raises :class:`CheckpointError` naming a directory that is neither."""
    if is_hub_ref(model):
        return download(str(model))
    path = Path(model).expanduser()
    if path.is_dir():
        for name in RUN_CHECKPOINTS:
            if (path / name).is_file():
                return path / name
        if not is_model_dir(path):
            raise CheckpointError(f"{path}: a directory without {' or '.join(RUN_CHECKPOINTS)} (a run) or "
                                  f"{CONFIG} + {WEIGHTS} (ats export RUN DIR --hub-ready); give a model file")
    return path


# ---------------------------------------------------------------- reading


def read_model_dir(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint dict (as :func:`ats_cli.checkpoint.load_checkpoint` returns one: spec
    in the current layout, classes, weights, the records) of a directory in the Hub's form.
    Raises :class:`HubError` naming the directory or file for a missing config or weights,
    a config of another format or a later version, a spec this ats cannot read, and
    weights that are not safetensors or hold NaN."""
    from ats_cli.checkpoint import _check_finite
    from ats_cli.models import SpecVersionError, migrate_spec

    folder = Path(folder)
    config = _read_config(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise HubError(f"{folder}: no {WEIGHTS} (the model's weights) beside its {CONFIG}; a model directory holds "
                       f"both, as ats export RUN DIR --hub-ready writes them")
    st = _import("safetensors.torch", f"{weights}")
    try:
        state = st.load_file(str(weights))
    except Exception as e:  # safetensors raises its own types for a damaged or foreign file
        raise HubError(f"{weights}: not a safetensors file ({_first_line(e)})") from None
    _check_finite(weights, state)
    try:
        spec = migrate_spec(config["spec"])
    except SpecVersionError as e:
        raise HubError(f"{folder / CONFIG}: {e}") from None
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "spec": spec,
            "classes": list(config["classes"]), "model": state,
            **{k: config[k] for k in RECORDS if config.get(k) is not None}}


def _read_config(folder: Path) -> dict[str, Any]:
    from ats_cli.nets.encoders import FORMAT as ENCODER_FORMAT

    path = folder / CONFIG
    if not path.is_file():
        raise HubError(f"{folder}: no {CONFIG} (the model spec) beside its {WEIGHTS}; a model directory holds both, "
                       "as ats export RUN DIR --hub-ready writes them")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise HubError(f"{path}: {path.stat().st_size / 2**20:.0f} MiB, not an ats model config (a few kB)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # nesting past the stack
        raise HubError(f"{path}: not a JSON model config ({_first_line(e)})") from None
    kind = config.get("format") if isinstance(config, dict) else None
    if kind == ENCODER_FORMAT:
        raise HubError(f"{path}: an encoder (ats export --encoder), not a model; give it to --feature-net {folder}")
    if kind != FORMAT:
        found = f"format {kind!r}" if kind else "no 'format' key: another library's config?"
        raise HubError(f"{path}: not an ats model config ({found}; ats export RUN DIR --hub-ready writes "
                       f"format {FORMAT!r})")
    version = config.get("version")
    if not isinstance(version, int) or version < 1:
        raise HubError(f"{path}: model config version {version!r} is not one this ats knows (1 to {VERSION})")
    if version > VERSION:
        raise HubError(f"{path}: model config version {version} is newer than this ats ({VERSION}); upgrade ats")
    classes = config.get("classes")
    if not isinstance(config.get("spec"), dict) or not isinstance(classes, list) \
            or not all(isinstance(c, str) for c in classes):
        raise HubError(f"{path}: has no model spec and class names ('spec' object, 'classes' list of names)")
    return config


# ---------------------------------------------------------------- the hub's cache and network


def download(ref: str) -> Path:
    """The snapshot directory of ``hf-hub:ORG/NAME[@REVISION]`` in the Hugging Face cache,
    fetched by huggingface_hub when the network can be had (the client then also checks
    for a newer revision), read from the cache alone when not. Raises
    :class:`HubOfflineError` when offline and not cached, naming the local form, and
    :class:`HubError` for a name the Hub does not have."""
    repo, _, revision = ref.removeprefix(HUB_PREFIX).partition("@")
    if not _REPO.fullmatch(repo):
        raise HubError(f"{ref}: not a Hub model name; give hf-hub:ORG/NAME (optionally @REVISION)")
    hub = _import("huggingface_hub", ref)
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ats_cli.nets.encoders import network_problem

    problem = network_problem(constants.ENDPOINT)
    try:
        folder = hub.snapshot_download(repo, revision=revision or None, allow_patterns=[CONFIG, WEIGHTS],
                                       local_files_only=bool(problem))
    except LocalEntryNotFoundError:
        why = f"no network ({problem})" if problem else "it could not be downloaded"
        raise HubOfflineError(
            f"{ref}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; where there is network, "
            f"`hf download {repo} --local-dir DIR` (or copy a directory from ats export --hub-ready), then give "
            "DIR in its place (--model DIR, init=DIR)") from None
    except (OSError, ValueError) as e:  # the client's errors: repository or revision not found, gated, HTTP
        raise HubError(f"{ref}: cannot be had from the Hugging Face hub ({_first_line(e)})") from None
    return Path(folder)


# ---------------------------------------------------------------- writing


def check_license(license: str | None) -> str:
    """``license`` as the card's front matter takes it (a Hub licence id such as ``mit``,
    ``apache-2.0``, ``cc-by-nc-4.0``, ``other``), or :data:`PLACEHOLDER_LICENSE` when None.
    ValueError for anything else: the value goes into YAML as it is."""
    if license is None:
        return PLACEHOLDER_LICENSE
    if not _LICENSE.fullmatch(license):
        raise ValueError(f"--license {license!r}: give a Hub licence id in lower case, e.g. mit, apache-2.0, "
                         "cc-by-4.0, other")
    return license


def write_model_dir(dst: str | os.PathLike[str], ckpt: dict[str, Any], model: torch.nn.Module, *,
                    license: str | None = None, overwrite: bool = False) -> dict[str, Path]:
    """Write ``dst/model.safetensors``, ``dst/config.json`` and ``dst/README.md`` for the
    checkpoint dict ``ckpt`` (spec, classes, records) and its built ``model``; returns the
    paths. Refuses (:class:`ats_cli.export.ExportError`, one line) a ``dst`` that is a file
    or already holds one of them (unless ``overwrite``); the three are written to temporary
    files first and each replaces its name only when all are written, and a failed write
    leaves neither them nor the directories made for them."""
    from ats_cli.export import ExportError, writing
    from ats_cli.io import atomic_path

    st = _import("safetensors.torch", "ats export --hub-ready")
    license = check_license(license)
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise ExportError(f"{dst}: not a directory (ats export --hub-ready writes {WEIGHTS}, {CONFIG} and {CARD} "
                          "into one)")
    held = [name for name in (WEIGHTS, CONFIG, CARD) if (dst / name).exists()]
    if held and not overwrite:
        raise ExportError(f"{dst}: already holds {', '.join(held)}; give --overwrite to replace them, or another "
                          "directory")
    config = {"format": FORMAT, "version": VERSION, "spec": ckpt["spec"], "classes": [str(c) for c in ckpt["classes"]],
              **{k: ckpt[k] for k in RECORDS if ckpt.get(k) is not None}}
    config = _plain(config)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    card = model_card(config, license=license, name=dst.resolve().name)
    paths = {name: dst / name for name in (WEIGHTS, CONFIG, CARD)}
    with writing(paths[CONFIG]), atomic_path(paths[WEIGHTS]) as weights, atomic_path(paths[CONFIG]) as cfg, \
            atomic_path(paths[CARD]) as readme:
        weights.write_bytes(st.save(state, metadata={"format": "pt"}))
        cfg.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        readme.write_text(card, encoding="utf-8")
    return paths


def _plain(value: Any) -> Any:
    """``value`` as strict JSON holds it: tuples as lists, a non-finite float (a diverged
    epoch's loss) as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    return value


# ---------------------------------------------------------------- the model card


def model_card(config: dict[str, Any], *, license: str, name: str) -> str:
    """The README.md the Hub shows for a model directory: front matter, what the model is,
    how to use it, the data it was trained on and the metrics of its epoch."""
    spec, classes = config["spec"], config["classes"]
    slides = bool(spec.get("levels") == 2 or (spec.get("input") or {}).get("mpp"))
    tags = ["ats", "attention-sampling", "image-classification", "pytorch", "safetensors",
            "whole-slide-images" if slides else "megapixel-images"]
    front = ["---", "library_name: ats", f"license: {license}", "tags:", *(f"- {t}" for t in tags),
             "pipeline_tag: image-classification", "---", ""]
    lines = [f"# {_md(name)}", "",
             f"An attention-sampling model (Katharopoulos & Fleuret, ICML 2019) made with `ats`: it classifies an "
             f"image into {len(classes)} classes ({', '.join(f'`{_md(c)}`' for c in classes)}) from "
             f"{_patches(spec)}, chosen by an attention distribution over a low-resolution view.", ""]
    if license == PLACEHOLDER_LICENSE:
        lines += ["Licence: not set yet (`ats export RUN DIR --hub-ready --license ID` sets it).", ""]
    lines += ["## Use", "", "```bash",
              "ats predict IMAGES --model hf-hub:ORG/NAME --out predictions.csv",
              "# offline: a local copy of this directory", "ats predict IMAGES --model DIR --out predictions.csv",
              "```", "",
              "The weights are `model.safetensors`; `config.json` holds the model spec ats rebuilds the model from "
              "(nothing is unpickled). It also fine-tunes: `ats train DATA --init hf-hub:ORG/NAME`.", "",
              "## Model", "", "| setting | value |", "|---|---|",
              *(f"| {k} | {_md(v)} |" for k, v in _settings(spec)), ""]
    lines += _training(config) + _metrics(config)
    return "\n".join(front + lines).rstrip() + "\n"


def _patches(spec: dict[str, Any]) -> str:
    ph, pw = spec.get("patch_size", ["?", "?"])
    n = spec.get("eval_n_patches") or spec.get("n_patches")
    if spec.get("method") == "cnn":
        return "its whole downsampled view (the CNN baseline)"
    return f"{n} patches of {ph}x{pw} pixels"


def _settings(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = [("method", spec.get("method")), ("feature net", spec.get("feature_net")),
            ("attention net", spec.get("attention_net")),
            ("patches", f"{spec.get('n_patches')} in training, {spec.get('eval_n_patches') or spec.get('n_patches')} "
                        f"in prediction, {'x'.join(str(s) for s in spec.get('patch_size', []))} px"),
            ("low-res view scale", spec.get("scale")), ("levels", spec.get("levels", 1)),
            ("pooling", (spec.get("pooling") or {}).get("name", "features")),
            ("labels", "multi-label (one sigmoid per class)" if spec.get("multilabel") else "one per image"),
            ("channels", spec.get("channels"))]
    mpp = (spec.get("input") or {}).get("mpp")
    if mpp:
        rows.append(("microns per pixel", mpp))
    return rows


def _training(config: dict[str, Any]) -> list[str]:
    cfg = config.get("config") or {}
    history = config.get("history") or []
    record = _epoch_record(config)
    if not cfg and not history:
        return ["## Training data", "", "Not recorded in the checkpoint this model was exported from.", ""]
    data = Path(str(cfg.get("data", ""))).name if cfg.get("data") else "not recorded"
    lines = ["## Training data", "", f"- dataset: `{_md(data)}` (its `train.csv`), classes as listed above"]
    if record and record.get("samples"):
        lines.append(f"- training images per epoch: {record['samples']}")
    if config.get("epoch"):
        lines.append(f"- epochs: {config['epoch']} of {cfg.get('epochs', len(history))} trained")
    for key in ("n_patches", "patch_size", "scale", "lr", "batch_size", "seed"):
        if key in cfg:
            lines.append(f"- {key}: {_md(cfg[key])}")
    return [*lines, ""]


def _epoch_record(config: dict[str, Any]) -> dict[str, Any] | None:
    history = config.get("history") or []
    epoch = config.get("epoch")
    return next((h for h in history if h.get("epoch") == epoch), history[-1] if history else None)


def _metrics(config: dict[str, Any]) -> list[str]:
    """The table of the checkpoint's epoch, one row per split (``best.pt``'s epoch was chosen
    on the validation accuracy when there is a validation split, else on the test one:
    the row that chose it says so, and a test figure that chose its epoch is an optimistic
    one); the training row is the running figure of the epoch, as training measured it."""
    record = _epoch_record(config)
    if not record:
        return ["## Metrics", "", "No metrics recorded (the checkpoint holds no training history).", ""]
    chosen_on = "val" if "val_acc" in record else "test"
    f1 = any(k.endswith("_macro_f1") for k in record)  # multi-label runs: accuracy is the exact match ratio
    accuracy = "exact match" if f1 else "accuracy"
    source = (config.get("export") or {}).get("source")
    which = (f"the run's `best.pt`, its epoch of the highest {chosen_on} {accuracy}" if source == "best.pt" else
             f"the run's `{_md(source)}`" if source else "the checkpoint's")
    selected = chosen_on if source == "best.pt" else None
    lines = ["## Metrics", "", f"Epoch {record['epoch']}, {which}.", "",
             f"| split | {accuracy} |{' macro-F1 |' if f1 else ''} loss |",
             f"|---|---|{'---|' if f1 else ''}---|"]
    for split in ("val", "test", "train"):
        if f"{split}_acc" not in record:
            continue
        loss = record.get("train_ce", record.get("train_loss")) if split == "train" else record.get(f"{split}_loss")
        cells = [_num(record.get(f"{split}_acc")), *([_num(record.get(f"{split}_macro_f1"))] if f1 else []), _num(loss)]
        said = " (selects the epoch)" if split == selected else " (during the epoch)" if split == "train" else ""
        lines.append(f"| {split}{said} | {' | '.join(cells)} |")
    lines.append("")
    if selected == "test":
        lines += ["No validation split: the epoch was chosen on the test split, so its test figures are an "
                  "optimistic estimate.", ""]
    return lines


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _md(value: Any) -> str:
    """A value in a Markdown table cell or line: no pipe or newline to break it."""
    return str(value).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------- helpers


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def _import(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise HubError(f"{what}: {module.split('.')[0]} is not installed; {EXTRA}") from None
