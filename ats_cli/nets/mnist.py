"""The Megapixel MNIST networks: the paper's (thesis B.8.1; defaults: idiap/attention-sampling,
scripts/mnist.py) and ``small-cnn``, the pooled feature net the defaults train with.

One module because they answer one question, the networks a run on Megapixel MNIST
trains from scratch (``mnist-attention`` and ``small-cnn`` are the defaults).

**small-cnn: a small pooled CNN feature network for any channel count** (gray digits, RGB
tissue). Why another feature net next to the paper's: the paper's LeNet-1-style net has no
pooling, so each output sees only a 13x13 window of a 50x50 patch and every layer runs
at full patch resolution (~47 MFLOPs per patch at width 32). Pooling after the first
two convolutions gives a receptive field larger than an MNIST digit (40x40) at about a
seventh of the cost (~6.5 MFLOPs at width 32), which matters on a CPU where the feature
network is most of a training step.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ats_cli.registry import register_net


class ConvAttention(nn.Module):
    """A small all-convolutional attention network with 'same' padding (margin 0):
    ``depth`` conv layers of ``width`` channels, then a 1-channel score map.

    The last layer starts at zero so the initial attention is exactly uniform: the
    network then explores every position before it learns where to look (thesis Fig.
    3.3 starts uniform too), instead of starting from a random, peaked preference.
    """

    margin = 0

    def __init__(self, in_channels: int = 1, width: int = 8, depth: int = 2, activation: str = "tanh"):
        super().__init__()
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
        layers: list[nn.Module] = []
        c = in_channels
        for _ in range(depth):
            layers += [nn.Conv2d(c, width, 3, padding=1), act()]
            c = width
        self.body = nn.Sequential(*layers)
        self.score = nn.Conv2d(c, 1, 3, padding=1)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.body(x))


class LeNetFeatures(nn.Module):
    """LeNet-1-inspired feature network: Conv(w,7) then 3x Conv(w,3), ReLU, 'valid',
    global max pool -> [N, w]. (The model applies the final L2 normalisation.)

    ``norm="batch"`` adds batch normalisation after each convolution. Why it matters:
    Megapixel MNIST patches are mostly black, so at initialisation the paper's net outputs
    almost the same vector for every patch (dominated by the biases, and nearly equal after
    the L2 normalisation). Then neither the classifier nor the
    attention gets a useful gradient, which is the long initial plateau of the reference.
    Normalised activations make the features depend on the content from the first step.
    """

    def __init__(self, in_channels: int = 1, width: int = 32, norm: str = "none"):
        super().__init__()
        if norm not in ("none", "batch"):
            raise ValueError(f"norm must be 'none' or 'batch', got {norm!r}")
        layers: list[nn.Module] = []
        c = in_channels
        for k in (7, 3, 3, 3):
            layers.append(nn.Conv2d(c, width, k, bias=norm == "none"))
            if norm == "batch":
                layers.append(nn.BatchNorm2d(width))
            layers.append(nn.ReLU())
            c = width
        self.body = nn.Sequential(*layers)
        self.out_features = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.amax(self.body(x), dim=(2, 3))


@register_net("mnist-attention", kind="attention")
def mnist_attention(in_channels: int = 1, width: int = 8) -> nn.Module:
    return ConvAttention(in_channels, width=width, depth=2, activation="tanh")


@register_net("mnist-features", kind="features")
def mnist_features(in_channels: int = 1, width: int = 32) -> nn.Module:
    """The paper's feature net, as published (no normalisation)."""
    return LeNetFeatures(in_channels, width=width)


@register_net("mnist-features-bn", kind="features")
def mnist_features_bn(in_channels: int = 1, width: int = 32) -> nn.Module:
    """The paper's feature net with batch normalisation: leaves the plateau early."""
    return LeNetFeatures(in_channels, width=width, norm="batch")


# ---------------------------------------------------------------------------- small-cnn


def _block(c_in: int, c_out: int, k: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


class PooledCNN(nn.Module):
    """Conv5(w/2) -> pool2 -> Conv3(w) -> pool2 -> Conv3(w) -> Conv3(w) -> global max -> [N, w].

    Batch normalisation for the reason given in :class:`ats_cli.nets.mnist.LeNetFeatures`
    (mostly-empty patches must still give content-dependent features from the first step).
    """

    def __init__(self, in_channels: int = 1, width: int = 32):
        super().__init__()
        half = max(1, width // 2)
        self.body = nn.Sequential(
            *_block(in_channels, half, 5), nn.MaxPool2d(2),
            *_block(half, width, 3), nn.MaxPool2d(2),
            *_block(width, width, 3),
            *_block(width, width, 3),
        )
        self.out_features = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.amax(self.body(x), dim=(2, 3))


@register_net("small-cnn", kind="features")
def small_cnn(in_channels: int = 1, width: int = 32) -> nn.Module:
    return PooledCNN(in_channels, width=width)
