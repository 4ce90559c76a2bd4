"""The two-level (nested, coarse-to-fine) attention-sampling model, readable top to bottom.

    coarse view of the whole image --coarse attention net--> cell scores
        --log-mean-exp per region of the grid (tissue cells only)--> softmax: a over the regions
    a --draw k regions--> each region's own view, read at the fine scale
        (from the pyramid level that matches it: :meth:`ats_cli.data.slides.SlideReader.read_view`)
    region view --fine attention net--> b^r over its cells --draw n--> n patches at full resolution
    patches --feature net--> v --nested estimator (ats_cli.core.nested)--> pooled --readout--> logits

A step reads one coarse view, k region views of a fixed size and k*n patches: its memory
and time are set by k, n, the region size and the two scales, never by the image's size.
The coarse view is at ``coarse_scale`` = ``coarse_px`` pixels per region side (``ats train
``coarse_px``, 4 by default), so it holds ``coarse_px**2`` pixels per region: a 200k-pixel
slide cut into 4096-pixel regions has a 195x195 coarse view where a one-level model at
1/32 would need 6250x6250 (docs/slides.md has the cost analysis).

:class:`NestedATSModel` is an :class:`~ats_cli.core.model.ATSModel` (its fine attention net,
feature net, classifier and extension slots are the same modules, under the same names,
so whatever trains, freezes or checks them works unchanged) with a second attention net,
``coarse_net``, in front. Its output is an :class:`NestedOutput`: the patches' fields as a
one-level model fills them (weights: each patch's weight in the pooled estimate, the
product of its region's and its own), plus the regions'.

What the extensions do here: the support (tissue mask, ``bright``) restricts both levels
(a region is drawn only if some coarse cell of it is kept; in a drawn region the fine cells
kept are those under the coarse mask and, for a tissue mask, those of the region's own
view above the saturation that splits the coarse view as the mask does:
:meth:`NestedATSModel._region_mask`); the prior shifts the coarse cells' scores
(and so the regions') and the fine cells' (its ``within_region`` form: the rarity prior
uncapped, so that a region's fine attention starts on its most unusual object); the gain
multiplies the features. Each is a
function of the input alone at its level, so the derivation in :mod:`ats_cli.core.nested`
holds. ``counts`` pooling needs the attention around each patch on one grid and is
refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.core.model import ATSModel, ATSOutput, pixels_to_float
from ats_cli.core.nested import (
    NestedConfigError,
    cell_regions,
    check_regions,
    nested_expectation,
    region_grid,
    region_offsets,
    region_scores,
)
from ats_cli.core.sampling import attention_distribution, entropy, estimator_threshold, estimator_weights, sample
from ats_cli.core.source import Sources, positions_to_offsets, source_sizes
from ats_cli.extensions.pooling_counts import CountPooling

__all__ = ["NestedATSModel", "NestedOutput", "region_views", "coarse_scale_for"]

def coarse_scale_for(region_size: int, coarse_px: int) -> float:
    """The coarse view's scale that gives each region ``coarse_px`` pixels per side."""
    return coarse_px / float(region_size)


@dataclass
class NestedOutput(ATSOutput):
    """An :class:`ATSOutput` whose ``attention`` is the coarse attention over the region
    grid [B, rows, cols] and whose patch fields run over the k*n patches, region by region
    (``sampled_probs``: the fine attention at each patch within its region; ``weights``:
    its weight in the pooled estimate, region weight x patch weight), plus the regions'."""

    region_size: int = 0  # full-resolution pixels per region side
    region_indices: torch.Tensor | None = None  # [B, k] flat positions on the region grid, in draw order
    region_offsets: torch.Tensor | None = None  # [B, k, 2] top-left (row, col) of each region, full resolution
    region_probs: torch.Tensor | None = None  # [B, k] the coarse attention at the drawn regions
    region_weights: torch.Tensor | None = None  # [B, k] the outer estimator weights W_r, detached
    region_contributions: torch.Tensor | None = None  # [B, k] the sum of the region's patches' contributions
    fine_attention: torch.Tensor | None = None  # [B, k, fh, fw] each drawn region's fine attention


def _resize(views: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of float views [N, C, h, w], as the low-res view is made."""
    if tuple(views.shape[-2:]) == tuple(size):
        return views
    return F.interpolate(views, size=size, mode="bilinear", align_corners=False, antialias=True)


def region_views(sources: Sources, offsets: torch.Tensor, region: int, view_size: tuple[int, int]) -> torch.Tensor:
    """Views [B, k, C, vh, vw] (float, [0, 1]) of the regions at ``offsets`` [B, k, 2]
    (full-resolution pixels, ``region`` on a side), resized to ``view_size``. A source with
    a ``read_view`` (a slide reader) reads each from the pyramid level that matches the view;
    any other reads the region whole and resizes it (in-memory images)."""
    B, k = offsets.shape[:2]
    if isinstance(sources, torch.Tensor):
        from ats_cli.core.patches import extract_patches

        crops = pixels_to_float(extract_patches(sources, offsets.to(sources.device), (region, region)))
        return _resize(crops.flatten(0, 1), view_size).view(B, k, -1, *view_size)
    out = []
    for src, off in zip(sources, offsets.cpu(), strict=True):
        read = getattr(src, "read_view", None)
        if read is not None:
            out.append(read(off, (region, region), view_size))
        else:
            out.append(_resize(pixels_to_float(src.read_patches(off, (region, region))), view_size))
    return torch.stack(out)


def _mask_under(mask: torch.Tensor, image_size: tuple[int, int], offsets: torch.Tensor, region: int,
                view_size: tuple[int, int]) -> torch.Tensor:
    """[B*k, vh, vw] bool: the coarse mask ``mask`` [B, h, w] (on the coarse view's pixels)
    under each pixel of each region view; False outside the image."""
    B, h, w = mask.shape
    H, W = image_size
    vh, vw = view_size
    off = offsets.to(mask.device).double()  # [B, k, 2]
    rows = off[..., 0:1] + (torch.arange(vh, device=mask.device, dtype=torch.float64) + 0.5) * (region / vh)
    cols = off[..., 1:2] + (torch.arange(vw, device=mask.device, dtype=torch.float64) + 0.5) * (region / vw)
    inside = (rows < H)[..., :, None] & (cols < W)[..., None, :]  # [B, k, vh, vw]
    mr = torch.floor(rows * (h / H)).long().clamp_(0, h - 1)  # [B, k, vh]
    mc = torch.floor(cols * (w / W)).long().clamp_(0, w - 1)
    b = torch.arange(B, device=mask.device)[:, None, None, None]
    picked = mask[b, mr[..., :, None], mc[..., None, :]]
    return (picked & inside).flatten(0, 1)


def _saturation(x: torch.Tensor) -> torch.Tensor:
    """HSV saturation [N, h, w] of RGB views [N, 3, h, w] in [0, 1] (0 where black)."""
    hi, lo = x.amax(1), x.amin(1)
    return torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), 0.0)


def _saturation_split(low: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """[B] a saturation threshold that splits each coarse view ``low`` [B, 3, h, w] as its
    ``mask`` [B, h, w] does (NaN for an image whose mask is not such a split), or None for
    views that are not RGB. The tissue mask is Otsu's threshold on this saturation
    (:func:`ats_cli.data.slides.tissue_mask`): its glass lies below, its tissue above. The
    5% and 95% quantiles, not the extremes, so that the colour augmentation (applied after
    the mask was made) blurring a few pixels across the split does not lose it."""
    if low.shape[1] != 3:
        return None
    sat = _saturation(low.float()).flatten(1)
    keep = mask.flatten(1).to(sat.device)
    out = torch.full((len(sat),), float("nan"), device=sat.device)
    for b in range(len(sat)):
        tissue, glass = sat[b][keep[b]], sat[b][~keep[b]]
        if len(tissue) and len(glass):
            top, bottom = torch.quantile(glass, 0.95), torch.quantile(tissue, 0.05)
            if top < bottom:
                out[b] = (top + bottom) / 2
    return out


class NestedATSModel(ATSModel):
    """Two-level attention sampling (module docstring). ``coarse_net``: the attention net of
    the coarse view, whose view is made at ``coarse_scale`` (this model's :attr:`scale`, the
    one every reader makes ``low`` at); ``attention_net``: the fine attention net, on each
    drawn region's view at ``fine_scale``. ``regions`` regions of ``region_size``
    full-resolution pixels are drawn (``eval_regions`` in evaluation, at most the grid's
    cells; 0 = ``regions``), then ``n_patches`` (``eval_n_patches`` in evaluation) patches in
    each; ``region_temperature``: how close a region's score is to its largest cell's
    (:func:`~ats_cli.core.nested.region_scores`). Why more regions at evaluation: as for
    patches, they cost no gradient memory, the estimate stays unbiased for any k, and a few
    drawn regions can miss the one that decides the label where several regions look alike
    at the coarse scale. The other arguments are :class:`ATSModel`'s."""

    takes_mixed_views = False  # images of different sizes have different region grids: batched by size


    def __init__(self, coarse_net: nn.Module, attention_net: nn.Module, feature_net: nn.Module, n_classes: int, *,
                 regions: int, region_size: int, coarse_scale: float, scale: float, eval_regions: int = 0,
                 eval_coarse_scale: float = 0.0, region_temperature: float = 1.0, **kwargs: Any):
        self.eval_coarse_scale = float(eval_coarse_scale)  # 0 = coarse_scale; before super() sets scale
        super().__init__(attention_net, feature_net, n_classes, scale=coarse_scale, **kwargs)
        if isinstance(self.pooling, CountPooling):
            raise NestedConfigError("pooling counts (and highest-counts, topmost-counts) needs one attention "
                                    "grid; use features, highest or votes with levels 2")
        self.coarse_net = coarse_net
        self.regions = int(regions)
        self.eval_regions = int(eval_regions)  # 0 = regions
        self.region_size = int(region_size)
        self.fine_scale = float(scale)
        self.region_temperature = float(region_temperature)  # core.nested.region_scores
        if self.regions < 1:
            raise NestedConfigError(f"regions {regions}: must be >= 1")
        if not self.region_temperature > 0:
            raise NestedConfigError(f"region_temperature {region_temperature}: must be > 0")
        if self.region_size % self.patch_size[0] or self.region_size % self.patch_size[1]:
            raise NestedConfigError(f"region_size {region_size} is not a multiple of the patch side "
                                    f"{self.patch_size[0]}: the patches of a region would not tile it")

    @property
    def scale(self) -> float:
        """The scale of the coarse view a reader makes for this model now: ``coarse_scale``
        in training, ``eval_coarse_scale`` (0 = the same; ``eval_coarse_px`` of ats train or
        ``--eval-coarse-px`` of ats export) in evaluation. Why a finer view at prediction can pay: where the coarse
        attention is mostly the prior's, a fixed function of the pixels, a nest under one
        coarse pixel gains contrast at twice the pixels, and the trained fine attention,
        features and gain are unchanged; the estimate stays unbiased for whatever attention
        the view gives (:mod:`ats_cli.core.nested`). The forward pass maps cells to regions from the
        view's own shape, so any scale works; the cost is the coarse view's pixels."""
        if not self.training and self.eval_coarse_scale:
            return self.eval_coarse_scale
        return self.coarse_scale

    @scale.setter
    def scale(self, value: float) -> None:
        self.coarse_scale = float(value)

    def regions_for(self, grid: tuple[int, int]) -> int:
        """The regions drawn now on a grid of ``grid`` cells: ``regions`` in training,
        ``eval_regions`` (or ``regions``) in evaluation, there at most the grid's cells."""
        if self.training or not self.eval_regions:
            return self.regions
        return min(self.eval_regions, grid[0] * grid[1])

    @property
    def view_size(self) -> tuple[int, int]:
        """(vh, vw): a region's view at the fine scale (at least 1x1)."""
        side = max(1, round(self.region_size * self.fine_scale))
        return side, side

    def _region_mask(self, low: torch.Tensor, mask: torch.Tensor, views: torch.Tensor, image_size: tuple[int, int],
                     roff: torch.Tensor) -> torch.Tensor:
        """[B*k, vh, vw] the region views' pixels that may be sampled: those under the coarse
        ``mask`` and, when that mask is a saturation split of the coarse view (a tissue mask),
        those above the same split in the region view itself, so that a region at the
        tissue's edge does not draw patches on the glass beside it (the coarse mask has only
        ``coarse_px`` pixels per region side). A function of the input alone: unbiased."""
        B, k = roff.shape[:2]
        under = _mask_under(mask, image_size, roff, self.region_size, self.view_size)
        split = _saturation_split(low, mask)
        if split is None:
            return under
        t = split.repeat_interleave(k)[:, None, None]  # NaN: no split, every pixel under the mask
        return under & ~(_saturation(views.float()) <= t)

    def coarse_attention(self, low: torch.Tensor, image_size: tuple[int, int], mask: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """[B, rows * cols] the coarse attention over the region grid of images of ``image_size``
        (full resolution) from their coarse views ``low``; ``mask`` [B, h, w] e.g. tissue."""
        return self._coarse(low, image_size, mask)[0]

    def _coarse(self, low: torch.Tensor, image_size: tuple[int, int], mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The coarse attention [B, regions] (:meth:`coarse_attention`) and the prior's own
        region scores [B, regions] (None without a prior), whose softmax is where the coarse
        attention starts (the regulariser's reference: ATSModel._explore)."""
        grid = check_regions(image_size, self.region_size, self.regions, self.patch_size)
        scores, keep, prior = self._scores_and_support(self.coarse_net, low, mask)
        att_shape = tuple(scores.shape[-2:])
        cells = cell_regions(att_shape, tuple(low.shape[-2:]), getattr(self.coarse_net, "margin", 0), image_size,
                             self.region_size, low.device)
        kept = None if keep is None else keep.flatten(1)

        def per_region(cell_scores: torch.Tensor) -> torch.Tensor:
            return region_scores(cell_scores.flatten(1), cells, grid[0] * grid[1], kept, self.region_temperature)

        rs = per_region(scores)
        if not torch.isfinite(rs).any(1).all():
            raise NestedConfigError(f"the coarse view ({low.shape[-1]}x{low.shape[-2]}) has no cell in any kept "
                                    f"region of {self.region_size} pixels; give larger regions")
        return torch.softmax(rs, dim=1), None if prior is None else per_region(prior.to(scores.dtype))

    def forward(
        self,
        low: torch.Tensor,
        sources: Sources,
        *,
        n_patches: int | None = None,
        generator: torch.Generator | None = None,
        return_patches: bool = False,
        support_mask: torch.Tensor | None = None,
        patch_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        view_sizes: torch.Tensor | None = None,
        feature_keys: list[str | None] | None = None,
    ) -> NestedOutput:
        """As :meth:`ATSModel.forward`, ``low`` being the coarse views [B, C, h, w] and
        ``n_patches`` the patches per region. ``view_sizes`` (a batch of views of different
        sizes, padded) is refused: images of different sizes have different region grids.
        ``feature_keys``: as :meth:`ATSModel.forward`; the fine patches' offsets are in the
        image's own pixels, as one level's are, so a patch drawn again from another region
        draw is read back too."""
        n = self.patches_now if n_patches is None else int(n_patches)
        R = self.region_size
        sizes = source_sizes(sources)
        if view_sizes is not None or not bool((sizes == sizes[0]).all()):
            raise NestedConfigError("images of different sizes in one batch have different region grids; use "
                                    "--batch-size 1")
        image_size = (int(sizes[0, 0]), int(sizes[0, 1]))
        B = low.shape[0]
        estimator = self.active_estimator

        # ---- the coarse level: k regions drawn from a over the region grid
        a, region_prior = self._coarse(low, image_size, support_mask)
        grid = region_grid(image_size, R)  # checked with regions by coarse_attention
        k = self.regions_for(grid)
        outer = sample(a, k, replace=self.replace, generator=generator)
        outer_w = estimator_weights(outer.probs, replace=self.replace,
                                    threshold=estimator_threshold(estimator, outer, a))
        roff = region_offsets(outer.indices, grid, R).to(low.device)  # [B, k, 2]

        # ---- the fine level: n patches drawn from b^r in each drawn region's own view
        vs = self.view_size
        views = region_views(sources, roff, R, vs).to(low.device).flatten(0, 1)  # [B*k, C, vh, vw]
        # the training augmentation's per-image colours on the region views too, never its flips
        # (a view's geometry is its cells' positions, as for the coarse view: Augmentation.low)
        colour = getattr(getattr(patch_transform, "__self__", None), "colour", None)
        if colour is not None:
            views = colour(views.view(B, k, *views.shape[1:])).flatten(0, 1)
        mask = None if support_mask is None else self._region_mask(low, support_mask.to(low.device), views,
                                                                    image_size, roff)
        fscores, fkeep, fprior = self._scores_and_support(self.attention_net, views, mask, within_region=True)
        fatt = tuple(fscores.shape[-2:])
        b = attention_distribution(fscores, fkeep)  # [B*k, K_f]
        inner = sample(b, n, replace=self.replace, generator=generator)
        inner_w = estimator_weights(inner.probs, replace=self.replace,
                                    threshold=estimator_threshold(estimator, inner, b))
        within = positions_to_offsets(inner.indices, fatt, (R, R), self.patch_size, low_size=vs,
                                      margin=getattr(self.attention_net, "margin", 0))  # [B*k, n, 2]
        offsets = (within.view(B, k, n, 2) + roff[:, :, None, :].to(within.device)).view(B, k * n, 2)

        # ---- the patches, their values and the nested estimate
        patches, unit, gain = self.drawn_features(sources, offsets, low.device, feature_keys=feature_keys,
                                                  patch_transform=patch_transform, return_patches=return_patches)
        feats = (unit if gain is None else gain * unit).view(B, k * n, -1)
        values = self.pooling.values(feats, self.classifier, None)
        pooled, _ = nested_expectation(values.view(B, k, n, -1), outer.probs, inner.probs.reshape(B, k, n),
                                       outer_w, inner_w.reshape(B, k, n))
        weights = (outer_w[:, :, None] * inner_w.reshape(B, k, n)).reshape(B, k * n).detach()
        with torch.no_grad():
            size = self.pooling.sizes(values, None if gain is None else gain.view(B, k * n))
            contributions = weights.double() * size.double()
        # the regulariser keeps both levels exploring: H(a) + the mean of the drawn regions' H(b^r),
        # with a prior each -KL to where the prior starts that level (ATSModel._explore)
        ent_a, ent_b = entropy(a), entropy(b)
        ent = ent_a + ent_b.view(B, k).mean(1)
        explore = self._explore(a, ent_a, region_prior, None) + \
            self._explore(b, ent_b, fprior, fkeep).view(B, k).mean(1)
        return NestedOutput(
            logits=self.pooling.readout(pooled, self.classifier),
            attention=a.view(B, *grid),
            indices=inner.indices.reshape(B, k * n),
            offsets=offsets,
            sampled_probs=inner.probs.reshape(B, k * n),
            entropy=ent,
            weights=weights,
            contributions=contributions,
            patch_logits=self.classifier(feats),
            patches=patches if return_patches else None,
            region_size=R,
            region_indices=outer.indices,
            region_offsets=roff,
            region_probs=outer.probs.detach(),
            region_weights=outer_w.detach(),
            region_contributions=contributions.view(B, k, n).sum(2),
            fine_attention=b.detach().view(B, k, *fatt),
            explore=explore,
        )
