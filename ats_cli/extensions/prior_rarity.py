"""``rarity``: the attention starts where the image looks unusual.

The log-prior of a pixel is ``weight * r``, ``r`` = :func:`rarity`, how unusual its colour
is within its own image (1 for a typical pixel): a cell's probability is multiplied by
``exp(weight * r)``, so one twice as unusual as the typical one gets ``e^weight`` times its
mass. Why: at initialisation the attention is uniform over the support, and where the
label hides in a few small regions (a few tumour nests among thousands of tissue cells)
the draws almost never show one, so neither network gets a signal. Regions that decide a
label usually look unlike the rest of the image (dense nuclei on stroma, a digit on a
blank canvas), so the attention starts there, and the attention net, whose last layer
starts at zero, learns its correction on top.

``cap`` (optional): the log-prior is ``weight * min(r, cap)``, so every cell at least ``cap``
times as unusual as the typical one starts alike. Why: the prior is to say where to look,
not which of the unusual cells matters, and without a cap a large weight hands the whole
mass to the single most unusual cell: on the coarse level of a two-level model the
estimate then becomes one region's, often a look-alike's
(benchmarks/slides.md#the-coarse-attentions-start-rarity-prior-cap-and-region-temperature).
``weight * (cap - 1)`` nats is the most a capped prior favours a cell over a
typical one. Within a region of a two-level model (:meth:`within_region`) the prior is not
capped: there the mass should go to the region's most unusual object, which the capped
prior shares with every cell past the cap (benchmarks/slides.md#runs-at-chance).

Unbiased: ``r`` and its cap are a fixed function of the input, computed without gradient
(:mod:`ats_cli.extensions.prior`).
"""

from __future__ import annotations

import torch

from ats_cli.extensions.prior import Prior
from ats_cli.registry import ExtensionError, register_extension

__all__ = ["RarityPrior", "rarity"]


def rarity(low: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """How unusual each low-res pixel is within its own image, [B, 1, h, w] >= 0.

    ``r = |x - m| / s``: the Euclidean distance of the pixel's colour (all channels) from
    ``m``, the per-channel median over the image's supported pixels (``keep`` [B, 1, h, w],
    None = all), in units of ``s``, the median of those distances: a typical pixel has
    r ~ 1, whatever the stain, brightness or contrast of the image. Medians, not means and
    standard deviations, so that the few unusual pixels being looked for do not set the
    scale they are measured in.

    Computed for the whole batch at once, with no value read back from the device (an
    image without a supported pixel uses all of them, chosen on the device): the medians
    are order statistics of the supported values, sorted with the others set to +inf;
    with every pixel supported (``keep`` None: no support, no tissue mask), torch's own
    median, a selection 4-6x cheaper than the sort on a CPU and the same value.
    """
    with torch.no_grad():
        x = low.float().flatten(2)  # [B, C, h*w]
        chosen = None
        if keep is not None:
            chosen = keep.flatten(1).to(x.device)
            chosen = chosen | ~chosen.any(1, keepdim=True)  # none supported: all of them
        centre = _median(x, None if chosen is None else chosen[:, None])[..., None]  # [B, C, 1]
        # the norm written out: torch's strided norm over the channel axis is much slower on a CPU
        dist = (x - centre).square().sum(1).sqrt()  # [B, h*w]
        ref = _median(dist, chosen).clamp_min(1e-3)
        return (dist / ref[:, None]).view(low.shape[0], 1, *low.shape[-2:])


# Rows at least this long take the CPU's selection: below it a row sorts in well under a
# millisecond and the per-row loop would cost more than it saves (a training batch of small
# views holds many short rows); the sort path stays the one a GPU takes, read-back free.
SELECT_FROM = 1 << 16


def _median(values: torch.Tensor, chosen: torch.Tensor | None) -> torch.Tensor:
    """``torch.median`` (the lower middle value) of ``values`` [..., N] over the entries
    ``chosen`` (bool, broadcast to it; at least one per row; None: all of them), per row."""
    if chosen is None:  # every entry: one batched selection on any device, nothing read back
        return values.median(dim=-1).values
    if values.device.type == "cpu" and values.shape[-1] >= SELECT_FROM:
        # a selection, not a sort (a slide's coarse view holds millions of cells);
        # per row, as rows hold different counts -- reading them is free on a CPU, not on a GPU
        rows, keep = values.reshape(-1, values.shape[-1]), chosen.expand_as(values).reshape(-1, values.shape[-1])
        picked = [torch.kthvalue(v[k], (int(k.sum()) + 1) // 2).values for v, k in zip(rows, keep, strict=True)]
        return torch.stack(picked).view(values.shape[:-1])
    return _median_by_sort(values, chosen)


def _median_by_sort(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """:func:`_median` with no value read back from the device: the chosen values sorted, the
    others set to +inf, and each row's middle gathered."""
    chosen = chosen.expand_as(values)
    ranked = values.masked_fill(~chosen, torch.inf).sort(dim=-1).values
    middle = (chosen.sum(-1, keepdim=True) - 1) // 2
    return ranked.gather(-1, middle)[..., 0]


@register_extension("prior", "rarity")
class RarityPrior(Prior):
    def __init__(self, *, weight: float, cap: float | None = None):
        super().__init__()
        if not weight > 0:
            raise ExtensionError(f"prior 'rarity': weight must be > 0, got {weight}")
        if cap is not None and not cap > 1:
            raise ExtensionError(f"prior 'rarity': cap must be > 1 (the typical cell's rarity), got {cap}")
        self.weight = float(weight)
        self.cap = None if cap is None else float(cap)

    def forward(self, low: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        r = rarity(low, keep)
        return self.weight * (r if self.cap is None else r.clamp(max=self.cap))

    def within_region(self, low: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return self.weight * rarity(low, keep)
