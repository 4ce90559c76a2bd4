"""``--method tile-mil``: the recipe most pathology groups run today (CLAM, Lu et al. 2021;
the TRIDENT toolkit's pipeline), named for what it does, so that a user can set attention
sampling against it on their own data (issue 69).

What it does, per image:

1. **Tiles.** The image, as the model reads it (``patch_size`` pixels at the model's scale:
   ``--mpp``/``patch_um`` resample a slide as for every method), is cut into a grid of
   non-overlapping tiles from its top-left corner, ``ceil(H / t) x ceil(W / t)`` of side t;
   the last row and column run past the border and are zero-padded there, as the readers
   pad every patch that does (:func:`ats_cli.core.patches.extract_patches_torch`), so every
   pixel lies in exactly one tile and tile (i, j) covers rows ``[i t, (i + 1) t)``.
   **Which tiles:** those whose footprint on the low-res view holds a pixel of the tissue
   mask the readers already compute for the attention's support
   (:func:`ats_cli.data.slides.tissue_mask`, ``tissue_mask``); an image without a mask (an
   ordinary image, ``tissue_mask off``) gives every tile, and so does a mask that holds no
   tile's pixel (as ATS gives such an image its whole map). A tile partly on tissue is
   kept: the object that decides a label may sit at the tissue's edge.
2. **Features, once.** The tiles go through the frozen encoder ``--feature-net`` in chunks
   of :data:`TILE_CHUNK` (read from the source chunk by chunk: the slide is never decoded
   whole), under ``no_grad``. With the run's feature store (:mod:`ats_cli.data.features`,
   ``feature_store``, on for this method unless turned off) each tile's feature is keyed by
   the image's content, how it is read, the tile's position and size, and the encoder's
   identity: the first epoch computes and stores them, later epochs, later runs on the same
   store and ``ats predict`` (:func:`attach_feature_store`) read them back and never call
   the encoder for a tile already encoded. A stored feature is the float32 the encoder
   computed, so training on it is training on the recomputed one (tested).
3. **Gated attention-MIL** (Ilse et al. 2018) with CLAM-SB's single-branch head
   (:class:`GatedAttentionHead`): ``h = Dropout(ReLU(W1 x))`` (512), attention scores
   ``w^T (tanh(V h) * sigmoid(U h))`` (256), softmax over the image's tiles, the
   attention-pooled ``h`` to a linear classifier; cross-entropy. CLAM's sizes and dropout
   (0.25, its default); features as the encoder gives them (CLAM does not normalise them).
   All of an image's features are held at once (N x D floats: 200 MB for 100,000 tiles of
   512 values), as CLAM's bag is.

Where this differs from CLAM: no instance-level clustering loss (CLAM's second term; the
single-branch head with the bag loss is the ABMIL recipe TRIDENT trains), tissue from the
Otsu mask of the view rather than CLAM's contours, and tiles at the model's scale rather
than a fixed 256 px at 20x. The encoder is frozen for this method (``feature_train none``,
settled; another value is refused), and training's patch augmentation is refused: a jittered
tile is new pixels at every draw, so nothing could be encoded once.

Output: an :class:`~ats_cli.core.model.ATSOutput` like Deep MIL's, so that training,
evaluation, ``predict`` and ``visualize`` treat it alike: ``attention`` is the softmax laid
on the tile grid [rows, cols] (0 on tiles that are not tissue; it sums to 1), ``offsets``,
``indices`` and ``sampled_probs`` the :data:`SHOWN_TILES` tiles of most attention, most
first (what the figure's strip and the GeoJSON's patches show; the GeoJSON's cells are the
tiles themselves, :attr:`TileMIL.tile_size`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.core.model import ATSOutput, pixels_to_float
from ats_cli.core.sampling import entropy
from ats_cli.core.source import Sources, gather_patches, gather_some, source_shapes, to_device
from ats_cli.nets.encoders import freeze

__all__ = ["GatedAttentionHead", "SHOWN_TILES", "TILE_CHUNK", "TileMIL", "attach_feature_store", "tile_grid",
           "tissue_tiles"]

TILE_CHUNK = 64  # tiles read and encoded at once: a ResNet-18's activations for 64 tiles of 224² are ~0.3 GB
SHOWN_TILES = 16  # the tiles reported as the output's patches: the figure's strip (render.figure.MAX_STRIP)
# CLAM-SB's head ("small": 512 hidden, 256 attention) and its default dropout (--drop_out 0.25)
HIDDEN, ATTENTION, DROPOUT = 512, 256, 0.25


def tile_grid(size: tuple[int, int], tile: int) -> tuple[int, int]:
    """(rows, cols) of the tiles of side ``tile`` covering an (H, W) image, the last ones padded."""
    return math.ceil(size[0] / tile), math.ceil(size[1] / tile)


def tissue_tiles(mask: torch.Tensor | None, size: tuple[int, int], tile: int) -> torch.Tensor:
    """Bool [rows, cols]: the tiles of an (H, W) image whose footprint on its low-res view
    holds a pixel of ``mask`` (bool [h, w] over that view; None: every tile). The footprint of
    rows ``[r, r + t)`` is view rows ``[floor(r h / H), ceil((r + t) h / H))``, at least one;
    counted on the mask's integral image, so a slide's grid is checked at once. No tile at
    all on the mask: every tile."""
    rows, cols = tile_grid(size, tile)
    if mask is None:
        return torch.ones(rows, cols, dtype=torch.bool)
    mask = mask.detach().cpu().bool()
    h, w = mask.shape
    H, W = size
    integral = F.pad(mask.long().cumsum(0).cumsum(1), (1, 0, 1, 0))

    def spans(n: int, full: int, view: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.arange(n, dtype=torch.long) * tile
        lo = (start * view) // full
        hi = torch.minimum(-((-(start + tile) * view) // full), torch.tensor(view))
        return lo, torch.maximum(hi, lo + 1).clamp(max=view)

    y0, y1 = spans(rows, H, h)
    x0, x1 = spans(cols, W, w)
    count = integral[y1][:, x1] - integral[y0][:, x1] - integral[y1][:, x0] + integral[y0][:, x0]
    keep = count > 0
    return keep if keep.any() else torch.ones(rows, cols, dtype=torch.bool)


class GatedAttentionHead(nn.Module):
    """CLAM-SB's attention network (``Attn_Net_Gated`` after its ``fc`` layer): features
    [n, dim] -> the hidden features [n, hidden] and the attention scores [n] (before the
    softmax). ``h = Dropout(ReLU(W1 x))``, score ``w^T (Dropout(tanh(V h)) * Dropout(sigmoid(U h)))``."""

    def __init__(self, dim: int, *, hidden: int = HIDDEN, attention: int = ATTENTION, dropout: float = DROPOUT):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.att_a = nn.Sequential(nn.Linear(hidden, attention), nn.Tanh(), nn.Dropout(dropout))
        self.att_b = nn.Sequential(nn.Linear(hidden, attention), nn.Sigmoid(), nn.Dropout(dropout))
        self.att_c = nn.Linear(attention, 1)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(feats)
        return h, self.att_c(self.att_a(h) * self.att_b(h))[..., 0]


class TileMIL(nn.Module):
    """Every tissue tile encoded once by a frozen encoder, then gated attention-MIL over
    the tiles' features (module docstring). ``feature_net`` is frozen here, whatever the
    caller did: this method never trains it. ``scale`` is the low-res view the tissue mask
    is computed on (and what predict makes, as for training)."""

    takes_mixed_views = True  # each image is tiled and pooled on its own: a batch may mix sizes

    def __init__(self, feature_net: nn.Module, n_classes: int, *, tile_size: int, scale: float = 0.12,
                 hidden: int = HIDDEN, attention: int = ATTENTION, dropout: float = DROPOUT):
        super().__init__()
        self.tile_size = int(tile_size)
        self.patch_size = (self.tile_size, self.tile_size)
        self.scale = float(scale)
        self.n_patches = "all"  # what `ats predict` reports: every tissue tile is read
        freeze(feature_net)
        self.feature_net = feature_net
        self.head = GatedAttentionHead(feature_net.out_features, hidden=hidden, attention=attention,
                                       dropout=dropout)
        self.classifier = nn.Linear(hidden, n_classes)
        # the frozen encoder's features read back instead of computed again (ats_cli.data.features;
        # set by whoever runs the model: ats train, attach_feature_store; never saved with it)
        self.feature_store = None

    def train(self, mode: bool = True) -> TileMIL:
        """As ``nn.Module.train``, the frozen encoder staying in evaluation mode (its batch
        norms at their own statistics: a tile's feature must not depend on its chunk)."""
        super().train(mode)
        self.feature_net.eval()
        return self

    def tiles(self, size: tuple[int, int], mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 tuple[int, int]]:
        """The tissue tiles of an (H, W) image: their top-left corners [n, 2] (host, int64)
        and flat grid indices [n], in raster order, and the grid's (rows, cols)."""
        keep = tissue_tiles(mask, size, self.tile_size)
        cells = keep.flatten().nonzero().flatten()
        cols = keep.shape[1]
        offsets = torch.stack([cells // cols, cells % cols], dim=1) * self.tile_size
        return offsets, cells, (int(keep.shape[0]), cols)

    @torch.no_grad()
    def encode(self, source: Sources, offsets: torch.Tensor, key: str | None, device: torch.device
               ) -> torch.Tensor:
        """Features [n, D] (float32) of one image's tiles at ``offsets`` [n, 2] (``source``:
        that image alone, a [1, C, H, W] tensor or one patch source), :data:`TILE_CHUNK`
        tiles read and encoded at a time; from the feature store where it holds them
        (``key``: the image's content key, None for one without)."""
        store, size = self.feature_store, self.patch_size
        out = []
        for start in range(0, len(offsets), TILE_CHUNK):
            chunk = offsets[start:start + TILE_CHUNK][None]
            if isinstance(source, torch.Tensor):
                chunk = to_device(chunk, source.device)
            if store is not None:
                out.append(store.features(self.feature_net, lambda miss, c=chunk: gather_some(source, c, size, miss),
                                          [key], chunk, size, device))
            else:
                patches = to_device(gather_patches(source, chunk, size)[0], device)
                out.append(self.feature_net(pixels_to_float(patches)).float())
        return torch.cat(out) if out else torch.empty(0, self.feature_net.out_features, device=device)

    def pool(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [classes], attention [n]) of one image's tile features [n, D]."""
        h, scores = self.head(feats)
        a = torch.softmax(scores.float(), dim=0)
        return self.classifier((a[:, None].to(h.dtype) * h).sum(0)), a

    def forward(self, low: torch.Tensor, sources: Sources, *, n_patches: int | None = None,
                generator: torch.Generator | None = None, return_patches: bool = False,
                support_mask: torch.Tensor | None = None, patch_transform=None,
                view_sizes: torch.Tensor | None = None, feature_keys: list[str | None] | None = None
                ) -> ATSOutput:
        """``low`` [B, C, h, w]: the views the tissue masks ``support_mask`` [B, h, w] lie
        on (each image's own size in ``view_sizes`` when they were padded to one);
        ``feature_keys``: each image's content key for :attr:`feature_store`. ``n_patches``
        and ``generator`` are accepted for a common interface and ignored: nothing is
        sampled. ``return_patches``: the pixels of the :data:`SHOWN_TILES` tiles reported."""
        if patch_transform is not None:
            raise ValueError("method tile-mil encodes each tile once and cannot augment its tiles; use augment none")
        shapes = source_shapes(sources)
        B, device = low.shape[0], low.device
        views = [tuple(low.shape[-2:])] * B if view_sizes is None else [tuple(int(v) for v in s) for s in view_sizes]
        logits, maps, grids, offsets, cells, probs, ents = [], [], [], [], [], [], []
        for b in range(B):
            one = sources[b:b + 1] if isinstance(sources, torch.Tensor) else [sources[b]]
            mask = None if support_mask is None else support_mask[b, :views[b][0], :views[b][1]]
            tile_offsets, tile_cells, grid = self.tiles(shapes[b], mask)
            feats = self.encode(one, tile_offsets, None if feature_keys is None else feature_keys[b], device)
            z, a = self.pool(feats)
            logits.append(z)
            full = torch.zeros(grid[0] * grid[1], dtype=a.dtype, device=device)
            maps.append(full.index_put((tile_cells.to(device),), a).view(grid))
            grids.append(grid)
            ents.append(entropy(a[None])[0])
            order = torch.argsort(a.detach(), descending=True, stable=True).cpu()
            offsets.append(tile_offsets[order])
            cells.append(tile_cells[order])
            probs.append(a[order.to(device)])
        k = min(SHOWN_TILES, *(len(c) for c in cells))
        rows, cols = max(g[0] for g in grids), max(g[1] for g in grids)
        attention = torch.stack([F.pad(m, (0, cols - m.shape[1], 0, rows - m.shape[0])) for m in maps])
        shown = torch.stack([o[:k] for o in offsets])
        patches = None
        if return_patches:
            patches = pixels_to_float(to_device(gather_patches(
                sources, to_device(shown, sources.device) if isinstance(sources, torch.Tensor) else shown,
                self.patch_size), device))
        top = torch.stack([p[:k] for p in probs])
        return ATSOutput(
            logits=torch.stack(logits),
            attention=attention,
            indices=torch.stack([c[:k] for c in cells]).to(device),
            offsets=to_device(shown, device),
            sampled_probs=top,
            entropy=torch.stack(ents),
            patches=patches,
            grids=None if len(set(grids)) == 1 else grids,
        )

    def attention_extent(self, size: tuple[int, int]) -> tuple[float, float, float, float]:
        """Where the attention map lies over an (H, W) image, in its pixels, imshow order
        (left, right, bottom, top): the tile grid, which runs past the border by less than a tile."""
        rows, cols = tile_grid(size, self.tile_size)
        return 0.0, float(cols * self.tile_size), float(rows * self.tile_size), 0.0

    def loss(self, out: ATSOutput, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits, target)


def attach_feature_store(model: nn.Module, spec: dict[str, Any], checkpoint: str | os.PathLike[str]) -> Any:
    """For ``ats predict`` and ``visualize`` of a tile-mil model: the feature store to read
    its tiles' features from (and add to), set on the model. ``$ATS_FEATURE_STORE`` when set
    (``off``: none), else the training run's own (``RUN/cache/features`` beside the
    checkpoint), when there is one: the run's test slides are then never encoded again. None
    otherwise (a model from elsewhere encodes its tiles, as without a store)."""
    from ats_cli.config import TrainConfig
    from ats_cli.data.features import ENV, feature_store_for

    if not isinstance(model, TileMIL):
        return None
    where = os.environ.get(ENV, "").strip()
    run = Path(checkpoint).parent
    if run.name == "epochs" and (run.parent / "cache" / "features").is_dir():  # RUN/epochs/epoch_NNN.pt
        run = run.parent
    if not where and not (run / "cache" / "features").is_dir():
        return None
    store = feature_store_for(run, model.feature_net, spec["feature_net"], spec["feature_kwargs"],
                              cap_gb=TrainConfig.feature_store_gb)
    model.feature_store = store
    return store
