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
import os
import re
from pathlib import Path
from typing import Any

from ats_cli.checkpoint import FORMAT as CHECKPOINT_FORMAT
from ats_cli.checkpoint import VERSION as CHECKPOINT_VERSION
from ats_cli.checkpoint import CheckpointError
from ats_cli.io import first_line

__all__ = ["CARD", "CONFIG", "FORMAT", "HUB_PREFIX", "VERSION", "WEIGHTS", "HubError", "HubOfflineError",
           "download", "is_hub_ref", "is_model_dir", "locate", "read_model_dir"]

FORMAT = "ats-model"
VERSION = 1
CONFIG, WEIGHTS, CARD = "config.json", "model.safetensors", "README.md"
HUB_PREFIX = "hf-hub:"
EXTRA = 'pip install -e ".[hub]"'
RUN_CHECKPOINTS = ("best.pt", "last.pt")  # what a run directory given as a model stands for, in order
MAX_CONFIG_BYTES = 64 << 20  # a model's config is a few kB; a larger file is not one, and is not read whole
# the records of a checkpoint that config.json carries besides the spec and the classes
RECORDS = ("epoch", "config", "history", "export", "release", "pretrain", "train_set")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


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
        raise HubError(f"{weights}: not a safetensors file ({first_line(e)})") from None
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
        raise HubError(f"{path}: not a JSON model config ({first_line(e)})") from None
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
        raise HubError(f"{ref}: cannot be had from the Hugging Face hub ({first_line(e)})") from None
    return Path(folder)


def _import(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise HubError(f"{what}: {module.split('.')[0]} is not installed; {EXTRA}") from None
