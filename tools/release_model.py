"""Write a released model: a run's checkpoint without its optimizer state.

    python tools/release_model.py RUN_DIR/best.pt models/NAME.pt [--mpp MPP] [--eval-n-patches N]
                                  [--pooling features|votes|counts] [--none-class off]
                                  [--count-floor F]

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
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ats_cli.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ats_cli.config import allowed_values
from ats_cli.legacy import upgrade_spec
from ats_cli.models import create_model


def main(src: str, dst: str, mpp: float | None = None, eval_n_patches: int | None = None,
         pooling: str | None = None, none_class: str | None = None, count_floor: float | None = None) -> None:
    try:
        ckpt = load_checkpoint(src)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
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
                    config=ckpt.get("config", {}), history=ckpt.get("history", []))
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
    a = parser.parse_args()
    main(a.src, a.dst, a.mpp, a.eval_n_patches, a.pooling, a.none_class, a.count_floor)
