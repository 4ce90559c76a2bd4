"""The attention-sampling model, readable top to bottom.

    low-res view --attention net--> scores --softmax--> a (distribution over positions)
    a --sample n positions--> indices --geometry--> full-res patch offsets
    patch source --read only those patches--> feature net --L2 normalise--> f
    (f, a at the samples) --unbiased estimator--> pooled feature --classifier--> logits
    (pooling="votes": the classifier's probabilities on each patch are pooled instead,
    and the logits are their log; pooling="counts": those probabilities, each divided by
    the attention mass around its cell, so that every object counts once)

The full-resolution image is only ever touched through a patch source (see
:mod:`ats_cli.core.source`), so its size never enters the cost of a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.core.geometry import positions_to_offsets
from ats_cli.core.sampling import (
    ESTIMATORS,
    attention_distribution,
    entropy,
    estimator_threshold,
    estimator_weights,
    expectation,
    sample,
)
from ats_cli.core.source import Sources, gather_patches, source_sizes

__all__ = ["POOLINGS", "ATSModel", "ATSOutput", "auxiliary_losses", "pixels_to_float", "rarity"]

POOLINGS = ("features", "votes", "counts")

CRITIC_FLOOR = 0.1  # nats added to every draw's information in the attention critic's target


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
    # of what it pooled (the gain with features, the vote's total with votes, that over the
    # attention mass around it with counts); detached. Figures rank and draw patches by it.
    contributions: torch.Tensor | None = None
    patch_logits: torch.Tensor | None = None  # [B, n, classes]: the classifier on each sampled patch alone
    patches: torch.Tensor | None = None  # [B, n, C, ph, pw] when asked for (visualisation)


def pixels_to_float(patches: torch.Tensor) -> torch.Tensor:
    """8-bit pixels to [0, 1]; other dtypes are taken as already scaled."""
    return patches.float() / 255.0 if patches.dtype == torch.uint8 else patches.float()


class ATSModel(nn.Module):
    """Attention net + feature net + linear classifier, joined by attention sampling.

    ``n_patches`` of ``patch_size`` are sampled per image (``replace`` chooses with or
    without replacement; ``estimator`` the unbiased estimator used without replacement,
    ``auto``, ``threshold`` or ``sequential``: same expectation, different variance, see
    :mod:`ats_cli.core.sampling`; it may be changed after training, and ``auto`` means
    ``threshold`` in eval mode); ``scale`` is the
    low-res view's scale, kept here so that prediction makes the same view as training;
    ``entropy_weight`` is lambda in ``loss = CE - lambda * H(a)``; ``smoothing`` mixes
    uniform mass into the attention.

    ``min_brightness`` > 0 removes dark background from the attention's support: a
    position whose low-res cell has no pixel brighter than it (max over channels) is
    never sampled. On a black canvas such as Megapixel MNIST this shrinks the search
    space from every cell to the few hundred that hold something, which is what lets
    training leave the initial plateau quickly; images with a white background (slides)
    use a tissue mask instead. A row with fewer supported cells than patches keeps its
    support: sampling without replacement then takes every supported cell first, and the
    extra draws have probability 0, hence weight 0 (wasted work, not a wrong answer).
    Falling back to the whole map there instead would spread the attention over background
    the network never learned to ignore (docs/training.md, "What closed the gap to 95%",
    has the run that showed it).
    Only a row with no supported cell at all (a blank image) uses the whole map.

    ``feature_scale`` multiplies the L2-normalised patch features before the classifier.
    Normalising keeps every feature's norm equal, which makes sampling from the attention
    optimal (thesis §3.3.4), but with unit-norm features a linear classifier's logits are
    bounded by its weight norm, which grows only by ~lr per step: the softmax stays
    unconfident and the loss high for hundreds of steps (docs/training.md, "Why the
    plateau"). A constant scale keeps the norms equal and lifts that bound. 1 = the paper.

    ``patch_gain`` gives up those equal norms on purpose: each patch's unit feature is
    multiplied by a learned gain ``g(x) = softplus(w . phi(x) + b) >= 0`` of its own raw
    feature (starting at 1 everywhere). Why: the pooled feature is the attention-weighted
    mean, so where a label is decided by one small region among look-alikes the attention
    cannot tell apart at low resolution (one tumour nest among decoy clusters), that region
    gets a share of the mass no larger than any look-alike's and the look-alikes outvote it;
    a gain lets the patches that show the class carry more weight than their share of the
    mass (docs/training.md, "Synthetic slides from scratch", has the misses that motivated
    it and the runs that measured it). The estimator is untouched: ``g(x) u(x)`` is still a
    function of the patch alone, so the pooled estimate of ``E_a[g u]`` and its gradients
    stay unbiased (tests/test_auxiliary_losses.py); what is lost is the optimality of
    sampling from ``a`` (thesis §3.3.4), i.e. the estimate's variance grows where a patch of
    large gain has a small attention. On where a label counts objects (Megapixel MNIST's
    majority of digits) every object should weigh alike, which the unit norms give: off.

    ``pooling`` says what the estimator averages. ``features`` (the thesis): the patches'
    features, then the classifier. ``votes``: each patch's class probabilities
    ``p(x) = softmax(W f(x))``, and the logits are ``log E_a[p]``: a soft vote. Why: where
    the label is a count (the majority of Megapixel MNIST's digits) an average of features
    lets one confident patch outweigh several less confident ones, a vote gives each at
    most its attention's share; and a patch that shows nothing of a class (noise taught to
    give equal logits, ``tools/pretrain_mnist_features.py --none-uniform``) adds the same
    to every class, so it cannot tip the vote. ``p`` is a function of the patch alone, so
    the estimate of ``E_a[p]`` and both its gradients are unbiased exactly as for features
    (tests/test_pooling.py); the log is the model's nonlinearity, as the classifier and
    softmax are with features. Measured: benchmarks/README.md, "Votes and counts".

    ``none_class`` (votes and counts only): one more logit per patch, for "no class here",
    in the softmax of each patch's vote, whose class entries are then its vote: a patch
    read as none (noise, background) votes little, where otherwise it must spread a whole
    vote over the classes. Stage 1 of the robust Megapixel MNIST recipe trains it
    (tools/pretrain_mnist_features.py: digit vs none on patches). Still a function of the
    patch alone: the estimate stays unbiased (tests/test_pooling.py).

    ``counts``: the vote of each patch divided by ``M_i``, the attention mass of the cells
    within one patch of its cell (:meth:`local_mass`), so the estimate is of
    ``sum_i a_i p_i / M_i``. Why: a vote weighs each object by the attention mass it got,
    and a learned attention is uneven (one digit 5 times another on clean Megapixel MNIST,
    which alone cost 9 points of a perfect reader's majority: benchmarks/README.md,
    "Votes and counts"). Derivation: for an object whose cells R lie within one patch of each other
    with no other mass near, ``M_i = a(R)`` for ``i`` in R and ``sum_{i in R} a_i / M_i =
    1``: every object adds its class probabilities once, whatever its mass, and the
    logits are the log of the estimated counts per class. Unbiased: ``p_i / M_i`` is a
    deterministic, differentiable function of the parameters for every cell (M from the
    whole attention map), so the estimator's argument (*) in
    :func:`ats_cli.core.sampling.expectation` holds unchanged for the value and for both
    gradients (tests/test_pooling.py); and ``a_i / M_i <= 1``, so no draw weighs more than
    a vote does.

    ``count_floor`` (counts only) divides by ``max(M_i, floor)`` instead: an object with at
    least ``floor`` of the attention counts once, one with less counts ``a(R) / floor``, in
    proportion to its mass as in a vote. 0 is the pure count, 1 the vote (M <= 1). Why:
    counted once each, the many small objects of unseen noise (50 rings an image, each
    with about 1% of the mass) outvote 5 digits on what little they misread; weighed by
    their mass, as a vote weighs them, they do not (benchmarks/README.md, "Votes and
    counts"). Still a deterministic function of the parameters per cell: unbiased.
    """

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
        entropy_weight: float = 0.01,
        smoothing: float = 0.0,
        min_brightness: float = 0.0,
        feature_scale: float = 1.0,
        estimator: str = "auto",
        rarity_prior: float = 0.0,
        eval_n_patches: int = 0,
        patch_gain: bool = False,
        pooling: str = "features",
        none_class: bool = False,
        count_floor: float = 0.0,
    ):
        super().__init__()
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; choose from {', '.join(ESTIMATORS)}")
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; choose from {', '.join(POOLINGS)}")
        self.attention_net = attention_net
        self.feature_net = feature_net
        self.classifier = nn.Linear(feature_net.out_features, n_classes)
        self.gain = nn.Linear(feature_net.out_features, 1) if patch_gain else None
        # one more logit per patch, for "no class here": see patch_values
        self.none = nn.Linear(feature_net.out_features, 1) if none_class else None
        if self.none is not None and pooling == "features":
            raise ValueError("none_class needs pooling votes or counts: pooled features have no per-patch vote")
        if self.gain is not None:  # g = softplus(b) = 1 for every patch at the start: the unit-norm model
            nn.init.zeros_(self.gain.weight)
            nn.init.constant_(self.gain.bias, math.log(math.e - 1.0))
        self.n_patches = int(n_patches)
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.scale = float(scale)
        self.replace = bool(replace)
        self.entropy_weight = float(entropy_weight)
        self.smoothing = float(smoothing)
        self.min_brightness = float(min_brightness)
        self.feature_scale = float(feature_scale)
        self.estimator = estimator
        self.rarity_prior = float(rarity_prior)
        self.eval_n_patches = int(eval_n_patches)  # 0 = n_patches
        self.pooling = pooling
        self.count_floor = float(count_floor)  # pooling="counts": M_i is floored here (class docstring)

    def _supported_pixels(self, low: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Bool [B, 1, h, w]: the low-res pixels that may be sampled (None = all): bright
        enough (``min_brightness``) and inside ``mask`` (e.g. a slide's tissue)."""
        if self.min_brightness <= 0 and mask is None:
            return None
        keep_px = torch.ones_like(low[:, :1], dtype=torch.bool)
        if self.min_brightness > 0:
            keep_px = low.amax(1, keepdim=True) > self.min_brightness
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

    def support(
        self, low: torch.Tensor, att_shape: tuple[int, int], mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Bool [B, att_h, att_w] of the positions that may be sampled (None = all).

        ``mask`` [B, h, w] (bool, on the low-res view's pixels, e.g. a slide's tissue mask)
        is applied the same way as the brightness test: a cell is kept if any of its pixels is."""
        return self._support_cells(self._supported_pixels(low, mask), att_shape)

    def _support_cells(self, keep_px: torch.Tensor | None, att_shape: tuple[int, int]) -> torch.Tensor | None:
        if keep_px is None:
            return None
        keep = self._to_cells(keep_px, att_shape) > 0
        blank = ~keep.flatten(1).any(1)
        return keep | blank[:, None, None]

    def prior(self, low: torch.Tensor, att_shape: tuple[int, int], mask: torch.Tensor | None = None
              ) -> torch.Tensor | None:
        """Log-prior [B, att_h, att_w] added to the attention scores: ``rarity_prior * r``,
        ``r`` = :func:`rarity` of the cell (its most unusual pixel). None when off.

        Why: at initialisation the attention is uniform over the support, and where the label
        hides in a few small regions (1-3 tumour nests among ~5,000 tissue cells) the draws
        almost never show one, so neither network gets a signal: training sits at chance
        (docs/training.md). Regions that decide a label are usually the ones that look unlike
        the rest of the image (dense nuclei on stroma, a digit on a blank canvas), so the
        attention starts there: the prior multiplies a cell's probability by ``exp(beta r)``
        (r is in units of the image's typical deviation, so a cell twice as unusual as the
        typical one gets e^beta times its mass), and the attention net, whose last layer
        starts at zero, learns a correction on top of it (it sees the same low-res view, so it
        can undo the prior where the unusual is uninformative). The prior is a fixed function
        of the input, part of the model (saved in its spec, applied at prediction alike): the
        attention is still a distribution the patches are sampled from, so the estimator and
        its gradient stay unbiased for it.
        """
        return self._prior_cells(low, self._supported_pixels(low, mask), att_shape)

    def _prior_cells(self, low: torch.Tensor, keep_px: torch.Tensor | None, att_shape: tuple[int, int]
                     ) -> torch.Tensor | None:
        if self.rarity_prior <= 0:  # 0 = off; -1 (auto, unsettled outside training) too
            return None
        return self.rarity_prior * self._to_cells(rarity(low, keep_px), att_shape)

    @property
    def patches_now(self) -> int:
        """Patches one forward pass draws by default: ``n_patches`` in training,
        ``eval_n_patches`` (0 = the same) in evaluation and prediction. More patches at
        evaluation leave the estimate unbiased and lower its variance; they cost compute but
        no memory for gradients, which is what bounds ``n_patches`` in training."""
        return self.n_patches if self.training else (self.eval_n_patches or self.n_patches)

    @property
    def active_estimator(self) -> str:
        """The estimator the current mode uses: ``auto`` is the per-image rule in training and
        the threshold estimator for prediction (fewer changed decisions, benchmarks/README.md;
        see ats_cli.core.sampling)."""
        return "threshold" if self.estimator == "auto" and not self.training else self.estimator

    @property
    def patch_gain(self) -> bool:
        return self.gain is not None

    def patch_features(self, patches: torch.Tensor) -> torch.Tensor:
        """The feature f(x) the estimator averages, for patches [N, C, ph, pw] (float):
        ``feature_scale`` times the unit-norm feature, times the patch's gain when the model
        has one (see the class docstring). A function of each patch alone, which is what
        keeps the pooled estimate unbiased."""
        feats, gain = self.patch_parts(patches)
        return feats if gain is None else gain * feats

    def patch_parts(self, patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The two factors of :meth:`patch_features` from one pass of the feature net: the
        scaled unit-norm feature [N, D] and the gain [N, 1] (None without one). Apart for
        whoever trains them apart (tools/pretrain_mnist_features.py: the patch classes on the
        unit feature, the gain as digit 1 / none 0)."""
        raw = self.feature_net(patches)
        # equal norms make sampling from a optimal (thesis 3.3.4); the scale: see the class docstring
        feats = self.feature_scale * F.normalize(raw, dim=-1)
        return feats, None if self.gain is None else F.softplus(self.gain(raw))

    def patch_values(self, feats: torch.Tensor, mass: torch.Tensor | None = None) -> torch.Tensor:
        """What the estimator pools for patches of features ``feats`` [..., D]: the features
        themselves, or with ``pooling="votes"`` the class probabilities [..., classes]
        (float32 even under autocast: the estimator's weights multiply them), or with
        ``"counts"`` those divided by ``mass`` [...], the patches' :meth:`local_mass`."""
        if self.pooling == "features":
            return feats
        logits = self.classifier(feats).float()
        if self.none is None:
            probs = logits.softmax(-1)
        else:  # the classes' share of a softmax that also has "no class here": a patch read as none votes little
            probs = torch.cat([logits, self.none(feats).float()], -1).softmax(-1)[..., :-1]
        if self.pooling == "votes":
            return probs
        if mass is None:
            raise ValueError("pooling 'counts' needs the attention mass around each patch (local_mass)")
        return probs / mass.float().clamp(min=max(self.count_floor, torch.finfo(torch.float32).tiny))[..., None]

    def local_mass(self, probs: torch.Tensor, att_shape: tuple[int, int], sizes: torch.Tensor) -> torch.Tensor:
        """[B, K]: for every cell, the attention mass of the cells whose centres lie within
        one patch of it (a window of ``ceil(patch / cell)`` cells, made odd), with
        ``probs`` [B, K] over the attention grid ``att_shape`` and ``sizes`` [B, 2] the
        full-resolution (H, W) that sets the cell size. What ``pooling="counts"`` divides
        each vote by (see the class docstring)."""
        h, w = att_shape
        out = probs.new_empty(probs.shape)
        windows = [(math.ceil(self.patch_size[0] * h / float(H)) | 1, math.ceil(self.patch_size[1] * w / float(W)) | 1)
                   for H, W in sizes.tolist()]
        for window in set(windows):
            rows = [b for b, k in enumerate(windows) if k == window]
            grid = probs[rows].view(len(rows), 1, h, w)
            summed = F.avg_pool2d(grid, window, stride=1, padding=(window[0] // 2, window[1] // 2),
                                  count_include_pad=True) * (window[0] * window[1])
            out[rows] = summed.view(len(rows), -1)
        return out

    def readout(self, pooled: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] from the pooled estimate [B, ...] (:meth:`patch_values`):
        the classifier, or with votes (counts) the log of the pooled probabilities (counts),
        floored at the smallest normal number: a class no patch voted for stays finite."""
        if self.pooling == "features":
            return self.classifier(pooled)
        return pooled.clamp(min=torch.finfo(pooled.dtype).tiny).log()

    def patch_gains(self, patches: torch.Tensor) -> torch.Tensor | None:
        """Each patch's gain [N, 1] (patches [N, C, ph, pw], float), None without one: what
        ``ats visualize`` multiplies the estimator weights by to show each patch's share."""
        return None if self.gain is None else F.softplus(self.gain(self.feature_net(patches)))

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
    ) -> ATSOutput:
        """``low``: low-res views [B, C, h, w] (float, [0, 1]); ``sources``: the
        full-resolution images, as a tensor [B, C, H, W] or a sequence of patch sources.
        ``n_patches`` overrides the default (:attr:`patches_now`: more patches, less variance);
        ``support_mask`` [B, h, w] restricts sampling (see :meth:`support`).
        ``patch_transform``: applied to the gathered patches [B, n, C, ph, pw] (float, [0, 1])
        before the feature net; the training step passes its augmentation here
        (:class:`ats_cli.augment.Augmentation`), prediction never does. It changes what the
        feature net sees, not which positions are drawn nor how they are pooled."""
        n = self.patches_now if n_patches is None else int(n_patches)
        scores = self.attention_net(low)
        att_shape = tuple(scores.shape[-2:])
        keep_px = self._supported_pixels(low, support_mask)  # shared by the prior and the support
        prior = self._prior_cells(low, keep_px, att_shape)
        if prior is not None:
            scores = scores + prior[:, None].to(scores.dtype)
        probs = attention_distribution(scores, self.smoothing, self._support_cells(keep_px, att_shape))
        draw = sample(probs, n, replace=self.replace, generator=generator)
        indices, sampled_probs = draw.indices, draw.probs

        offsets = positions_to_offsets(
            indices,
            att_shape,
            source_sizes(sources).to(indices.device),
            self.patch_size,
            low_size=tuple(low.shape[-2:]),
            margin=getattr(self.attention_net, "margin", 0),
        )
        patches = pixels_to_float(gather_patches(sources, offsets, self.patch_size).to(low.device))
        if patch_transform is not None:
            patches = patch_transform(patches)
        B = low.shape[0]
        unit, gain = self.patch_parts(patches.flatten(0, 1))
        feats = (unit if gain is None else gain * unit).view(B, n, -1)
        threshold = estimator_threshold(self.active_estimator, draw, probs)
        weights = estimator_weights(sampled_probs, replace=self.replace, threshold=threshold)
        mass = None
        if self.pooling == "counts":
            mass = self.local_mass(probs, att_shape, source_sizes(sources).to(probs.device)).gather(1, indices)
        values = self.patch_values(feats, mass)
        pooled = expectation(values, sampled_probs, replace=self.replace, weights=weights)
        with torch.no_grad():  # each draw's share, in the unit of what was pooled (see ATSOutput)
            size = values.sum(-1) if self.pooling != "features" else (
                gain.view(B, n) if gain is not None else torch.ones_like(weights))
            contributions = weights.double() * size.double()
        return ATSOutput(
            logits=self.readout(pooled),
            attention=probs.view(B, *att_shape),
            indices=indices,
            offsets=offsets,
            sampled_probs=sampled_probs,
            entropy=entropy(probs),
            weights=weights.detach(),
            contributions=contributions,
            # read by the auxiliary losses only; the pooled estimate above does not use it
            patch_logits=self.classifier(feats),
            patches=patches if return_patches else None,
        )

    def loss(self, out: ATSOutput, target: torch.Tensor, *, patch_loss: float = 0.0,
             attention_loss: float = 0.0) -> torch.Tensor:
        """Cross-entropy minus the entropy bonus (thesis eq. 3.21), averaged over the batch,
        plus the two optional auxiliary terms of :func:`auxiliary_losses` with these weights.

        The classification term is the thesis's, untouched: the auxiliary terms are added
        to it, they do not enter the pooled feature, so its estimate and its gradient stay
        unbiased (tests/test_auxiliary_losses.py). What they change is the direction the
        networks are pushed in besides it: see :func:`auxiliary_losses`.
        """
        loss = F.cross_entropy(out.logits, target) - self.entropy_weight * out.entropy.mean()
        if patch_loss or attention_loss:
            p_term, a_term = auxiliary_losses(out, target)
            loss = loss + patch_loss * p_term + attention_loss * a_term
        return loss


def rarity(low: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """How unusual each low-res pixel is within its own image, [B, 1, h, w] >= 0.

    ``r = |x - m| / s``: the Euclidean distance of the pixel's colour (all channels) from
    ``m``, the per-channel median over the image's supported pixels (``keep`` [B, 1, h, w],
    None = all), in units of ``s``, the median of those distances: a typical pixel has
    r ~ 1, whatever the stain, brightness or contrast of the image. Medians, not means and
    standard deviations, so that the few unusual pixels being looked for do not set the
    scale they are measured in. Computed without gradient (an input, not a parameter).
    """
    with torch.no_grad():
        x = low.float()
        out = torch.zeros_like(x[:, :1])
        for b in range(x.shape[0]):
            pixels = x[b].flatten(1)  # [C, h*w]
            chosen = pixels[:, keep[b].flatten()] if keep is not None else pixels
            if chosen.shape[1] == 0:
                chosen = pixels
            centre = chosen.median(dim=1).values[:, None]
            dist = (pixels - centre).norm(dim=0)
            ref = (chosen - centre).norm(dim=0).median().clamp_min(1e-3)
            out[b, 0] = (dist / ref).view(x.shape[-2:])
        return out


def auxiliary_losses(out: ATSOutput, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two optional training signals against the initial plateau (``ats train --patch-loss``,
    ``--attention-loss``; off by default: in the ablation of docs/training.md they slowed
    learning, and what gets a model off the plateau is the default recipe instead).

    The idea: the attention network learns only through differences between the sampled
    patches' features, and the features learn only from the pooled estimate, where the few
    informative patches are diluted among the many drawn from background or noise. At
    initialisation neither network has anything to learn from the other, which is the
    long plateau of the reference (its Megapixel MNIST test error sits near chance for
    ~210 epochs) and why our earlier models needed a hand-made curriculum.

    * ``patch`` (multiple-instance "instance loss"): the classifier applied to each sampled
      patch alone must predict the image's label; mean cross-entropy over the drawn patches
      (draws of probability 0, past the end of a small support, excluded). Patches that
      show the class (a target digit, a tumour nest) learn it directly, from the first
      step, instead of through a weight of ~1/n in the pooled feature; patches that appear
      under every label (empty canvas, noise, normal tissue) can only learn the label
      prior, i.e. an unconfident prediction. Gradient: feature net and classifier.
    * ``attention`` (a critic of the attention): how informative was each sampled patch?
      ``u_k = log C - H(softmax(patch_logits_k))``, the information in the patch's own
      prediction (0 for a uniform one, log C for a certain one; no label used), detached.
      The attention restricted to the sampled positions, ``a_k / sum_j a_j``, is fitted to
      ``(u_k + c) / sum_j (u_j + c)`` (``c = CRITIC_FLOOR``) by cross-entropy: among the
      positions it drew, the attention learns to give more mass to those that turned out
      informative. Gradient: attention net only (``u`` is a constant). Early on all ``u``
      are ~0 and the term only keeps the sampled attention flat.

    Neither term changes the classification term's estimate or its gradient (they are
    added beside it); they change what the sum of the terms is minimised towards, as the
    entropy bonus already does. That is also their cost: the critic favours the patches the
    classifier is already sure of, where a label that needs every object (a majority of
    digits) wants the attention spread over all of them; and the patch term asks one
    classifier to be calibrated on single patches and on the pooled feature at once.
    Both return a scalar averaged over the batch.
    """
    logits = out.patch_logits
    valid = (out.sampled_probs > 0).float()  # [B, n]
    n_valid = valid.sum(1).clamp_min(1.0)
    ce = F.cross_entropy(logits.flatten(0, 1), target.repeat_interleave(logits.shape[1]), reduction="none")
    patch = ((ce.view_as(valid) * valid).sum(1) / n_valid).mean()

    with torch.no_grad():
        log_p = torch.log_softmax(logits.float(), dim=-1)
        info = (math.log(logits.shape[-1]) + (log_p.exp() * log_p).sum(-1)).clamp_min(0.0)
        # + CRITIC_FLOOR: while no patch says anything yet (all u ~ 0) the teacher is flat
        # instead of amplifying tiny differences; later a patch with u = 2 nats outweighs
        # an uninformative one ~20 to 1
        teacher = (info + CRITIC_FLOOR) * valid
        teacher = teacher / teacher.sum(1, keepdim=True).clamp_min(1e-12)
    log_a = torch.log(out.sampled_probs.clamp_min(1e-30))
    log_a = log_a.masked_fill(valid == 0, -math.inf)
    log_share = torch.log_softmax(log_a, dim=1).masked_fill(valid == 0, 0.0)
    attention = -(teacher * log_share).sum(1).mean()
    return patch, attention
