"""The attention-sampling model, readable top to bottom.

    low-res view --attention net (+ prior)--> scores --softmax over the support--> a
    a --sample n positions--> indices --geometry--> full-res patch offsets
    patch source --read only those patches--> feature net --L2 normalise (x gain)--> f
    (f, a at the samples) --pooling: values v--> unbiased estimate of E_a[v] --readout--> logits

The full-resolution image is only ever touched through a patch source (see
:mod:`ats_cli.core.source`), so its size never enters the cost of a step. The prior,
support, gain and pooling are extensions (:mod:`ats_cli.extensions`); without them this is
the thesis's model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.core.sampling import (
    ESTIMATORS,
    attention_distribution,
    entropy,
    estimator_threshold,
    estimator_weights,
    expectation,
    prior_divergence,
    sample,
)
from ats_cli.core.source import (
    Sources,
    gather_patches,
    gather_some,
    positions_to_offsets,
    source_shapes,
    to_device,
    uniform_shape,
)
from ats_cli.extensions import create_extension
from ats_cli.extensions.gain import Gain
from ats_cli.extensions.pooling import Pooling, Where
from ats_cli.extensions.position import PositionFeatures, patch_centres
from ats_cli.extensions.prior import Prior
from ats_cli.extensions.support import Support

__all__ = ["ATSModel", "ATSOutput", "exploration", "pixels_to_float"]


@dataclass
class ATSOutput:
    """What one forward pass produced; everything a loss or a heatmap needs."""

    logits: torch.Tensor  # [B, classes]
    attention: torch.Tensor  # [B, att_h, att_w], sums to 1 per image
    indices: torch.Tensor  # [B, n] flat attention positions, in draw order
    offsets: torch.Tensor  # [B, n, 2] top-left (row, col) of each patch at full resolution
    sampled_probs: torch.Tensor  # [B, n] attention at the sampled positions
    entropy: torch.Tensor  # [B] entropy of the attention distribution (nats)
    # [B, n] the estimator's weight of each draw: the pooled estimate is sum_k w_k v_k
    # (ats_cli.core.sampling.estimator_weights), detached
    weights: torch.Tensor | None = None
    # [B, n] what each draw adds to the prediction, in one number: its weight times the size
    # of what it pooled (ats_cli.extensions.pooling.Pooling.sizes: the gain with features, the
    # vote's total with votes, that over the attention mass around it with counts); detached.
    # Figures rank and draw patches by it.
    contributions: torch.Tensor | None = None
    patch_logits: torch.Tensor | None = None  # [B, n, classes]: the classifier on each sampled patch alone
    patches: torch.Tensor | None = None  # [B, n, C, ph, pw] when asked for (visualisation)
    # [B] what the loss's regulariser maximises: H(a) (the thesis), or with a prior -KL(a || the
    # prior's own attention) (ats_cli.core.sampling.prior_divergence); None: the entropy
    explore: torch.Tensor | None = None
    # each image's own attention grid (att_h, att_w) in the top-left corner of ``attention``
    # when the batch's views differed in size and were padded (ATSModel.forward's view_sizes);
    # None: every image's grid is the whole of ``attention``
    grids: list[tuple[int, int]] | None = None


def exploration(out: Any) -> torch.Tensor:
    """[B] the term ``loss = CE - lambda * this`` maximises: ``out.explore``, else the
    attention's entropy (the thesis's eq. 3.21)."""
    explore = getattr(out, "explore", None)
    return out.entropy if explore is None else explore


def _view_shapes(view_sizes: torch.Tensor | Sequence[Sequence[int]] | None, low: torch.Tensor
                 ) -> list[tuple[int, int]] | None:
    """``view_sizes`` as B (h, w) host ints, checked against ``low`` [B, C, h, w]; None when
    there are none or every view fills ``low`` (a batch of one size: nothing to undo)."""
    if view_sizes is None:
        return None
    pairs = view_sizes.tolist() if isinstance(view_sizes, torch.Tensor) else view_sizes
    views = [(int(h), int(w)) for h, w in pairs]
    H, W = low.shape[-2:]
    if len(views) != low.shape[0] or any(not (0 < h <= H and 0 < w <= W) for h, w in views):
        raise ValueError(f"view sizes {views} do not fit the batch of low-res views {tuple(low.shape)}")
    return None if all(v == (H, W) for v in views) else views


def pixels_to_float(patches: torch.Tensor) -> torch.Tensor:
    """8-bit pixels to [0, 1]; other dtypes are taken as already scaled."""
    return patches.float() / 255.0 if patches.dtype == torch.uint8 else patches.float()


def _extension(kind: str, value: Any, base: type[nn.Module], **dims: Any) -> Any:
    """A slot's extension: None, one already built, or one built from its plain spec."""
    if value is None or isinstance(value, base):
        return value
    return create_extension(kind, value, **dims)


class ATSModel(nn.Module):
    """Attention net + feature net + linear classifier, joined by attention sampling (thesis ch. 3).

    ``n_patches`` patches of ``patch_size`` are drawn per image from the attention over a
    low-res view at ``scale`` (kept here, so that prediction makes the view training made);
    ``replace`` draws with replacement, else ``estimator`` picks the unbiased estimator
    (``auto``, ``threshold``, ``sequential``: same expectation, other variance, see
    :mod:`ats_cli.core.sampling`; it may change after training). ``eval_n_patches`` (0 =
    ``n_patches``) are drawn in evaluation: more draws, less variance, no gradient memory.
    ``entropy_weight`` is lambda in ``loss = CE - lambda H(a)`` (thesis eq. 3.21); with a
    prior, ``loss = CE - lambda (-KL(a || pi))``, pi the prior's own attention, which keeps
    the attention where the prior started it rather than pulling it to uniform
    (:func:`~ats_cli.core.sampling.prior_divergence` says why).

    ``feature_scale`` multiplies the L2-normalised features. Equal norms make sampling from
    the attention optimal (thesis 3.3.4), but with unit norms a linear classifier's logits
    are bounded by its weight norm, which grows by about the learning rate per step, so the
    softmax stays unconfident for many steps; a constant scale keeps the norms equal and
    lifts that bound. 1 is the paper's.

    The four extension slots (:mod:`ats_cli.extensions`), each None, an extension, or its
    plain spec ``{"name": ..., **options}``: ``pooling`` (what the estimator averages and
    how logits are read from it; None = pooled features then the classifier, the thesis's),
    ``support`` (cells that may be sampled; None = every cell), ``prior`` (a fixed log-prior
    on the scores; None = none) and ``gain`` (a per-patch factor on the unit feature; None =
    none). Each keeps the estimate and its gradients unbiased; its module says why.
    ``position`` (None, a :class:`PositionFeatures` or its options as a dict): each patch's
    position in the image goes into its feature before pooling
    (:mod:`ats_cli.extensions.position`).
    """

    # forward takes a batch of views of different sizes, padded (view_sizes): the loaders and
    # the predictor then batch images of any size together
    takes_mixed_views = True

    def __init__(
        self,
        attention_net: nn.Module,
        feature_net: nn.Module,
        n_classes: int,
        *,
        n_patches: int = 10,
        patch_size: tuple[int, int] = (50, 50),
        scale: float = 0.12,
        replace: bool = False,
        estimator: str = "auto",
        entropy_weight: float = 0.01,
        eval_n_patches: int = 0,
        feature_scale: float = 1.0,
        pooling: Pooling | dict[str, Any] | None = None,
        support: Support | dict[str, Any] | None = None,
        prior: Prior | dict[str, Any] | None = None,
        gain: Gain | dict[str, Any] | None = None,
        position: PositionFeatures | dict[str, Any] | None = None,
        patch_loss: float = 0.0,
    ):
        super().__init__()
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; choose from {', '.join(ESTIMATORS)}")
        self.attention_net = attention_net
        self.feature_net = feature_net
        d = feature_net.out_features
        self.classifier = nn.Linear(d, n_classes)
        self.gain = _extension("gain", gain, Gain, features=d)
        self.pooling = _extension("pooling", {"name": "features"} if pooling is None else pooling, Pooling, features=d,
                                  n_classes=n_classes)
        self.support = _extension("support", support, Support)
        self.prior = _extension("prior", prior, Prior)
        self.position = position if position is None or isinstance(position, PositionFeatures) else \
            PositionFeatures(d, **position)
        self.n_patches = int(n_patches)
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.scale = float(scale)
        self.replace = bool(replace)
        self.estimator = estimator
        self.entropy_weight = float(entropy_weight)
        self.eval_n_patches = int(eval_n_patches)  # 0 = n_patches
        self.feature_scale = float(feature_scale)
        self.patch_weight = float(patch_loss)  # the per-patch loss's weight: patch_nll says why
        # a frozen feature net's features read back instead of computed again
        # (ats_cli.data.features.FeatureStore; set by whoever runs the model, never saved with it)
        self.feature_store = None

    def _supported_pixels(self, low: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Bool [B, 1, h, w]: the low-res pixels that may be sampled (None = all): kept by the
        support and inside ``mask`` (e.g. a slide's tissue)."""
        if self.support is None and mask is None:
            return None
        keep_px = torch.ones_like(low[:, :1], dtype=torch.bool) if self.support is None else self.support(low)
        if mask is not None:
            keep_px = keep_px & mask[:, None].to(low.device)
        return keep_px

    def _to_cells(self, pixels: torch.Tensor, att_shape: tuple[int, int]) -> torch.Tensor:
        """Max-pool a per-pixel map [B, 1, h, w] onto the attention grid [B, att_h, att_w]
        (the attention net's 'valid' margin is cropped first, as positions_to_offsets does)."""
        m = getattr(self.attention_net, "margin", 0)
        if m:
            pixels = pixels[..., m:pixels.shape[-2] - m, m:pixels.shape[-1] - m]
        return F.adaptive_max_pool2d(pixels.float(), att_shape)[:, 0]

    def _support_cells(self, keep_px: torch.Tensor | None, att_shape: tuple[int, int]) -> torch.Tensor | None:
        if keep_px is None:
            return None
        keep = self._to_cells(keep_px, att_shape) > 0
        blank = ~keep.flatten(1).any(1)  # a blank image: the whole map
        return keep | blank[:, None, None]

    def _prior_cells(self, low: torch.Tensor, keep_px: torch.Tensor | None, att_shape: tuple[int, int],
                     within_region: bool = False) -> torch.Tensor | None:
        if self.prior is None:
            return None
        prior = self.prior.within_region(low, keep_px) if within_region else self.prior(low, keep_px)
        return self._to_cells(prior, att_shape)

    def _scores_and_support(self, net: nn.Module, view: torch.Tensor, mask: torch.Tensor | None,
                            within_region: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``net``'s attention scores [B, 1, att_h, att_w] on ``view`` with the prior's
        log-prior added, the cells the support and ``mask`` keep (None = all) and the
        log-prior [B, att_h, att_w] (None without a prior): what every attention of the model
        (a one-level model's, both of a two-level model's) is made of. ``within_region``: the
        view is a region's, the prior's :meth:`~ats_cli.extensions.prior.Prior.within_region`."""
        scores = net(view)
        att_shape = tuple(scores.shape[-2:])
        keep_px = self._supported_pixels(view, mask)  # shared by the prior and the support
        prior = self._prior_cells(view, keep_px, att_shape, within_region)
        if prior is not None:
            scores = scores + prior[:, None].to(scores.dtype)
        return scores, self._support_cells(keep_px, att_shape), prior

    def _padded_scores(self, low: torch.Tensor, views: list[tuple[int, int]], mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[tuple[int, int]],
                                  torch.Tensor]:
        """:meth:`_scores_and_support` for views of different sizes padded into ``low``:
        the attention net (and the support, the prior) run on each image's own view, one
        group of equal view size at a time, and the score maps are padded bottom/right to
        the largest grid. Why not run the net on the padded tensor: a 'same'-padded
        convolution (:class:`ats_cli.nets.mnist.ConvAttention`) would see the padding's
        values where alone it sees its own zero border, which changes the scores of the
        border cells from the second layer on; run apart, an image's scores are those it
        has alone, and the views are small, so the extra calls are cheap. Returns the
        scores [B, 1, H, W], the cells that may be sampled [B, H, W] (False on the
        padding), the log-prior [B, H, W] (0 on the padding; None without a prior), each
        image's own grid (host ints) and the cells that exist [B, H, W] (bool, on the host)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for b, view in enumerate(views):
            groups.setdefault(view, []).append(b)
        parts = []
        for (h, w), members in groups.items():
            rows = torch.tensor(members).to(low.device)
            own_mask = None if mask is None else mask.to(low.device)[rows, :h, :w]
            scores, keep, prior = self._scores_and_support(self.attention_net, low[rows, :, :h, :w], own_mask)
            parts.append((members, scores, keep, prior))
        H = max(int(p[1].shape[-2]) for p in parts)
        W = max(int(p[1].shape[-1]) for p in parts)
        grids: list[tuple[int, int]] = [(0, 0)] * len(views)
        order: list[int] = []
        padded_scores, padded_keep, padded_prior = [], [], []
        for members, scores, keep, prior in parts:
            h, w = (int(v) for v in scores.shape[-2:])
            for b in members:
                grids[b] = (h, w)
            order += members
            pad = (0, W - w, 0, H - h)
            padded_scores.append(F.pad(scores, pad))
            keep = torch.ones(scores.shape[0], h, w, dtype=torch.bool, device=scores.device) if keep is None else keep
            padded_keep.append(F.pad(keep, pad, value=False))
            if prior is not None:
                padded_prior.append(F.pad(prior, pad))
        back = torch.tensor(order).argsort().to(low.device)  # the groups' rows back in batch order
        exists = torch.zeros(len(views), H, W, dtype=torch.bool)
        for b, (h, w) in enumerate(grids):
            exists[b, :h, :w] = True
        prior = torch.cat(padded_prior)[back] if padded_prior else None
        return torch.cat(padded_scores)[back], torch.cat(padded_keep)[back], prior, grids, exists

    @staticmethod
    def _explore(probs: torch.Tensor, ent: torch.Tensor, prior: torch.Tensor | None, keep: torch.Tensor | None
                 ) -> torch.Tensor:
        """[B] the regulariser's term for the attention ``probs`` [B, K] (:class:`ATSOutput`
        ``explore``): its entropy ``ent``, or with a prior -KL(a || the prior's attention)."""
        return ent if prior is None else -prior_divergence(probs, prior, keep)

    def sampling_support(self, low: torch.Tensor, att_shape: tuple[int, int], mask: torch.Tensor | None = None
                         ) -> torch.Tensor | None:
        """Bool [B, att_h, att_w] of the cells that may be sampled (None = all): a cell is kept
        if any of its pixels is kept by the support and by ``mask`` [B, h, w] (bool, on the
        low-res view's pixels, e.g. a slide's tissue)."""
        return self._support_cells(self._supported_pixels(low, mask), att_shape)

    def log_prior(self, low: torch.Tensor, att_shape: tuple[int, int], mask: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
        """The prior's log-prior [B, att_h, att_w] added to the attention scores (None without
        a prior): a cell's is the largest of its pixels'."""
        return self._prior_cells(low, self._supported_pixels(low, mask), att_shape)

    @property
    def patches_now(self) -> int:
        """Patches one forward pass draws by default: ``n_patches`` in training,
        ``eval_n_patches`` (0 = the same) in evaluation and prediction."""
        return self.n_patches if self.training else (self.eval_n_patches or self.n_patches)

    @property
    def active_estimator(self) -> str:
        """The estimator the current mode uses: ``auto`` is the per-image rule in training and
        the threshold estimator for prediction (see :mod:`ats_cli.core.sampling`)."""
        return "threshold" if self.estimator == "auto" and not self.training else self.estimator

    def patch_features(self, patches: torch.Tensor) -> torch.Tensor:
        """The feature f(x) the pooling receives, for patches [N, C, ph, pw] (float):
        ``feature_scale`` times the unit-norm feature, times the patch's gain when the model
        has one. A function of each patch alone, which keeps the estimate unbiased."""
        feats, gain = self.patch_parts(patches)
        return feats if gain is None else gain * feats

    def patch_parts(self, patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The two factors of :meth:`patch_features` from one pass of the feature net: the
        scaled unit-norm feature [N, D] and the gain [N, 1] (None without one). Apart for
        whoever trains them apart (pretraining the patch classes on the unit feature)."""
        return self._parts(self.feature_net(patches))

    def drawn_features(self, sources: Sources, offsets: torch.Tensor, device: torch.device, *,
                       feature_keys: list[str | None] | None = None,
                       patch_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       return_patches: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(patches, unit, gain) of the patches at ``offsets`` [B, n, 2] (the image's own
        pixels, at one level or two): :meth:`patch_parts` of the pixels read and transformed,
        or, with :attr:`feature_store` and ``feature_keys`` (:meth:`forward` says when), of
        the features read back where stored and encoded where not; ``patches`` is then None."""
        store = self.feature_store
        if store is not None and feature_keys is not None and patch_transform is None and not return_patches:
            raw = store.features(self.feature_net, lambda miss: gather_some(sources, offsets, self.patch_size, miss),
                                 feature_keys, offsets, self.patch_size, device)
            return (None, *self._parts(raw))
        patches = pixels_to_float(to_device(gather_patches(sources, offsets, self.patch_size), device))
        if patch_transform is not None:
            patches = patch_transform(patches)
        return (patches, *self.patch_parts(patches.flatten(0, 1)))

    def _parts(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`patch_parts` from the feature net's output [N, D] (computed, or read back
        from the feature store)."""
        # equal norms make sampling from a optimal (thesis 3.3.4); the scale: see the class docstring
        feats = self.feature_scale * F.normalize(raw, dim=-1)
        return feats, None if self.gain is None else self.gain(raw)

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
        view_sizes: torch.Tensor | Sequence[Sequence[int]] | None = None,
        feature_keys: Sequence[str | None] | None = None,
    ) -> ATSOutput:
        """``low``: low-res views [B, C, h, w] (float, [0, 1]); ``sources``: the
        full-resolution images, as a tensor [B, C, H, W] or a sequence of patch sources.
        ``n_patches`` overrides the default (:attr:`patches_now`: more patches, less variance);
        ``support_mask`` [B, h, w] restricts sampling (see :meth:`sampling_support`).
        ``patch_transform``: applied to the gathered patches [B, n, C, ph, pw] (float, [0, 1])
        before the feature net; the training step passes its augmentation here
        (:class:`ats_cli.augment.Augmentation`), prediction never does. It changes what the
        feature net sees, not which positions are drawn nor how they are pooled.

        ``view_sizes`` (host ints, [B, 2] or B pairs; None = every view fills ``low``): each
        image's own low-res (h, w) when ``low`` holds views of different sizes padded
        bottom/right to the largest (:func:`ats_cli.data.inputs.collate`). Each image then
        gets what it would get alone (:meth:`_padded_scores`): its attention over its own
        cells, the padding given probability 0 and never drawn, its patches mapped with its
        own geometry. ``attention`` is then [B, att_h, att_w] over the padded grid, each
        image's own grid in its top-left corner and zeros around it.

        ``feature_keys``: each image's content key (:class:`ats_cli.data.features.ImageKeys`;
        None for one without) when :attr:`feature_store` holds the frozen feature net's
        features: those of patches already encoded are read back, only the others are read
        from the sources and encoded. Not with ``patch_transform`` (augmented pixels are new
        at every draw) nor ``return_patches`` (the pixels are wanted): then every patch is
        read and encoded, as without a store."""
        n = self.patches_now if n_patches is None else int(n_patches)
        views = _view_shapes(view_sizes, low)
        if views is None:
            scores, keep, prior = self._scores_and_support(self.attention_net, low, support_mask)
            grids = exists = None
        else:
            scores, keep, prior, grids, exists = self._padded_scores(low, views, support_mask)
            fewest = min(h * w for h, w in grids)
            if not self.replace and n > fewest:  # refused as that image alone is (sampling._check_probs)
                raise ValueError(f"cannot draw {n} positions without replacement from only {fewest} positions; "
                                 "use fewer patches, a larger low-resolution view, or sampling with replacement")
        att_shape = tuple(scores.shape[-2:])
        # the support cells are never empty (a blank image gets the whole map): no check, which would wait
        probs = attention_distribution(scores, keep, check=False)
        draw = sample(probs, n, replace=self.replace, generator=generator,
                      exists=None if exists is None else to_device(exists.flatten(1), probs.device))
        indices, sampled_probs = draw.indices, draw.probs

        shapes = source_shapes(sources)  # host ints: a batch of one size maps positions with no size tensor
        sizes = torch.tensor(shapes, dtype=torch.long)
        offsets = positions_to_offsets(
            indices,
            att_shape,
            uniform_shape(shapes) or sizes,
            self.patch_size,
            low_size=tuple(low.shape[-2:]),
            margin=getattr(self.attention_net, "margin", 0),
            views=views,
            grids=grids,
        )
        B = low.shape[0]
        patches, unit, gain = self.drawn_features(sources, offsets, low.device, feature_keys=feature_keys,
                                                  patch_transform=patch_transform, return_patches=return_patches)
        feats = (unit if gain is None else gain * unit).view(B, n, -1)
        if self.position is not None:  # f(x, p): a function of the drawn cell, as x is
            feats = self.position(feats, patch_centres(offsets, sizes, self.patch_size))
        threshold = estimator_threshold(self.active_estimator, draw, probs)
        weights = estimator_weights(sampled_probs, replace=self.replace, threshold=threshold)
        where = Where(probs, att_shape, indices, sizes, self.patch_size, shapes, grids or ())
        values = self.pooling.values(feats, self.classifier, where)
        pooled = expectation(values, sampled_probs, replace=self.replace, weights=weights)
        with torch.no_grad():  # each draw's share, in the unit of what was pooled (see ATSOutput)
            size = self.pooling.sizes(values, None if gain is None else gain.view(B, n))
            contributions = weights.double() * size.double()
        ent = entropy(probs)
        return ATSOutput(
            logits=self.pooling.readout(pooled, self.classifier),
            attention=probs.view(B, *att_shape),
            indices=indices,
            offsets=offsets,
            sampled_probs=sampled_probs,
            entropy=ent,
            weights=weights.detach(),
            contributions=contributions,
            patch_logits=self.classifier(feats),  # for consumers; the pooled estimate above does not use it
            patches=patches if return_patches else None,
            explore=self._explore(probs, ent, prior, keep),
            grids=grids,
        )

    def loss(self, out: ATSOutput, target: torch.Tensor) -> torch.Tensor:
        """The label's negative log-likelihood (the cross-entropy, or the pooling's own:
        :meth:`ats_cli.extensions.pooling.Pooling.nll`) minus the exploration bonus (thesis
        eq. 3.21; :func:`exploration`), averaged over the batch; plus ``patch_loss`` times
        the per-patch loss (:meth:`patch_nll`)."""
        loss = self.pooling.nll(out.logits, target) - self.entropy_weight * exploration(out).mean()
        if self.patch_weight and out.patch_logits is not None:
            loss = loss + self.patch_weight * self.patch_nll(out.patch_logits, target)
        return loss

    @staticmethod
    def patch_nll(patch_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The per-patch loss: each drawn patch's own logits [B, n, classes] (the classifier
        on its feature alone) against its image's label, averaged over the patches.

        Why: with the thesis's pooling the image's logits are the attention-weighted mean of
        the patches' (the classifier is linear), so a patch that shows the object weighs
        1/n of the estimate while the attention is still spread. When the objects that
        decide the label are small, few drawn patches show them (measured:
        benchmarks/README.md#first-tries-on-real-pixels), the feature net learns them at
        that diluted rate, and the attention, which learns only
        through what the feature net tells apart, stays uniform. Here every patch that shows
        the object is told the label at full strength, while one of background is told a
        label it cannot predict and settles at the classes' frequencies (logits near equal,
        so it adds little to the mean). It is a loss term on the features only: the sampled
        estimate, its unbiasedness, the attention's gradient and prediction are unchanged."""
        n = patch_logits.shape[1]
        return F.cross_entropy(patch_logits.flatten(0, 1).float(), target.repeat_interleave(n))
