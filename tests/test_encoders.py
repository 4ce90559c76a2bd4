"""Pretrained encoders as feature networks (ats_cli.nets.encoders): timm and torchvision
models by name from local weights, ``ats export --encoder`` and back bit for bit, frozen
means frozen, an unbiased estimate with a frozen encoder, one-line errors offline and
without the extra, and ats train + predict with a timm encoder. Nothing is downloaded:
the weights are the ones each test makes (the hub is offline: tests/conftest.py)."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint, save_checkpoint
from ats_cli.cli import app
from ats_cli.core.model import ATSModel
from ats_cli.models import create_model, model_spec
from ats_cli.nets import create
from ats_cli.nets.encoders import (
    EXTRA,
    Encoder,
    EncoderError,
    HubUnavailableError,
    MissingExtraError,
    apply_feature_train,
    feature_spec,
    load_start_weights,
)
from tests.montecarlo import PATCH, SCALE, Z_MAX, N, z_of_estimate
from tests.test_train import _cfg, _write_squares_dataset

timm = pytest.importorskip("timm")
runner = CliRunner()
TIMM, TORCHVISION = "timm:test_resnet", "torchvision:resnet18"  # test_resnet: timm's tiny ResNet (160 px input)


def ats(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def _patches(channels: int = 3, n: int = 4, size: int = 24) -> torch.Tensor:
    return torch.rand(n, channels, size, size, generator=torch.Generator().manual_seed(7))


def _timm_weights(path) -> dict[str, torch.Tensor]:
    """A timm test_resnet's weights with its classifier, as a checkpoint of it would hold them."""
    torch.manual_seed(11)
    net = timm.create_model("test_resnet", pretrained=False, num_classes=5)
    for m in net.modules():  # statistics other than the initial ones, so that a reset would show
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    state = net.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return state


def _built(name: str, weights: str, channels: int = 3, train: str = "all") -> nn.Module:
    net_name, kwargs = feature_spec(name, channels=channels, width=8, train=train)
    net = create(net_name, kind="features", **kwargs)
    load_start_weights(net, name, weights, kwargs)
    return net.eval()


def test_a_timm_encoder_reads_local_weights_at_its_own_input_size_and_normalisation(tmp_path):
    state = _timm_weights(tmp_path / "w.safetensors")
    enc = _built(TIMM, str(tmp_path / "w.safetensors"), channels=1)
    cfg = timm.data.resolve_data_config(model=timm.create_model("test_resnet"))
    assert enc.input_size == cfg["input_size"][1:] and enc.out_features == enc.backbone.num_features
    reference = timm.create_model("test_resnet", pretrained=False, num_classes=0).eval()
    reference.load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")})
    grey = _patches(channels=1)
    x = F.interpolate(grey.expand(-1, 3, -1, -1), size=enc.input_size, mode=cfg["interpolation"],
                      align_corners=False, antialias=True)
    x = (x - torch.tensor(cfg["mean"]).view(1, 3, 1, 1)) / torch.tensor(cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        assert torch.allclose(enc(grey), reference(x), atol=1e-5)


def _checkpoint(tmp_path, name: str, weights: str, channels: int = 3):
    """A run's checkpoint whose feature net is ``name`` started from ``weights``."""
    cfg = _cfg(tmp_path, tmp_path / "run", feature_net=name, feature_weights=weights, feature_train="none")
    spec = model_spec(cfg, n_classes=2, channels=channels)
    model = create_model(spec)
    load_start_weights(model.feature_net, name, weights, spec["feature_kwargs"])
    path = tmp_path / "model.pt"
    save_checkpoint(path, spec=spec, classes=["a", "b"], model=model)
    return path, model.feature_net.eval()


@pytest.mark.parametrize("name", [TIMM, TORCHVISION])
def test_an_encoder_exported_and_read_back_computes_the_same_features_bit_for_bit(tmp_path, name):
    if name == TIMM:
        weights = tmp_path / "w.safetensors"
        _timm_weights(weights)
    else:  # a torchvision state dict as torch.save writes it, classifier included
        torch.manual_seed(12)
        from torchvision.models import resnet18

        weights = tmp_path / "w.pth"
        torch.save(resnet18(num_classes=1000).state_dict(), weights)
    ckpt, original = _checkpoint(tmp_path, name, str(weights))
    result = ats("export", ckpt, tmp_path / "enc", "--encoder")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "enc" / "config.json").read_text())
    assert config["feature_net"] == name and config["out_features"] == original.out_features
    assert config["input_size"] == list(original.input_size) and config["mean"] == original.mean.flatten().tolist()
    for ref in (str(tmp_path / "enc"), f"local:{tmp_path / 'enc'}"):
        back = _built(ref, "auto")
        with torch.no_grad():
            assert torch.equal(back(_patches()), original(_patches()))
    # and as --feature-weights: the exported file into the same architecture
    again = _built(name, str(tmp_path / "enc" / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(again(_patches()), original(_patches()))


def test_weights_of_another_network_are_refused_in_one_line(tmp_path):
    save_file({"conv.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(EncoderError, match=r"--feature-weights .*other.safetensors: the weights do not fit") as e:
        _built(TIMM, str(tmp_path / "other.safetensors"))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- frozen means frozen


def _encoder_params(model: ATSModel, part: str = "feature_net") -> set[int]:
    return {id(p) for p in model.get_submodule(part).parameters()}


@pytest.mark.parametrize("mode", ["none", "head"])
def test_a_frozen_encoder_does_not_change_in_training_and_holds_no_optimizer_state(tmp_path, mode):
    from ats_cli.train import _optimizer

    data = _write_squares_dataset(tmp_path / "data", n_train=8, n_test=4)
    _timm_weights(tmp_path / "w.safetensors")
    cfg = _cfg(data, tmp_path / "run", feature_net=TIMM, feature_weights=str(tmp_path / "w.safetensors"),
               feature_train=mode, epochs=1)
    from ats_cli.train import train

    train(cfg, progress=None, log=lambda s: None)
    ckpt = load_checkpoint(tmp_path / "run" / "last.pt")
    start = {f"feature_net.backbone.{k}": v for k, v in
             _built(TIMM, str(tmp_path / "w.safetensors"), channels=1).backbone.state_dict().items()}
    trained = ckpt["model"]
    assert all(torch.equal(trained[k], v) for k, v in start.items())  # weights and batch-norm statistics
    model = create_model(ckpt["spec"])
    model.load_state_dict(trained)
    apply_feature_train(model.feature_net, mode)
    opt = _optimizer(cfg, model)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not held & _encoder_params(model, "feature_net.backbone")
    # the saved optimizer state: one entry per trained parameter, none for the encoder
    saved = ckpt["optimizer"]
    n_trained = sum(p.requires_grad for p in model.parameters())
    assert sum(len(g["params"]) for g in saved["param_groups"]) == n_trained == len(saved["state"])
    if mode == "head":  # its projection trains
        assert n_trained == sum(1 for _ in model.feature_net.head.parameters()) + len(
            [p for n, p in model.named_parameters() if not n.startswith("feature_net")])


def test_pretrained_weights_freeze_the_encoder_by_default():
    """--feature-train auto is settled with the rest of the configuration, with its reason."""
    from ats_cli.config import TrainConfig, settle
    from ats_cli.data.facts import DataFacts
    from ats_cli.nets.encoders import pretrained_source

    def settled(train: str, weights: str, name: str) -> tuple[str, str]:
        flags = TrainConfig(data="d", out="o", feature_net=name, feature_weights=weights, feature_train=train)
        _, reasons = settle(flags, DataFacts(pretrained=pretrained_source(name, weights)))
        reason = next(r for r in reasons if r.key == "feature_train")
        return reason.value, reason.why

    assert settled("auto", "auto", TIMM) == ("none", f"the feature net starts from pretrained weights ({TIMM}'s own): "
                                                     "frozen")
    assert settled("auto", "none", TIMM)[0] == "all"
    assert settled("auto", "w.safetensors", "small-cnn")[0] == "none"
    assert settled("auto", "auto", "small-cnn") == ("all", "the feature net starts from random weights: all of it "
                                                           "trains")
    assert settled("head", "auto", TIMM) == ("head", "given")


# ---------------------------------------------------------------- unbiased with a frozen encoder


class _TinyBackbone(nn.Module):
    """A conv, a batch norm and a max: what a pretrained CNN is, small enough for the check."""

    num_features = 6

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.norm.running_mean.uniform_(-0.3, 0.3)
        self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return torch.amax(torch.tanh(self.norm(self.conv(x))), dim=(2, 3))


def _frozen_model(properly: bool) -> ATSModel:
    torch.manual_seed(3)
    enc = Encoder(_TinyBackbone(), in_channels=1, input_size=None, mean=(0.5,) * 3, std=(0.25,) * 3)
    m = ATSModel(create("mnist-attention", in_channels=1, width=4), enc, n_classes=3, n_patches=N,
                 patch_size=(PATCH, PATCH), scale=SCALE, entropy_weight=0.0, feature_scale=3.0, estimator="sequential")
    nn.init.normal_(m.attention_net.score.weight, std=0.5)
    m.train()
    if properly:
        apply_feature_train(enc, "none")  # ats train's --feature-train none
    else:  # no gradients, but the batch norm still normalises with the statistics of the draws
        enc.requires_grad_(False)
    return m


def test_a_frozen_encoder_keeps_the_estimate_and_the_attention_gradient_unbiased():
    m = _frozen_model(properly=True)
    assert not any(p.requires_grad for p in m.feature_net.parameters())
    assert any(p.requires_grad for p in m.attention_net.parameters())
    assert z_of_estimate(m) < Z_MAX


def test_the_check_rejects_an_encoder_frozen_with_its_batch_norm_in_training_mode():
    """The statistics of 400 draws' patches vary little from batch to batch, so the bias is
    small: 400 groups to see it plainly (z 20.8 against the 15 asked; 17.4 with 300, 25.8
    with 600, ~5 with the default 40)."""
    assert z_of_estimate(_frozen_model(properly=False), groups=400, per_group=400) > 3 * Z_MAX


# ---------------------------------------------------------------- one-line errors


def test_an_unreachable_hub_model_fails_in_one_line_naming_local_weights(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    for name in ("timm:hf-hub:ats-tests/no-such-encoder", TIMM):
        with pytest.raises(HubUnavailableError) as e:
            _built(name, "auto")
        assert "\n" not in str(e.value) and "--feature-weights FILE" in str(e.value) and name in str(e.value)
    data = _write_squares_dataset(tmp_path / "data", n_train=2, n_test=2)
    result = ats("train", data, "--out", tmp_path / "run", "--feature-net", "timm:hf-hub:ats-tests/no-such-encoder")
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--feature-weights FILE" in result.output, result.output


def test_without_timm_a_timm_name_fails_in_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(MissingExtraError) as e:
        feature_spec("timm:resnet18", channels=3, width=8)
    assert str(e.value) == f"--feature-net timm:resnet18: timm is not installed; {EXTRA}"


def test_head_needs_a_pretrained_encoder():
    with pytest.raises(EncoderError, match="feature_train head: small-cnn is not a pretrained encoder"):
        feature_spec("small-cnn", channels=1, width=8, train="head")


# ---------------------------------------------------------------- end to end


def test_train_and_predict_with_a_timm_encoder(tmp_path):
    data = _write_squares_dataset(tmp_path / "data", n_train=16, n_test=8)
    _timm_weights(tmp_path / "w.safetensors")
    run = tmp_path / "run"
    result = ats("train", data, "--out", run, "--feature-net", TIMM, "--feature-weights", tmp_path / "w.safetensors",
                 "--epochs", 1, "--n-patches", 2, "--patch-size", 16, "--scale", 0.125, "--batch-size", 8,
                 "--workers", 0)
    assert result.exit_code == 0, result.output
    assert "feature_train none" in result.output
    assert json.loads((run / "config.json").read_text())["feature_train"] == "none"
    (tmp_path / "w.safetensors").unlink()  # predict needs neither the weights file nor the network
    result = ats("predict", data / "test.csv", "--model", run, "--out", tmp_path / "p.csv")
    assert result.exit_code == 0, result.output
    with open(tmp_path / "p.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(abs(float(r["prob_horizontal"]) + float(r["prob_vertical"]) - 1) < 1e-4
                                  for r in rows)


def test_timm_arguments_after_the_name_reach_the_model_as_plain_values_in_the_spec():
    name, kwargs = feature_spec("timm:test_vit?mlp_layer=SwiGLUPacked&act_layer=silu&init_values=1e-5",
                                channels=3, width=8)
    assert kwargs["args"] == {"mlp_layer": "SwiGLUPacked", "act_layer": "silu", "init_values": 1e-5}
    assert json.loads(json.dumps(kwargs)) == kwargs  # what a checkpoint can hold
    block = create(name, kind="features", **kwargs).backbone.blocks[0]
    assert isinstance(block.mlp, timm.layers.GluMlp) and isinstance(block.mlp.act, nn.SiLU)
    assert isinstance(block.ls1, timm.layers.LayerScale)
    with pytest.raises(EncoderError, match=r"expected \?key=value"):
        feature_spec("timm:test_vit?init_values", channels=3, width=8)


def test_a_hub_model_is_rebuilt_from_its_architecture_without_the_hub(monkeypatch):
    """What predict does with a run trained on timm:hf-hub:...: the spec names the
    architecture and its arguments, and the normalisation from the hub's config."""
    hub_cfg = {**timm.models.get_pretrained_cfg("test_resnet").to_dict(), "mean": (0.7, 0.6, 0.7), "std": (0.2,) * 3}
    monkeypatch.setattr(timm.models, "load_model_config_from_hf",
                        lambda hub_id: (dict(hub_cfg), "test_resnet", {"drop_rate": 0.1}))
    name, kwargs = feature_spec("timm:hf-hub:ats-tests/encoder", channels=3, width=8)
    assert (kwargs["arch"], kwargs["args"], kwargs["mean"]) == ("test_resnet", {"drop_rate": 0.1}, [0.7, 0.6, 0.7])

    def no_hub(hub_id):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(timm.models, "load_model_config_from_hf", no_hub)
    net = create(name, kind="features", **json.loads(json.dumps(kwargs)))
    assert torch.allclose(net.mean.flatten(), torch.tensor([0.7, 0.6, 0.7])) and net.backbone.drop_rate == 0.1


def test_timm_is_imported_only_for_a_timm_name():
    import subprocess

    code = ("import sys, ats_cli.train, ats_cli.models, ats_cli.nets, ats_cli.cli.export; "
            "assert 'timm' not in sys.modules and 'safetensors' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["timm:mobilenetv3_small_050", "timm:test_vit", "torchvision:mobilenet_v3_small"])
def test_the_width_is_what_the_encoder_outputs(name):
    """MobileNetV3's features pass a pre-logits layer wider than num_features."""
    enc = create(name, kind="features", in_channels=3).eval()
    with torch.no_grad():
        assert enc(_patches(n=2, size=16)).shape == (2, enc.out_features)


def test_an_unreachable_torchvision_download_fails_in_one_line(monkeypatch):
    import urllib.error

    from torchvision.models import _api

    def offline(self, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(_api.WeightsEnum, "get_state_dict", offline)
    with pytest.raises(HubUnavailableError) as e:
        _built(TORCHVISION, "auto")
    assert "\n" not in str(e.value) and "--feature-weights FILE" in str(e.value)
