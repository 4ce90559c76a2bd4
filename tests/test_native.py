"""The native patch kernels (csrc/) against the torch path, and the fallback when they cannot be built.

The C++ kernel is tested here on every machine with a compiler. The CUDA tests need a GPU
and skip cleanly without one; on one they check the kernel bit for bit against the torch
path on the same device across dtypes, layouts, borders and random shapes.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest
import torch

from ats_cli.core import extract_patches, native
from ats_cli.core.patches import extract_patches_torch

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64]
pytestmark = pytest.mark.uses_cuda  # the CUDA kernel tests use the GPU where there is one
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cpu_kernel():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the torch path is used (tested in test_patches.py)")
    return native.build(cuda=False)  # a machine with a compiler must build it: fail loudly if not


@pytest.fixture(scope="module")
def cuda_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return native.build(cuda=True)


def random_case(g: torch.Generator, dtype: torch.dtype, layout: str, device: str = "cpu"):
    B, C = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    H, W = (int(v) for v in torch.randint(1, 70, (2,), generator=g))
    h, w = (int(v) for v in torch.randint(1, 30, (2,), generator=g))
    n = int(torch.randint(1, 12, (1,), generator=g))
    images = (torch.rand(B, C, H, W, generator=g) * 255).to(dtype)
    if layout == "channels_last":
        images = images.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # a view with gaps: every other column of a wider image
        wide = (torch.rand(B, C, H, 2 * W, generator=g) * 255).to(dtype)
        images = wide[..., ::2]
    elif layout == "cropped":  # contiguous rows at odd addresses: a crop one column in of a wider image
        wide = (torch.rand(B, C, H, W + 3, generator=g) * 255).to(dtype)
        images = wide[..., 1:W + 1]
    # Offsets inside, across every border, and wholly outside the image.
    offsets = torch.stack(
        [torch.randint(-h - 3, H + 3, (B, n), generator=g), torch.randint(-w - 3, W + 3, (B, n), generator=g)], -1
    )
    return images.to(device), offsets.to(device), (h, w)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "cropped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_kernel_equals_torch_path_bit_for_bit(cpu_kernel, dtype, layout):
    g = torch.Generator().manual_seed(10 * DTYPES.index(dtype) + len(layout))
    for _ in range(20):
        images, offsets, (h, w) = random_case(g, dtype, layout)
        expected = extract_patches_torch(images, offsets, (h, w))
        got = cpu_kernel.extract(images, offsets, h, w)
        assert got.shape == expected.shape and got.dtype == dtype
        assert torch.equal(got, expected), (tuple(images.shape), tuple(offsets.shape), (h, w))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cpu_kernel_backward_is_the_scatter_add(cpu_kernel, layout):
    """Overlapping patches accumulate: the gradient equals autograd through the torch path."""
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        images, offsets, size = random_case(g, torch.float64, layout)
        images.requires_grad_(True)
        grad = torch.randn(*offsets.shape[:2], images.shape[1], *size, dtype=torch.float64, generator=g)
        (expected,) = torch.autograd.grad((extract_patches_torch(images, offsets, size) * grad).sum(), images)
        (got,) = torch.autograd.grad((native.ExtractPatches.apply(cpu_kernel, images, offsets, *size) * grad).sum(),
                                     images)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_extract_patches_uses_the_native_kernel_and_reports_it(cpu_kernel, monkeypatch):
    monkeypatch.delenv("ATS_NATIVE", raising=False)
    images = torch.arange(2 * 3 * 20 * 20, dtype=torch.float32).reshape(2, 3, 20, 20)
    offsets = torch.tensor([[[-2, 5], [10, 15]], [[0, 0], [19, -4]]])
    assert native.kernel_for(images) is not None
    assert native.status()["cpu"].startswith("native kernel")
    assert torch.equal(extract_patches(images, offsets, (4, 6)), extract_patches_torch(images, offsets, (4, 6)))


def test_ats_native_0_selects_the_torch_path(monkeypatch):
    monkeypatch.setenv("ATS_NATIVE", "0")
    assert native.kernel_for(torch.zeros(1, 1, 4, 4)) is None
    assert native.status()["cpu"] == "torch path (ATS_NATIVE=0)"


def test_a_failed_build_falls_back_with_one_log_line(monkeypatch, caplog):
    """No compiler, no nvcc, a broken toolkit: extraction still works and says why, once."""
    monkeypatch.delenv("ATS_NATIVE", raising=False)
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(native, "_reasons", {})

    def broken(cuda: bool, verbose: bool = False):
        raise RuntimeError("Error building extension 'ats_patches_cpu': c++: not found")

    monkeypatch.setattr(native, "build", broken)
    images = torch.rand(1, 2, 16, 16)
    offsets = torch.tensor([[[3, -2], [12, 12]]])
    with caplog.at_level(logging.WARNING, logger="ats_cli.core.native"):
        first = extract_patches(images, offsets, (5, 5))
        second = extract_patches(images, offsets, (5, 5))
    assert torch.equal(first, extract_patches_torch(images, offsets, (5, 5))) and torch.equal(first, second)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "c++: not found" in warnings[0].getMessage()
    assert native.status()["cpu"].startswith("torch path: build failed (RuntimeError")


def test_ats_doctor_reports_the_patch_paths(monkeypatch):
    from typer.testing import CliRunner

    from ats_cli.cli import app

    monkeypatch.setenv("ATS_NATIVE", "0")
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "patches on cpu" in result.output and "ATS_NATIVE=0" in result.output


def test_the_cuda_gather_chunk_logic_on_the_host(tmp_path):
    """The CUDA forward's per-chunk code (csrc/ats_patches_wide.cuh: 16 bytes per thread,
    realigned word loads) compiled for the host and compared with the definition on 6,000
    random cases (csrc/check_wide.cpp): its logic is checked on every machine with a C++
    compiler, a GPU or not."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path / "check_wide"
    subprocess.run([compiler, "-O2", "-std=c++17", "-I", str(native.CSRC), str(native.CSRC / "check_wide.cpp"),
                    "-o", str(binary)], check=True, capture_output=True)
    done = subprocess.run([str(binary)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("0 of 6000"), done.stdout


# ---- CUDA: these run only where a GPU is present ------------------------------------------


@needs_gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "cropped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernel_equals_torch_path_bit_for_bit(cuda_kernel, dtype, layout):
    g = torch.Generator().manual_seed(100 + 10 * DTYPES.index(dtype) + len(layout))
    for _ in range(20):
        images, offsets, (h, w) = random_case(g, dtype, layout, device="cuda")
        expected = extract_patches_torch(images, offsets, (h, w))
        got = cuda_kernel.extract(images, offsets, h, w)
        assert got.device == images.device and torch.equal(got, expected)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_cuda_kernel_backward(cuda_kernel, dtype):
    g = torch.Generator().manual_seed(5)
    images, offsets, size = random_case(g, dtype, "contiguous", device="cuda")
    images.requires_grad_(True)
    grad = torch.randn(*offsets.shape[:2], images.shape[1], *size, generator=g).to("cuda", dtype)
    (expected,) = torch.autograd.grad((extract_patches_torch(images, offsets, size) * grad).sum(), images)
    (got,) = torch.autograd.grad((extract_patches(images, offsets, size) * grad).sum(), images)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)  # atomics add in another order
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@needs_gpu
def test_cuda_kernel_on_another_device_and_a_side_stream(cuda_kernel):
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    g = torch.Generator().manual_seed(7)
    images, offsets, size = random_case(g, torch.float32, "contiguous")
    images, offsets = images.to(device), offsets.to(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(0), torch.cuda.stream(stream):
        got = cuda_kernel.extract(images, offsets, *size)
    stream.synchronize()
    assert got.device == device and torch.equal(got, extract_patches_torch(images, offsets, size))


@needs_gpu
def test_cuda_kernel_64_bit_indexing():
    """An image with more than 2**31 elements: offsets near its end must not wrap around."""
    if torch.cuda.get_device_properties(0).total_memory < 8 * 2**30:
        pytest.skip("needs 8 GB of GPU memory")
    kernel = native.build(cuda=True)
    H = W = 47_000  # 2.2e9 elements > 2**31
    images = torch.zeros(1, 1, H, W, dtype=torch.uint8, device="cuda")
    images[0, 0, H - 10 :, W - 10 :] = 7
    offsets = torch.tensor([[[H - 10, W - 10], [0, 0]]], device="cuda")
    got = kernel.extract(images, offsets, 10, 10)
    assert bool((got[0, 0] == 7).all()) and bool((got[0, 1] == 0).all())
