"""`ats pretrain`: parse flags, run the library's patch-level pretraining (ats_cli.pretrain)."""

from __future__ import annotations

from pathlib import Path

import typer

from ats_cli.cli import OutputConsole, app
from ats_cli.cli.options import config_option
from ats_cli.config import VOTING_POOLINGS  # loaded already: cli.options imports config

NETS = "Networks (as ats train's)"
STAGES = "Stages"


def config_help_of(name: str) -> str:
    """TrainConfig field ``name``'s help without its default (ats pretrain has its own)."""
    from ats_cli.cli.options import FIELDS

    f = FIELDS[name]
    choices = f.metadata.get("choices") or {}
    return f.metadata["help"].format(choices=" | ".join(choices)) + "."


@app.command()
def pretrain(
    data: Path = typer.Argument(..., help="A dataset directory whose CSV rows record regions (see --regions).",
                                show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="The checkpoint to write.", show_default=False),
    regions: str = typer.Option("digits", help="The CSV column naming each row's regions: a JSON list of "
                                "\\[class, top, left, height, width] in level-0 pixels (ats make-dataset "
                                "megapixel-mnist writes it as 'digits', synthetic-slides as 'boxes'), or the path "
                                "of a QuPath GeoJSON annotation export (relative to DATA; classified polygons "
                                "become their bounding boxes, unclassified ones are skipped)."),
    images: int = typer.Option(12000, min=1, help="Training images patches are cut from (the first N rows)."),
    test_images: int = typer.Option(300, min=1, help="Test images whose patches are scored after each epoch."),
    epochs: int = typer.Option(3, min=0, help="Stage 1: epochs training the feature net and its patch head.",
                               rich_help_panel=STAGES),
    attention_epochs: int = typer.Option(5, min=0, help="Stage 1b: epochs fitting the attention to give each "
                                         "region the same mass (0 = leave it at its initialisation).",
                                         rich_help_panel=STAGES),
    shrunken: int = typer.Option(3, min=0, help="'None' patches per image holding its own objects shrunk to "
                                 "0.3-0.6 of their size (0 = none).", rich_help_panel=STAGES),
    none_uniform: float = typer.Option(0.5, min=0.0, help="Weight of the loss making the class logits equal on "
                                       "'none' patches, so that clutter does not vote (0 = off).",
                                       rich_help_panel=STAGES),
    batch_size: int = typer.Option(256, min=1, help="Patches per step of stage 1.", rich_help_panel=STAGES),
    lr: float = typer.Option(3e-3, help="Learning rate of both stages.", rich_help_panel=STAGES),
    scale: float = typer.Option(0.2, help="The low-res view's scale, as ats train's --scale.", rich_help_panel=NETS),
    attention_net: str = typer.Option("block-attention", rich_help_panel=NETS,
                                      help=config_help_of("attention_net")),
    attention_width: int = typer.Option(32, min=1, rich_help_panel=NETS, help="Attention net width."),
    feature_net: str = typer.Option("small-cnn", rich_help_panel=NETS, help=config_help_of("feature_net")),
    feature_width: int = typer.Option(32, min=1, rich_help_panel=NETS, help="Feature net width."),
    feature_scale: float = typer.Option(10.0, rich_help_panel=NETS, help="Scale of the unit patch features."),
    pooling: str = typer.Option("counts", rich_help_panel=NETS, help=config_help_of("pooling")),
    none_class: str = typer.Option("on", rich_help_panel=NETS, help="on: the patch head's 'none' row becomes the "
                                   "model's per-patch 'no class here' logit (needs a voting pooling: "
                                   f"{', '.join(VOTING_POOLINGS)})."),
    seed: int = typer.Option(0, help="Seeds the model, the patches cut and both stages' order."),
    workers: int = typer.Option(2, min=0, help="Processes reading images."),
    device: str = config_option("device", "auto"),
) -> None:
    """Teach a model from the regions a dataset records, not only its image labels.

    Stage 1 trains the feature net on patches holding one whole object (labelled with its
    class) or no part of one ("none"); stage 1b fits the attention to give each object the
    same mass. The checkpoint is the model ats train builds with the same network settings:
    [bold]ats export[/] makes it a model to predict with, [bold]ats train --set init=CKPT[/] fine-tunes it.
    The defaults are the recipe of models/megapixel-mnist-ats.pt; RGB images (slides) need
    --shrunken 0.
    """
    from rich.markup import escape

    from ats_cli.config import allowed_values
    from ats_cli.pretrain import PretrainError
    from ats_cli.pretrain.run import PretrainOptions
    from ats_cli.pretrain.run import pretrain as run_pretrain

    err = OutputConsole(stderr=True, highlight=False, soft_wrap=True)
    allowed = allowed_values()
    for flag, value, field in (("--pooling", pooling, "pooling"), ("--none-class", none_class, "none_class")):
        if value not in allowed[field]:
            err.print(f"[red]error:[/] {flag} must be one of {', '.join(allowed[field])} (got {value!r})")
            raise typer.Exit(2)
    opts = PretrainOptions(data=str(data), out=str(out), regions=regions, images=images, test_images=test_images,
                           epochs=epochs, attention_epochs=attention_epochs, batch_size=batch_size, lr=lr, seed=seed,
                           workers=workers, device=device, shrunken=shrunken, none_uniform=none_uniform, scale=scale,
                           attention_net=attention_net, attention_width=attention_width, feature_net=feature_net,
                           feature_width=feature_width, feature_scale=feature_scale, pooling=pooling,
                           none_class=none_class)

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        opts.check()
    except PretrainError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    try:
        run_pretrain(opts, log=log)
    except PretrainError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: nothing written")
        raise typer.Exit(130) from None

