"""Training-time augmentation (``ats train --augment``): stain (HED) jitter,
brightness/contrast, and flips/rot90 of the sampled patches.

Why here and not in the loader: the full-resolution image is never decoded (a slide is read
lazily, patch by patch, inside :meth:`ats_cli.core.model.ATSModel.forward`), so there is no
whole image to transform. Instead the parameters are drawn per image in the training step
and applied twice, alike: to the low-res view the loader made (:meth:`Augmentation.low`) and
to that image's patches once they are gathered (:meth:`Augmentation.patches`, the model's
``patch_transform`` hook). The colour transforms are per-pixel functions, so a transformed
patch is exactly the patch of the transformed image; the low-res view is an average of
full-resolution pixels, and the transform of an average is close to, not exactly, the
average of the transforms (the log and exp below are not linear), which is the same
approximation the tissue mask and the rarity prior already make on that view.

Flips and rotations by 90 degrees are applied to each patch on its own and never to the
low-res view: the view keeps its geometry, so the sampled positions, the offsets the
patches are read at and the attention map stay right. A patch's content is then seen in
one of the 8 orientations of the square (4 for a non-square patch), which is what teaches
the feature net that tissue has no "up".

The draws come from a generator seeded by the caller (training: from the step's seed), so
a resumed run draws what an uninterrupted one did. Nothing is learned here and nothing is
saved in the model: prediction never augments.

Stain model: colour deconvolution (Ruifrok & Johnston, "Quantification of histochemical
staining by color deconvolution", Analytical and Quantitative Cytology and Histology
23(4):291-299, 2001). By Beer-Lambert, a pixel's optical density ``OD = -log(I)`` (I in
(0, 1], per RGB channel) is a sum of each stain's amount times that stain's OD vector:
``OD = stains @ M`` with the rows of ``M`` the haematoxylin, eosin and DAB vectors of the
paper. So ``stains = OD @ inv(M)``; the jitter scales and shifts each stain's amount,
``stains' = alpha * stains + beta``, and ``I' = exp(-(stains' @ M))``: "more eosin" or "a
bluer haematoxylin batch" rather than an arbitrary hue shift. This is the HED jitter of
Tellez et al. (2018, "Whole-slide mitosis detection in H&E breast histology using PHH3 as a
reference to train distilled stain-invariant convolutional networks", IEEE TMI 37(9)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ats_cli.core.source import to_device

__all__ = ["MODES", "RUIFROK_HED", "STAIN_SCALE", "STAIN_SHIFT", "BRIGHTNESS", "CONTRAST", "Augmentation",
           "brightness_contrast", "dihedral", "hed_jitter"]

# what ``--augment`` accepts besides ``auto`` (ats_cli.train settles auto)
MODES = ("none", "colour", "colour+flips")

# The OD vectors (rows: haematoxylin, eosin, DAB; columns: R, G, B) of Ruifrok & Johnston
# (2001), as published (each row has norm ~1); skimage.color.rgb2hed uses the same matrix.
RUIFROK_HED = ((0.65, 0.70, 0.29), (0.07, 0.99, 0.11), (0.27, 0.57, 0.78))
OD_EPS = 1e-6  # I is clamped to this before the log: a black pixel has a finite OD

# The strengths, per image (each drawn uniformly, independently per image and per stain):
# alpha ~ U(1 - STAIN_SCALE, 1 + STAIN_SCALE): each stain's amount +-20%, a change of
# intensity a person sees at once, while haematoxylin stays blue-purple and eosin pink;
# beta ~ U(-STAIN_SHIFT, STAIN_SHIFT) in OD units: a small offset, which also tints the
# glass (kept small, so that glass stays nearly white and apart from tissue); brightness
# b ~ U(-BRIGHTNESS, BRIGHTNESS) and contrast c ~ U(1 - CONTRAST, 1 + CONTRAST) in
# I' = (I - 0.5) c + 0.5 + b: the scanner's exposure.
STAIN_SCALE = 0.2
STAIN_SHIFT = 0.05
BRIGHTNESS = 0.1
CONTRAST = 0.1


def _stain_matrices(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.tensor(RUIFROK_HED, dtype=torch.float64)
    return to_device(m.float(), device), to_device(torch.linalg.inv(m).float(), device)


def _mix(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix`` over the channel axis of ``x`` [..., 3, h, w] (channels first), written
    as broadcast products: no matmul, so autocast leaves it in float32."""
    return sum(x[..., c:c + 1, :, :] * matrix[c].view(3, 1, 1) for c in range(3))


def _per_image(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-image values ``p`` [B] or [B, C] shaped to broadcast over ``x`` [B, ..., C, h, w]."""
    if p.dim() == 1:
        return p.view(-1, *[1] * (x.dim() - 1))
    return p.view(p.shape[0], *[1] * (x.dim() - 4), p.shape[1], 1, 1)


def hed_jitter(images: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """RGB ``images`` [B, ..., 3, h, w] in [0, 1] with each image's stain amounts scaled by
    ``alpha`` [B, 3] and shifted by ``beta`` [B, 3] (haematoxylin, eosin, DAB); clipped to
    [0, 1]. ``alpha = 1, beta = 0`` gives the images back (up to rounding)."""
    m, m_inv = _stain_matrices(images.device)
    od = -torch.log(images.float().clamp_min(OD_EPS))
    stains = _mix(od, m_inv) * _per_image(alpha, od) + _per_image(beta, od)
    return torch.exp(-_mix(stains, m)).clamp(0.0, 1.0)


def brightness_contrast(images: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor) -> torch.Tensor:
    """``(I - 0.5) * contrast + 0.5 + brightness`` per image (``brightness``, ``contrast``:
    [B]) on ``images`` [B, ..., C, h, w], clipped to [0, 1]."""
    return ((images - 0.5) * _per_image(contrast, images) + 0.5 + _per_image(brightness, images)).clamp(0.0, 1.0)


def dihedral(patches: torch.Tensor, ops: torch.Tensor) -> torch.Tensor:
    """Each patch of ``patches`` [B, n, C, h, w] turned by ``ops`` [B, n] in 0..7: rotated by
    ``(op % 4) * 90`` degrees, then mirrored left-right if ``op >= 4`` (the 8 symmetries of
    a square). A non-square patch takes only ops 0, 2, 4, 6 (those that keep its shape).
    ``ops`` are drawn on the host (:meth:`Augmentation.patches`) and the choices made there,
    so that patches on a device are turned without reading anything back from it."""
    flat, ops = patches.flatten(0, 1), ops.flatten().cpu()
    if flat.shape[-1] != flat.shape[-2] and bool((ops % 2 == 1).any()):
        raise ValueError("a non-square patch can only be turned by 0 or 180 degrees (even ops)")
    out = flat.clone()
    for op in range(1, 8):
        chosen = (ops == op).nonzero().squeeze(1)
        if len(chosen):
            chosen = to_device(chosen, flat.device)
            turned = torch.rot90(flat.index_select(0, chosen), op % 4, dims=(-2, -1))
            out.index_copy_(0, chosen, turned.flip(-1) if op >= 4 else turned)
    return out.view_as(patches)


def _uniform(generator: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator)


@dataclass
class Augmentation:
    """One training step's augmentation: per-image colour parameters (drawn when it is
    made) and, with ``flips``, per-patch orientations (drawn when the patches arrive, since
    only the model knows how many it samples). Apply :meth:`low` to the batch's low-res
    views and pass :meth:`patches` to the model as ``patch_transform``."""

    alpha: torch.Tensor  # [B, 3] stain amount factors (HED)
    beta: torch.Tensor  # [B, 3] stain amount offsets, OD units
    brightness: torch.Tensor  # [B]
    contrast: torch.Tensor  # [B]
    flips: bool
    generator: torch.Generator

    @classmethod
    def draw(cls, mode: str, batch_size: int, seed: int) -> Augmentation | None:
        """The augmentation ``mode`` (one of :data:`MODES`) makes for a batch of
        ``batch_size`` images, its draws seeded by ``seed``; None for ``none``. The draws are
        made on the CPU, so a seed gives the same augmentation on every device."""
        if mode not in MODES:
            raise ValueError(f"unknown augmentation {mode!r}; choose from {', '.join(MODES)}")
        if mode == "none":
            return None
        gen = torch.Generator().manual_seed(seed)
        b = batch_size
        return cls(alpha=_uniform(gen, (b, 3), 1 - STAIN_SCALE, 1 + STAIN_SCALE),
                   beta=_uniform(gen, (b, 3), -STAIN_SHIFT, STAIN_SHIFT),
                   brightness=_uniform(gen, (b,), -BRIGHTNESS, BRIGHTNESS),
                   contrast=_uniform(gen, (b,), 1 - CONTRAST, 1 + CONTRAST),
                   flips=mode == "colour+flips", generator=gen)

    def colour(self, images: torch.Tensor) -> torch.Tensor:
        """The per-image colour jitter on ``images`` [B, C, h, w] or [B, n, C, h, w] in
        [0, 1]: HED jitter for RGB (other channel counts have no stains to speak of), then
        brightness and contrast."""
        dev = images.device
        if images.shape[-3] == 3:
            images = hed_jitter(images, to_device(self.alpha, dev), to_device(self.beta, dev))
        return brightness_contrast(images.float(), to_device(self.brightness, dev), to_device(self.contrast, dev))

    def low(self, low: torch.Tensor) -> torch.Tensor:
        """The low-res views [B, C, h, w]: colour only (their geometry is the positions')."""
        return self.colour(low)

    def patches(self, patches: torch.Tensor) -> torch.Tensor:
        """The gathered patches [B, n, C, h, w]: the same colour jitter as their image's
        low-res view, then (``flips``) each patch in a random orientation."""
        out = self.colour(patches)
        if not self.flips:
            return out
        B, n, _, h, w = out.shape
        ops = torch.randint(0, 8 if h == w else 4, (B, n), generator=self.generator)
        return dihedral(out, ops if h == w else 2 * ops)
