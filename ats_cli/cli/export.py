"""`ats export`: parse flags, set a checkpoint's evaluation options (ats_cli.export)."""

from __future__ import annotations

from pathlib import Path

import typer

from ats_cli.cli import OutputConsole, app


def _share(text: str | None) -> float | None:
    if text is None:
        return None
    from ats_cli.export import parse_share

    try:
        return parse_share(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def export(
    src: Path = typer.Argument(..., help="A checkpoint: ats pretrain's, or a run's best.pt / last.pt, or a run "
                               "directory (its best.pt, else last.pt); or a model directory from --hub-ready, or "
                               "hf-hub:ORG/NAME.", show_default=False),
    dst: Path = typer.Argument(..., help="The model file to write (in one step; an existing one only with "
                               "--overwrite); --encoder, --hub-ready: a directory.", show_default=False),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST (--encoder: the encoder in DST) if it "
                                   "exists.", show_default=False),
    encoder: bool = typer.Option(False, "--encoder", help="Write only the feature network, as DST/model.safetensors "
                                 "+ DST/config.json, for --feature-net DST in another run (docs/training.md)."),
    hub_ready: bool = typer.Option(False, "--hub-ready", help="Write DST as a Hugging Face Hub model: "
                                   "DST/model.safetensors, DST/config.json (the model spec) and DST/README.md (a model "
                                   "card with its metrics); --model DST or, uploaded, --model hf-hub:ORG/NAME takes "
                                   "it (docs/hub.md)."),
    license: str = typer.Option(None, "--license", show_default=False, help="--hub-ready: the licence id the "
                                "model card gives, e.g. mit, apache-2.0, cc-by-nc-4.0 \\[default: unknown, a "
                                "placeholder to set]."),
    eval_n_patches: int = typer.Option(None, "--eval-n-patches", min=0, show_default=False,
                                       help="Patches prediction draws by default \\[default: as in SRC]."),
    eval_regions: int = typer.Option(None, "--eval-regions", min=0, show_default=False,
                                     help="Two levels: regions prediction draws \\[default: as in SRC]."),
    eval_coarse_px: int = typer.Option(None, "--eval-coarse-px", min=0, show_default=False,
                                       help="Two levels: coarse-view pixels per region side at prediction, e.g. "
                                       "twice training's coarse_px \\[default: as in SRC; 0: as trained]."),
    pooling: str = typer.Option(None, "--pooling", show_default=False,
                                help="What the model pools: features | highest | votes | counts | "
                                "highest-counts | topmost-counts \\[default: as in SRC]."),
    count_floor: float = typer.Option(None, "--count-floor", min=0.0, max=1.0, show_default=False,
                                      help="The floor a counts pooling reads at (and trains at with ats train "
                                      "--set init=DST; replaces a reading floor of its own) \\[default: as in SRC]."),
    none_class: str = typer.Option(None, "--none-class", show_default=False,
                                   help="off: drop the model's 'no class here' logit."),
    none_prior: str = typer.Option(None, "--none-prior", callback=_share, show_default=False,
                                   help="Share of 'none' among the objects the model will count, e.g. 50/55 (50 "
                                   "noise objects, 5 digits): the none logit is moved from the share it was "
                                   "trained on to this one by Bayes' rule. Once per model."),
    trained_none_share: str = typer.Option(None, "--trained-none-share", callback=_share, show_default=False,
                                           help="The share of 'none' SRC was trained on, for a checkpoint that "
                                           "does not record it \\[default: SRC's pretrain.none_share]."),
    mpp: float = typer.Option(None, "--mpp", show_default=False,
                              help="Record that the model was trained at this many microns per pixel."),
) -> None:
    """Make a checkpoint a model to predict with: set its evaluation options, drop the
    optimizer state, record what was done in the file. --hub-ready: a directory the
    Hugging Face Hub shows as a model, with its model card.
    """
    from rich.markup import escape

    from ats_cli.config import allowed_values
    from ats_cli.export import ExportError, export_checkpoint

    console = OutputConsole(highlight=False, soft_wrap=True)
    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    if encoder and hub_ready:
        err.print("[red]error:[/] --encoder and --hub-ready write different directories; give one")
        raise typer.Exit(2)
    if encoder:
        _export_encoder(src, dst, console, err, overwrite=overwrite)
        return
    poolings = [p for p in allowed_values()["pooling"] if p != "auto"]  # a trained model's pooling is known
    if pooling is not None and pooling not in poolings:
        err.print(f"[red]error:[/] --pooling must be one of {', '.join(poolings)} (got {pooling!r})")
        raise typer.Exit(2)
    if none_class not in (None, "off"):
        err.print(f"[red]error:[/] --none-class takes only off (got {none_class!r})")
        raise typer.Exit(2)
    try:
        done = export_checkpoint(src, dst, mpp=mpp, eval_n_patches=eval_n_patches, eval_regions=eval_regions,
                                 eval_coarse_px=eval_coarse_px, pooling=pooling,
                                 none_class=none_class, count_floor=count_floor, none_prior=none_prior,
                                 trained_none_share=trained_none_share, overwrite=overwrite, hub_ready=hub_ready,
                                 license=license)
    except ExportError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    settings = ", ".join(f"{k} {v}" for k, v in done.items() if k != "source") or "options as trained"
    taken = src / done["source"]  # a run directory: the checkpoint taken from it
    source = escape(str(taken if taken.is_file() else src))
    if hub_ready:
        from ats_cli.hub import WEIGHTS

        size = (dst / WEIGHTS).stat().st_size / 1e3
        console.print(f"wrote {escape(str(dst))} ({WEIGHTS} {size:.0f} kB, config.json, README.md) from {source}: "
                      f"{escape(settings)}; --model {escape(str(dst))} takes it, and uploaded (hf upload ORG/NAME "
                      f"{escape(str(dst))}) --model hf-hub:ORG/NAME")
        return
    size = dst.stat().st_size / 1e3
    console.print(f"wrote {escape(str(dst))} ({size:.0f} kB) from {source}: {escape(settings)}")


def _export_encoder(src: Path, dst: Path, console: OutputConsole, err: OutputConsole, *, overwrite: bool) -> None:
    from rich.markup import escape

    from ats_cli.checkpoint import CheckpointError
    from ats_cli.export_encoder import export_encoder
    from ats_cli.nets.encoders import EncoderError

    try:
        config = export_encoder(src, dst, overwrite=overwrite)
    except (CheckpointError, EncoderError, OSError) as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    console.print(f"wrote {escape(str(dst))}: {escape(config['feature_net'])}, {config['out_features']} features; "
                  f"use it with --feature-net {escape(str(dst))}")
