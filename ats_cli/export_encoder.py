"""``ats export SRC DIR --encoder``: a run's feature network as an encoder of its own.

Writes ``DIR/model.safetensors`` (the feature network's state dict: no code, readable by any
safetensors reader) and ``DIR/config.json`` (:data:`ats_cli.nets.encoders.FORMAT`): the
network's name and keyword arguments as the run's model spec holds them, which is all it
takes to rebuild it without the network or the run (a timm model by its architecture, never
by a hub name), and, for the reader's sake, its input size, normalisation and output width.
``--feature-net DIR`` (or ``local:DIR``) takes it back: train on one task, reuse the encoder,
frozen by default, on another (ats_cli.nets.encoders).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ats_cli.checkpoint import load_model
from ats_cli.io import atomic_path
from ats_cli.nets.encoders import CONFIG, FORMAT, VERSION, WEIGHTS, Encoder, EncoderError, import_extra
from ats_cli.predict.predictor import resolve_model_path

__all__ = ["export_encoder"]


def export_encoder(src: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False
                   ) -> dict[str, Any]:
    """Write the feature network of checkpoint (or run directory) ``src`` to directory ``out``;
    returns the config written. Raises :class:`EncoderError` for a model without one, for
    an ``out`` that already holds an encoder (unless ``overwrite``) and for a write that
    fails (then neither file is there, nor the directories made for them), and
    :class:`ats_cli.checkpoint.CheckpointError` for a file that is not a checkpoint."""
    st = import_extra("safetensors.torch", "export --encoder")
    path = resolve_model_path(src)
    model, ckpt = load_model(path)
    spec = ckpt["spec"]
    net = getattr(model, "feature_net", None)
    if net is None:
        raise EncoderError(f"{path}: a {spec.get('method')} model has no feature network to export")
    enc = net if isinstance(net, Encoder) else None
    config = {"format": FORMAT, "version": VERSION, "feature_net": spec["feature_net"],
              "feature_kwargs": spec["feature_kwargs"], "channels": spec.get("channels"),
              "out_features": int(net.out_features),
              "input_size": list(enc.input_size) if enc and enc.input_size else None,
              "mean": enc.mean.flatten().tolist() if enc else None, "std": enc.std.flatten().tolist() if enc else None,
              "interpolation": enc.interpolation if enc else None, "source": str(path)}
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EncoderError(f"{out}: not a directory (ats export --encoder writes {WEIGHTS} and {CONFIG} into one)")
    held = [name for name in (WEIGHTS, CONFIG) if (out / name).exists()]
    if held and not overwrite:
        raise EncoderError(f"{out}: already holds {' and '.join(held)}; give --overwrite to replace them, or another "
                           "directory")
    from ats_cli.export import ExportError, writing

    try:
        with writing(out / CONFIG), atomic_path(out / WEIGHTS) as weights, atomic_path(out / CONFIG) as cfg:
            weights.write_bytes(st.save({k: v.contiguous() for k, v in net.state_dict().items()}))
            cfg.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    except ExportError as e:  # both files are written before either replaces what was there
        raise EncoderError(str(e)) from None
    return config
