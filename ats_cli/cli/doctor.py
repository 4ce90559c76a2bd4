"""`ats doctor`: what this installation will run on, and why (versions, devices, kernels)."""

from __future__ import annotations

import importlib.metadata
import platform

import typer
from rich.table import Table

from ats_cli.cli import OutputConsole, app


@app.command()
def doctor(
    build: bool = typer.Option(False, "--build", help="Build the native patch kernels now instead of on first use."),
) -> None:
    """Show versions, devices and which patch-extraction path (native kernel or torch) each device uses."""
    import torch

    from ats_cli import __version__
    from ats_cli.core import native

    table = Table(title="ats doctor", show_header=False)
    table.add_row("ats", __version__)
    table.add_row("python", platform.python_version())
    cuda = torch.version.cuda or "none"
    table.add_row("torch", f"{torch.__version__} (CUDA {cuda}), {torch.get_num_threads()} threads")
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    table.add_row("GPUs", ", ".join(gpus) or "none visible")
    try:  # its version only: importing it (its models, its C ops) took 4 s of the doctor's start, for a package
        # ats loads only for a --feature-net torchvision:ARCH (ats_cli/nets/encoders.py), which says so if it fails
        table.add_row("torchvision", importlib.metadata.version("torchvision"))
    except importlib.metadata.PackageNotFoundError:
        table.add_row("torchvision", "not installed (needed only for --feature-net torchvision:ARCH)")
    for name in ("openslide", "tifffile", "PIL"):
        try:
            module = __import__(name)
            version = getattr(module, "__version__", "?")
            if name == "openslide":
                version = f"{version} (library {getattr(module, '__library_version__', '?')})"
            table.add_row(name, version)
        except Exception as exc:  # noqa: BLE001 - report, don't crash: this is the diagnostic tool
            table.add_row(name, f"[red]unavailable[/red] ({type(exc).__name__}: {exc})")
    for device, line in native.status(try_build=build).items():
        if "on first use" in line and native.is_built(device == "cuda"):
            # status() speaks of this process, which has not loaded the kernel yet; the cache
            # line below says it is built, and the first use loads that build in milliseconds
            line = "native kernel (built; loaded on first use)"
        table.add_row(f"patches on {device}", line)
    for cuda in (False, True) if torch.cuda.is_available() else (False,):
        state = ("built" if native.is_built(cuda)
                 else "not built yet: compiled on first use, or now with `ats doctor --build`")
        table.add_row(f"kernel cache ({'cuda' if cuda else 'cpu'})", f"{native.build_dir(cuda)} ({state})")
    OutputConsole().print(table)
