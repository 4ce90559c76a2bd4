"""One config source: `ats train`'s flags, their help and validate()'s allowed values all come
from TrainConfig's fields, and the options several commands share are the same everywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import typer
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.cli.options import config_help
from ats_cli.config import DATA_DEFAULTS, ConfigError, TrainConfig, allowed_values
from ats_cli.recipes import resolve_config

COMMANDS = typer.main.get_command(app).commands
CLI_ONLY = {"config", "resume", "overwrite", "devices", "recipes", "set_"}  # ats train's parameters, not fields


def _params(command: str) -> dict:
    return {p.name: p for p in COMMANDS[command].params}


def _help_lines(command: str) -> str:
    """`ats COMMAND --help` wide enough that every option's help is one line."""
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "1000"}, terminal_width=1000)
    assert result.exit_code == 0, result.output
    return result.output


def _option_line(help_text: str, flag: str) -> str:
    (line,) = [x for x in help_text.splitlines() if re.match(rf"│\s+{re.escape(flag)}\s", x)]
    return line


def _expected_default(f) -> str | None:
    """What the help should show for field ``f``, written out independently of ats_cli.cli.options."""
    if f.name in DATA_DEFAULTS:
        return "0 = the recipe's, else the dataset's hint, else for the images' size"
    if f.default == "":
        return None
    if isinstance(f.default, bool):
        value = "yes" if f.default else "no"
    elif isinstance(f.default, float):
        value = f"{f.default:g}"  # 0.003, 10
    else:
        value = str(f.default)
    return f"{value} = {f.metadata['means']}" if f.metadata.get("means") else value


def test_ats_train_has_at_most_30_options_and_a_flag_for_each_field_marked_so():
    """The fields marked as flags (the settings a user of any dataset may need) have one
    flag each, showing its default; every other field is a recipe/config key with no flag
    (settable with --config, --recipe or --set); --help lists at most 30 options."""
    params = _params("train")
    names = [f.name for f in fields(TrainConfig) if f.metadata["flag"] or f.name in ("data", "out", "recipe")]
    assert set(params) - CLI_ONLY == set(names)
    assert len(COMMANDS["train"].params) == len(names) + len(CLI_ONLY)  # no name twice
    text = _help_lines("train")
    listed = re.findall(r"^│\s+(--[a-z-]+)", text, re.M)
    assert len(listed) == len(set(listed)) == len(params) <= 30, listed  # the options and --help; not DATA
    for f in fields(TrainConfig):
        if not f.metadata["flag"] and f.name not in ("data", "out", "recipe"):
            assert "--" + f.name.replace("_", "-") not in listed, f.name
    for name in (n for n in names if n not in ("out", "recipe")):
        param = params[name]
        if name == "data":  # the positional DATA
            assert param.param_type_name == "argument"
            continue
        flag = "--" + name.replace("_", "-")
        assert flag in param.opts, (name, param.opts)
        assert param.default is None, name  # unset: the --config file's value, else the field's default
        line = _option_line(text, flag)
        shown = _expected_default(next(f for f in fields(TrainConfig) if f.name == name))
        if shown is None:
            assert "[default:" not in line, line
        else:
            assert f"[default: {shown}]." in line, (name, line)
    # each flag in its field's panel, the panels in field order
    panels = {m[1]: m[2] for m in re.finditer(r"╭─ (.+?) ─+╮\n(.*?)╰", text, re.S)}
    for f in fields(TrainConfig):
        if f.metadata["flag"]:
            assert re.search(rf"│\s+--{f.name.replace('_', '-')}\s", panels[f.metadata["panel"]]), f.name
    order = list(dict.fromkeys(f.metadata["panel"] for f in fields(TrainConfig) if f.metadata["flag"]))
    assert [p for p in panels if p in order] == order


def test_flags_left_out_give_the_defaults_and_given_ones_win():
    assert resolve_config(None, data="d", out="o") == TrainConfig(data="d", out="o")
    flags = {"lr": 0.5, "replace": True, "tissue_mask": "off", "epochs": 3}
    assert resolve_config(None, data="d", out="o", **flags) == TrainConfig(data="d", out="o", **flags)


def test_validate_allows_exactly_the_values_the_help_lists():
    from ats_cli.augment import MODES
    from ats_cli.core.sampling import ESTIMATORS
    from ats_cli.data.slides import READERS
    from ats_cli.extensions import available_extensions
    from ats_cli.models import available_methods

    allowed = allowed_values()
    assert set(allowed) == {"method", "estimator", "reader", "tissue_mask", "optimizer", "schedule", "amp",
                            "augment", "patch_gain", "pooling", "none_class", "feature_train",
                            "feature_store", "position_features"}
    # the lists the library itself works from
    assert (allowed["estimator"], allowed["reader"], allowed["augment"]) == (ESTIMATORS, READERS, ("auto", *MODES))
    assert allowed["pooling"] == ("auto", *available_extensions("pooling"))  # auto: the dataset's hint
    assert set(allowed["method"]) == set(available_methods())
    for key, values in allowed.items():
        line = config_help(key)  # the flag's help, or the key's in docs/configuration.md
        # the values in order, each with an optional note in brackets, " | " between, and no others
        listing = r" \| ".join(rf"\b{re.escape(v)}(?: \([^)]*\))?" for v in values)
        assert re.search(listing, line) and line.count("|") == len(values) - 1, (key, line)
        needs = {"pooling": "votes"} if key == "none_class" else {}  # a none logit needs per-patch votes
        for value in values:
            TrainConfig(**{key: value, **needs}).validate()
        with pytest.raises(ConfigError, match=re.escape(f"{key} must be one of {', '.join(values)} ")):
            TrainConfig(**{key: "bogus"}).validate()


def test_min_brightness_auto_value_in_the_help_is_the_one_training_uses():
    from ats_cli.config import AUTO_MIN_BRIGHTNESS

    assert f"-1 = auto: {AUTO_MIN_BRIGHTNESS:g} when" in config_help("min_brightness")


@pytest.mark.parametrize("name", ["reader", "level", "mpp", "tissue_mask"])
def test_reading_options_are_the_training_fields_in_every_command(name):
    """train, predict and visualize take the same flag, type and help; predict and visualize
    only say that unset means the model's training setting (saved in the checkpoint)."""
    flag = "--" + name.replace("_", "-")
    commands = ("train", "predict", "visualize") if name == "mpp" else ("predict", "visualize")  # train: a key
    params = [_params(c)[name] for c in commands]
    assert all(p.opts == [flag] for p in params)
    assert params[-1].help == params[-2].help
    lines = [_option_line(_help_lines(c), flag) for c in commands]
    types = {re.search(rf"{flag}\s+(\S+)", line)[1] for line in lines}
    assert len(types) == 1, types  # N, N [x>=0]: the same type
    predict = params[-2]
    body = config_help(name).split(" \\[default: ")[0]
    assert predict.help.startswith(body + " \\[default: the model's training setting, else ")
    assert all(p.default is None for p in params[-2:])


def test_device_defaults_to_auto_everywhere_and_auto_means_cuda_when_present(monkeypatch):
    import torch

    from ats_cli.runtime import resolve_device

    helps = set()
    for command in ("predict", "visualize", "benchmark"):
        device = _params(command)["device"]
        assert device.default == "auto", command
        helps.add(device.help)
    assert len(helps) == 1 and helps == {_params("train")["device"].help}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def _same(name: str, commands: tuple[str, ...]) -> bool:
    return len({(tuple(p.opts), p.help, p.default) for p in (_params(c)[name] for c in commands)}) == 1


def test_shared_options_are_declared_once():
    assert _same("seed", ("predict", "visualize", "selfcheck"))
    assert _same("n_patches", ("predict", "visualize"))
    assert _same("max_pixels", ("predict", "visualize", "info"))
    assert _params("info")["reader"].help == config_help("reader")  # default auto in both


def test_bad_reading_values_are_usage_errors():
    runner = CliRunner()
    for args in (["info", "x.png", "--reader", "bogus"], ["predict", "x.png", "-m", "m.pt", "--tissue-mask", "yes"],
                 ["visualize", "x.png", "-m", "m.pt", "-o", "f.png", "--level", "-1"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "Invalid value for" in result.output


def test_cli_definition_does_not_import_torch():
    """`ats --help` and every command's parsing stay quick: torch is imported by the commands' bodies."""
    code = "import sys, ats_cli.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_info_on_an_image_and_doctor_leave_heavy_packages_unimported(tmp_path):
    """`ats info x.png` took 7 s, all but one of them importing torch through the slide
    readers; `ats doctor` imported torchvision (4 s) for its version. info on an ordinary
    image imports neither torch nor anything heavy; doctor needs torch, not torchvision."""
    from PIL import Image

    image = tmp_path / "x.png"
    Image.new("L", (30, 20)).save(image)
    heavy = ("torch", "torchvision", "matplotlib", "timm", "skimage", "scipy")
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "from ats_cli.cli import app\n"
            f"out = CliRunner().invoke(app, ['info', {str(image)!r}])\n"
            "assert out.exit_code == 0 and '20 │    30' in out.output, out.output\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "from ats_cli.cli import app\n"
            "out = CliRunner().invoke(app, ['doctor'])\n"
            "assert out.exit_code == 0 and 'torchvision' in out.output, out.output\n"
            "print('torchvision' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stdout


def test_a_module_that_registers_an_extension_adds_its_flag_value(tmp_path):
    """An extension is registered by running code, not by its source being parsed: a module
    of one's own (outside ats_cli) that registers a pooling when it is imported makes its
    name a --pooling value (help and validation) without touching config.py, and the model
    builds it from the spec."""
    (tmp_path / "my_pooling.py").write_text(
        "from ats_cli.extensions.pooling import FeaturePooling\n"
        "from ats_cli.registry import register_extension\n\n\n"
        '@register_extension("pooling", "mean", note="a test pooling")\n'
        "class MeanPooling(FeaturePooling):\n    pass\n")
    code = (
        "import my_pooling\n"
        "from typer.testing import CliRunner\n"
        "from ats_cli.cli import app\n"
        "from ats_cli.config import TrainConfig, allowed_values\n"
        "assert allowed_values()['pooling'] == ('auto', 'features', 'votes', 'counts', 'highest', 'highest-counts', "
        "'topmost-counts', 'mean'), allowed_values()['pooling']\n"
        "TrainConfig(data='d', out='o', pooling='mean').validate()\n"
        "out = CliRunner().invoke(app, ['train', '--help'], env={'COLUMNS': '1000'}, terminal_width=1000).output\n"
        "assert 'mean (a test pooling)' in out, out\n"
        "from ats_cli.extensions import available_extensions, create_extension\n"
        "assert available_extensions('pooling') == ['features', 'votes', 'counts', 'highest', 'highest-counts', "
        "'topmost-counts', 'mean']\n"
        "made = create_extension('pooling', {'name': 'mean'}, features=4, n_classes=2)\n"
        "assert type(made).__name__ == 'MeanPooling'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)


def test_the_table_of_extensions_is_what_their_modules_register():
    """``ats --help`` lists the extensions from ats_cli.registry.EXTENSIONS without
    importing them; importing every module of the package registers exactly those names,
    each from the module the table gives, so that the help never lists a name that cannot
    be built nor misses one that can."""
    import importlib
    import pkgutil

    import ats_cli.extensions as extensions
    from ats_cli.registry import EXTENSIONS, KINDS, _registry, available_extensions

    for module in pkgutil.iter_modules(extensions.__path__):
        importlib.import_module(f"ats_cli.extensions.{module.name}")
    for kind in KINDS:
        assert available_extensions(kind) == list(EXTENSIONS[kind]), kind
        for name, (module, _) in EXTENSIONS[kind].items():
            factory = _registry(kind)._factories[name][1]
            assert factory.__module__ == f"ats_cli.extensions.{module}", (kind, name)


def test_ats_help_and_train_help_import_no_torch():
    """The reason the extension names sit in a table: listing the commands and the flags'
    values must not import torch (`python -X importtime -m ats_cli --help`)."""
    for command in ([], ["train"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ats_cli", *command, "--help"],
                              capture_output=True, text=True, check=True)
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "ats_cli" in imported and "torch" not in imported, command


@pytest.mark.parametrize("command", ["train", "predict", "visualize", "make-dataset megapixel-mnist"])
@pytest.mark.parametrize("columns", [80, 120])
def test_help_fills_its_lines_and_shows_no_bool_beside_a_flag(command, columns):
    """The description is wrapped to the terminal, not cut where the docstring's source
    lines end ("What the flags leave to the data" alone on an 80-column line), and a flag
    (--overwrite, --replace/--no-replace, --help) shows no "<bool>" value it does not take."""
    result = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    text = result.output.split("╭")[0].splitlines()
    for line, after in zip(text, text[1:], strict=False):
        if line.strip() and after.strip() and "Usage:" not in line:  # a line with more of its paragraph after it
            fits = len(line.rstrip()) + 1 + len(after.split()[0]) <= columns - 2  # the next word would have fit
            assert not fits, f"cut short at {columns} columns: {line!r}"
    options = result.output.split("╭─ Options")[1]
    assert re.search(r"--overwrite\s{2,}\S", options) or command != "train"
