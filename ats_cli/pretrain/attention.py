"""Stage 1b: the attention net taught where the objects are, each the same mass.

On the low-res views ``ats train`` makes (``--scale``), the attention's distribution is
fitted by cross-entropy to one that gives every object of the image the same mass, spread
over the cells whose patch holds that object whole (:func:`attention_targets`). Why: from
the image labels alone the attention learns slowly and unevenly, putting much more mass on
one digit than on another, and the pooled feature, which tends to the mass-weighted vote of
the digits, then follows the heaviest digit instead of the majority.
"""

from __future__ import annotations

import time

import numpy as np

from ats_cli.pretrain.internals import attention_net, sampling_support


def attention_example(image, boxes: list[list[int]], size: int, scale: float, att_shape: tuple[int, int],
                      margin: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The low-res view [h, w] (float16) that ats train makes of the image [1, H, W] (uint8
    tensor) and, for each of its digits, the attention cells whose patch (where ats train
    would cut it) holds the digit whole."""
    import torch

    from ats_cli.core.source import positions_to_offsets
    from ats_cli.data.inputs import low_res_view
    from ats_cli.data.megapixel_mnist import box_fractions

    low = low_res_view(image, scale)
    cells = torch.arange(att_shape[0] * att_shape[1])[None]
    corners = positions_to_offsets(cells, att_shape, tuple(image.shape[-2:]), (size, size),
                                   low_size=tuple(low.shape[-2:]), margin=margin)[0].numpy()
    whole = box_fractions(corners, [b[1:] for b in boxes], (size, size)) >= 1.0  # [cells, digits]
    view = low[0] if low.shape[0] == 1 else low  # [h, w] for one channel, else [C, h, w]
    return view.numpy().astype(np.float16), [np.flatnonzero(whole[:, j]) for j in range(len(boxes))]


def attention_targets(model, views: np.ndarray, digit_cells: list[list[np.ndarray]], att_shape: tuple[int, int]
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per image, the distribution the attention is taught, as (cells, probabilities, digit
    of each cell): each digit gets the same mass, spread evenly over its cells that the
    brightness support keeps (ats train never samples the others). Equal mass per digit
    because the label is the majority of the digits: the pooled feature tends to the
    mass-weighted vote, which is the majority only when every digit weighs alike."""
    import torch

    out = []
    for i in range(0, len(views), 64):
        low = _batch(views[i : i + 64])
        keep = sampling_support(model, low, att_shape)
        keep = (torch.ones(len(low), att_shape[0] * att_shape[1], dtype=torch.bool) if keep is None
                else keep.flatten(1)).numpy()
        for k, cells in zip(keep, digit_cells[i : i + 64], strict=True):
            kept = [(d, c[k[c]]) for d, c in enumerate(cells)]
            kept = [(d, c) for d, c in kept if len(c)]
            if not kept:
                out.append((np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)))
                continue
            out.append((np.concatenate([c for _, c in kept]),
                        np.concatenate([np.full(len(c), 1.0 / (len(c) * len(kept)), np.float32) for _, c in kept]),
                        np.concatenate([np.full(len(c), d) for d, c in kept])))
    return out


def _batch(views: np.ndarray):
    """Views [B, h, w] (one channel) or [B, C, h, w] as a float tensor [B, C, h, w]."""
    import torch

    low = torch.from_numpy(views.astype(np.float32))
    return low[:, None] if low.ndim == 3 else low


def _targets_dense(targets, att_shape: tuple[int, int], device):
    """The targets as one dense [B, cells] tensor."""
    import torch

    t = torch.zeros(len(targets), att_shape[0] * att_shape[1])
    for row, (idx, prob, _) in zip(t, targets, strict=True):
        row.index_add_(0, torch.from_numpy(idx), torch.from_numpy(prob))  # a cell may hold two digits whole
    return t.to(device)


def _log_attention(model, views: np.ndarray, att_shape: tuple[int, int], device):
    """log a [B, cells] of the model's attention on these views (-inf off the support, as
    ats train samples it), and the support [B, cells] (None = every cell)."""

    from ats_cli.core.sampling import attention_distribution

    low = _batch(views).to(device)
    keep = sampling_support(model, low, att_shape)
    keep = None if keep is None else keep.flatten(1)
    return attention_distribution(attention_net(model)(low), support=keep, log=True), keep


def train_attention(model, views: np.ndarray, targets, att_shape: tuple[int, int], *, epochs: int, lr: float,
                    batch_size: int, seed: int, device, log=print) -> None:
    """Fit the attention net's distribution to ``targets`` (cross-entropy), on the views."""
    import torch

    net = attention_net(model)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * -(-len(views) // batch_size))
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(1, epochs + 1):
        net.train()
        order, total, t0 = torch.randperm(len(views), generator=gen).numpy(), 0.0, time.time()
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            log_a, keep = _log_attention(model, views[idx], att_shape, device)
            if keep is not None:  # 0 * -inf: the target is 0 wherever the support is not
                log_a = log_a.masked_fill(~keep, 0.0)
            loss = -(_targets_dense([targets[j] for j in idx], att_shape, device) * log_a).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        log(f"attention epoch {epoch}: cross-entropy {total / len(views):.3f}, {time.time() - t0:.0f}s")


def attention_masses(model, views: np.ndarray, targets, att_shape: tuple[int, int], device
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per image, the attention's mass on the digits' cells, and the largest digit's mass
    over the smallest's (1 = every digit weighs alike); images without a target are skipped."""
    import torch

    mass, ratio = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(views), 64):
            probs = _log_attention(model, views[i : i + 64], att_shape, device)[0].exp().cpu().numpy()
            for row, (idx, _, digit) in zip(probs, targets[i : i + 64], strict=True):
                if len(idx):
                    per_digit = np.bincount(digit, weights=row[idx])[np.unique(digit)]
                    mass.append(per_digit.sum())
                    ratio.append(per_digit.max() / max(per_digit.min(), 1e-12))
    return np.array(mass), np.array(ratio)


def attention_report(model, views: np.ndarray, targets, att_shape: tuple[int, int], device) -> str:
    """One line: the median mass on the objects, and the median largest/smallest object's mass."""
    mass, ratio = attention_masses(model, views, targets, att_shape, device)
    if not len(mass):
        return "no image with a region whole inside a cell's patch, nothing to measure"
    return (f"attention mass on the digits median {100 * np.median(mass):.0f}%, largest/smallest digit "
            f"{np.median(ratio):.1f}")


def attention_shape(model, path: str, scale: float, device, channels: int = 1) -> tuple[int, int]:
    """The attention map's shape on the views of a set (every Megapixel MNIST image of a set
    has one size)."""
    import torch

    from ats_cli.core.source import low_res_size
    from ats_cli.data.images import open_pil

    with open_pil(path) as im:
        width, height = im.size
    low = torch.zeros(1, channels, *low_res_size((height, width), scale), device=device)
    with torch.no_grad():
        return tuple(attention_net(model)(low).shape[-2:])
