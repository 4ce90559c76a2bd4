"""Write a released model: a run's checkpoint without its optimizer state.

    python tools/release_model.py RUN_DIR/best.pt models/NAME.pt

Keeps what prediction and a model card need (spec, classes, weights, the training
configuration and the per-epoch history) and drops the optimizer and scaler state, so
the file is a few hundred kB. Loadable with ``torch.load(weights_only=True)`` like any
ats checkpoint; ``ats train --init`` accepts it for fine-tuning.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ats_cli.checkpoint import load_checkpoint, save_checkpoint
from ats_cli.models import create_model


def main(src: str, dst: str) -> None:
    ckpt = load_checkpoint(src)
    model = create_model(ckpt["spec"])
    model.load_state_dict(ckpt["model"])
    save_checkpoint(dst, spec=ckpt["spec"], classes=ckpt["classes"], model=model, epoch=ckpt.get("epoch"),
                    config=ckpt.get("config", {}), history=ckpt.get("history", []))
    print(f"wrote {dst} ({Path(dst).stat().st_size / 1e3:.0f} kB) from {src}, epoch {ckpt.get('epoch')}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
