"""Command-line options shared by several commands, defined once.

The options that are training settings are built from :class:`ats_cli.config.TrainConfig`'s
fields, which carry their help, panel and allowed values: ``ats train`` gets one flag per
field from :func:`config_flags`, and the other commands build their reading and device
options from the same fields with :func:`config_option`. A default, an allowed value or a
sentence of help is then written in one place, and the commands cannot drift apart
(tests/test_cli_options.py holds them to it).

Only :mod:`ats_cli.config` and :mod:`ats_cli.config` are imported here (no torch), so ``ats --help``
stays quick.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import Field, fields
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from ats_cli.config import DATA_DEFAULTS, TrainConfig

__all__ = ["HelpCommand", "reflow", "use_help_command", "config_flags", "config_help", "config_option",
           "tissue_setting", "ReaderOption", "LevelOption",
           "MppOption", "TissueOption", "MaxPixelsOption", "NPatchesOption", "DEVICE_OPTION", "SEED_OPTION"]

FIELDS: dict[str, Field] = {f.name: f for f in fields(TrainConfig)}
MODEL_SETTING = "the model's training setting"  # what an unset reading option means where a model is given


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown_default(name: str) -> str | None:
    """The default of TrainConfig field ``name`` as help shows it (None: it has none to show,
    like --init's empty "no checkpoint")."""
    f = FIELDS[name]
    if name in DATA_DEFAULTS:  # 0 = settled from the data (ats_cli.config)
        return "0 = the recipe's, else the dataset's hint, else for the images' size"
    if f.default == "":
        return None
    means = f.metadata.get("means")
    return f"{_text(f.default)} = {means}" if means else _text(f.default)


def config_help(name: str, unset: str | None = None) -> str:
    """Field ``name``'s help: its text with the allowed values written in, and its default
    shown; ``unset``: what leaving the option out means where that is not the default
    itself ("the model's training setting", which falls back to the default)."""
    f = FIELDS[name]
    choices = f.metadata.get("choices") or {}
    text = f.metadata["help"].format(choices=" | ".join(f"{v} ({note})" if note else v for v, note in choices.items()))
    shown = _shown_default(name)
    if unset is not None:
        shown = f"{unset}, else {shown}" if shown else unset
    return f"{text} \\[default: {shown}]." if shown else f"{text}."


def _choice_check(name: str) -> Callable[[Any], Any]:
    allowed = tuple(FIELDS[name].metadata["choices"])

    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"must be one of {', '.join(allowed)} (got {value!r})")
        return value

    return check


def config_option(name: str, default: Any = ..., *, unset: str | None = None, panel: bool = False,
                  check: bool = False, **options: Any) -> Any:
    """A ``typer.Option`` for TrainConfig field ``name``: its flag (``--tissue-mask``;
    ``--replace/--no-replace`` for a yes/no field), help (:func:`config_help`) and, with
    ``panel``, its help panel. ``default``: as ``typer.Option``'s (leave it out for an
    ``Annotated`` alias). ``check``: refuse values outside the field's allowed ones while
    parsing (``ats train`` leaves that to TrainConfig.validate, which also sees --config
    files). ``options``: more ``typer.Option`` arguments (``min=0``)."""
    f = FIELDS[name]
    flag = "--" + name.replace("_", "-")
    if isinstance(f.default, bool):
        flag = f"{flag}/--no-{flag[2:]}"
    if check and f.metadata.get("choices"):
        options["callback"] = _choice_check(name)
    if panel:
        options["rich_help_panel"] = f.metadata["panel"]
    decls = (flag,) if default is ... else (default, flag)
    return typer.Option(*decls, help=config_help(name, unset), show_default=False, **options)


def config_flags(*, before: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the decorated command one option per TrainConfig field marked as a flag (the
    settings a user of any dataset may need; the others are recipe and config keys), each
    defaulting to None ("not given": the --config file's value, else the recipe's, else
    the field's default), placed before its parameter ``before`` (else last); the command
    takes them as ``**flags``. Typer reads a command's parameters from its signature, so
    the options are added to ``__signature__``; the function itself is not wrapped."""

    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        generated = [
            inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                              annotation=Annotated[type(f.default) | None, config_option(f.name, panel=True)])
            for f in FIELDS.values() if f.metadata.get("flag")
        ]
        at = [p.name for p in own].index(before) if before else len(own)
        command.__signature__ = signature.replace(parameters=[*own[:at], *generated, *own[at:]])
        return command

    return add


def tissue_setting(value: str | None) -> bool | str | None:
    """``--tissue-mask`` as :meth:`ats_cli.predict.Predictor.opener` takes it: True, False,
    "auto" (the rule by file type), or None when not given (as the model was trained)."""
    return {"on": True, "off": False}.get(value, value)


# How an input is read (ats predict, ats visualize): the training flags of the same names;
# unset, what the model was trained with (saved in its checkpoint).
ReaderOption = Annotated[str | None, config_option("reader", unset=MODEL_SETTING, check=True)]
LevelOption = Annotated[int | None, config_option("level", unset=MODEL_SETTING, min=0)]


def _mpp_check(value: float | None) -> float | None:
    """``--mpp``: 0 is off (read by level as it is, ats_cli.data.inputs.open_input), else a
    plausible microscope scale (ats_cli.data.dataset): a value outside it would
    resample every input by a factor of hundreds or more."""
    from ats_cli.data.dataset import mpp_problem

    if value is not None and value != 0 and (problem := mpp_problem(value)):
        raise typer.BadParameter(f"{value:g} µm/px is {problem} (0 = off: read by level as it is)")
    return value


MppOption = Annotated[float | None, config_option("mpp", unset=MODEL_SETTING, callback=_mpp_check)]
TissueOption = Annotated[str | None, config_option("tissue_mask", unset=MODEL_SETTING, check=True)]
NPatchesOption = Annotated[int | None, typer.Option(
    "--n-patches", min=1, show_default=False,
    help="Patches sampled per image \\[default: the model's evaluation count (twice its training count for "
         "models trained since it is recorded)].")]
# Options with a value of their own, the same in every command (`device: str = DEVICE_OPTION`).
DEVICE_OPTION: Any = config_option("device", FIELDS["device"].default)
SEED_OPTION: Any = typer.Option(0, "--seed", help="Sampling seed; the same seed gives the same output.")
MaxPixelsOption = Annotated[int | None, typer.Option(
    "--max-pixels", min=1, show_default=False,
    help="The most pixels decoded at once from one input: a whole PNG/JPEG, the slide level the low-res view is "
         "made from, one TIFF strip or tile; larger inputs are refused by name, before decoding \\[default: "
         "ATS_MAX_PIXELS, else 64000000 (8000 x 8000), which keeps memory under about 1.5 GB].")]


def reflow(text: str | None) -> str | None:
    """A docstring as ``--help`` should show it: each paragraph (blank-line separated) one
    line, which rich then wraps at the terminal's width. Typer's rich mode keeps a
    docstring's single line breaks, so the breaks of the source (at 90 columns) showed as
    lines cut mid-sentence at 80 columns and ragged ones at 120. A paragraph that opens with
    ``\\b`` (click's "keep as written") is kept."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(line.strip() for line in p.splitlines())
                       for p in paragraphs)


# The value an option takes, as --help shows it: one short word, so the help text keeps most
# of an 80-column terminal (Typer's "<int range>" beside "[x>=1]" left it 17 columns).
METAVARS = {"int": "N", "float": "X", "str": "TEXT", "Path": "PATH"}


def _metavar(option: Any) -> str | None:
    """:data:`METAVARS`' word for ``option``'s type; None (Typer's own) for a choice, whose
    values it lists, and for any type not listed."""
    desc = getattr(option, "type_descriptor", None)
    if desc is None or desc.is_choice or desc.is_list or desc.is_tuple:
        return None
    if desc.is_path:
        return "PATH"
    name = desc.ranged_type_name if desc.is_ranged else option.bare_type()
    return METAVARS.get(str(name), None)


class HelpCommand(TyperCommand):
    """Every ``ats`` command's class: its help reflowed (:func:`reflow`), no type shown
    beside a flag (``--overwrite``, ``--replace/--no-replace``: Typer showed ``<bool>``, a
    value the flag does not take) and a one-word one beside an option that takes a value
    (:data:`METAVARS`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = reflow(self.help)
        for param in self.params:
            if param.metavar is not None or getattr(param, "param_type_name", "") != "option":
                continue
            if getattr(param, "is_flag", False):
                param.metavar = ""
            else:
                param.metavar = _metavar(param)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option


def use_help_command(*apps: typer.Typer) -> None:
    """Make :class:`HelpCommand` the class of every command registered on ``apps``."""
    for app in apps:
        for info in app.registered_commands:
            if info.cls in (None, TyperCommand):
                info.cls = HelpCommand


def key_reference() -> str:
    """Every TrainConfig key as a markdown table (docs/configuration.md holds it; a test keeps
    the two the same): its group, its flag where ``ats train`` has one, and its help with the
    default, as ``--help`` shows a flag's."""
    rows = ["| key | flag | what it sets |", "|---|---|---|"]
    own = {"data": "DATA", "out": "`--out`", "recipe": "`--recipe`"}  # declared by ats train itself
    for f in FIELDS.values():
        flag = "`--" + f.name.replace("_", "-") + "`" if f.metadata.get("flag") else own.get(f.name, "")
        text = config_help(f.name).replace("\\[", "[").replace("|", "\\|")
        rows.append(f"| `{f.name}` | {flag} | {text} |")
    return "\n".join(rows) + "\n"
