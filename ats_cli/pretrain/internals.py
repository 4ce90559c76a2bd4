"""Every place ``ats pretrain`` reaches into the model's parts, in one module.

Why one module: stage 1 trains the feature network with a head of its own and then copies
that head's rows into the model's classifier and its "no class here" logit; stage 1b trains
the attention network alone. Those are the model's internals, not its interface, and when
:class:`ats_cli.core.model.ATSModel` moves a part (the none head, say) only this file has
to follow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def feature_width(model) -> int:
    """The width of the patch features the classifier reads."""
    return int(model.feature_net.out_features)


def feature_parameters(model) -> list[torch.nn.Parameter]:
    """What stage 1 trains of the model: the feature network."""
    return list(model.feature_net.parameters())


def patch_features(model, patches: torch.Tensor) -> torch.Tensor:
    """The (scaled, unit) features [N, D] the model pools, of patches [N, C, h, w] in [0, 1],
    without the patch gain (stage 1 does not train it)."""
    return model.patch_parts(patches)[0]


def attention_net(model) -> torch.nn.Module:
    """The network that maps a low-resolution view to attention logits."""
    return model.attention_net


def attention_margin(model) -> int:
    """Cells the attention net leaves out at each border (0 for most nets)."""
    return getattr(model.attention_net, "margin", 0)


def sampling_support(model, low: torch.Tensor, att_shape: tuple[int, int]) -> torch.Tensor | None:
    """Bool [B, att_h, att_w] of the cells the model may sample on views ``low`` (None = all):
    the attention is taught over exactly the cells ``ats train`` and ``ats predict`` draw from."""
    return model.sampling_support(low, att_shape)


def none_head(model) -> torch.nn.Linear | None:
    """The model's per-patch "no class here" logit (``--none-class on``), else None."""
    return getattr(model.pooling, "none", None)


def set_head(model, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Copy a patch head of ``n_classes`` (+1: none) rows into the model: the first rows
    become the classifier (the pooled feature is the attention-weighted mean of the
    patches' features, so the image's logits start as its patches' weighted vote), the
    last, when the head has one more row than classes, the none logit."""
    import torch

    n = model.classifier.out_features
    with torch.no_grad():
        model.classifier.weight.copy_(weight[:n])
        model.classifier.bias.copy_(bias[:n])
        none = none_head(model)
        if none is not None and len(weight) > n:
            none.weight.copy_(weight[n:])
            none.bias.copy_(bias[n:])


NONE_BIAS_KEY = "pooling.none.bias"  # the none logit's bias in a checkpoint's state dict (ats export --none-prior)
NONE_PREFIX = "pooling.none."  # the none head's keys in a checkpoint's state dict (ats export --none-class off)
