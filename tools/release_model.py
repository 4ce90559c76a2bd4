"""Write a released model: a run's checkpoint without its optimizer state.

    python tools/release_model.py RUN_DIR/best.pt models/NAME.pt [--mpp MPP] [--eval-n-patches N]
                                  [--pooling features|votes|counts] [--none-class off]
                                  [--count-floor F] [--none-prior P [--trained-none-share Q]]

Keeps what prediction and a model card need (spec, classes, weights, the training
configuration and the per-epoch history) and drops the optimizer and scaler state, so
the file is a few hundred kB. Loadable with ``torch.load(weights_only=True)`` like any
ats checkpoint; ``ats train --init`` accepts it for fine-tuning.

``--mpp MPP``: record that the model was trained at MPP microns per pixel, for a
checkpoint written before models recorded it (ats_cli.data.magnification); the weights
are unchanged, and predict then reads slides that record their mpp at that scale.

``--eval-n-patches N``: the patches prediction draws by default (spec version 4; a model
saved before predicts with its training count): e.g. twice the training count, the
default of models trained since (docs/training.md, "Patches at evaluation").

``--pooling features|votes|counts``: what the released model pools (spec version 6), for a
checkpoint whose classifier reads one patch as well as the pooled features: that of
``tools/pretrain_mnist_features.py``, trained on single patches, read either way.
``--none-class off`` drops a checkpoint's "no class here" logit (ats train --none-class),
so that one checkpoint can be read with and without it; ``--count-floor F`` sets the floor
of a counts pooling (ats train --count-floor).

``--none-prior P``: the share of "none" among the objects the released model will count,
for a checkpoint whose "no class here" logit was trained on single patches in another
proportion Q (``tools/pretrain_mnist_features.py`` records it as ``pretrain.none_share``;
``--trained-none-share Q`` gives it for a checkpoint that does not). Why: a classifier
trained under class prior pi_train outputs p_train(y|x), and under another prior pi_test the
posterior is p_test(y|x) ∝ p_train(y|x) pi_test(y) / pi_train(y) (Bayes' rule, the x-given-y
likelihood unchanged: Saerens, Latinne & Decaestecker, Neural Computation 2002). Counts
pool one vote per object, and on a paper-spec Megapixel MNIST image 50 of the 55 objects are
noise (P = 50/55) where stage 1 trained on about two "none" patches per digit patch (Q ≈
0.67): read at Q, every noise object is taken as about 5 times likelier to be a digit than
it is, and 50 of them add up. With the ten digits sharing the rest alike in both priors,
only the none logit moves, by ``log(P/Q) - log((1-P)/(1-Q))`` (:func:`none_shift`): its
bias is shifted, nothing else changes, and the pooled estimate stays an expectation of a
function of each patch alone (unbiased). The values are recorded in the file
(``release.none_prior``, ``release.trained_none_share``, ``release.none_shift``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ats_cli.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ats_cli.config import allowed_values
from ats_cli.legacy import upgrade_spec
from ats_cli.models import create_model


def none_shift(prior: float, trained: float) -> float:
    """What the none logit gains when the share of "none" goes from ``trained`` to ``prior``
    (both in (0, 1)), the ten classes sharing the rest alike before and after (module
    docstring): ``log(prior / trained) - log((1 - prior) / (1 - trained))``."""
    return math.log(prior / trained) - math.log((1.0 - prior) / (1.0 - trained))


def share(text: str) -> float:
    """``"0.9"`` or ``"50/55"`` (noise objects over all objects) -> a float; argparse's type."""
    num, _, den = text.partition("/")
    try:
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a share like 0.9 or 50/55, got {text!r}") from None


def main(src: str, dst: str, mpp: float | None = None, eval_n_patches: int | None = None,
         pooling: str | None = None, none_class: str | None = None, count_floor: float | None = None,
         none_prior: float | None = None, trained_none_share: float | None = None) -> None:
    try:
        ckpt = load_checkpoint(src)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    release = dict(ckpt.get("release") or {})
    if none_prior is not None:
        if "none_prior" in release:  # shifting twice would count the first shift as the training prior
            raise SystemExit(f"error: {src}: its none logit is already read at prior {release['none_prior']}; "
                             "release from the checkpoint it came from")
        trained = trained_none_share
        if trained is None:
            trained = (ckpt.get("pretrain") or {}).get("none_share")
        if trained is None:
            raise SystemExit(f"error: {src}: does not record the share of 'none' patches it was trained on; "
                             "give it with --trained-none-share")
        if not (0 < none_prior < 1 and 0 < trained < 1):
            raise SystemExit(f"--none-prior and the trained share must be in (0, 1), got {none_prior} and {trained}")
        if none_class == "off" or "none.bias" not in ckpt["model"]:
            raise SystemExit(f"error: {src}: --none-prior needs the checkpoint's none logit (--none-class on)")
        shift = none_shift(none_prior, float(trained))
        ckpt["model"] = {**ckpt["model"], "none.bias": ckpt["model"]["none.bias"] + shift}
        release.update(none_prior=float(none_prior), trained_none_share=float(trained), none_shift=shift)
    elif trained_none_share is not None:
        raise SystemExit("--trained-none-share goes with --none-prior")
    if mpp is not None:
        if not mpp > 0:
            raise SystemExit(f"--mpp must be > 0, got {mpp}")
        ckpt["spec"]["input"] = {**ckpt["spec"]["input"], "mpp": float(mpp), "level": None, "resample": True}
    if eval_n_patches is not None and eval_n_patches < 0:
        raise SystemExit(f"--eval-n-patches must be >= 0, got {eval_n_patches}")
    if count_floor is not None and not 0 <= count_floor <= 1:
        raise SystemExit(f"--count-floor must be in [0, 1], got {count_floor}")
    # the spec keys these options set, each at the spec version that has it (upgrade_spec)
    changes = {k: cast(v) for k, v, cast in (("eval_n_patches", eval_n_patches, int), ("pooling", pooling, str),
                                             ("count_floor", count_floor, float)) if v is not None}
    if none_class == "off":
        changes["none_class"] = False
        ckpt["model"] = {k: v for k, v in ckpt["model"].items() if not k.startswith("none.")}
    if changes:
        ckpt["spec"] = {**upgrade_spec(ckpt["spec"]), **changes}
    try:  # e.g. --pooling features on a checkpoint with a none logit: one line naming the file
        model = create_model(ckpt["spec"])
        model.load_state_dict(ckpt["model"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {src}: cannot be released so ({str(e).splitlines()[0]})") from None
    save_checkpoint(dst, spec=ckpt["spec"], classes=ckpt["classes"], model=model, epoch=ckpt.get("epoch"),
                    config=ckpt.get("config", {}), history=ckpt.get("history", []),
                    **({"release": release} if release else {}))
    print(f"wrote {dst} ({Path(dst).stat().st_size / 1e3:.0f} kB) from {src}, epoch {ckpt.get('epoch')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--mpp", type=float, default=None)
    parser.add_argument("--eval-n-patches", type=int, default=None)
    parser.add_argument("--pooling", choices=allowed_values()["pooling"], default=None)
    parser.add_argument("--none-class", choices=["off"], default=None)
    parser.add_argument("--count-floor", type=float, default=None)
    parser.add_argument("--none-prior", type=share, default=None, help="e.g. 50/55: 50 noise objects, 5 digits")
    parser.add_argument("--trained-none-share", type=share, default=None)
    a = parser.parse_args()
    main(a.src, a.dst, a.mpp, a.eval_n_patches, a.pooling, a.none_class, a.count_floor, a.none_prior,
         a.trained_none_share)
