"""``ats export``: a checkpoint made a model to predict with -- its evaluation options set,
its optimizer state dropped, what was done recorded in the file.

Keeps what prediction and a model card need (spec, classes, weights, the training
configuration and the per-epoch history, ``pretrain``'s record) and drops the optimizer and
scaler state, so the file is a few hundred kB; loadable with ``torch.load(weights_only=True)``
like any ats checkpoint, and ``ats train --set init=FILE`` still takes it.

Options, each a field of the spec (``export`` in the file lists those set):

``mpp``: the model was trained at this many microns per pixel, for a checkpoint written
before models recorded it; predict then reads slides that record their mpp at that scale.

``eval_n_patches``: the patches prediction draws by default (e.g. 80 where training drew 10).

``eval_regions``: a two-level model's regions drawn at prediction (0 = as in training).

``eval_coarse_px``: a two-level model's coarse-view pixels per region side at prediction (0 =
as in training), recorded as the spec's ``eval_coarse_scale``: a finer coarse view than
training's, where the coarse attention is mostly the prior's and a small object is under
one coarse pixel (:attr:`ats_cli.core.nested_model.NestedATSModel.scale` says why; the
figures are in benchmarks/slides.md#accuracy-at-100k²).

``pooling``: what the model pools, for a checkpoint whose classifier reads one patch as well
as the pooled features (that of ``ats pretrain``, trained on single patches, reads either
way); ``none_class="off"`` drops its "no class here" logit; ``count_floor`` the floor of a
counts pooling, the one it reads at and, with ``ats train --set init=...``, trains at (a reading
floor of its own, ``eval_floor``, is dropped).

``none_prior`` P: the share of "none" among the objects the model will count, for a
checkpoint whose "no class here" logit was trained on single patches in another proportion
Q (``ats pretrain`` records it as ``pretrain.none_share``; ``trained_none_share`` gives it
for one that does not). Why: a classifier trained under class prior pi_train outputs
p_train(y|x), and under another prior pi_test the posterior is

    p_test(y|x) = p_train(y|x) pi_test(y) / pi_train(y) / Z(x)

(Bayes' rule with the likelihood p(x|y) unchanged: Saerens, Latinne & Decaestecker, Neural
Computation 2002). With a softmax, p(y|x) ∝ exp(l_y), so the correction adds
log(pi_test(y) / pi_train(y)) to logit y; Z(x) is the softmax's own normalisation. With the
classes sharing the non-none mass alike in both priors, every class logit gains the same
log((1-P)/(1-Q)) -- which the softmax ignores -- and the none logit gains log(P/Q); moving
only the none logit by the difference, ``log(P/Q) - log((1-P)/(1-Q))`` (:func:`none_shift`),
gives the same posterior. So only the none logit's bias moves; the estimate pooled from the
patches stays an expectation of a function of each patch alone. Counts pool one vote per
object, and on a paper-spec Megapixel MNIST image 50 of the 55 objects are noise
(P = 50/55) where stage 1 trained on about two "none" patches per object patch (Q ≈ 0.67):
read at Q, every noise object is taken as about 5 times likelier to be a digit than it is,
and 50 of them add up. Shifting twice would take the first shift's prior for the training
one, so a checkpoint that records a shift is refused.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ats_cli.config import COUNTING_POOLINGS, VOTING_POOLINGS, none_class_refusal

if TYPE_CHECKING:
    import torch

__all__ = ["ExportError", "check_destination", "export_checkpoint", "none_shift", "parse_share", "writing"]


class ExportError(ValueError):
    """A checkpoint or option combination ``ats export`` refuses; one line naming the file."""


def none_shift(prior: float, trained: float) -> float:
    """What the none logit gains when the share of "none" goes from ``trained`` to ``prior``
    (both in (0, 1)), the classes sharing the rest alike before and after (module
    docstring): ``log(prior / trained) - log((1 - prior) / (1 - trained))``."""
    return math.log(prior / trained) - math.log((1.0 - prior) / (1.0 - trained))


def parse_share(text: str) -> float:
    """``"0.9"`` or ``"50/55"`` (noise objects over all objects) -> a float; ValueError otherwise."""
    num, _, den = str(text).partition("/")
    try:
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"expected a share like 0.9 or 50/55, got {text!r}") from None


def export_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, mpp: float | None = None,
                      eval_n_patches: int | None = None, eval_regions: int | None = None,
                      eval_coarse_px: int | None = None, pooling: str | None = None, none_class: str | None = None,
                      count_floor: float | None = None, none_prior: float | None = None,
                      trained_none_share: float | None = None, overwrite: bool = False, hub_ready: bool = False,
                      license: str | None = None) -> dict[str, Any]:
    """Write ``dst``, the model of ``src`` (a checkpoint, or a run directory: its ``best.pt``,
    else ``last.pt``, as ``ats predict -m`` takes it) with the given evaluation options
    (module docstring), atomically; returns the ``export`` record written in it. Raises
    :class:`ExportError` (one line) for a file that is not a checkpoint, a second prior
    shift, options the model cannot take or a ``dst`` that exists (unless ``overwrite``),
    before anything is written, and for a write that fails (a full or read-only disk):
    then nothing is left behind, not even the directories made for ``dst``.

    ``hub_ready``: ``dst`` is a directory, written in the Hugging Face Hub's form
    (:func:`write_model_dir`: safetensors weights, the spec as JSON, a model card
    whose front matter gives ``license``); the same options apply."""
    from ats_cli.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from ats_cli.models import create_model
    from ats_cli.predict.predictor import resolve_model_path
    from ats_cli.pretrain.internals import NONE_BIAS_KEY, NONE_PREFIX

    _check_values(mpp, eval_n_patches, eval_regions, eval_coarse_px, count_floor)
    try:
        given, src = str(src), resolve_model_path(src)
        ckpt = load_checkpoint(src)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if hub_ready:

        try:
            check_license(license)
        except ValueError as e:
            raise ExportError(str(e)) from None
    else:
        if license is not None:
            raise ExportError("--license goes with --hub-ready (it is the model card's)")
        check_destination(dst, overwrite=overwrite)
    release = dict(ckpt.get("release") or {})
    if none_prior is not None:
        if "none_prior" in release:  # shifting twice would count the first shift as the training prior
            raise ExportError(f"{src}: its none logit is already read at prior {release['none_prior']}; "
                              "export from the checkpoint it came from")
        trained = trained_none_share
        if trained is None:
            trained = (ckpt.get("pretrain") or {}).get("none_share")
        if trained is None:
            raise ExportError(f"{src}: does not record the share of 'none' patches it was trained on; "
                              "give it with --trained-none-share")
        if not (0 < none_prior < 1 and 0 < trained < 1):
            raise ExportError(f"--none-prior and the trained share must be in (0, 1), got {none_prior} and {trained}")
        if none_class == "off" or NONE_BIAS_KEY not in ckpt["model"]:
            raise ExportError(f"{src}: --none-prior needs the checkpoint's none logit (trained with none_class on)")
        shift = none_shift(none_prior, float(trained))
        ckpt["model"] = {**ckpt["model"], NONE_BIAS_KEY: ckpt["model"][NONE_BIAS_KEY] + shift}
        release.update(none_prior=float(none_prior), trained_none_share=float(trained), none_shift=shift)
    elif trained_none_share is not None:
        raise ExportError("--trained-none-share goes with --none-prior")
    if mpp is not None:
        ckpt["spec"]["input"] = {**ckpt["spec"]["input"], "mpp": float(mpp), "level": None, "resample": True}
    changes: dict[str, Any] = {}
    if eval_n_patches is not None:
        changes["eval_n_patches"] = int(eval_n_patches)
        ckpt["spec"]["eval_n_patches"] = int(eval_n_patches)
    for flag, value in (("--eval-regions", eval_regions), ("--eval-coarse-px", eval_coarse_px)):
        if value is not None and ckpt["spec"].get("levels", 1) != 2:
            raise ExportError(f"{src}: {flag} is for a two-level model (trained with levels 2); this one has one level")
    if eval_regions is not None:
        changes["eval_regions"] = int(eval_regions)
        ckpt["spec"]["eval_regions"] = int(eval_regions)
    if eval_coarse_px is not None:
        from ats_cli.core.nested_model import coarse_scale_for

        changes["eval_coarse_px"] = int(eval_coarse_px)
        # 0 px gives scale 0: as trained (NestedATSModel.scale)
        ckpt["spec"]["eval_coarse_scale"] = coarse_scale_for(ckpt["spec"]["region_size"], eval_coarse_px)
    try:
        pooling_spec = _pooling_spec(ckpt["spec"].get("pooling"), pooling, none_class, count_floor)
    except ValueError as e:
        raise ExportError(f"{src}: cannot be exported so ({e})") from None
    if pooling_spec != ckpt["spec"].get("pooling"):
        changes["pooling"] = pooling_spec
        ckpt["spec"]["pooling"] = pooling_spec
    if none_class == "off":
        ckpt["model"] = {k: v for k, v in ckpt["model"].items() if not k.startswith(NONE_PREFIX)}
    try:  # e.g. --pooling features on a checkpoint with a none logit: one line naming the file
        model = create_model(ckpt["spec"])
        model.load_state_dict(ckpt["model"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise ExportError(f"{src}: cannot be exported so ({str(e).splitlines()[0]})") from None
    done = {**changes, **({"mpp": float(mpp)} if mpp is not None else {}),
            **({k: release[k] for k in ("none_prior", "none_shift")} if none_prior is not None else {}),
            "source": given if given.startswith("hf-hub:") else Path(src).name}  # not the cache's revision folder
    extra = {k: ckpt[k] for k in ("pretrain",) if k in ckpt}
    if hub_ready:

        out = {"spec": ckpt["spec"], "classes": ckpt["classes"], "epoch": ckpt.get("epoch"),
               "config": ckpt.get("config", {}), "history": ckpt.get("history", []), "export": done, **extra,
               **({"release": release} if release else {})}
        write_model_dir(dst, out, model, license=license, overwrite=overwrite)
        return done
    with writing(dst):
        save_checkpoint(dst, spec=ckpt["spec"], classes=ckpt["classes"], model=model, epoch=ckpt.get("epoch"),
                        config=ckpt.get("config", {}), history=ckpt.get("history", []), export=done, **extra,
                        **({"release": release} if release else {}))
    return done


def check_destination(dst: str | os.PathLike[str], *, overwrite: bool) -> None:
    """Refuse a ``dst`` that is a directory, or a file that exists unless ``overwrite``
    (it used to be replaced without a word: an exported model is often the only copy of a
    choice of options)."""
    dst = Path(dst)
    if dst.is_dir():
        raise ExportError(f"{dst}: is a directory; give the model file to write (or --encoder to write an encoder "
                          "directory)")
    if dst.exists() and not overwrite:
        raise ExportError(f"{dst}: exists; give --overwrite to replace it, or another name")


@contextmanager
def writing(dst: str | os.PathLike[str]) -> Iterator[None]:
    """Make the directories ``dst`` needs, run the body (which writes ``dst`` atomically);
    an OSError in either (a full or read-only disk) is an :class:`ExportError` naming
    ``dst``, after removing the directories made here (it used to be a traceback that
    left an empty directory)."""
    dst = Path(dst)
    missing = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as e:
        for folder in missing:  # deepest first; only those made here, only when empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise ExportError(f"{dst}: cannot write it ({e.strerror or e}); nothing was written") from None


def _pooling_spec(current: dict[str, Any] | None, name: str | None, none_class: str | None,
                  floor: float | None) -> dict[str, Any]:
    """The pooling extension's spec after the export options: ``name`` replaces the pooling
    and keeps what the new one takes of the old one's options (its "none" logit, its floor);
    ``none_class="off"`` and ``floor`` then set those options. An option the pooling does
    not take (a floor on votes, a none logit on features) is refused when the model is built."""
    spec = dict(current or {"name": "features"})
    if name is not None and name != spec["name"]:
        kept = (("none_class",) if name in VOTING_POOLINGS else ()) + (("floor", "eval_floor") if name in
                                                                         COUNTING_POOLINGS else ())
        if spec.get("none_class") and none_class != "off" and (refusal := none_class_refusal(name, "none_class")):
            raise ValueError(f"{refusal}; --none-class off drops the none logit")
        spec = {"name": name, **{k: spec[k] for k in kept if k in spec}}
    if none_class == "off" and spec.get("none_class"):
        spec["none_class"] = False
    if floor is not None:  # the floor the model reads at, and trains at with ats train --set init=...: one floor
        spec["floor"] = float(floor)
        spec.pop("eval_floor", None)
    return spec


def _check_values(mpp: float | None, eval_n_patches: int | None, eval_regions: int | None,
                  eval_coarse_px: int | None, count_floor: float | None) -> None:
    if mpp is not None and not mpp > 0:
        raise ExportError(f"--mpp must be > 0, got {mpp}")
    for flag, count in (("--eval-n-patches", eval_n_patches), ("--eval-regions", eval_regions),
                        ("--eval-coarse-px", eval_coarse_px)):
        if count is not None and count < 0:
            raise ExportError(f"{flag} must be >= 0, got {count}")
    if count_floor is not None and not 0 <= count_floor <= 1:
        raise ExportError(f"--count-floor must be in [0, 1], got {count_floor}")


# ------------------------------------------------ the Hugging Face Hub's form (ats_cli.hub reads it)


_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")
PLACEHOLDER_LICENSE = "unknown"


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
    paths. Refuses (:class:`ExportError`, one line) a ``dst`` that is a file
    or already holds one of them (unless ``overwrite``); the three are written to temporary
    files first and each replaces its name only when all are written, and a failed write
    leaves neither them nor the directories made for them."""
    import json

    from ats_cli.hub import CARD, CONFIG, FORMAT, RECORDS, VERSION, WEIGHTS, _import
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
    import torch

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
