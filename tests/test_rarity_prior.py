"""The rarity prior (ats_cli.extensions.prior_rarity, ``ats train --rarity-prior``): what
``rarity`` measures, that it points the untrained attention at the unusual cell, and when
``auto`` turns it on. Its unbiasedness: tests/test_extensions.py."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from ats_cli.config import AUTO_RARITY_PRIOR, TrainConfig, settle, settle_data
from ats_cli.core.model import ATSModel
from ats_cli.core.source import low_res_view
from ats_cli.data.dataset import load_dataset, write_dataset
from ats_cli.data.facts import DataFacts
from ats_cli.extensions.prior_rarity import SELECT_FROM, _median, _median_by_sort, rarity
from ats_cli.nets import create
from ats_cli.recipes import resolve_config


def _tissue(seed=0, size=32) -> torch.Tensor:
    """A pinkish RGB view with texture and one dark purple cell at (20, 11)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.tensor([0.9, 0.6, 0.75])[None, :, None, None] + 0.04 * torch.randn(1, 3, size, size, generator=g)
    low[0, :, 20, 11] = torch.tensor([0.35, 0.2, 0.5])
    return low


def test_the_cpu_median_selects_what_the_device_median_sorts():
    """The CPU path (a selection per row) and the GPU path (one sort, no read-back) give the same
    values: torch.median's lower middle over each row's chosen entries, rows holding different counts."""
    g = torch.Generator().manual_seed(0)
    n = SELECT_FROM + 1  # long rows: the CPU selects (shorter ones sort, as on a GPU)
    values = torch.rand(3, 2, n, generator=g)
    values[0, 0, :10] = 0.5  # ties
    chosen = torch.rand(3, 1, n, generator=g) < torch.tensor([0.9, 0.5, 0.00002])[:, None, None]
    chosen[2, 0, :2] = True  # at least one per row; the last row holds two or three
    got = _median(values, chosen)
    assert torch.equal(got, _median_by_sort(values, chosen))
    for b in range(3):
        for c in range(2):
            assert got[b, c] == values[b, c][chosen[b, 0]].median()
    # negative control: the middle of all the entries is another value where few are chosen
    assert not torch.equal(got[2], values[2].median(-1).values)


def test_with_every_pixel_supported_the_median_and_the_rarity_are_those_of_the_sort():
    """keep None (no support, no tissue mask) takes torch's own median, a selection: the
    same values as the sort over all entries, for short and long rows, odd and even, ties."""
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 7, 600, SELECT_FROM + 2):
        values = torch.rand(4, 3, n, generator=g)
        values[0, 0, : n // 2] = 0.5  # ties
        assert torch.equal(_median(values, None), _median_by_sort(values, torch.ones(1, 1, n, dtype=torch.bool)))
    low = _tissue()
    everywhere = torch.ones(1, 1, 32, 32, dtype=torch.bool)
    assert torch.equal(rarity(low), rarity(low, everywhere))  # the sort's path, every pixel chosen


def test_rarity_is_one_for_a_typical_pixel_high_for_the_odd_one_and_free_of_stain_and_contrast():
    low = _tissue()
    r = rarity(low)
    assert abs(float(r.median()) - 1.0) < 0.05
    assert float(r[0, 0, 20, 11]) > 5 * float(torch.quantile(r.flatten(), 0.99))
    # another lab: darker, lower contrast, shifted stain; the same cells are unusual by the same amount
    restained = 0.6 * low + torch.tensor([0.05, 0.1, 0.0])[None, :, None, None]
    assert torch.allclose(rarity(restained), r, rtol=1e-4, atol=1e-4)


def test_only_the_supported_pixels_set_what_is_typical():
    low = _tissue()
    low[..., :, :16] = 1.0  # white glass on the left half
    glass = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    glass[..., :, 16:] = True  # tissue = right half
    r = rarity(low, glass)
    assert abs(float(r[..., 16:].median()) - 1.0) < 0.05  # measured against the tissue, not the glass
    assert float(r[..., :16].min()) > 3  # glass is far from typical tissue (it is masked out anyway)


def test_the_prior_points_the_untrained_attention_at_the_unusual_cell():
    torch.manual_seed(0)
    kwargs = dict(n_classes=2, n_patches=4, patch_size=(8, 8), scale=0.25)
    low = _tissue()
    for beta, expect_peak in ((0.0, False), (2.0, True)):
        m = ATSModel(create("mnist-attention", in_channels=3, width=4), create("small-cnn", in_channels=3, width=4),
                     prior={"name": "rarity", "weight": beta} if beta else None, **kwargs).eval()
        image = torch.nn.functional.interpolate(low, scale_factor=4).mul(255).clamp(0, 255).to(torch.uint8)
        with torch.no_grad():
            out = m(low_res_view(image, 0.25), image, generator=torch.Generator().manual_seed(0))
        att = out.attention[0]
        if expect_peak:
            margin = m.attention_net.margin
            assert tuple(int(v) for v in divmod(int(att.argmax()), att.shape[1])) == (20 - margin, 11 - margin)
            assert float(att.max()) > 100 * float(att.median())
        else:  # the zero-initialised attention net alone: uniform
            assert torch.allclose(att, torch.full_like(att, 1 / att.numel()))


def _dataset(tmp_path, background: int):
    rng = np.random.default_rng(0)
    rows = {}
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        rows[split] = []
        for i in range(4):
            pixels = (background + 40 * rng.random((64, 64, 3))).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": "a"})
    write_dataset(tmp_path, ["a"], rows, hints={"channels": 3, "scale": 0.25})
    return load_dataset(tmp_path)


def test_auto_turns_the_prior_on_for_slides_and_photographs_and_off_on_a_black_background(tmp_path):
    data = _dataset(tmp_path, background=180)
    for tissue in ("on", "auto"):  # a tissue mask (as on a slide) / a photograph: on both
        cfg = resolve_config(None, data=str(tmp_path), out="o", tissue_mask=tissue)
        assert cfg.rarity_prior == -1
        assert settle_data(cfg, data)[0].config.rarity_prior == AUTO_RARITY_PRIOR
    black = DataFacts(probed=16, dark=0.9)  # Megapixel MNIST's canvas: the brightness support's job
    assert settle(TrainConfig(), black)[0].config.rarity_prior == 0.0
    cfg = resolve_config(None, data=str(tmp_path), out="o", tissue_mask="on", rarity_prior=0.5)  # a value given
    assert settle_data(cfg, data)[0].config.rarity_prior == 0.5
    cfg = resolve_config(None, data=str(tmp_path), out="o", tissue_mask="on", method="uniform")  # as the thesis's
    assert settle_data(cfg, data)[0].config.rarity_prior == 0.0
