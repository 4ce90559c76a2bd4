"""The thesis's baselines for attention sampling, each a method of `ats train --method`
(created by name in :mod:`ats_cli.models`).

* ``uniform`` -- U-N in thesis Tables 3.1/3.2: the *same* model as ATS, but the attention
  is fixed to the uniform distribution over the low-res view (:class:`UniformAttention`),
  so the n patches are drawn uniformly at random. It isolates what learning where to
  look is worth.
* ``deepmil`` -- Deep MIL (Ilse et al. 2018, gated attention, :class:`DeepMIL`): the same
  feature network on *every* patch of a grid with stride half a patch, pooled by a
  learned gated attention. It is what ATS approximates with n samples, at the cost of
  the whole grid.
* ``cnn`` -- a CNN (:class:`CNNClassifier`: torchvision ResNet-18 from the network
  registry, random init) on the whole image downsampled to ``--scale``, i.e. on the same
  low-res view ATS's attention sees.

Every model takes ``(low, sources)`` and returns an :class:`ATSOutput`, so the training
loop, evaluation, ``predict`` and ``visualize`` treat them alike. Deep MIL's attention is
its pooling weights over the grid (a real heatmap); the CNN has no attention, so its
output carries a single cell of weight 1 and no patches.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.core.model import ATSOutput, pixels_to_float
from ats_cli.core.sampling import entropy
from ats_cli.core.source import Sources, gather_patches, source_shapes, to_device, uniform_shape

__all__ = ["UniformAttention", "DeepMIL", "CNNClassifier", "grid_axes", "grid_offsets"]


class UniformAttention(nn.Module):
    """Scores of zero at every low-res pixel: softmax makes them a uniform distribution.
    No parameters, so U-N learns only the feature net and the classifier."""

    margin = 0

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        return low.new_zeros(low.shape[0], 1, *low.shape[-2:])


def grid_axes(image_size: tuple[int, int], patch_size: tuple[int, int], stride: tuple[int, int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first rows and first columns of a regular grid of patches covering an (H, W)
    image; the last row/column is moved in so it ends at the border. Patch k of the grid
    in raster order starts at ``(rows[k // len(cols)], cols[k % len(cols)])``: a method that
    walks a large image's grid in chunks (:mod:`ats_cli.baselines_ips`) never holds all of it."""
    axes = []
    for full, p, s in zip(image_size, patch_size, stride, strict=True):
        starts = list(range(0, max(full - p, 0) + 1, s))
        if starts[-1] < full - p:
            starts.append(full - p)
        axes.append(torch.tensor(starts))
    return axes[0], axes[1]


def grid_offsets(image_size: tuple[int, int], patch_size: tuple[int, int], stride: tuple[int, int]
                 ) -> tuple[torch.Tensor, tuple[int, int]]:
    """Top-left corners [N, 2] of the grid of :func:`grid_axes` in raster order, and the grid's shape."""
    rows, cols = torch.meshgrid(*grid_axes(image_size, patch_size, stride), indexing="ij")
    return torch.stack([rows.flatten(), cols.flatten()], dim=1), tuple(rows.shape)


class DeepMIL(nn.Module):
    """Gated-attention MIL (Ilse et al. 2018, eq. 9) over all grid patches of the full image.

    ``a_k = softmax_k(w^T (tanh(V h_k) * sigmoid(U h_k)))``, pooled ``z = sum_k a_k h_k``.
    Features are L2-normalised as in ATS so the two differ only in how patches are chosen
    and weighted. All patches go through the feature net in one pass: the memory that
    costs is exactly what the benchmark measures.
    """

    def __init__(self, feature_net: nn.Module, n_classes: int, *, patch_size: tuple[int, int] = (50, 50),
                 stride: tuple[int, int] | None = None, hidden: int = 128, scale: float = 0.12):
        super().__init__()
        self.scale = float(scale)  # predict and visualize make the same low-res view as training
        self.n_patches = "all"  # what `ats predict` reports: the whole grid is read
        self.feature_net = feature_net
        d = feature_net.out_features
        self.att_v = nn.Linear(d, hidden)
        self.att_u = nn.Linear(d, hidden)
        self.att_w = nn.Linear(hidden, 1)
        self.classifier = nn.Linear(d, n_classes)
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.stride = tuple(int(s) for s in (stride or (max(1, p // 2) for p in self.patch_size)))

    def forward(self, low: torch.Tensor, sources: Sources, *, n_patches: int | None = None,
                generator: torch.Generator | None = None, return_patches: bool = False,
                support_mask: torch.Tensor | None = None, patch_transform=None,
                view_sizes: torch.Tensor | None = None) -> ATSOutput:
        """``n_patches``, ``generator`` and ``support_mask`` (a slide's tissue mask) are
        accepted for a common interface and ignored: Deep MIL is deterministic and always
        reads the whole grid, as the baseline of the thesis does. ``patch_transform``: as
        :meth:`ats_cli.core.model.ATSModel.forward`'s (training's augmentation)."""
        size = None if view_sizes is not None else uniform_shape(source_shapes(sources))
        if size is None:
            raise ValueError("Deep MIL needs the images of a batch to share a size; use --batch-size 1")
        grid, shape = grid_offsets(size, self.patch_size, self.stride)
        B = low.shape[0]
        offsets = grid[None].expand(B, -1, -1).contiguous()
        if isinstance(sources, torch.Tensor):  # cut where the images are
            offsets = to_device(offsets, sources.device)
        patches = pixels_to_float(to_device(gather_patches(sources, offsets, self.patch_size), low.device))
        if patch_transform is not None:
            patches = patch_transform(patches)
        feats = F.normalize(self.feature_net(patches.flatten(0, 1)).view(B, grid.shape[0], -1), dim=-1)
        scores = self.att_w(torch.tanh(self.att_v(feats)) * torch.sigmoid(self.att_u(feats)))[..., 0]
        a = torch.softmax(scores, dim=1)
        pooled = (a[..., None] * feats).sum(1)
        return ATSOutput(
            logits=self.classifier(pooled),
            attention=a.view(B, *shape),
            indices=torch.arange(grid.shape[0], device=low.device).expand(B, -1),
            offsets=to_device(offsets, low.device),
            sampled_probs=a,
            entropy=entropy(a),
            patches=patches if return_patches else None,
        )

    def loss(self, out: ATSOutput, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits, target)


class CNNClassifier(nn.Module):
    """A registry feature network applied to the whole low-res view, then a linear layer."""

    def __init__(self, net: nn.Module, n_classes: int, *, scale: float = 0.12):
        super().__init__()
        self.scale = float(scale)
        self.patch_size = (1, 1)  # no patches are read: any image is large enough
        self.n_patches = "none"
        self.net = net
        self.classifier = nn.Linear(net.out_features, n_classes)

    def forward(self, low: torch.Tensor, sources: Sources, *, n_patches: int | None = None,
                generator: torch.Generator | None = None, return_patches: bool = False,
                support_mask: torch.Tensor | None = None, patch_transform=None,
                view_sizes: torch.Tensor | None = None) -> ATSOutput:
        """Reads nothing at full resolution; the output has one attention cell and no patches.
        ``support_mask`` is ignored: the CNN sees the whole downsampled image; so is
        ``patch_transform`` (there are no patches; training augments ``low`` itself).
        ``view_sizes`` (views of different sizes, padded) is refused: the CNN would see the
        padding as part of the image."""
        if view_sizes is not None:
            raise ValueError("the CNN baseline needs the images of a batch to share a size; use --batch-size 1")
        if return_patches:
            self.attention_net  # noqa: B018  (raises: there are no patches or map to show)
        B = low.shape[0]
        empty = torch.zeros(B, 0, dtype=torch.long, device=low.device)
        return ATSOutput(
            logits=self.classifier(self.net(low)),
            attention=low.new_ones(B, 1, 1),
            indices=empty,
            offsets=empty[..., None].expand(B, 0, 2),
            sampled_probs=low.new_zeros(B, 0),
            entropy=low.new_zeros(B),
            patches=None,
        )

    def loss(self, out: ATSOutput, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits, target)

    @property
    def attention_net(self) -> nn.Module:
        """``ats visualize`` draws the attention net's map: a CNN has none, so say so
        (a ValueError, which the command reports) rather than draw a meaningless flat map."""
        raise ValueError("a model trained with --method cnn has no attention map to visualize "
                         "(methods with one: ats, uniform, deepmil, ips)")

