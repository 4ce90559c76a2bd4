"""What a run's settling rules know of its dataset, read from the data: :class:`DataFacts`.

``ats train`` leaves some values to the data (:func:`ats_cli.config.settle` decides them
from the flags and these facts, without I/O). Reading the facts is this module's part, in
two steps, because the second depends on a decision of the first's facts:

* :func:`read_facts`: the hints, and from every training file's header its size and the
  microns per pixel it records;
* :func:`probe_images`: a look at the first :data:`AUTO_PROBE_IMAGES` training images, read
  as training will read them (the view scale and patch size the sizes rule settled from the
  headers), for the share of dark pixels and the tissue masks. Only when a value is left to
  the images (:func:`ats_cli.config.looks_at_images`).

:func:`ats_cli.config.settle_data` runs both around the one call of ``settle``. The facts
are saved with the reasons in ``RUN/settled.json`` (:func:`save_settled`) and read back by
``--resume`` (:func:`load_facts`), which then looks at nothing again. This module imports
nothing of the configuration (it takes the flags as they are), so that the configuration
can import it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ats_cli.data.dataset import Dataset

__all__ = ["AUTO_PROBE_IMAGES", "DARK", "SETTLED_JSON", "DataFacts", "SettledFileError", "load_facts",
           "probe_images", "read_facts", "save_settled"]

AUTO_PROBE_IMAGES = 16  # the first training images looked at
DARK = 0.05  # a low-res pixel at or below this in every channel is dark
SETTLED_JSON = "settled.json"


class SettledFileError(ValueError):
    """A ``RUN/settled.json`` that ats train did not write; the message names the file."""


@dataclass(frozen=True)
class DataFacts:
    """What the rules know of a dataset, as the run's reading keys (reader, level,
    tissue_mask) read it. Plain values, saved in ``RUN/settled.json``."""

    hints: Mapping[str, float] = field(default_factory=dict)  # dataset.json's usable n_patches, patch_size, scale
    channels: int = 1
    files: int = 0  # training files
    mpps: tuple[float, ...] = ()  # the microns per pixel the training files record (at level), ascending
    mpps_agree: bool = False  # every training file records one, all within the readers' tolerance
    no_mpp: str = ""  # the first training file that records none
    # slides and TIFFs among the training files that record no microns per pixel (or none that is a
    # microscope's), and the first whose recorded pixel size is no scale with why ("PATH: the TIFF
    # resolution tags, 72 pixels per inch ... not a microscope's scale"): ats train says it once
    unscaled: int = 0
    scale_unknown: str = ""
    probed: int = 0  # readable images among the first AUTO_PROBE_IMAGES training images; 0: not looked at
    dark: float = 0.0  # the median over those of the share of their low-res pixels that are dark
    masked: int = 0  # how many of those have a tissue mask (slides and TIFFs, tissue_mask auto)
    pretrained: str = ""  # where the feature net's pretrained starting weights come from; "": random
    no_pretrained: str = ""  # --feature-net auto on RGB images: why PRETRAINED_FEATURE_NET's weights cannot be had
    init_feature_net: str = ""  # --feature-net auto with init: the feature net of that checkpoint
    sizes: tuple[str, ...] = ()  # the first 3 distinct sizes of the training images as read ("HxW [at MPP µm/px]")
    n_sizes: int = 0  # how many distinct ones there are; 0: not read
    pixels: int = 0  # the largest training image's pixels, H x W as its header says; 0: not read
    long_side: int = 0  # the median of the training images' long sides (headers); 0: not read (sizes_for)
    # the largest height and the largest width among them (a step's views are padded to them); 0: not read
    frame_h: int = 0
    frame_w: int = 0
    position_hint: str = ""  # dataset.json hints.position_features ("on"/"off"); "": none
    pooling_hint: str = ""  # dataset.json hints.pooling, a registered pooling's name; "": none
    none_class_hint: str = ""  # dataset.json hints.none_class ("on"/"off"); "": none
    count_floor_hint: float = -1.0  # dataset.json hints.count_floor in [0, 1]; -1: none
    eval_count_floor_hint: float = -1.0  # dataset.json hints.eval_count_floor in [0, 1]; -1: none
    multilabel: bool = False  # the labels hold several classes per image
    ignored_hints: tuple[str, ...] = ()  # one line per dataset.json hint read as no hint (read_hints)

    @property
    def slides(self) -> bool:
        """Most images looked at have a tissue mask."""
        return self.masked * 2 > self.probed


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2] if values else 0


def read_facts(flags: Any, data: Dataset, *, hinted: Mapping[str, Any], ignored_hints: Sequence[str] = ()
               ) -> DataFacts:
    """The facts of ``data`` that its headers and hints give, as ``flags`` (a
    :class:`~ats_cli.config.TrainConfig`) read the training files: the microns per pixel
    of every training file and its size (headers only). ``hinted``: DataFacts' hint fields
    as :func:`ats_cli.config.read_hints` reads dataset.json's hints, with ``ignored_hints``
    its lines for those read as none. Deterministic, so every process of a run reads alike."""
    from ats_cli.data.inputs import file_header
    from ats_cli.data.slides import MPP_TOLERANCE

    reading = flags.input_options()
    records = data["train"]
    read = [file_header(r.path, reader=reading["reader"], level=reading["level"]) for r in records]
    headers = [(h.mpp, h.size) for h in read]
    recorded = [mpp for mpp, _ in headers]
    shapes = list(dict.fromkeys(f"{s[0]}x{s[1]}" + (f" at {m:.4g} µm/px" if m else "") for m, s in headers if s))
    known = sorted(m for m in recorded if m is not None)
    missing = [str(r.path) for r, m in zip(records, recorded, strict=True) if m is None]
    agree = bool(known) and not missing and known[-1] <= known[0] * (1 + MPP_TOLERANCE)
    unknown = next((f"{r.path}: {h.scale_unknown}" for r, h in zip(records, read, strict=True) if h.scale_unknown), "")
    return DataFacts(**hinted, ignored_hints=tuple(ignored_hints),
                     files=len(records), mpps=tuple(known), mpps_agree=agree, no_mpp=missing[0] if missing else "",
                     unscaled=sum(h.lazy and h.mpp is None for h in read), scale_unknown=unknown,
                     sizes=tuple(shapes[:3]), n_sizes=len(shapes),
                     pixels=max((s[0] * s[1] for _, s in headers if s), default=0),
                     long_side=_median([max(s) for _, s in headers if s]),
                     frame_h=max((s[0] for _, s in headers if s), default=0),
                     frame_w=max((s[1] for _, s in headers if s), default=0),
                     multilabel=bool(data.multilabel))


def probe_images(facts: DataFacts, flags: Any, data: Dataset, *, scale: float, patch_size: int,
                 view_cache: Any = None) -> DataFacts:
    """``facts`` with what the first :data:`AUTO_PROBE_IMAGES` training images show, read
    as training reads them: at ``scale`` (the view training reads: a two-level model's
    coarse one, as a 100k slide's view at the fine scale would be 3,125² pixels made for
    nothing) with ``patch_size`` patches, through ``view_cache``, where a slide's low-res
    view is then ready for training. An image that cannot be read is skipped (training
    names it when it reaches it)."""
    from ats_cli.data.inputs import ImageDataset, Unreadable

    probe = ImageDataset(data["train"][:AUTO_PROBE_IMAGES], channels=facts.channels, scale=scale,
                         patch_size=(patch_size, patch_size), view_cache=view_cache, **flags.input_options())
    dark, masked = [], 0
    for i in range(len(probe)):
        item = probe[i]
        if isinstance(item, Unreadable):
            continue
        dark.append(float((item[0].amax(0) <= DARK).float().mean()))
        masked += int(item[4] is not None)
    median = sorted(dark)[len(dark) // 2] if dark else 0.0
    return replace(facts, probed=len(dark), dark=round(median, 4), masked=masked)


def save_settled(run: str | Path, settled: Any, reasons: Sequence[Any]) -> None:
    """``RUN/settled.json`` (written whole or not at all): the reasons as printed, the
    model's microns per pixel and the facts they were settled from (``settled``: a
    :class:`~ats_cli.config.Settled`)."""
    from ats_cli.io import atomic_write_text

    record = {"reasons": [str(r) for r in reasons], "mpp": settled.mpp, "facts": asdict(settled.facts)}
    atomic_write_text(Path(run) / SETTLED_JSON, json.dumps(record, indent=2, ensure_ascii=False) + "\n")


def load_facts(run: str | Path) -> DataFacts | None:
    """The facts ``RUN/settled.json`` holds; None when it holds none (a run started by an
    older ats). Raises :class:`SettledFileError` naming the file for one ats did not write."""
    path = Path(run) / SETTLED_JSON
    if not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text())["facts"]
        return DataFacts(**{**facts, "mpps": tuple(facts["mpps"]), "sizes": tuple(facts.get("sizes", ())),
                            "ignored_hints": tuple(facts.get("ignored_hints", ()))})
    except (ValueError, KeyError, TypeError) as e:
        raise SettledFileError(f"{path}: not a settled.json written by ats train ({e})") from None
