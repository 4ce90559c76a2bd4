"""Recipes (ats_cli.recipes): named TOML files of training keys, the settings a task needs
beyond ats train's generic defaults. A task is added by one file; the shipped ones are listed
by ``ats train --recipes``; a dataset names its own; and the released models and IPS's tasks
settle to exactly what their old flags and dataset.json hints settled to."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.cli.train import resolve_train_config
from ats_cli.config import ConfigError, settle_data
from ats_cli.data.dataset import DatasetError, load_dataset
from ats_cli.recipes import RecipeError, load_recipe, packaged_recipes, resolve_config

ROOT = Path(__file__).resolve().parents[1]
TEST_RECIPE = Path(__file__).parent / "recipes" / "tiny-counts.toml"
TRAIN = typer.main.get_command(app).commands["train"]
runner = CliRunner()
TINY = dict(n_train=6, n_test=4, width=160, height=140, n_noise=6, seed=0)
TINY_TRAIN = ["--epochs", "1", "--patch-size", "28", "--scale", "0.25", "--batch-size", "4", "--workers", "0",
              "--device", "cpu", "--set", "feature_width=8", "--set", "attention_width=4"]


def _megapixel(root: Path, task: str) -> Path:
    from ats_cli.data.megapixel_mnist import generate_megapixel_mnist, make_config
    from ats_cli.data.mnist import load_bundled_digits

    generate_megapixel_mnist(root, make_config("small", **TINY, task=task), load_bundled_digits(), workers=1)
    return root


def test_recipes_lists_every_shipped_recipe_and_each_one_is_valid():
    result = runner.invoke(app, ["train", "--recipes"])
    assert result.exit_code == 0, result.output
    shipped = packaged_recipes()
    assert {"megapixel-mnist", "megapixel-mnist-max", "megapixel-mnist-top", "synthetic-slides",
            "synthetic-slides-100k"} <= {r.name for r in shipped}
    for recipe in shipped:
        assert re.search(rf"^{re.escape(recipe.name)}\s+{re.escape(recipe.description)}$", result.output, re.M)
        assert recipe.description and resolve_config(recipe=recipe.name).recipe == recipe.name  # validates
        text = (ROOT / "ats_cli" / "recipes" / f"{recipe.name}.toml").read_text()
        for key in recipe.values:  # a comment saying why on every key's line
            assert re.search(rf"^{key} = .*#", text, re.M), (recipe.name, key)
    # a non-editable install ships them: the package data names the files
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.toml" in pyproject["tool"]["setuptools"]["package-data"]["ats_cli.recipes"]


def test_a_recipe_file_of_ones_own_sets_its_values_under_config_and_flags(tmp_path):
    """Precedence: generic defaults < recipe < --config < flags and --set; the recipe's path
    is recorded."""
    flags = {k: None for k in ("n_patches", "lr")}
    cfg = resolve_train_config(Path("d"), Path("o"), None, str(TEST_RECIPE), None, None, flags)
    assert (cfg.n_patches, cfg.pooling, cfg.count_floor, cfg.eval_n_patches) == (3, "counts", 0.2, 5)
    assert cfg.recipe == str(TEST_RECIPE) and cfg.lr == resolve_config().lr
    config = tmp_path / "c.toml"
    config.write_text("n_patches = 4\ncount_floor = 0.3\n")
    cfg = resolve_train_config(Path("d"), Path("o"), config, str(TEST_RECIPE), None, ["count_floor=0.4"],
                               {**flags, "n_patches": 6})
    assert (cfg.n_patches, cfg.count_floor, cfg.eval_n_patches) == (6, 0.4, 5)
    with pytest.raises(ConfigError, match="--set n_patches: given by its flag too"):
        resolve_train_config(Path("d"), Path("o"), None, None, None, ["n_patches=2"], {"n_patches": 3})


def test_a_size_in_microns_given_replaces_the_recipes_size_in_pixels():
    """A recipe gives patch_size and scale in pixels; --patch-um / --low-res-um over it are
    the user's, not a contradiction (both forms at once are refused only within one layer)."""
    recipe = load_recipe("synthetic-slides").values
    assert recipe.get("patch_size") and recipe.get("scale")
    cfg = resolve_config(recipe="synthetic-slides", patch_um=16.0, low_res_um=16.0)
    assert (cfg.patch_um, cfg.low_res_um) == (16.0, 16.0)
    assert cfg.patch_size == resolve_config().patch_size and cfg.scale == resolve_config().scale
    assert resolve_config(recipe="synthetic-slides", patch_size=32).patch_size == 32


def test_ats_train_with_a_recipe_path_and_with_the_one_dataset_json_names(tmp_path):
    """End to end: --recipe PATH uses the file's values (the settled config.json holds them
    and the recipe's path); without --recipe, the dataset's recipe is used and the run says
    so before it settles."""
    data = _megapixel(tmp_path / "max", "max")
    own = tmp_path / "own"
    result = runner.invoke(app, ["train", str(data), "--out", str(own), "--recipe", str(TEST_RECIPE), *TINY_TRAIN])
    assert result.exit_code == 0, result.output
    saved = json.loads((own / "config.json").read_text())
    assert (saved["recipe"], saved["n_patches"], saved["pooling"], saved["count_floor"], saved["eval_n_patches"]) \
        == (str(TEST_RECIPE), 3, "counts", 0.2, 5)
    assert f"recipe {TEST_RECIPE} (named by --recipe): n_patches 3" in result.output
    named = tmp_path / "named"
    result = runner.invoke(app, ["train", str(data), "--out", str(named), *TINY_TRAIN])
    assert result.exit_code == 0, result.output
    assert f"recipe megapixel-mnist-max (named by {data / 'dataset.json'}): " in result.output
    saved = json.loads((named / "config.json").read_text())
    assert (saved["recipe"], saved["pooling"], saved["n_patches"], saved["eval_count_floor"]) == \
        ("megapixel-mnist-max", "highest-counts", 20, 0.07)
    settled = json.loads((named / "settled.json").read_text())["reasons"]
    assert "pooling highest-counts: given" in settled  # the recipe's value, not a hint


def test_recipe_problems_are_one_line_naming_the_recipe(tmp_path):
    result = runner.invoke(app, ["train", str(tmp_path), "--out", str(tmp_path / "r"), "--recipe", "ips-nothing"])
    assert result.exit_code == 2 and "recipe 'ips-nothing': no such recipe; the recipes are megapixel-mnist" \
        in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text('description = "x"\n[train]\npoolng = "counts"\n')
    with pytest.raises(RecipeError, match=re.escape(f"{bad}: unknown key(s) poolng")):
        load_recipe(str(bad))
    bad.write_text("[train]\ncount_floor = 2.0\n")  # validated as any configuration
    with pytest.raises(ConfigError, match="count_floor must be in"):
        resolve_config(recipe=str(bad))
    bad.write_text('[train]\nout = "elsewhere"\n')
    with pytest.raises(RecipeError, match="sets out, which the command line gives"):
        load_recipe(str(bad))
    data = _megapixel(tmp_path / "d", "majority")
    meta = json.loads((data / "dataset.json").read_text())
    (data / "dataset.json").write_text(json.dumps({**meta, "recipe": 3}))
    with pytest.raises(DatasetError, match="'recipe' must be a recipe's name"):
        load_dataset(data)
    (data / "dataset.json").write_text(json.dumps({**meta, "recipe": "nope"}))
    with pytest.raises(RecipeError, match="recipe 'nope': no such recipe"):
        resolve_config(data=str(data))


# ---------------------------------------------------------------- the released models and IPS's tasks hold
# What the generators wrote as hints before recipes (commit c6539d6), and the commands the cards and
# scripts ran then: the old configuration, which each recipe must settle to exactly.
OLD_MNIST_HINTS = {"channels": 1, "scale": 0.12, "patch_size": [50, 50], "n_patches": 10}
OLD_TASK_HINTS = {"max": {"pooling": "highest-counts", "none_class": "on", "count_floor": 0.15,
                          "eval_count_floor": 0.07, "n_patches": 20},
                  "top": {"pooling": "topmost-counts", "none_class": "on", "count_floor": 0.15,
                          "eval_count_floor": 0.07, "n_patches": 20}}
OLD_SLIDE_HINTS = {"channels": 3, "scale": 1 / 32, "patch_size": [64, 64], "n_patches": 12, "mpp": 0.5}
OLD_CARD_FLAGS = {
    "synthetic-slides-ats": "--batch-size 32",
    "synthetic-slides-100k-ats": "--levels 2 --regions 8 --region-size 768 --coarse-px 12 --scale 0.125 "
                                 "--patch-size 64 --n-patches 4 --epochs 20 --workers 0",
}


def _old_dataset(new: Path, old: Path, hints: dict) -> Path:
    """A copy of ``new``'s dataset.json as the generator wrote it before recipes: the hints,
    no recipe; the same images (absolute paths)."""
    meta = json.loads((new / "dataset.json").read_text())
    old.mkdir()
    for split in meta["splits"]:
        rows = (new / f"{split}.csv").read_text().splitlines()
        head, *body = rows
        (old / f"{split}.csv").write_text("\n".join([head, *(f"{new}/{r}" for r in body)]) + "\n")
    meta.pop("recipe")
    (old / "dataset.json").write_text(json.dumps({**meta, "hints": {**meta["hints"], **hints}}))
    return old


def _old_flags(text: str) -> dict:
    """An old command's flags as TrainConfig keys (--region-size 768: region_size 768)."""
    words = shlex.split(text)
    return {words[i][2:].replace("-", "_"): tomllib.loads(f"v = {words[i + 1]}")["v"]
            for i in range(0, len(words), 2)}


def _card_command(card: str, data: Path, out: Path) -> list[str]:
    """The `ats train` command in models/CARD.md, on ``data`` into ``out``."""
    text = (ROOT / "models" / f"{card}.md").read_text().replace("\\\n", " ")
    (line,) = [x for x in text.splitlines() if x.startswith("ats train ")]
    words = shlex.split(line.split("#")[0])[2:]
    words[0] = str(data)
    words[words.index("--out") + 1] = str(out)
    return words


def _settled(cfg, root: Path) -> tuple[dict, dict]:
    """What ats train settles ``cfg`` to on ``root``, and the model spec it makes of it."""
    from ats_cli.models import model_spec

    data = load_dataset(root)
    settled = settle_data(cfg, data)[0]
    facts = settled.facts
    values = {k: v for k, v in asdict(settled.config).items() if k not in ("data", "out", "recipe")}
    spec = model_spec(settled.config, n_classes=data.num_classes, channels=facts.channels, mpp=settled.mpp)
    return values, spec


def _new(words: list[str]):
    """ats train's configuration from its command-line ``words``, as the command makes it."""
    params = TRAIN.make_context("train", list(words)).params
    flags = {k: v for k, v in params.items()
             if k not in ("data", "out", "config", "recipe", "resume", "set_", "overwrite", "devices", "recipes")}
    return resolve_train_config(params["data"], params["out"], params["config"], params["recipe"],
                                params["resume"], params["set_"], flags)


@pytest.mark.parametrize("task", ["majority", "max", "top", "multilabel"])
def test_ips_tasks_settle_as_their_old_hints_did(tmp_path, task):
    """benchmarks/ips_tasks.sh trains each task with `ats train DATA --out RUN`: the recipe
    the generator now names settles to what its hints did, key by key, and the same model."""
    new = _megapixel(tmp_path / "new", task)
    old = _old_dataset(new, tmp_path / "old", {**OLD_MNIST_HINTS, **OLD_TASK_HINTS.get(task, {})})
    was = _settled(resolve_config(data=str(old), out="run"), old)
    now = _settled(_new([str(new), "--out", "run"]), new)
    assert now == was
    assert now[0]["n_patches"] == (20 if task in ("max", "top") else 10)  # the recipe was read


@pytest.mark.parametrize("card", sorted(OLD_CARD_FLAGS))
def test_the_released_slide_models_cards_settle_as_their_old_flags_did(tmp_path, card):
    """Each card's `ats train` command (now with --recipe where it passed the recipe's flags)
    on the generator's slides settles to what the old command did on the old dataset.json,
    key by key, and makes the same model. Small virtual slides: the settling reads their
    headers and first views as it would a 100k² slide's."""
    from ats_cli.data.synthetic_slides import SyntheticSlidesConfig
    from ats_cli.data.virtual_slides import generate_virtual_slides

    new = tmp_path / "new"
    generate_virtual_slides(new, SyntheticSlidesConfig(n_train=3, n_test=1, size=3072, seed=0), workers=1)
    old = _old_dataset(new, tmp_path / "old", OLD_SLIDE_HINTS)
    was = _settled(resolve_config(data=str(old), out="run", **_old_flags(OLD_CARD_FLAGS[card])), old)
    now = _settled(_new(_card_command(card, new, tmp_path / "run")), new)
    assert now == was


def test_the_released_mnist_models_pretraining_settles_as_before(tmp_path):
    """models/megapixel-mnist-ats.md is made by ats pretrain on make-dataset's data: its
    configuration, settled with the recipe dataset.json names, is the one the hints gave."""
    from ats_cli.pretrain.run import PretrainOptions, pretrain_config

    new = _megapixel(tmp_path / "new", "majority")
    old = _old_dataset(new, tmp_path / "old", OLD_MNIST_HINTS)
    was = _settled(pretrain_config(PretrainOptions(data=str(old), out="x.pt"), load_dataset(old)), old)
    now = _settled(pretrain_config(PretrainOptions(data=str(new), out="x.pt"), load_dataset(new)), new)
    assert now == was and now[0]["patch_size"] == 50


def test_the_key_reference_in_the_docs_lists_every_key_as_the_code_has_it():
    from ats_cli.cli.options import key_reference

    text = (ROOT / "docs" / "configuration.md").read_text()
    block = text.split("<!-- keys: generated by ats_cli.cli.options.key_reference -->\n")[1].split("<!-- /keys")[0]
    assert block == key_reference()  # to regenerate: print(key_reference()) into the block
    for recipe in packaged_recipes():
        assert f"| `{recipe.name}` | {recipe.description} |" in text


def test_a_task_with_a_rule_of_its_own_is_a_recipe_file_and_an_extension_file(tmp_path):
    """A maintainer adds a task that needs a new rule by adding two files and touching no
    other: an extension module in ats_cli/extensions/ (here a folder added to the package's
    path, as if the file were there) and a recipe naming it. Training finds the extension by
    the recipe's name for it, prediction by the checkpoint's; a process that lacks the file
    says so in one line (the negative control)."""
    data = _megapixel(tmp_path / "data", "majority")
    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "pooling_plain.py").write_text(
        "from ats_cli.extensions.pooling import FeaturePooling\n"
        "from ats_cli.registry import register_extension\n\n\n"
        '@register_extension("pooling", "plain", note="the thesis\'s pooling under a name of its own")\n'
        "class PlainPooling(FeaturePooling):\n    pass\n")
    recipe = tmp_path / "plain.toml"
    recipe.write_text('description = "a task whose rule is an extension file"\n\n[train]\n'
                      'pooling = "plain"  # the rule this task adds (ext/pooling_plain.py)\n')
    run, preds = tmp_path / "run", tmp_path / "preds.csv"
    prefix = f"import ats_cli.extensions as e\ne.__path__.append({str(ext)!r})\n"
    cli = ("import sys\nfrom typer.testing import CliRunner\nfrom ats_cli.cli import app\n"
           "r = CliRunner().invoke(app, sys.argv[1:])\nprint(r.output)\nsys.exit(r.exit_code)\n")
    train = ["train", str(data), "--out", str(run), "--recipe", str(recipe), *TINY_TRAIN]
    predict = ["predict", str(data / "test.csv"), "--model", str(run / "best.pt"), "--out", str(preds),
               "--device", "cpu"]
    # one process trains, then predicts from the checkpoint; one without the file is refused
    both = cli.replace("r = CliRunner().invoke(app, sys.argv[1:])",
                       "cut = sys.argv.index('--then')\n"
                       "r = CliRunner().invoke(app, sys.argv[1:cut])\n"
                       "r = r if r.exit_code else CliRunner().invoke(app, sys.argv[cut + 1:])")
    done = subprocess.run([sys.executable, "-c", prefix + both, *train, "--then", *predict], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((run / "config.json").read_text())["pooling"] == "plain"
    without = subprocess.run([sys.executable, "-c", cli, *predict, "--overwrite"], capture_output=True, text=True)
    assert without.returncode != 0 and "unknown pooling 'plain'" in without.stdout + without.stderr
    assert "Traceback" not in without.stdout + without.stderr
    assert len(preds.read_text().splitlines()) == 1 + len((data / "test.csv").read_text().splitlines()) - 1


def test_each_keys_help_names_only_flags_ats_train_has():
    """The key reference (docs/configuration.md) and ``ats train --help`` show each key's help:
    a key's help that says "with --levels 2" names a flag the command refuses; it names the
    key (levels 2). Another command's own flags (make-dataset --task, ats export --encoder)
    are theirs."""
    from ats_cli.cli.options import FIELDS, config_help
    from tests.test_settle import _train_flags, named_flags

    flags = _train_flags()
    wrong = {name: sorted(named_flags(config_help(name)) - flags) for name in FIELDS}
    assert not {k: v for k, v in wrong.items() if v}
