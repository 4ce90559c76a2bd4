"""What files written by older versions of ats meant: the one place that knows.

Two kinds of file outlive the code that wrote them:

* a model's *spec*, in every checkpoint (written by :func:`ats_cli.models.model_spec`,
  read by :func:`ats_cli.models.create_model`), carrying :data:`SPEC_VERSION`;
* a run's ``config.json`` (:meth:`ats_cli.config.TrainConfig.to_dict`), read back when
  the run is resumed.

When a setting is added, files written before lack it, and that absence has to be read
as what those files' runs actually did, which need not be today's default. Each legacy
value below says what it was and why; nothing else in ats fills in a missing key.
:func:`upgrade_spec` and :func:`upgrade_run_config` are the only readers of these tables.

The spec keys that every checkpoint ats ever wrote holds (the networks and their
arguments, ``n_classes``, ``channels``, ``n_patches``, ``patch_size``, ``scale``,
``replace``, ``entropy_weight``, ``smoothing``, ``min_brightness``) have no legacy value:
a spec without one was not written by ats, and loading it fails by name.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["SPEC_VERSION", "SPEC_LEGACY", "SPEC_LEGACY_2", "SPEC_INPUT_LEGACY_3", "SPEC_LEGACY_4", "SPEC_LEGACY_5",
           "SPEC_LEGACY_6", "RUN_CONFIG_LEGACY", "upgrade_spec", "upgrade_run_config"]

# Version 1: the spec carries its version. Every spec written before (all of them "version
# 0", e.g. the released models/*.pt) is read through SPEC_LEGACY. A future change of what
# a key *means* (not only a new key) bumps this and adds its step to upgrade_spec.
# Version 2: the spec carries ``rarity_prior`` (ats_cli.core.model.ATSModel.prior).
# Version 3: the input block's ``mpp`` is the physical scale the model's pixels have, and
# ``input.resample`` says slides are resampled to it (ats_cli.data.magnification).
# Version 4: the spec carries ``eval_n_patches``, the patches drawn at evaluation and
# prediction (ats_cli.core.model.ATSModel.patches_now).
# Version 5: the spec carries ``patch_gain`` (ats_cli.core.model.ATSModel.patch_features).
# Version 6: the spec carries ``pooling``, ``none_class`` and ``count_floor``
# (ats_cli.core.model.ATSModel.patch_values).
SPEC_VERSION = 6

# Keys a version-0 spec may lack, with the value that stands for its absence.
SPEC_LEGACY: dict[str, Any] = {
    # Before `ats train --method` existed, attention sampling was the only model trained.
    "method": "ats",
    # Before --feature-scale was saved the features went to the classifier unscaled: a
    # scale of 1, the paper's (ats_cli.core.model.ATSModel explains the scale).
    "feature_scale": 1.0,
    # Before train saved how it read its inputs, predict and visualize read every input
    # with ats_cli.data.inputs.open_input's own choices: None for each option.
    "input": {"reader": None, "level": None, "mpp": None, "tissue": None},
    # Models saved before --estimator existed were trained with the thesis's `sequential`
    # estimator (the only one then), but such a model predicts with `auto` (= `threshold`
    # in eval mode), as it has since the estimators were added. The estimator is not
    # something the weights learned: every estimator is unbiased for the same pooled
    # feature, so the weights are equally right under each, and in prediction `threshold`
    # is the one whose class departs less often from the exact expectation's
    # (ats_cli.core.sampling). The released models' cards report their
    # accuracy with `auto` and the `sequential` figure beside it; `ats predict --estimator
    # sequential` gives the predictions these models made before the estimators were added.
    "estimator": "auto",
}

# Keys a version-1 spec may lack (version 0 lacks them too).
SPEC_LEGACY_2: dict[str, Any] = {
    # Models saved before the rarity prior existed sampled from the attention net's output
    # alone: a prior of 0 is exactly that model.
    "rarity_prior": 0.0,
}

# Keys a version-3 (or older) spec may lack.
SPEC_LEGACY_4: dict[str, Any] = {
    # Models saved before the evaluation count was recorded predicted with their training
    # count (0 stands for it), and their cards report figures measured that way.
    "eval_n_patches": 0,
}

# Keys a version-4 (or older) spec may lack.
SPEC_LEGACY_5: dict[str, Any] = {
    # Models saved before the gain existed pooled unit-norm features: no gain is exactly
    # that model (and their checkpoints hold no gain weights).
    "patch_gain": False,
}

# Keys a version-5 (or older) spec may lack.
SPEC_LEGACY_6: dict[str, Any] = {
    # Models saved before the votes existed pooled their features (the thesis).
    "pooling": "features",
    "none_class": False,
    "count_floor": 0.0,
}

# Keys a version-2 (or older) spec's ``input`` block may lack.
SPEC_INPUT_LEGACY_3: dict[str, Any] = {
    # Before models knew their microns, an ``input.mpp`` (from `ats train --mpp`) picked the
    # level closest to it, read as it is, and a file recording no mpp was refused: no
    # resampling is exactly that reading. (Such models record no mpp otherwise.)
    "resample": False,
}

# Keys a run's config.json may lack because the run was saved before the key existed,
# with the value that run used. Resuming continues a run "exactly where it stopped", so
# it keeps what it was trained with instead of switching to a newer default half-way; a
# new run from a hand-written file gets the default.
RUN_CONFIG_LEGACY: dict[str, Any] = {
    # Runs saved before --rarity-prior existed sampled without it: resuming one keeps it off
    # (today's default, auto, would turn it on half-way through a slide run).
    "rarity_prior": 0.0,
    # Runs saved before --estimator existed trained with the thesis's sequential
    # estimator, the only one then (unlike SPEC_LEGACY's prediction-time `auto`: the
    # estimator's noise shapes the gradients of the epochs still to come).
    "estimator": "sequential",
    # Runs saved before --augment existed trained on the images as they are: resuming one
    # keeps that (today's default, auto, would start augmenting a slide run half-way).
    "augment": "none",
    # Runs saved before --patch-gain existed have no gain in their model: resuming one
    # keeps it off (today's default, auto, would add one to a slide run's checkpoint).
    "patch_gain": "off",
    # Runs saved before --pooling existed pooled features, with no "none" logit.
    "pooling": "features",
    "none_class": "off",
    "count_floor": 0.0,
}


def upgrade_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` as the current :data:`SPEC_VERSION` writes it: keys that a spec of an
    older version lacks take their :data:`SPEC_LEGACY` value. Returns a new dict; a spec
    already current comes back equal. Raises ValueError for a spec newer than this ats."""
    version = spec.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"model spec version {version!r} is not a version number")
    if version > SPEC_VERSION:
        raise ValueError(f"model spec version {version} is newer than this ats ({SPEC_VERSION}); upgrade ats")
    out = copy.deepcopy(spec)
    for since, legacy in ((1, SPEC_LEGACY), (2, SPEC_LEGACY_2), (4, SPEC_LEGACY_4), (5, SPEC_LEGACY_5),
                          (6, SPEC_LEGACY_6)):
        if version < since:
            for key, value in legacy.items():
                out.setdefault(key, copy.deepcopy(value))
    if version < 3 and isinstance(out.get("input"), dict):
        for key, value in SPEC_INPUT_LEGACY_3.items():
            out["input"].setdefault(key, value)
    out["version"] = SPEC_VERSION
    return out


def upgrade_run_config(values: dict[str, Any]) -> dict[str, Any]:
    """A resumed run's saved config values, keys it lacks taking their
    :data:`RUN_CONFIG_LEGACY` value. Returns a new dict."""
    return {**{k: v for k, v in RUN_CONFIG_LEGACY.items() if k not in values}, **values}
