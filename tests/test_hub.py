"""Models in the Hugging Face Hub's form (ats_cli.hub): ``ats export RUN DIR --hub-ready``
writes what the Hub shows as a model; ``--model DIR`` and ``--model hf-hub:ORG/NAME`` (from
huggingface_hub's own cache, offline) predict as the run's best.pt does; a directory
without weights, a foreign config and a model neither cached nor downloadable are refused
in one line naming them. Never the network: the session is offline (tests/conftest.py)."""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint
from ats_cli.cli import app
from ats_cli.train import train
from tests.test_train import _cfg, _write_squares_dataset

runner = CliRunner()
REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the Hub names snapshots


def ats(*args: object):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run: two epochs on a dozen 64x64 images."""
    root = tmp_path_factory.mktemp("hub")
    data = _write_squares_dataset(root / "squares", n_train=8, n_test=4)
    train(_cfg(data, root / "run", epochs=2, batch_size=4), log=lambda s: None)
    return root / "run", sorted((data / "test").glob("*.png"))


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    dst = tmp_path_factory.mktemp("export") / "squares-ats"
    result = ats("export", run[0], dst, "--hub-ready", "--license", "mit")
    return dst, result


def predictions(model: object, images: list[Path], out: Path) -> list[dict[str, str]]:
    result = ats("predict", *images, "--model", model, "--out", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    with open(out, newline="") as fh:
        return list(csv.DictReader(fh))


def one_line_error(result, code: int = 2) -> str:
    """The one line a refusal prints (predict and visualize exit 2 for a model they cannot
    use, before any image is read; export 1)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HOME at a temporary folder, as huggingface_hub reads it (at its import: the
    constant too); returns the cache folder, ``HF_HOME/hub``."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home / "hub"


def test_export_hub_ready_writes_a_hub_model_that_predicts_as_best_pt(run, exported, tmp_path):
    """The directory holds safetensors weights, the spec as JSON and a model card whose
    front matter the Hub reads and whose table gives the best epoch's metrics from
    metrics.jsonl; predict with --model DIR writes the CSV best.pt writes, byte for byte."""
    run_dir, images = run
    dst, result = exported
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dst.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert f"--model {dst}" in result.output
    best = load_checkpoint(run_dir / "best.pt")
    config = json.loads((dst / "config.json").read_text())
    assert config["format"] == "ats-model" and config["version"] == 1
    assert config["spec"] == json.loads(json.dumps(best["spec"])) and config["classes"] == best["classes"]
    from safetensors.torch import load_file

    weights = load_file(str(dst / "model.safetensors"))
    assert set(weights) == set(best["model"])
    assert all(torch.equal(weights[k], v) for k, v in best["model"].items())
    card = (dst / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "library_name: ats\n" in front and "license: mit\n" in front
    assert "pipeline_tag: image-classification\n" in front and "- attention-sampling\n" in front
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record = next(r for r in records if r["epoch"] == best["epoch"])
    assert f"Epoch {best['epoch']}," in card
    assert f"| test (selects the epoch) | {record['test_acc']:.4f} | {record['test_loss']:.4f} |" in card
    assert "dataset: `squares`" in card and f"training images per epoch: {record['samples']}" in card
    assert predictions(dst, images, tmp_path / "dir.csv") == predictions(run_dir / "best.pt", images,
                                                                         tmp_path / "pt.csv")
    again = ats("predict", *images, "--model", dst, "--out", tmp_path / "dir.csv", "--device", "cpu")
    assert again.exit_code == 0 and "nothing left to predict" in again.output  # the directory's digest: resumed
    # no licence given: the card's placeholder says how to set it
    bare = tmp_path / "bare"
    assert ats("export", run_dir, bare, "--hub-ready").exit_code == 0
    placeholder = (bare / "README.md").read_text()
    assert "license: unknown\n" in placeholder and "--license ID" in placeholder
    # a licence that is not an id would go into the YAML as it is: refused, nothing written
    line = one_line_error(ats("export", run_dir, tmp_path / "odd", "--hub-ready", "--license", "MIT: see below"), 1)
    assert "--license" in line and not (tmp_path / "odd").exists()
    # an existing directory's model is replaced only with --overwrite
    line = one_line_error(ats("export", run_dir, dst, "--hub-ready"), 1)
    assert str(dst) in line and "--overwrite" in line


def test_hf_hub_name_loads_from_the_library_cache_offline(run, exported, hub_cache, tmp_path):
    """The exported files in huggingface_hub's cache layout (models--ORG--NAME/snapshots/REV,
    refs/main naming REV) under HF_HOME: ``--model hf-hub:acme/squares`` predicts offline as
    the directory does; visualize and ``ats train --init`` take the name too."""
    run_dir, images = run
    dst, _ = exported
    repo = hub_cache / "models--acme--squares"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(dst / name, repo / "snapshots" / REVISION / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    expected = predictions(dst, images, tmp_path / "dir.csv")
    assert predictions("hf-hub:acme/squares", images, tmp_path / "hub.csv") == expected
    assert predictions(f"hf-hub:acme/squares@{REVISION}", images, tmp_path / "rev.csv") == expected
    result = ats("visualize", images[0], "--model", "hf-hub:acme/squares", "--out", tmp_path / "fig.png",
                 "--device", "cpu")
    assert result.exit_code == 0 and (tmp_path / "fig.png").is_file(), result.output
    said: list[str] = []
    data = images[0].parent.parent
    train(_cfg(data, tmp_path / "tuned", epochs=1, batch_size=4, lr=1e-12, init="hf-hub:acme/squares"),
          log=said.append)
    [line] = [s for s in said if s.startswith("initialised the model from hf-hub:acme/squares: took")]
    assert "attention_net" in line and "classifier" in line
    # ~0 learning rate: the run keeps the weights it started from, the exported ones
    tuned, best = load_checkpoint(tmp_path / "tuned" / "last.pt"), load_checkpoint(run_dir / "best.pt")
    for k in ("attention_net", "classifier"):
        key = next(n for n in best["model"] if n.startswith(k) and n.endswith("weight"))
        torch.testing.assert_close(tuned["model"][key], best["model"][key], rtol=0, atol=1e-6)


def test_a_model_directory_without_weights_or_of_another_kind_is_refused_in_one_line(exported, tmp_path):
    """Each refusal names the directory or file and what is wrong, and nothing is unpickled."""
    dst, _ = exported
    image = tmp_path / "x.png"
    shutil.copy(next(p for p in Path(dst).parent.parent.rglob("*.png")), image)

    def copy(name: str, *, config: dict | None = None, weights: bool = True) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        if config is None:
            shutil.copy(dst / "config.json", folder / "config.json")
        else:
            (folder / "config.json").write_text(json.dumps(config))
        if weights:
            shutil.copy(dst / "model.safetensors", folder / "model.safetensors")
        return folder

    good = json.loads((dst / "config.json").read_text())
    cases = {
        "no-weights": ({"weights": False}, "no-weights: no model.safetensors"),
        "foreign": ({"config": {"architectures": ["BertModel"]}}, "config.json: not an ats model config"),
        "later": ({"config": {**good, "version": 7}}, "config.json: model config version 7 is newer"),
        "encoder": ({"config": {"format": "ats-encoder", "version": 1}}, "an encoder (ats export --encoder)"),
        "later-spec": ({"config": {**good, "spec": {**good["spec"], "version": 99}}},
                       "config.json: model spec version 99 is newer"),
    }
    for name, (kw, said) in cases.items():
        folder = copy(name, **kw)
        line = one_line_error(ats("predict", image, "--model", folder))
        assert said in line and str(tmp_path / name) in line, line
    from ats_cli.nets.encoders import EncoderError, feature_spec

    with pytest.raises(EncoderError, match="is a whole model .*--model"):  # not an encoder directory
        feature_spec(str(dst), channels=1, width=8)
    damaged = copy("damaged")
    (damaged / "model.safetensors").write_bytes(b"\x80\x04\x95a pickle, not safetensors")
    line = one_line_error(ats("predict", image, "--model", damaged))
    assert str(damaged / "model.safetensors") in line
    assert "model.safetensors: not a safetensors file" in line


def test_an_hf_hub_model_neither_cached_nor_downloadable_is_refused_at_once(hub_cache, monkeypatch, tmp_path):
    """Offline (HF_HUB_OFFLINE, as in the whole session) or with the Hub's host not
    answering, a model not in the cache: one line naming the local form, in seconds, the
    client never asked to reach the network."""
    image = tmp_path / "x.png"
    image.write_bytes(b"")  # never read: the model is refused first
    start = time.monotonic()
    line = one_line_error(ats("predict", image, "--model", "hf-hub:acme/nowhere"))
    assert time.monotonic() - start < 5
    assert "hf-hub:acme/nowhere: not in the Hugging Face cache" in line and "HF_HUB_OFFLINE is set" in line
    assert "--model DIR" in line and str(hub_cache) in line
    # no variable, no network: one probe of the host (here answered at once), then the same line
    from huggingface_hub import constants

    import ats_cli.nets.encoders as encoders

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(encoders, "_probed", {})
    monkeypatch.setattr(encoders, "_reachable", lambda host, port, timeout: False)
    start = time.monotonic()
    line = one_line_error(ats("visualize", image, "--model", "hf-hub:acme/nowhere", "--out", tmp_path / "f.png"))
    assert time.monotonic() - start < 5
    assert "could not be reached" in line and "--model DIR" in line
