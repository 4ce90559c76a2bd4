"""The plain records the renderers draw: numbers and pixels, no tensors and no model.

A record is read off a model's output once (:meth:`AttentionRecord.from_output`, by
attribute access alone, so that this package imports no model code and a prediction can
build one without importing the figures), and every consumer, the PNG figure and the
GeoJSON file alike, draws what the record says instead of recomputing what the model
knew.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["AttentionRecord", "DigitBox", "LevelFrame", "PatchSite", "RegionSite", "level_frame", "parse_boxes",
           "patch_sites"]


@dataclass(frozen=True)
class LevelFrame:
    """Where the model's "full resolution" sits in the file: the level patches are read
    from, the downsample d (level-0 pixels per pixel of it: the level's times the
    resampling factor when the slide is read at the model's microns per pixel), its size
    and level 0's."""

    level: int
    downsample: float
    size: tuple[int, int]  # (H, W) of the level patches are read from
    size0: tuple[int, int]  # (H, W) at level 0
    mpp: tuple[float, float] | None = None  # level-0 microns per pixel (y, x), when the file says


def level_frame(source) -> LevelFrame:
    """The :class:`LevelFrame` of a patch source: a slide reader's chosen level and its
    downsample (a source that has a ``patch_downsample``), or level 0 (d = 1) for an
    image read whole."""
    downsample = getattr(source, "patch_downsample", None)
    H, W = (int(v) for v in source.size)
    if downsample is None:
        return LevelFrame(0, 1.0, (H, W), (H, W), None)
    mpp = getattr(source, "mpp", None)
    return LevelFrame(int(source.level), float(downsample), (H, W), tuple(int(v) for v in source.dimensions),
                      tuple(mpp) if mpp else None)


@dataclass(frozen=True)
class DigitBox:
    """An object recorded by a generator: class and box (top-left row, col; h, w) in full-res pixels."""

    cls: str
    row: int
    col: int
    h: int
    w: int


def parse_boxes(text: str | None) -> list[tuple[str, int, int, int, int]]:
    """A dataset CSV's ``boxes``/``digits`` cell, ``[[class, row, col, h, w], ...]`` in
    level-0 pixels; [] when absent or malformed."""
    if not text:
        return []
    try:
        return [(str(c), int(r), int(k), int(h), int(w)) for c, r, k, h, w in json.loads(text)]
    except (ValueError, TypeError):
        return []


def _numpy(tensor, dtype) -> np.ndarray:
    return np.asarray(tensor.detach().cpu().numpy(), dtype=dtype)


@dataclass(frozen=True)
class RegionSite:
    """One region a two-level model drew (:mod:`ats_cli.core.nested_model`): its top-left
    (row, col) and side in full-res pixels, its draw number (1-based), the coarse attention
    it was drawn with, its weight in the estimate, its share of the prediction, the fine
    attention over its own view and where that map lies (left, right, bottom, top; full-res
    pixels, the region less the fine attention net's margin)."""

    row: int
    col: int
    size: int
    draw: int
    attention: float
    weight: float
    contribution: float | None
    fine: np.ndarray  # [fh, fw], sums to 1
    fine_extent: tuple[float, float, float, float]


def _region_sites(model, output, b: int) -> tuple[RegionSite, ...] | None:
    """Row ``b``'s drawn regions, for a two-level model's output; None for one level."""
    if getattr(output, "region_offsets", None) is None:
        return None
    size = int(output.region_size)
    vh, vw = (int(v) for v in model.view_size)
    m = int(getattr(getattr(model, "attention_net", None), "margin", 0))
    contributions = getattr(output, "region_contributions", None)
    sites = []
    for j, (r, c) in enumerate(_numpy(output.region_offsets[b], np.int64).reshape(-1, 2).tolist()):
        ry, rx = size / vh, size / vw
        sites.append(RegionSite(int(r), int(c), size, j + 1, float(output.region_probs[b, j]),
                                float(output.region_weights[b, j]),
                                None if contributions is None else float(contributions[b, j]),
                                _numpy(output.fine_attention[b, j], np.float64),
                                (c + m * rx, c + (vw - m) * rx, r + (vh - m) * ry, r + m * ry)))
    return tuple(sites)


@dataclass
class AttentionRecord:
    """One image's attention and sampled patches, in numbers, with where they sit in the file."""

    attention: np.ndarray  # [att_h, att_w], sums to 1
    offsets: np.ndarray  # [n, 2] (row, col) top-left of each patch, in the patch level's pixels, draw order
    sampled_probs: np.ndarray  # [n]
    weights: np.ndarray | None  # [n] the estimator weights the estimate used; None for a model without
    contributions: np.ndarray | None  # [n] each draw's share of the prediction; None for a model without
    patch_size: tuple[int, int]
    low_size: tuple[int, int]
    margin: int
    frame: LevelFrame
    # a two-level model's drawn regions (``attention`` is then its coarse attention over the
    # region grid, ``sampled_probs`` each patch's fine attention within its region); None: one level
    regions: tuple[RegionSite, ...] | None = None
    # tile-mil (ats_cli.baselines_tilemil): the attention's cells are the model's tiles, of this
    # side in the patch level's pixels, cell (i, j) at (i * tile, j * tile); 0: the low-res view's cells
    tile: int = 0

    @property
    def region_grid(self) -> tuple[int, int] | None:
        """(rows, cols) of a two-level model's region grid: its coarse attention's shape."""
        return None if self.regions is None else (int(self.attention.shape[0]), int(self.attention.shape[1]))

    @classmethod
    def from_output(cls, model, opened, output, b: int = 0) -> AttentionRecord:
        """Row ``b`` of a model output (its attention, offsets, weights, contributions) for
        the input ``opened`` (an OpenedImage: its low-res view and patch source)."""

        def row(values):
            return None if values is None else _numpy(values[b], np.float64)

        attention = output.attention[b]
        grids = getattr(output, "grids", None)
        if grids:  # a batch of views of different sizes: this image's own grid, not the padding
            attention = attention[:grids[b][0], :grids[b][1]]
        return cls(
            attention=_numpy(attention, np.float64),
            offsets=_numpy(output.offsets[b], np.int64).reshape(-1, 2),
            sampled_probs=_numpy(output.sampled_probs[b], np.float64),
            weights=row(getattr(output, "weights", None)),
            contributions=row(getattr(output, "contributions", None)),
            patch_size=tuple(int(v) for v in model.patch_size),
            low_size=tuple(int(v) for v in opened.low.shape[-2:]),
            margin=int(getattr(getattr(model, "attention_net", None), "margin", 0)),
            frame=level_frame(opened.source),
            regions=_region_sites(model, output, b),
            tile=int(getattr(model, "tile_size", 0)),
        )


@dataclass(frozen=True)
class PatchSite:
    """One distinct sampled patch location: its top-left (row, col) in full-res pixels, the
    draws that chose it (1-based draw numbers), its attention probability, its total
    estimator weight (the attention when the weights are unknown), the index of its first
    draw in the model's outputs and its total share of the prediction (the weight when
    that is unknown), which ranks the sites."""

    row: int
    col: int
    draws: tuple[int, ...]
    attention: float
    weight: float
    index: int
    contribution: float


def patch_sites(offsets: Sequence[Sequence[int]], attention: Sequence[float],
                weights: Sequence[float] | None = None,
                contributions: Sequence[float] | None = None) -> list[PatchSite]:
    """The sampled patches grouped by location (with replacement a location can be drawn
    several times; its weight and contribution are then the sums of its draws'), ranked
    by contribution, then weight, then attention, whichever is known first, most first;
    ties keep draw order."""
    sites: dict[tuple[int, int], dict] = {}
    for i, (r, c) in enumerate(offsets):
        site = sites.setdefault((int(r), int(c)), {"draws": [], "weight": 0.0, "share": 0.0, "index": i,
                                                   "attention": float(attention[i])})
        first = not site["draws"]
        site["draws"].append(i + 1)
        w = float(attention[i]) if weights is None else float(weights[i])
        if weights is not None or first:  # without weights a place counts its attention once
            site["weight"] += w
        if contributions is not None:
            site["share"] += float(contributions[i])
    for site in sites.values():
        if contributions is None:
            site["share"] = site["weight"]
    ordered = sorted(sites.items(), key=lambda kv: (-kv[1]["share"], kv[1]["index"]))
    return [PatchSite(r, c, tuple(v["draws"]), v["attention"], v["weight"], v["index"], v["share"])
            for (r, c), v in ordered]
