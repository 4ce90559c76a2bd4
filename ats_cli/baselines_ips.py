"""``--method ips``: iterative patch selection (Bergner et al., ICLR 2023, "Iterative Patch
Selection for High-Resolution Image Recognition"), a peer of attention sampling that a user
can train and compare on the same data (issue 69).

What it does, per image:

1. **Selection, without gradients.** The image is cut into a grid of patches (``patch_size``,
   ``stride``; the paper's Megapixel MNIST: 50 px at stride 50). The grid is walked in chunks
   of ``iteration`` (I) patches read from the patch source; each chunk goes through the
   encoder and the scoring head (the cross-attention's scores, below), and a memory buffer
   keeps the ``memory`` (M) best-scoring patches seen so far (:func:`keep_top`). Only the
   buffer's scores and grid indices travel from chunk to chunk, so memory is bounded by M
   and I whatever the image's size: a slide is read chunk by chunk, never whole.
2. **Prediction, with gradients.** The M kept patches are read again, encoded, pooled by
   multi-head cross-attention with one learned query (a transformer layer: attention,
   residual and layer norm, an MLP, residual and layer norm; :class:`CrossAttentionPool`)
   and classified. Only these M patches hold activations for the backward pass.

The defaults are the paper's Megapixel MNIST configuration (their public code,
config/mnist_config.yml): M = 100, I = 100, 8 heads of 16 dimensions, an MLP of 512,
dropout 0.1 in attention and after it; the encoder is ``--feature-net``, as for every method.

Where this differs from the paper's code, and why:

* **A patch's score is its own.** Their score is the cross-attention's softmax over the M + I
  patches in hand, averaged over the heads: a patch's score then depends on which other
  patches share its chunk, so what is kept depends on I and on the order of the grid. Here
  a patch scores ``log mean_h exp(q_h . k_h / sqrt(d))``, the same logits before the
  softmax's normalisation (with one head it ranks exactly as theirs). Because it depends on
  the patch alone, the buffer ends holding exactly the top M patches of the whole image,
  for any I: what the iteration is meant to compute (tested).
* **Ties are broken by grid position**, the earlier patch in raster order kept, so a run
  is deterministic; theirs shuffles the patches so that ties fall at random.
* **No positional encoding** (theirs adds a 1-D sinusoidal one over the grid index for
  Megapixel MNIST); ``position_features`` is refused for ips, as for deepmil.
* Training's patch augmentation (``--augment``) is applied to the M kept patches only;
  selection scores the patches as they are.

Output: an :class:`~ats_cli.core.model.ATSOutput` like Deep MIL's, so that training,
evaluation, ``predict`` and ``visualize`` treat it alike: ``attention`` is the pooling's
attention (mean over heads) laid on the grid, non-zero only at the M kept patches (it sums
to 1), ``offsets``/``indices`` the kept patches in the order of their selection score.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.baselines import grid_axes
from ats_cli.core.model import ATSOutput, pixels_to_float
from ats_cli.core.sampling import entropy
from ats_cli.core.source import Sources, gather_patches, source_shapes, to_device, uniform_shape

__all__ = ["CrossAttentionPool", "IPSModel", "keep_top", "IPS_MEMORY", "IPS_ITER"]

# the paper's Megapixel MNIST configuration (M, I): benbergner/ips, config/mnist_config.yml
IPS_MEMORY, IPS_ITER = 100, 100


def keep_top(mem_scores: torch.Tensor, mem_index: torch.Tensor, scores: torch.Tensor, index: torch.Tensor,
             m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory buffer after one chunk: the top ``m`` of the buffer (``mem_scores``,
    ``mem_index`` [B, k], k <= m) and the chunk (``scores``, ``index`` [B, n]) by score, ties
    to the lower grid index; returned as (scores, index) [B, min(m, k + n)], best first.

    Ordered by (score descending, index ascending), a total order when the indices are
    distinct, so the buffer after the last chunk is the top m of all the scores, whatever
    the chunks were: a sort by index, then a stable sort by score."""
    all_scores = torch.cat([mem_scores, scores.to(mem_scores.dtype)], dim=1)
    all_index = torch.cat([mem_index, index.to(mem_index.device)], dim=1)
    by_index = all_index.argsort(dim=1, stable=True)
    ranked = all_scores.gather(1, by_index).argsort(dim=1, descending=True, stable=True)[:, :m]
    keep = by_index.gather(1, ranked)
    return all_scores.gather(1, keep), all_index.gather(1, keep)


class CrossAttentionPool(nn.Module):
    """Multi-head cross-attention from one learned query to the patches' features, then an
    MLP, each with a residual connection and a layer norm (the paper's aggregation module):
    [B, n, dim] -> pooled [B, dim] and the attention [B, n] (mean over heads, before
    dropout; each row sums to 1). :meth:`scores` is the same attention's per-patch score
    for selection (the module docstring says why it is not normalised over the chunk)."""

    def __init__(self, dim: int, *, heads: int = 8, head_dim: int = 16, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        self.heads, self.head_dim = int(heads), int(head_dim)
        inner = self.heads * self.head_dim
        self.query = nn.Parameter(torch.empty(1, dim))
        bound = math.sqrt(1 / self.head_dim)  # the paper's initialisation
        nn.init.uniform_(self.query, -bound, bound)
        self.q = nn.Linear(dim, inner, bias=False)
        self.k = nn.Linear(dim, inner, bias=False)
        self.v = nn.Linear(dim, inner, bias=False)
        self.out = nn.Linear(inner, dim, bias=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.mlp_norm = nn.LayerNorm(dim, eps=1e-6)
        self.attn_dropout = nn.Dropout(dropout)
        self.dropout = nn.Dropout(dropout)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, heads, n]: each head's query-key products over sqrt(head_dim)."""
        B, n, _ = feats.shape
        q = self.q(self.query).view(self.heads, self.head_dim)
        k = self.k(feats).view(B, n, self.heads, self.head_dim)
        return torch.einsum("hd,bnhd->bhn", q, k) / math.sqrt(self.head_dim)

    def scores(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, n] each patch's selection score, log of the mean over heads of exp(logit)."""
        return torch.logsumexp(self.logits(feats), dim=1) - math.log(self.heads)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, n, _ = feats.shape
        a = torch.softmax(self.logits(feats), dim=-1)  # [B, H, n]
        v = self.v(feats).view(B, n, self.heads, self.head_dim)
        x = torch.einsum("bhn,bnhd->bhd", self.attn_dropout(a), v).reshape(B, -1)
        x = self.norm(self.dropout(self.out(x)) + self.query)
        x = self.mlp_norm(self.dropout(self.mlp(x)) + x)
        return x, a.mean(1)


class IPSModel(nn.Module):
    """Iterative patch selection over the grid of a full-resolution image, then
    cross-attention pooling of the ``memory`` kept patches and a linear classifier (module
    docstring). ``stride`` None: the patch size (non-overlapping, the paper's). ``scale`` is
    kept for prediction, which makes the same low-res view as training (IPS itself reads none)."""

    def __init__(self, feature_net: nn.Module, n_classes: int, *, patch_size: tuple[int, int] = (50, 50),
                 stride: tuple[int, int] | None = None, memory: int = IPS_MEMORY, iteration: int = IPS_ITER,
                 heads: int = 8, head_dim: int = 16, hidden: int = 512, dropout: float = 0.1, scale: float = 0.12):
        super().__init__()
        if memory < 1 or iteration < 1:
            raise ValueError(f"IPS needs memory >= 1 and iteration >= 1 (got {memory}, {iteration})")
        self.scale = float(scale)
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.stride = tuple(int(s) for s in (stride or self.patch_size))
        self.memory, self.iteration = int(memory), int(iteration)
        self.n_patches = self.memory  # what `ats predict` reports: the patches the prediction pools
        self.patches_now = self.memory
        self.feature_net = feature_net
        self.pool = CrossAttentionPool(feature_net.out_features, heads=heads, head_dim=head_dim, hidden=hidden,
                                       dropout=dropout)
        self.classifier = nn.Linear(feature_net.out_features, n_classes)

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """Patches [B, n, C, h, w] (pixels) to features [B, n, D]."""
        B, n = patches.shape[:2]
        return self.feature_net(pixels_to_float(patches).flatten(0, 1)).view(B, n, -1)

    def scores(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, n] the selection scores of patches [B, n, C, h, w]: encoder, then the scoring head."""
        return self.pool.scores(self.encode(patches))

    @torch.no_grad()
    def select(self, sources: Sources, rows: torch.Tensor, cols: torch.Tensor, device: torch.device
               ) -> torch.Tensor:
        """The grid indices [B, min(M, N)] of the top-scoring patches, best first (the whole
        grid in raster order, unscored, when M >= N): the grid
        (``rows`` x ``cols``, raster order) read and scored ``iteration`` patches at a time,
        in evaluation mode (dropout off, batch norms at their running statistics, as the
        paper's selection), each module's mode restored after."""
        B = len(source_shapes(sources))
        n_cells = len(rows) * len(cols)
        if self.memory >= n_cells:  # the buffer holds the whole grid: nothing to choose (the paper's shortcut)
            return torch.arange(n_cells, device=device).expand(B, -1)
        m = self.memory
        modes = [(module, module.training) for module in self.modules()]
        self.eval()
        try:
            mem_scores = torch.empty(B, 0, device=device)
            mem_index = torch.empty(B, 0, dtype=torch.long, device=device)
            for start in range(0, n_cells, self.iteration):
                index = torch.arange(start, min(start + self.iteration, n_cells))
                patches = self._read(sources, _offsets(index.expand(B, -1), rows, cols), device)
                mem_scores, mem_index = keep_top(mem_scores, mem_index, self.scores(patches).float(),
                                                 index.to(device).expand(B, -1), m)
        finally:
            for module, training in modes:
                module.train(training)
        return mem_index

    def _read(self, sources: Sources, offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Patches [B, n, C, h, w] at ``offsets`` [B, n, 2], cut where the images are, on ``device``."""
        if isinstance(sources, torch.Tensor):
            offsets = to_device(offsets, sources.device)
        return to_device(gather_patches(sources, offsets, self.patch_size), device)

    def forward(self, low: torch.Tensor, sources: Sources, *, n_patches: int | None = None,
                generator: torch.Generator | None = None, return_patches: bool = False,
                support_mask: torch.Tensor | None = None, patch_transform=None,
                view_sizes: torch.Tensor | None = None) -> ATSOutput:
        """``n_patches``, ``generator`` and ``support_mask`` are accepted for a common
        interface and ignored: IPS is deterministic and walks the whole grid. ``low`` is
        read only for its batch size and device. ``patch_transform``: training's patch
        augmentation, applied to the kept patches."""
        size = None if view_sizes is not None else uniform_shape(source_shapes(sources))
        if size is None:
            raise ValueError("IPS needs the images of a batch to share a size; use --batch-size 1")
        rows, cols = grid_axes(size, self.patch_size, self.stride)
        B, device = low.shape[0], low.device
        index = self.select(sources, rows, cols, device)
        offsets = _offsets(index.cpu(), rows, cols)
        patches = pixels_to_float(self._read(sources, offsets, device))
        if patch_transform is not None:
            patches = patch_transform(patches)
        pooled, a = self.pool(self.encode(patches))
        attention = torch.zeros(B, len(rows) * len(cols), dtype=a.dtype, device=device)
        attention.scatter_(1, index, a)
        return ATSOutput(
            logits=self.classifier(pooled),
            attention=attention.view(B, len(rows), len(cols)),
            indices=index,
            offsets=to_device(offsets, device),
            sampled_probs=a,
            entropy=entropy(a),
            patches=patches if return_patches else None,
        )

    def loss(self, out: ATSOutput, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits, target)


def _offsets(index: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Top-left corners [B, n, 2] of grid cells ``index`` [B, n] (raster order over ``rows`` x ``cols``)."""
    index = index.cpu()
    return torch.stack([rows[index // len(cols)], cols[index % len(cols)]], dim=-1)
