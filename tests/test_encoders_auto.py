"""--feature-net auto (ats_cli.config._feature_net, ats_cli.nets.encoders): RGB images start
from the pretrained encoder when its weights are in the cache, named in the settle log with
the cache they came from; without them and without a network, the random-initialised net,
said in one line at once; an explicit timm name without weights or network fails at once
naming the model and the cache. Nothing touches the network: the hub is offline
(tests/conftest.py), the cache is a tmp folder, and the reachability probe is stood in for."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import ats_cli.config as config
from ats_cli.cli import app
from ats_cli.config import RANDOM_FEATURE_NET, DataFacts, TrainConfig, settle
from ats_cli.nets import encoders
from tests.test_train import _write_squares_dataset

timm = pytest.importorskip("timm")
runner = CliRunner()
TINY = "timm:test_resnet"  # timm's tiny ResNet; its pretrained weights live in hub repo timm/test_resnet.r160_in1k
SMALL = ("--epochs", 1, "--n-patches", 2, "--patch-size", 16, "--scale", 0.125, "--batch-size", 8, "--workers", 0)


def ats(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, the probe's memory cleared, the pretrained
    default the tiny test_resnet (its weights are made here, not downloaded)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(encoders, "_probed", {})
    monkeypatch.setattr(config, "PRETRAINED_FEATURE_NET", TINY)
    return cache


def _cache_weights(cache) -> dict[str, torch.Tensor]:
    """test_resnet's pretrained weights (random ones, with its classifier) where the hub
    client puts a download: models--timm--test_resnet.r160_in1k/snapshots/REV/model.safetensors."""
    torch.manual_seed(5)
    state = {k: v.contiguous() for k, v in timm.create_model("test_resnet", num_classes=1000).state_dict().items()}
    repo, rev = cache / "models--timm--test_resnet.r160_in1k", "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    (repo / "snapshots" / rev).mkdir(parents=True)
    save_file(state, str(repo / "snapshots" / rev / "model.safetensors"))
    return state


def test_auto_starts_rgb_images_from_the_pretrained_encoder_in_the_cache_and_says_where(hub_cache, tmp_path):
    state = _cache_weights(hub_cache)
    data = _write_squares_dataset(tmp_path / "data", n_train=8, n_test=4, channels=3)
    run = tmp_path / "run"
    result = ats("train", data, "--out", run, *SMALL)
    assert result.exit_code == 0, result.output
    assert (f"feature_net {TINY}: RGB images, and test_resnet's pretrained weights, in the cache {hub_cache}: a "
            "pretrained encoder") in result.output
    assert "feature_train none: the feature net starts from pretrained weights" in result.output
    assert f"from the cache {hub_cache}" in result.output  # the line that loads them
    saved = json.loads((run / "config.json").read_text())
    assert (saved["feature_net"], saved["feature_train"]) == (TINY, "none")
    model = torch.load(run / "best.pt", map_location="cpu", weights_only=True)["model"]
    assert torch.equal(model["feature_net.backbone.conv1.0.weight"], state["conv1.0.weight"])  # the cache's, frozen


def test_auto_falls_back_to_random_weights_in_one_line_without_cache_or_network(hub_cache, tmp_path):
    data = _write_squares_dataset(tmp_path / "data", n_train=8, n_test=4, channels=3)
    run = tmp_path / "run"
    result = ats("train", data, "--out", run, *SMALL)
    assert result.exit_code == 0, result.output
    said = [line.strip() for line in result.output.splitlines() if "pretrained weights for" in line]
    assert said == [f"feature_net small-cnn: no pretrained weights for {TINY} in the cache ({hub_cache}) and no "
                    "network (HF_HUB_OFFLINE is set): starting the feature net from random weights; to use them, "
                    "run once where huggingface.co can be reached (they are then cached) or give --feature-net "
                    f"{TINY} --feature-weights FILE (docs/training.md#pretrained-encoders)"]
    saved = json.loads((run / "config.json").read_text())
    assert (saved["feature_net"], saved["feature_train"]) == (RANDOM_FEATURE_NET, "all")


def test_the_network_is_asked_once_a_run_with_a_short_timeout(hub_cache, monkeypatch):
    """Without an offline variable: one probe of the hub's host, within PROBE_SECONDS even
    where the connection (or the name lookup) hangs; its answer kept for the run."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def hangs(address, timeout=None):
        calls.append(address)
        time.sleep(5)
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", hangs)
    monkeypatch.setattr(encoders, "PROBE_SECONDS", 0.3)
    start = time.perf_counter()
    first = encoders.pretrained_availability(TINY)
    second = encoders.pretrained_availability(TINY)
    assert time.perf_counter() - start < 1.5
    assert first == second == ("", f"no pretrained weights for {TINY} in the cache ({hub_cache}) and no network "
                                    "(huggingface.co:443 could not be reached within 0.3 s)")
    assert calls == [("huggingface.co", 443)]


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATS_OFFLINE"])
def test_an_offline_variable_answers_without_asking_the_network(monkeypatch, var):
    from huggingface_hub import constants

    for other in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATS_OFFLINE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(encoders, "_reachable", lambda *a: pytest.fail("the network was asked"))
    assert encoders.network_problem("https://huggingface.co") == f"{var} is set"


def test_an_explicit_timm_name_without_weights_or_network_fails_at_once_naming_model_and_cache(
        hub_cache, tmp_path, monkeypatch):
    """Offline, timm's download used to retry the hub for ~50 s before its error; the
    hub's client must not be asked at all when the probe says there is no network."""
    data = _write_squares_dataset(tmp_path / "data", n_train=4, n_test=2, channels=3)
    result = ats("train", data, "--out", tmp_path / "run", "--feature-net", TINY, *SMALL)  # HF_HUB_OFFLINE is set
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert errors == [f"error: --feature-net {TINY}: no pretrained weights for it in the cache ({hub_cache}) and no "
                      "network (HF_HUB_OFFLINE is set); download them once where the network is (the same command), "
                      "or pass local weights: --feature-weights FILE (safetensors or a state dict), or an encoder "
                      "directory from ats export --encoder"], result.output
    assert "settled from the data" not in result.output  # refused before the data is looked at or prepared

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(encoders, "_reachable", lambda *a: False)  # no route, as on a machine without network
    monkeypatch.setattr(timm.models._hub, "hf_hub_download", lambda *a, **k: pytest.fail("the hub was asked"))
    net_name, kwargs = encoders.feature_spec(TINY, channels=3, width=8)
    net = encoders.create_encoder(net_name, **kwargs)
    start = time.perf_counter()
    with pytest.raises(encoders.HubUnavailableError) as e:
        encoders.load_start_weights(net, TINY, "auto", kwargs)
    assert time.perf_counter() - start < 3
    assert f"{TINY}: no pretrained weights for it in the cache ({hub_cache})" in str(e.value)
    assert "huggingface.co:443 could not be reached" in str(e.value) and "\n" not in str(e.value)


def test_cached_weights_are_read_without_asking_the_hub(hub_cache, monkeypatch):
    """In the cache: loaded in the hub's offline mode, even with a network (no update check)."""
    from huggingface_hub import constants

    state = _cache_weights(hub_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(encoders, "_reachable", lambda *a: pytest.fail("the network was asked"))
    net_name, kwargs = encoders.feature_spec(TINY, channels=3, width=8)
    net = encoders.create_encoder(net_name, **kwargs)
    assert encoders.load_start_weights(net, TINY, "auto", kwargs) == (
        f"test_resnet's pretrained weights (timm, from the cache {hub_cache})")
    assert torch.equal(net.backbone.conv1[0].weight, state["conv1.0.weight"])
    assert constants.HF_HUB_OFFLINE is False  # restored


def test_the_auto_rule_and_its_reasons():
    """Pure: RGB with weights -> the pretrained encoder; grey, no weights, --init or a weights
    file -> the random-initialised net (or the checkpoint's); a given name wins."""
    rgb, grey = DataFacts(channels=3, pretrained="x's pretrained weights, in the cache C"), DataFacts(channels=1)

    def net(facts, **flags) -> tuple[str, str]:
        reason = next(r for r in settle(TrainConfig(data="d", out="o", **flags), facts)[1] if r.key == "feature_net")
        return reason.value, reason.why

    pretrained = config.PRETRAINED_FEATURE_NET
    assert net(rgb) == (pretrained, "RGB images, and x's pretrained weights, in the cache C: a pretrained encoder")
    assert net(grey)[0] == RANDOM_FEATURE_NET and "1-channel images, not RGB" in net(grey)[1]
    missing = DataFacts(channels=3, no_pretrained="no pretrained weights for X in the cache (C) and no network (N)")
    assert net(missing)[0] == RANDOM_FEATURE_NET
    assert net(missing)[1].startswith("no pretrained weights for X in the cache (C) and no network (N): starting the "
                                      "feature net from random weights; ")
    assert net(DataFacts(channels=3, init_feature_net="timm:y"), init="r/best.pt") == (
        "timm:y", "the feature net of init r/best.pt")
    assert net(rgb, feature_weights="w.safetensors")[0] == RANDOM_FEATURE_NET
    assert net(rgb, feature_net="mnist-features") == ("mnist-features", "given")
    assert net(rgb, method="cnn")[0] == RANDOM_FEATURE_NET  # no feature net to start anywhere
    # frozen when pretrained, trained when not (the --feature-train auto rule, unchanged)
    train = {r.key: r.value for r in settle(TrainConfig(data="d", out="o"), rgb)[1]}["feature_train"]
    assert train == "none"
    assert {r.key: r.value for r in settle(TrainConfig(data="d", out="o"), missing)[1]}["feature_train"] == "all"


def test_the_default_encoders_hub_repo_is_timms_own():
    """Its repo is known without importing timm (_HUB_REPOS); it must be the one timm fetches."""
    arch = config.PRETRAINED_FEATURE_NET.removeprefix("timm:")
    assert encoders._HUB_REPOS[arch] == timm.models.get_pretrained_cfg(arch).hf_hub_id
