"""Pretrained encoders as feature networks: timm and torchvision models by name, and the
feature network of a run exported with ``ats export --encoder``.

Names ``--feature-net`` takes besides the registered nets:

* ``timm:ARCH`` -- any timm model, ``ARCH`` also ``hf-hub:ORG/NAME``; keyword arguments
  for timm's ``create_model`` after a ``?``: ``timm:hf-hub:MahmoodLab/uni?init_values=1e-5``;
* ``torchvision:ARCH`` -- a torchvision classification model (its last linear layer dropped);
* ``local:DIR`` or ``DIR`` -- an exported encoder (``DIR/config.json`` + ``DIR/model.safetensors``).

Why two steps, *resolve* then *create*: a checkpoint must rebuild its model without the
network and without the directory it was trained from. :func:`feature_spec` resolves a name
once, when training starts (it may read a hub model's ``config.json``), into a plain recipe
-- the architecture, its keyword arguments, input size and normalisation -- which the model
spec stores; :func:`create_encoder` builds from a recipe and never downloads. The starting
weights (:func:`load_start_weights`) are read afterwards and only by training: prediction
takes the weights from the checkpoint.

Why resize and normalise inside the module: the encoder was trained on images of its input
size normalised by its mean and std (timm's ``pretrained_cfg``, torchvision's weights' meta),
and patches arrive as [N, C, ph, pw] in [0, 1] at whatever size attention sampling reads;
doing it on the device keeps the data pipeline the same for every feature net. Patches are
resized whole (no centre crop: a patch's border is as much its content as its centre) and
grey patches repeated to three channels. timm is imported only when a ``timm:`` name is used.

**Pretrained weights, from the cache or the network, decided at once** (:func:`weights_location`,
:func:`network_problem`, :func:`pretrained_availability`). The weights of a ``timm:`` or
``torchvision:`` name are read from the library's cache (the Hugging Face hub cache, or torch
hub's) without asking the network; when they are not there, one TCP connection to the host
that serves them, with a timeout of :data:`PROBE_SECONDS` and asked once a run, says whether
they can be downloaded now. ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and ``ATS_OFFLINE``
say no without asking. Why: offline, the hub's own client retried five times a file, two
files, and failed after ~50 s; ``--feature-net auto`` (:func:`ats_cli.config.settle`) must
know before training starts whether the pretrained default can be had, and say in one line
when not.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.io import first_line
from ats_cli.registry import RANDOM_FEATURE_NET, register_net_prefix

__all__ = ["Encoder", "EncoderError", "MissingExtraError", "HubUnavailableError", "EXTRA", "FORMAT", "VERSION",
           "CONFIG", "WEIGHTS", "create_encoder", "feature_spec", "load_start_weights", "pretrained_source",
           "freeze", "apply_feature_train", "read_weights", "is_local", "import_extra", "PROBE_SECONDS",
           "weights_location", "network_problem", "pretrained_availability",
           "check_weights_can_be_had"]

EXTRA = 'pip install -e ".[encoders]"'
FORMAT = "ats-encoder"
VERSION = 1
CONFIG, WEIGHTS = "config.json", "model.safetensors"
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class EncoderError(ValueError):
    """An encoder name, weights file or setting that cannot be used; one line naming it."""


class MissingExtraError(EncoderError):
    """timm or safetensors is not installed; the message names the extra that installs it."""


class HubUnavailableError(EncoderError):
    """A hub model whose config or weights cannot be fetched (offline, gated, unreachable);
    the message says how to pass local weights instead."""


def import_extra(module: str, what: str):
    """``module`` of the encoders extra, or :class:`MissingExtraError` naming ``what`` needed it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise MissingExtraError(f"{what}: {module.split('.')[0]} is not installed; {EXTRA}") from None


# ---------------------------------------------------------------- the module


class Encoder(nn.Module):
    """A pretrained ``backbone`` ([N, 3, H, W] normalised -> [N, D]) as a feature network for
    patches [N, ``in_channels``, ph, pw] in [0, 1]: grey repeated to three channels, resized
    to ``input_size`` ((H, W); None = as they come), normalised by ``mean`` and ``std``.
    ``head`` (a width) adds a trainable linear + ReLU projection on top, the CLAM-style
    adapter that ``feature_train head`` trains on a frozen backbone. ``dropped``: the
    classifier's names in the pretrained model (its weights files carry them; this has none).

    A backbone without a parameter that requires a gradient runs under
    ``torch.inference_mode`` (bf16 autocast on CUDA) and its output is cloned out of it: no
    activation is kept for a backward pass that cannot happen, and the attention's gradient
    is untouched, because the estimator differentiates the attention through the sampled
    probabilities and the weights of the draws only, the features entering it as constants
    (:func:`ats_cli.core.sampling.estimator_weights`)."""

    def __init__(self, backbone: nn.Module, *, in_channels: int = 3, input_size: tuple[int, int] | None = None,
                 mean: tuple[float, ...] = IMAGENET[0], std: tuple[float, ...] = IMAGENET[1],
                 interpolation: str = "bilinear", head: int | None = None, dropped: tuple[str, ...] = ()):
        super().__init__()
        self.dropped = tuple(dropped)  # prefixes of the classifier weights a pretrained file has and this has not
        if in_channels not in (1, 3):
            raise EncoderError(f"a pretrained encoder reads grey or RGB patches; these have {in_channels} channels")
        self.backbone = backbone
        self.in_channels = in_channels
        self.input_size = tuple(int(s) for s in input_size) if input_size else None
        self.interpolation = "bicubic" if interpolation == "bicubic" else "bilinear"
        # not in the state dict: the recipe holds them, and the exported weights stay the backbone's
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        width = _width(backbone, self.input_size or (224, 224))
        self.head = nn.Sequential(nn.Linear(width, int(head)), nn.ReLU()) if head else None
        self.out_features = int(head) if head else width

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Patches in [0, 1] as the backbone was trained to see them."""
        x = x.float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if self.input_size and tuple(x.shape[-2:]) != self.input_size:
            x = F.interpolate(x, size=self.input_size, mode=self.interpolation, align_corners=False, antialias=True)
        return (x - self.mean) / self.std

    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prepare(x)
        if self.backbone_frozen():
            bf16 = torch.autocast("cuda", dtype=torch.bfloat16) if x.is_cuda else nullcontext()
            with torch.inference_mode(), bf16:
                feats = self.backbone(x)
            feats = feats.float().clone()  # an ordinary tensor again: later layers may save it for backward
        else:
            feats = self.backbone(x)
        return feats if self.head is None else self.head(feats)


def _width(backbone: nn.Module, size: tuple[int, int]) -> int:
    """The backbone's output width: a timm model's (``head_hidden_size`` where a pre-logits
    layer follows the features, as in MobileNetV3, else ``num_features``), otherwise one dry
    forward pass."""
    for attr in ("head_hidden_size", "num_features"):
        if isinstance(getattr(backbone, attr, None), int):
            return getattr(backbone, attr)
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            return int(backbone(torch.zeros(1, 3, *size)).flatten(1).shape[1])
    finally:
        backbone.train(was_training)


# ---------------------------------------------------------------- names -> recipes (resolve)


# create_model arguments that make timm read a file or fetch weights itself: timm's
# checkpoint reader unpickles (torch.load without weights_only), and weights are ats's to
# load (--feature-weights, read safely); so they are refused, naming the way that works
_FILE_ARGS = ("checkpoint_path", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")


def _split_args(arch: str, name: str | None = None) -> tuple[str, dict[str, Any]]:
    """``ARCH?k=v&k2=v2`` -> (ARCH, {k: v}); values read as JSON where they parse
    (``1e-5``, ``true``), else kept as strings (``silu``). Arguments that would make timm
    load weights itself (:data:`_FILE_ARGS`) are refused."""
    arch, _, query = arch.partition("?")
    args: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq or not key.isidentifier():
            raise EncoderError(f"--feature-net {arch}?{query}: expected ?key=value&key=value, got {part!r}")
        if key in _FILE_ARGS:
            raise EncoderError(f"--feature-net {name or arch + '?' + query}: ?{key} is not taken (timm would load "
                               "weights itself, unpickling the file); give the weights with --feature-weights "
                               "FILE (safetensors or a state dict, read without running code)")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return arch, args


def _hub_id(arch: str) -> str | None:
    m = re.match(r"hf[-_]hub:(.+)", arch)
    return m.group(1) if m else None


def _hub_error(name: str, e: BaseException, what: str) -> HubUnavailableError:
    return HubUnavailableError(
        f"--feature-net {name}: cannot fetch its {what} from the Hugging Face hub ({first_line(e)}); offline, or a "
        "gated model (accept its terms on the hub, then `hf auth login`)? Pass local weights instead: "
        "--feature-weights FILE (safetensors or a state dict) with --feature-net timm:ARCH?key=value naming the "
        "architecture, or an encoder directory from ats export --encoder")


# ---------------------------------------------------------------- where pretrained weights are, and can they be had

PROBE_SECONDS = 2.0  # one TCP connection to the weights' host; the hub's client took ~50 s offline
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATS_OFFLINE")
_probed: dict[tuple[str, int], bool] = {}  # (host, port) -> reachable, once a process (a run)
_HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm fetches of a hub model, in its order
# hub repos of timm models known without importing timm (2.5 s on a loaded 2-core machine):
# --feature-net auto's default is looked for on every RGB run (tests check it against timm's)
_HUB_REPOS = {"convnext_atto.d2_in1k": "timm/convnext_atto.d2_in1k"}


def _is_set(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _offline_var() -> str:
    """The variable that says no network (``HF_HUB_OFFLINE``, also as huggingface_hub read
    it at its import; ``TRANSFORMERS_OFFLINE``; ``ATS_OFFLINE``, the demo's), "" when none does."""
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None and getattr(hub, "HF_HUB_OFFLINE", False):
        return "HF_HUB_OFFLINE"
    return next((var for var in _OFFLINE_VARS if _is_set(os.environ.get(var))), "")


def _reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds, name
    lookup included (in a thread: the resolver has no timeout of its own)."""
    answer: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answer and answer[0])


def network_problem(url: str, timeout: float | None = None) -> str:
    """Why ``url`` cannot be downloaded from now, in words ("" when it can): an offline
    variable, or its host (the https proxy's, when one is set) not answering within
    ``timeout`` seconds (default :data:`PROBE_SECONDS`). The host is asked once a process."""
    timeout = PROBE_SECONDS if timeout is None else timeout
    var = _offline_var()
    if var:
        return f"{var} is set"
    parsed = urlparse(url)
    proxy = urllib.request.getproxies().get(parsed.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(parsed.hostname or ""):
        parsed = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    host = parsed.hostname or ""
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    if (host, port) not in _probed:
        _probed[(host, port)] = bool(host) and _reachable(host, port, timeout)
    return "" if _probed[(host, port)] else f"{host}:{port} could not be reached within {timeout:g} s"


def _hf_cached(repo: str, filenames: tuple[str, ...]) -> tuple[str | None, str, str]:
    """The first of ``filenames`` of hub repo ``repo`` (``ORG/NAME[@REVISION]``) in the
    Hugging Face cache, the cache folder, and the hub's address."""
    from huggingface_hub import constants, try_to_load_from_cache

    repo_id, _, revision = repo.partition("@")
    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename, revision=revision or None)
        if isinstance(found, str):  # not the "known to be missing" marker
            return found, constants.HF_HUB_CACHE, constants.ENDPOINT
    return None, constants.HF_HUB_CACHE, constants.ENDPOINT


def _url_cached(url: str) -> tuple[str | None, str, str]:
    """A download URL's file in torch hub's cache (where torchvision and timm's URL weights
    go), the cache folder, and the URL."""
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    file = folder / os.path.basename(urlparse(url).path)
    return (str(file) if file.is_file() else None), str(folder), url


def weights_location(name: str) -> tuple[str | None, str, str]:
    """Where ``--feature-net NAME``'s pretrained weights are: the file in the library's cache
    (None when not there), the cache folder, and the URL they download from. Reads the
    cache only; the network is not asked. Raises :class:`EncoderError` for a timm model
    that has no pretrained weights."""
    prefix, _, arch = name.partition(":")
    if prefix == "torchvision":
        from torchvision import models

        return _url_cached(models.get_model_weights(arch).DEFAULT.url)
    arch, _ = _split_args(arch, name)
    if arch in _HUB_REPOS:
        return _hf_cached(_HUB_REPOS[arch], _HF_FILES)
    timm = import_extra("timm", f"--feature-net {name}")
    hub = _hub_id(arch)
    if hub:
        return _hf_cached(hub, _HF_FILES)
    cfg = timm.models.get_pretrained_cfg(arch)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise EncoderError(f"--feature-net {name}: timm has no pretrained weights for {arch}; give them with "
                           "--feature-weights FILE, or --feature-weights none for random ones")
    if cfg.hf_hub_id:
        return _hf_cached(cfg.hf_hub_id, (cfg.hf_hub_filename,) if cfg.hf_hub_filename else _HF_FILES)
    return _url_cached(cfg.url)


def pretrained_availability(name: str) -> tuple[str, str]:
    """Whether ``--feature-net NAME``'s pretrained weights can be had now, at once: (where
    from, in words; "" when they cannot) and (why not, one clause; "" when they can). The
    cache is read; the network asked only when they are not in it (:func:`network_problem`)."""
    try:
        cached, folder, url = weights_location(name)
    except EncoderError as e:  # no timm, no weights for that model
        return "", str(e).removeprefix(f"--feature-net {name}: ")
    except ImportError:  # huggingface_hub (timm's) not installed
        return "", f"timm is not installed; {EXTRA}"
    problem = "" if cached else network_problem(url)
    if problem:
        return "", f"no pretrained weights for {name} in the cache ({folder}) and no network ({problem})"
    if name.startswith("timm:"):
        try:  # they can be had: training builds the model with timm (imported only now, 2.5 s)
            import_extra("timm", f"--feature-net {name}")
        except MissingExtraError as e:
            return "", str(e).removeprefix(f"--feature-net {name}: ")
    arch = name.partition(":")[2]
    if cached:
        return f"{arch}'s pretrained weights, in the cache {folder}", ""
    return f"{arch}'s pretrained weights, downloaded from {urlparse(url).hostname} to the cache {folder}", ""


@contextmanager
def _fetching(name: str, what: str, location: tuple[str | None, str, str], *, client_offline: bool = False):
    """Around a timm / huggingface_hub call that may fetch ``what`` of ``--feature-net
    NAME`` (``location``: :func:`weights_location`'s): from the cache, the hub is not asked
    (offline mode for the call: no update check, nothing to wait for); not cached and no
    network: :class:`HubUnavailableError` now, naming the model and the cache, instead of
    the client's ~50 s of retries; else the call downloads as it always did.
    ``client_offline``: with the hub's own offline variable set, the call is made (it fails
    at once by itself, and a test may stand in for it)."""
    cached, folder, url = location
    if cached:
        try:
            from huggingface_hub import constants
        except ImportError:  # torchvision without timm: torch hub reads its cache without asking
            yield
            return
        was = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = True
        try:
            yield
        finally:
            constants.HF_HUB_OFFLINE = was
        return
    problem = network_problem(url)
    if problem and not (client_offline and _offline_var() in _OFFLINE_VARS[:2]):
        raise _unavailable(name, what, folder, problem)
    yield


def _unavailable(name: str, what: str, folder: str, problem: str) -> HubUnavailableError:
    return HubUnavailableError(
        f"--feature-net {name}: no {what} for it in the cache ({folder}) and no network ({problem}); download "
        "them once where the network is (the same command), or pass local weights: --feature-weights FILE "
        "(safetensors or a state dict), or an encoder directory from ats export --encoder")


def check_weights_can_be_had(name: str) -> None:
    """Raise :class:`HubUnavailableError` now when the pretrained weights of ``timm:`` /
    ``torchvision:`` ``name`` are neither in the cache nor downloadable: ``ats train``
    asks before it prepares a single image, not after."""
    if name.partition(":")[0] not in _RECIPES:
        return
    cached, folder, url = weights_location(name)
    if not cached and (problem := network_problem(url)):
        raise _unavailable(name, "pretrained weights", folder, problem)


def _timm_recipe(name: str, arch: str) -> dict[str, Any]:
    """timm: the architecture to rebuild, its keyword arguments, input size and normalisation."""
    timm = import_extra("timm", f"--feature-net {name}")
    from timm.data import resolve_data_config

    arch, user_args = _split_args(arch, name)
    hub = _hub_id(arch)
    if hub:
        try:
            with _fetching(name, "config", _hf_cached(hub, ("config.json",)), client_offline=True):
                pretrained_cfg, model_name, model_args = timm.models.load_model_config_from_hf(hub)
        except HubUnavailableError:
            raise
        except OSError as e:  # offline, gated, missing: huggingface_hub's errors are OSErrors
            raise _hub_error(name, e, "config") from None
        args = {**model_args, **user_args}
    else:
        if not timm.is_model(arch):
            close = timm.list_models(f"*{arch.split('.')[0]}*")[:8]
            raise EncoderError(f"--feature-net {name}: timm has no model {arch!r}"
                               + (f"; similar: {', '.join(close)}" if close else ""))
        model_name, args = arch, user_args
        pretrained_cfg = timm.models.get_pretrained_cfg(arch)
        pretrained_cfg = pretrained_cfg.to_dict() if pretrained_cfg is not None else {}
    args.pop("num_classes", None)  # the classifier is dropped (num_classes=0)
    data = resolve_data_config(pretrained_cfg=pretrained_cfg)
    return {"arch": model_name, "pretrained_name": arch, "args": args, "input_size": list(data["input_size"][1:]),
            "mean": list(data["mean"]), "std": list(data["std"]), "interpolation": data["interpolation"]}


def _torchvision_recipe(name: str, arch: str) -> dict[str, Any]:
    from torchvision import models

    if arch not in models.list_models(module=models):
        raise EncoderError(f"--feature-net {name}: not a torchvision classification model; e.g. "
                           f"{', '.join(models.list_models(module=models)[:6])}, ...")
    t = models.get_model_weights(arch).DEFAULT.transforms()  # the weights' meta: nothing is downloaded
    crop = t.crop_size[0]
    return {"arch": arch, "input_size": [crop, crop], "mean": list(t.mean), "std": list(t.std),
            "interpolation": t.interpolation.value}


_RECIPES = {"timm": _timm_recipe, "torchvision": _torchvision_recipe}


def is_local(name: str) -> bool:
    """``local:DIR``, or a directory that holds an exported encoder."""
    return name.startswith("local:") or (":" not in name and (Path(name) / CONFIG).is_file())


def _local(name: str) -> tuple[Path, dict[str, Any]]:
    folder = Path(name.removeprefix("local:"))
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise EncoderError(f"--feature-net {name}: {folder / CONFIG} not found; make it with "
                           "ats export RUN DIR --encoder") from None
    except (OSError, json.JSONDecodeError) as e:
        raise EncoderError(f"--feature-net {name}: {folder / CONFIG}: {first_line(e)}") from None
    if config.get("format") == "ats-model":  # ats_cli.hub.FORMAT (not imported: it imports the checkpoint)
        raise EncoderError(f"--feature-net {name}: {folder} is a whole model (ats export --hub-ready), not an "
                           f"encoder: give it to --model or key init, or make its feature net one with ats export "
                           f"{folder} DIR --encoder")
    if config.get("format") != FORMAT or not isinstance(config.get("feature_net"), str):
        raise EncoderError(f"--feature-net {name}: {folder / CONFIG} is not an encoder written by ats export --encoder")
    if config.get("version", 0) > VERSION:
        raise EncoderError(f"--feature-net {name}: encoder format version {config['version']} is newer than this ats")
    net = config["feature_net"]
    if net.startswith("local:") or (":" not in net and (Path(net) / CONFIG).is_file()):
        raise EncoderError(f"--feature-net {name}: {folder / CONFIG} names an encoder directory ({net}) as its "
                           "network; an exported encoder names the network it was trained with (timm:ARCH, "
                           "torchvision:ARCH or a built-in net): export it again with ats export RUN DIR --encoder")
    from ats_cli.registry import available_nets

    if net.partition(":")[0] not in _RECIPES and net not in available_nets():
        raise EncoderError(f"--feature-net {name}: {folder / CONFIG} names the network {net!r}, which this ats does "
                           f"not have (built in: {', '.join(available_nets())}; or timm:ARCH, torchvision:ARCH)")
    if not isinstance(config.get("feature_kwargs"), dict):
        raise EncoderError(f"--feature-net {name}: {folder / CONFIG} has no feature_kwargs object")
    return folder, config


def feature_spec(name: str, *, channels: int, width: int, train: str = "all") -> tuple[str, dict[str, Any]]:
    """The feature network's name and keyword arguments as the model spec stores them.

    A registered net keeps ``{"in_channels", "width"}`` (the spec of every run before
    encoders); a ``timm:``/``torchvision:`` name gets its recipe; an exported encoder the
    name and arguments it was trained with. ``train`` ``head`` adds a projection to
    ``width`` channels (to an encoder that has none yet). ``auto`` not yet settled
    (:func:`ats_cli.config.settle` decides it from the data and the cache) is read as
    settling finds it without pretrained weights: the random-initialised net."""
    if name == "auto":
        name = RANDOM_FEATURE_NET
    if is_local(name):
        _, config = _local(name)
        net, kwargs = config["feature_net"], dict(config["feature_kwargs"])
        prefix = net.partition(":")[0]
        if prefix in _RECIPES:
            kwargs["in_channels"] = channels  # grey or RGB alike (Encoder)
        elif kwargs.get("in_channels", channels) != channels:
            raise EncoderError(f"--feature-net {name}: the encoder reads {kwargs['in_channels']}-channel patches, "
                               f"this dataset's images have {channels}")
    else:
        net = name
        prefix, _, arch = name.partition(":")
        kwargs = {"in_channels": channels, **_RECIPES[prefix](name, arch)} if prefix in _RECIPES \
            else {"in_channels": channels, "width": width}
    if train == "head":
        if net.partition(":")[0] not in _RECIPES:
            raise EncoderError(f"feature_train head: {name} is not a pretrained encoder (timm:, torchvision:, or one "
                               "of those exported); use none or all")
        kwargs["head"] = kwargs.get("head") or width
    return net, kwargs


def pretrained_source(name: str, weights: str) -> str:
    """Where ``--feature-net NAME --feature-weights WEIGHTS`` takes pretrained starting
    weights from, in words ("" for random ones): a file, an exported encoder, or a
    timm/torchvision model's own. :func:`ats_cli.config.settle` freezes such a net by default."""
    if weights not in ("auto", "none"):
        return f"--feature-weights {weights}"
    if weights == "auto" and (is_local(name) or name.partition(":")[0] in _RECIPES):
        return f"{name}'s own"
    return ""


# ---------------------------------------------------------------- recipes -> modules (create)


def _layer_classes(timm, args: dict[str, Any]) -> dict[str, Any]:
    """``*_layer`` arguments named by a string (``mlp_layer=SwiGLUPacked``, or a dotted name as
    some hub configs write it) as the class of that name in ``timm.layers`` or ``torch.nn``:
    Virchow's MLP is a class, and a recipe holds plain values only. Only those two namespaces
    are looked in; anything else stays a string (timm reads ``act_layer=silu`` itself)."""
    def resolve(value: Any) -> Any:
        short = value.rsplit(".", 1)[-1]
        return getattr(timm.layers, short, None) or getattr(nn, short, None) or value

    return {k: resolve(v) if k.endswith("_layer") and isinstance(v, str) else v for k, v in args.items()}


def _timm_backbone(name: str, recipe: dict[str, Any], pretrained: bool = False) -> nn.Module:
    timm = import_extra("timm", f"--feature-net {name}")
    args = _layer_classes(timm, recipe["args"])
    if pretrained:  # timm's own download code (the Hugging Face hub, through its cache)
        try:
            return timm.create_model(recipe["pretrained_name"], pretrained=True, num_classes=0, **args)
        except (TypeError, ValueError, KeyError, AssertionError) as e:
            raise EncoderError(f"--feature-net {name}: timm cannot build {recipe['arch']} with {recipe['args']} "
                               f"({first_line(e)})") from None
        except OSError as e:  # huggingface_hub's errors (offline, gated, missing) are OSErrors
            raise _hub_error(name, e, "weights") from None
        except RuntimeError as e:  # e.g. weights with layer scales for a model built without them
            raise EncoderError(f"--feature-net {name}: its pretrained weights do not fit the model built with "
                               f"{recipe['args'] or 'no arguments'} ({first_line(e)}); the model card names the "
                               "create_model arguments to give after ?") from None
    try:
        return timm.create_model(recipe["arch"], pretrained=False, num_classes=0, **args)
    except (TypeError, ValueError, KeyError, AssertionError) as e:  # an argument the architecture does not take
        raise EncoderError(f"--feature-net {name}: timm cannot build {recipe['arch']} with {recipe['args']} "
                           f"({first_line(e)})") from None


def _drop_classifier(model: nn.Module) -> str:
    """Replace a torchvision model's last linear layer by the identity; its qualified name."""
    last = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not last:
        raise EncoderError("this torchvision model has no linear classifier to drop")
    parent_name, _, child = last[-1].rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, nn.Sequential):
        parent[int(child)] = nn.Identity()
    else:
        setattr(parent, child, nn.Identity())
    return last[-1]


def _torchvision_backbone(name: str, recipe: dict[str, Any]) -> tuple[nn.Module, tuple[str, ...]]:
    from torchvision import models

    model = models.get_model(recipe["arch"], weights=None)
    return model, (_drop_classifier(model),)


def create_encoder(name: str, in_channels: int = 3, head: int | None = None, **recipe: Any) -> Encoder:
    """The :class:`Encoder` for ``timm:ARCH`` / ``torchvision:ARCH`` from its recipe (randomly
    initialised, nothing downloaded); without a recipe, the name is resolved first."""
    prefix, _, arch = name.partition(":")
    recipe = recipe or _RECIPES[prefix](name, arch)
    if prefix == "timm":
        backbone = _timm_backbone(name, recipe)
        classifier = backbone.pretrained_cfg.get("classifier") or "head"
        dropped = classifier if isinstance(classifier, (list, tuple)) else (classifier,)
    else:
        backbone, dropped = _torchvision_backbone(name, recipe)
    return Encoder(backbone, in_channels=in_channels, input_size=recipe.get("input_size"), mean=recipe["mean"],
                   std=recipe["std"], interpolation=recipe.get("interpolation", "bilinear"), head=head,
                   dropped=tuple(f"{n}." for n in dropped))


for _prefix in _RECIPES:
    register_net_prefix(_prefix, create_encoder, kind="features")


# ---------------------------------------------------------------- weights


def read_weights(path: str | os.PathLike[str], flag: str = "--feature-weights") -> dict[str, torch.Tensor]:
    """A state dict from a safetensors file or a PyTorch file read with ``weights_only=True``
    (never unpickling objects); one nesting level (``state_dict``, ``model``) and a DDP
    ``module.`` prefix are taken off."""
    path = Path(path)
    if not path.is_file():
        raise EncoderError(f"{flag} {path}: file not found")
    if path.suffix == ".safetensors":
        st = import_extra("safetensors.torch", f"{flag} {path}")
        try:
            return _finite(st.load_file(str(path)), f"{flag} {path}")
        except EncoderError:
            raise
        except Exception as e:
            raise EncoderError(f"{flag} {path}: not a safetensors file ({first_line(e)})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EncoderError(f"{flag} {path}: {_unsafe_load(e)}") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EncoderError(f"{flag} {path}: not a state dict (names -> tensors)")
    return _finite({k.removeprefix("module."): v for k, v in state.items()}, f"{flag} {path}")


def _unsafe_load(e: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a weights file (:func:`ats_cli.io.load_refusal`)."""
    from ats_cli.io import load_refusal

    what, first = load_refusal(e)
    if what is not None:
        return (f"holds a Python object{what} where a weights file holds only tensors; refused without running "
                "anything: give safetensors or a plain state dict")
    return f"not a PyTorch state dict ({first[:200]})"


def _finite(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """``state``, refused when a floating weight holds NaN or infinity: training from it
    ran with loss nan to the end and exit 0, saving a model that predicts nothing."""
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                raise EncoderError(f"{where}: weight {name} holds {bad} NaN/infinite value(s) of {value.numel()}; "
                                   "the file is damaged or its training diverged")
    return state


def _load(module: nn.Module, state: dict[str, torch.Tensor], where: str, *, ignore: tuple[str, ...] = ()) -> None:
    """Load ``state`` into ``module``: every weight must be there and fit; names under
    ``ignore`` (the classifier a pretrained file carries) may be left over."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own and not k.startswith(ignore)]
    if missing or extra:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise EncoderError(f"{where}: the weights do not fit the network ({detail}"
                           f"{', ...' if len(missing or extra) > 3 else ''}; {len(missing)} missing, "
                           f"{len(extra)} unexpected)")
    try:
        module.load_state_dict({k: v for k, v in state.items() if k in own})
    except RuntimeError as e:
        raise EncoderError(f"{where}: the weights do not fit the network ({first_line(e)})") from None


def _load_whole(net: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """An exported feature net's weights into ``net``; an encoder given a projection head
    that the export has not (feature_train head on it) keeps its new head as initialised."""
    head = getattr(net, "head", None) if isinstance(net, Encoder) else None
    if head is not None and not any(k.startswith("head.") for k in state):
        state = {**state, **{f"head.{k}": v for k, v in head.state_dict().items()}}
    _load(net, state, where)


def load_start_weights(feature_net: nn.Module, name: str, weights: str, kwargs: dict[str, Any]) -> str | None:
    """Load into ``feature_net`` (built from the spec's ``kwargs``) the starting weights that
    ``--feature-weights`` (``weights``) names for ``--feature-net`` (``name``); what was
    loaded, in words (None: random initialisation). ``auto``: a timm/torchvision model's
    pretrained weights (the library's cache, else its own download code), an exported
    encoder's own."""
    prefix, _, arch = name.partition(":")
    if weights == "none" or (weights == "auto" and not is_local(name) and prefix not in _RECIPES):
        return None
    encoder = feature_net if isinstance(feature_net, Encoder) else None
    target = encoder.backbone if encoder else feature_net
    if weights != "auto":
        state = read_weights(weights)
        if encoder and any(k.startswith("backbone.") for k in state):  # an exported encoder's file
            _load_whole(encoder, state, f"--feature-weights {weights}")
        else:
            _load(target, state, f"--feature-weights {weights}", ignore=encoder.dropped if encoder else ())
        return weights
    if is_local(name):
        folder, _ = _local(name)
        _load_whole(feature_net, read_weights(folder / WEIGHTS, flag=f"--feature-net {name}:"), f"--feature-net {name}")
        return str(folder / WEIGHTS)
    location = weights_location(name)
    where = f"the cache {location[1]}" if location[0] else f"{urlparse(location[2]).hostname}, downloaded"
    if prefix == "timm":
        with _fetching(name, "pretrained weights", location):
            backbone = _timm_backbone(name, kwargs, pretrained=True)
        _load(target, backbone.state_dict(), f"--feature-net {name}")
        return f"{arch}'s pretrained weights (timm, from {where})"
    from torchvision import models

    try:
        with _fetching(name, "pretrained weights", location):
            state = models.get_model_weights(arch).DEFAULT.get_state_dict(progress=False)
    except HubUnavailableError:
        raise
    except Exception as e:  # urllib's many errors when offline
        raise HubUnavailableError(f"--feature-net {name}: cannot fetch its pretrained weights ({first_line(e)}); "
                                  "pass a local copy with --feature-weights FILE, or --feature-weights none") from None
    _load(target, state, f"--feature-net {name}", ignore=encoder.dropped)
    return f"{arch}'s pretrained weights (torchvision, from {where})"


# ---------------------------------------------------------------- freezing


def freeze(module: nn.Module) -> None:
    """A fixed encoder: no gradients (so no backward pass through it and no optimizer state),
    and batch norms kept in evaluation mode (``frozen``: ats_cli.train's ``train_mode`` and
    ``recalibrate_batch_norm`` leave it be): in training mode they would normalise with the
    statistics of the attention's draws, not those the encoder was trained with, and the
    feature of a patch would depend on which other patches were drawn."""
    module.requires_grad_(False)
    module.frozen = True
    module.eval()


def apply_feature_train(feature_net: nn.Module, mode: str) -> None:
    """``feature_train``: ``none`` freezes the feature net, ``head`` the backbone under its
    projection, ``all`` nothing."""
    if mode == "none":
        freeze(feature_net)
    elif mode == "head":
        freeze(feature_net.backbone)
