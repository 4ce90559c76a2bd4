"""A wider attention network that looks at blocks of the low-res view, not single pixels.

Why: the paper's attention net (:class:`ats_cli.nets.mnist.ConvAttention`, 8 channels,
three 3x3 convolutions at the view's full resolution) sees 7x7 low-res pixels and has
room for little more than "bright here". That is enough where the distractors all look
alike (one noise family: it learns to avoid that texture) and falls short where they
look like what it should find (fragments of digits, printed glyphs, strokes, grids):
telling a digit from a digit-like scribble at low resolution takes a wider view of its
surroundings than 7x7 pixels.

What: ``PixelUnshuffle(r)`` folds each r x r block of the view into r*r channels (a
learned stride-r convolution with a 3r x 3r kernel, at none of the cost of running it
densely), then ``depth`` 3x3 convolutions of ``width`` channels and a 3x3 score layer
that starts at zero (uniform attention at the start, as the paper's net). Four times
the channels cost about the same time on a CPU: the wide layers run on an r*r times
smaller grid, and the paper net's 1- and 8-channel convolutions are memory-bound, not
compute-bound.

The score map comes back at the view's resolution: each block's score is given to each of
its r x r pixels (the view is padded with black to a multiple of r first, and the padding
cut off again). So the attention grid is the view's, as with the paper's net, and
everything that maps cells to the image (patch offsets, the brightness support and the
rarity prior, heatmaps, GeoJSON) stays exact for any view size; the support still picks
single bright pixels, so patches centre on ink rather than on a block's centre. Sampling
is over as many cells as with the paper's net.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ats_cli.nets.mnist import ConvAttention
from ats_cli.registry import register_net


class BlockAttention(ConvAttention):
    """PixelUnshuffle(r) -> the paper's net (depth x [Conv3x3(width), ReLU] -> Conv3x3(1),
    zero-initialised) -> each block's score repeated over its r x r pixels:
    [B, C, h, w] -> [B, 1, h, w]."""

    def __init__(self, in_channels: int = 1, width: int = 32, depth: int = 3, block: int = 3):
        super().__init__(in_channels * block ** 2, width=width, depth=depth, activation="relu")
        self.block = int(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.block
        h, w = x.shape[-2:]
        x = F.pad(x, (0, -w % r, 0, -h % r))
        blocks = super().forward(F.pixel_unshuffle(x, r))
        return blocks.repeat_interleave(r, dim=-2).repeat_interleave(r, dim=-1)[..., :h, :w]


@register_net("block-attention", kind="attention")
def block_attention(in_channels: int = 1, width: int = 32) -> nn.Module:
    """3x3 blocks, three 3x3 layers of ``width`` (set attention_width = 32: the CLI's
    default width, 8, is the paper net's)."""
    return BlockAttention(in_channels, width=width, depth=3, block=3)
