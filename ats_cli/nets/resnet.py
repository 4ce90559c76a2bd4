"""torchvision ResNets as feature networks: the CNN baseline (thesis Tables 3.1/3.2).

Randomly initialised (``weights=None``): nothing is downloaded, and the thesis's CNN
baseline is trained from scratch too. The first convolution takes ``in_channels`` and
the final layer is dropped, so the net maps [N, C, h, w] (any size) to [N, 512]
(or to [N, width] through a linear projection when ``width`` is given).
"""

from __future__ import annotations

import torch.nn as nn

from ats_cli.registry import register_net


@register_net("resnet18", kind="features")
def resnet18(in_channels: int = 3, width: int | None = None) -> nn.Module:
    """``width`` (the feature-net flag, e.g. when ATS uses this net on patches) adds a
    linear projection of the 512 pooled features to ``width``; None keeps 512 (the CNN
    baseline)."""
    from torchvision.models import resnet18 as tv_resnet18

    net = tv_resnet18(weights=None)
    if in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    net.out_features = width or net.fc.in_features
    net.fc = nn.Linear(net.fc.in_features, width) if width else nn.Identity()
    return net
