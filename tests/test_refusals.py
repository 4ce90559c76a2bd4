"""The smaller items of issue #67: each bad input is one line naming the file, nothing is
left behind, and where the behaviour is a choice the choice is written down (docs,
docstrings). Every test here was seen failing on the code before its fix.

a. a predict CSV that lists one file twice with different labels (the first was taken
   silently); b. GeoJSON regions with NaN/Infinity coordinates (a traceback); c. a
   --feature-weights file holding a pickled object (torch's advice to load it with
   weights_only=False); d. weights holding NaN (training ran with loss nan, exit 0) and a
   loss that becomes non-finite; e. timm create_model arguments that load files, and an
   encoder config.json naming itself (tracebacks); f. a FIFO named .png (predict hung);
   g. ats export: a full or read-only disk (traceback, an empty directory left), an
   existing output (replaced silently), a run directory (\"model file not found\").
"""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
import torch
from typer.testing import CliRunner

import ats_cli.io as io_mod
from ats_cli.checkpoint import load_checkpoint
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.models import create_model, model_spec
from ats_cli.nets.encoders import EncoderError, read_weights
from ats_cli.predict.inputs import resolve_inputs
from ats_cli.pretrain import PretrainError
from ats_cli.pretrain.annotations import read_annotations
from ats_cli.pretrain.regions import row_regions
from ats_cli.train import train
from tests.test_trust import square_cfg, write_squares

runner = CliRunner(env={"COLUMNS": "1000"})
quiet = {"log": lambda _: None}


def _one_line(result, *words):
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    return write_squares(tmp_path_factory.mktemp("squares"))


def _cfg(data, out, **kw):
    return square_cfg(data, out, **{"epochs": 1, **kw})


@pytest.fixture(scope="module")
def model_file(squares, tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "run"
    train(_cfg(squares, run), **quiet)
    return run


# ---------------------------------------------------------------------------- a. duplicates in a predict CSV


def test_a_a_file_listed_twice_with_other_labels_is_a_failed_row_naming_both_lines(squares, tmp_path):
    csv = tmp_path / "in.csv"
    png = squares / "test" / "0.png"
    csv.write_text(f"path,label\n{png},a\n{png},a\n{png},b\n{squares / 'test' / '1.png'},b\n")
    items = resolve_inputs([csv])
    assert [i.label for i in items if i.error is None] == ["a", "b"]  # the same label again adds nothing
    (bad,) = [i for i in items if i.error is not None]
    assert f"{csv}:4" in bad.error and "'b'" in bad.error and "line 2" in bad.error and "'a'" in bad.error


def test_a_predict_reports_the_conflict_and_predicts_the_rest(squares, model_file, tmp_path):
    csv = tmp_path / "in.csv"
    png = squares / "test" / "0.png"
    csv.write_text(f"path,label\n{png},a\n{png},b\n")
    result = runner.invoke(app, ["predict", str(csv), "-m", str(model_file)])
    assert "1 predicted, 1 failed" in result.output and "listed again with label 'b'" in result.output, \
        result.output


# ---------------------------------------------------------------------------- b. GeoJSON coordinates


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_b_geojson_with_a_non_finite_coordinate_is_one_line_naming_the_file(tmp_path, bad):
    path = tmp_path / "regions.geojson"
    path.write_text('{"type": "FeatureCollection", "features": [{"type": "Feature", "properties": '
                    '{"classification": {"name": "a"}}, "geometry": {"type": "Polygon", "coordinates": '
                    f'[[[0, 0], [10, 0], [10, {bad}], [0, 10], [0, 0]]]}}}}]}}')
    with pytest.raises(PretrainError) as e:
        read_annotations(path, ["a", "b"])
    assert str(path) in str(e.value) and "finite" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PretrainError, match="no usable 'boxes' column"):
        row_regions({"boxes": f'[["a", {bad}, 0, 4, 4]]'}, "boxes", ["a", "b"], "x.csv:2")


# ---------------------------------------------------------------------------- c, d. weights files


class Payload:  # a pickled object that is not a tensor
    def __reduce__(self):
        return (os.getcwd, ())


def _feature_state(tmp_path):
    spec = model_spec(TrainConfig(patch_size=8, scale=0.25, n_patches=2, feature_width=8), n_classes=2, channels=1)
    return create_model(spec).feature_net.state_dict()


def test_c_a_pickled_object_in_feature_weights_is_refused_in_our_words(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"w": Payload()}, path)
    with pytest.raises(EncoderError) as e:
        read_weights(path)
    text = str(e.value)
    assert str(path) in text and "Python object" in text and "without running anything" in text, text
    assert "weights_only" not in text and "\n" not in text


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_d_feature_weights_holding_nan_are_refused_at_load(tmp_path, squares, suffix):
    state = _feature_state(tmp_path)
    name = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 1)
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    with pytest.raises(EncoderError, match=rf"{path.name}: weight {name} holds 1 NaN/infinite"):
        train(_cfg(squares, tmp_path / "run", feature_weights=str(path)), **quiet)
    assert not (tmp_path / "run" / "last.pt").exists()


def test_d_a_loss_that_becomes_nan_stops_training_without_saving_it(squares, tmp_path):
    """A learning rate of 1e30 makes the weights non-finite within the first epoch (with a
    finite loss on its last step): stopped before anything saves them, exit 1, one line."""
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(squares), "--out", str(run), "--epochs", "2", "--patch-size", "8",
                                 "--n-patches", "2", "--set", "feature_width=8", "--lr", "1e30", "--workers", "0",
                                 "--batch-size", "32"])  # one step an epoch: the weights, not the loss, go first
    assert result.exit_code == 1, result.output
    assert "NaN or infinite" in result.output and "lower --lr" in result.output, result.output
    assert not (run / "last.pt").exists() and not (run / "best.pt").exists()
    import ats_cli.train as train_mod

    with pytest.raises(train_mod.TrainingDiverged, match="training loss became nan"):
        real = train_mod.step_loss
        train_mod.step_loss = lambda model, out, labels: real(model, out, labels) * float("nan")
        try:
            train(_cfg(squares, tmp_path / "run2"), **quiet)
        finally:
            train_mod.step_loss = real


# ---------------------------------------------------------------------------- e. encoder names


def test_e_timm_arguments_that_load_files_are_refused_in_one_line(squares, tmp_path):
    pytest.importorskip("timm")
    target = tmp_path / "f.pt"
    torch.save({"x": torch.zeros(1)}, target)
    for arg in (f"checkpoint_path={target}", "pretrained=true"):
        result = runner.invoke(app, ["train", str(squares), "--out", str(tmp_path / "r"), "--feature-net",
                                     f"timm:resnet18?{arg}", "--epochs", "1", "--patch-size", "8"])
        assert result.exit_code != 0 and "--feature-weights FILE" in result.output, result.output
        assert "Traceback" not in result.output and not isinstance(result.exception, TypeError), result.output
    result = runner.invoke(app, ["train", str(squares), "--out", str(tmp_path / "r2"), "--feature-net",
                                 "timm:resnet18?no_such_argument=3", "--epochs", "1", "--patch-size", "8"])
    assert result.exit_code == 1 and "no_such_argument" in result.output, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)


def test_e_an_encoder_config_naming_itself_is_one_line(squares, tmp_path):
    enc = tmp_path / "enc"
    enc.mkdir()
    (enc / "config.json").write_text(json.dumps({"format": "ats-encoder", "version": 1, "feature_net": f"local:{enc}",
                                                 "feature_kwargs": {}}))
    result = runner.invoke(app, ["train", str(squares), "--out", str(tmp_path / "r"), "--feature-net", str(enc),
                                 "--epochs", "1", "--patch-size", "8"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert "names an encoder directory" in result.output and str(enc / "config.json") in result.output


# ---------------------------------------------------------------------------- f. FIFOs


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_f_a_fifo_named_png_is_refused_not_waited_on(squares, model_file, tmp_path):
    fifo = tmp_path / "x.png"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    (item,) = resolve_inputs([fifo])
    assert "FIFO" in item.error and str(fifo) in item.error
    csv = tmp_path / "in.csv"
    csv.write_text(f"path\n{fifo}\n{squares / 'test' / '0.png'}\n")
    result = runner.invoke(app, ["predict", str(csv), "-m", str(model_file)])  # hung before the fix
    assert "1 predicted, 1 failed" in result.output and "FIFO" in result.output, result.output


# ---------------------------------------------------------------------------- g. ats export


def test_g_export_takes_a_run_directory_and_refuses_to_overwrite(model_file, tmp_path):
    out = tmp_path / "m.pt"
    result = runner.invoke(app, ["export", str(model_file), str(out)])
    assert result.exit_code == 0, result.output
    assert str(model_file / "best.pt") in result.output and load_checkpoint(out)["export"]["source"] == "best.pt"
    before = out.read_bytes()
    again = runner.invoke(app, ["export", str(model_file), str(out), "--eval-n-patches", "9"])
    _one_line(again, str(out), "exists", "--overwrite")
    assert out.read_bytes() == before
    assert runner.invoke(app, ["export", str(model_file), str(out), "--eval-n-patches", "9",
                               "--overwrite"]).exit_code == 0
    assert load_checkpoint(out)["spec"]["eval_n_patches"] == 9
    enc = tmp_path / "enc"
    assert runner.invoke(app, ["export", str(model_file), str(enc), "--encoder"]).exit_code == 0
    _one_line(runner.invoke(app, ["export", str(model_file), str(enc), "--encoder"]), "already holds", "--overwrite")
    assert runner.invoke(app, ["export", str(model_file), str(enc), "--encoder", "--overwrite"]).exit_code == 0


@pytest.mark.parametrize("encoder", [False, True])
def test_g_export_on_a_full_disk_is_one_line_and_leaves_nothing(model_file, tmp_path, monkeypatch, encoder):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if encoder:
        monkeypatch.setattr("pathlib.Path.write_bytes", full)
    else:
        monkeypatch.setattr(io_mod.os, "fsync", full)
    out = tmp_path / "new" / "deeper" / ("enc" if encoder else "m.pt")
    args = ["export", str(model_file), str(out)] + (["--encoder"] if encoder else [])
    _one_line(runner.invoke(app, args), str(out.parent if encoder else out), "No space left on device")
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_g_export_into_a_read_only_directory_is_one_line(model_file, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _one_line(runner.invoke(app, ["export", str(model_file), str(ro / "m.pt")]), str(ro / "m.pt"))
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)

