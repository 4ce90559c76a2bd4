"""A small pooled CNN feature network for any channel count (gray digits, RGB tissue).

Why another feature net next to the paper's: the paper's LeNet-1-style net has no
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
