"""Named recipes: what a task or a dataset needs beyond ``ats train``'s generic defaults.

A recipe is a TOML file of ordinary training keys (those of :class:`ats_cli.config.TrainConfig`,
in a ``[train]`` table), each with a comment saying why, and a one-line ``description``. The
ones shipped are the ``*.toml`` files beside this module (package data), named by their file
name: ``ats train DATA --recipe megapixel-mnist-max``; a user's own file is named by its
path. ``ats train --recipes`` lists the shipped ones.

Why recipes: the settings one benchmark needs (a counting readout for IPS's task max, two
levels for 100k² slides) are then one file each, read the same way as any ``--config``
file, instead of flags every user scrolls past and hints only a generator can write. A
maintainer adds a task by adding a file here; nothing else changes.

Precedence (:func:`resolve_config`): the generic defaults < the recipe < a
``--config`` file < flags. Without ``--recipe``, the recipe a dataset's ``dataset.json``
names (``"recipe": "megapixel-mnist-max"``, which the generators write) is used. The run's
``config.json`` records the recipe's name beside every value, so ``--resume`` and
``ats predict`` read what the run started with even when a recipe file changes later.

Standard library and :mod:`ats_cli.config` only: ``ats train --help`` and ``--recipes``
stay quick.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ats_cli.config import ConfigError, TrainConfig, config_values, load_config_file, typed_values

__all__ = ["Recipe", "RecipeError", "dataset_recipe", "dataset_values", "load_recipe", "packaged_recipes",
           "resolve_config"]

SUFFIX = ".toml"
# keys a recipe may not set: the command line's (where the data is, where the run goes)
NOT_IN_RECIPES = ("data", "out", "recipe")


class RecipeError(ConfigError):
    """A recipe that cannot be found or read, or a dataset.json that names one wrongly."""


@dataclass(frozen=True)
class Recipe:
    """``name``: a shipped recipe's name, or the path of a user's file; ``values``: the
    training keys it sets, typed (an int where a float is wanted is one)."""

    name: str
    description: str
    values: dict[str, Any]


def _shipped() -> dict[str, Any]:
    """Name -> the shipped recipe file (an importlib resource)."""
    return {entry.name[: -len(SUFFIX)]: entry for entry in resources.files(__name__).iterdir()
            if entry.name.endswith(SUFFIX) and entry.is_file()}


def _is_path(name: str) -> bool:
    """Whether ``--recipe name`` names a file rather than a shipped recipe."""
    return name.endswith(SUFFIX) or "/" in name or "\\" in name


def _parse(text: str, name: str, where: str) -> Recipe:
    """A recipe from its TOML ``text``; ``where`` names it in errors."""
    try:
        description = tomllib.loads(text).get("description", "")
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{where}: not a valid recipe ({e})") from None
    if not isinstance(description, str):
        raise RecipeError(f"{where}: description must be a string")
    try:
        values = config_values(text, where)
    except ConfigError as e:
        raise RecipeError(str(e)) from None
    if bad := [k for k in NOT_IN_RECIPES if k in values]:
        raise RecipeError(f"{where}: sets {', '.join(bad)}, which the command line gives, not a recipe")
    return Recipe(name=name, description=description.strip(), values=values)


def load_recipe(name: str) -> Recipe:
    """The shipped recipe ``name``, or the recipe file at path ``name`` (a name ending in
    .toml or holding a /). Raises :class:`RecipeError` in one line, naming the recipe, for
    one that does not exist, is no TOML, sets an unknown key or a value of the wrong type
    (its values are validated with the rest of the configuration)."""
    if _is_path(name):
        path = Path(name).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RecipeError(f"{path}: recipe file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise RecipeError(f"{path}: not a readable recipe file ({e})") from None
        return _parse(text, str(path), str(path))
    shipped = _shipped()
    if name not in shipped:
        raise RecipeError(f"recipe {name!r}: no such recipe; the recipes are {', '.join(sorted(shipped))} "
                          "(ats train --recipes), or give the path of a .toml file")
    return _parse(shipped[name].read_text(encoding="utf-8"), name, f"recipe {name}")


def packaged_recipes() -> list[Recipe]:
    """Every shipped recipe, by name."""
    return [load_recipe(name) for name in sorted(_shipped())]


def dataset_recipe(root: str | Path) -> str:
    """The recipe ``root``/dataset.json names (``"recipe"``), "" when it names none or there
    is no readable dataset.json there (loading the dataset names that problem); a relative
    path is the dataset directory's. Raises
    :class:`RecipeError` for a ``recipe`` that is not a string."""
    if not root:
        return ""
    path = Path(root).expanduser() / "dataset.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    recipe = meta.get("recipe", "") if isinstance(meta, dict) else ""
    if not isinstance(recipe, str):
        raise RecipeError(f"{path}: 'recipe' must be a recipe's name (a string), got {json.dumps(recipe)}")
    if recipe and _is_path(recipe) and not Path(recipe).expanduser().is_absolute():  # a file beside the data
        return str(path.parent / recipe)
    return recipe


def dataset_values(root: str | Path) -> dict[str, Any]:
    """The training keys the recipe ``root``/dataset.json names sets ({} for none): what the
    commands that read a dataset as ats train does (ats pretrain, make-dataset prepare,
    benchmark) start from."""
    name = dataset_recipe(root)
    return load_recipe(name).values if name else {}


# two ways to give one size: a layer (recipe, file, flags) that gives either replaces the
# other from the layers below it, so --patch-um overrides a recipe's patch_size
ALTERNATIVES = (("patch_size", "patch_um"), ("scale", "low_res_um"))


def resolve_config(file: str | Path | None = None, recipe: str | None = None, *, use_recipes: bool = True,
                   **overrides: Any) -> TrainConfig:
    """The run's configuration: the generic defaults, then the recipe, then the file (a TOML
    file, or a run's config.json when it is resumed), then the overrides that are not None
    (the flags of a run). What they leave to the data is settled when the run starts
    (:mod:`ats_cli.config`).

    The recipe (:mod:`ats_cli.recipes`): ``recipe`` (a name or a .toml path), else the
    file's ``recipe`` key, else the one the dataset's dataset.json names; its name is
    recorded in the configuration's ``recipe``. ``use_recipes`` False (a resumed run):
    none is read, the file holds every value the recipe set when the run started."""
    values: dict[str, Any] = load_config_file(file) if file else {}
    given = {k: v for k, v in overrides.items() if v is not None}
    base: dict[str, Any] = {}
    if use_recipes:
        name = recipe or values.get("recipe") or dataset_recipe(given.get("data") or values.get("data") or "")
        if name:
            chosen = load_recipe(name)
            base = {**chosen.values, "recipe": chosen.name}
    merged: dict[str, Any] = {}
    for layer in (base, values, typed_values(given)):
        for a, b in ALTERNATIVES:  # a size in microns given above replaces the recipe's in pixels, and back
            if layer.get(a):
                merged.pop(b, None)
            if layer.get(b):
                merged.pop(a, None)
        merged.update(layer)
    values = merged
    if recipe:  # --recipe names the recipe even over a file's record of another
        values["recipe"] = base["recipe"]
    return TrainConfig(**values).validate()
