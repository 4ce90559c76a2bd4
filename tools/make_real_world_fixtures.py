#!/usr/bin/env python
"""Regenerate tests/data/real-world/: small slides written by the tools labs use.

Fixtures written by tifffile only test tifffile's own idea of a TIFF. These files come
from the writers real slides come from, each with its own habits: libvips (`vips
tiffsave`, what many conversion pipelines use) writes JPEG tiles in YCbCr with JPEG
tables, resolution in pixels per centimetre or inch, reduced levels as separate IFDs or
as SubIFDs, BigTIFF on request; Aperio's JPEG 2000 "YCbCr" tiles (TIFF compression 33003)
are raw J2K codestreams of Y, Cb and Cr with the chroma halved across (4:2:2) and no
colour transform, which OpenJPEG's `opj_compress` writes the same way from raw planes.

CI does not run this (neither tool is installed there): the files are committed and
`tests/test_real_world_files.py` compares what the readers return with
:func:`source_image`, recomputed from its formula. Formats whose writer is tifffile
anyway (OME-TIFF, JPEG 2000 RGB SVS, 16-bit and multi-channel TIFFs) are generated in
the tests instead.

    apt-get install -y libvips-tools libopenjp2-tools
    PYTHONPATH=. python tools/make_real_world_fixtures.py [--out tests/data/real-world]

Regenerating with other versions of the tools gives other bytes (and can move the JPEG
error within the tests' tolerance); the tests only rely on what the files declare.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "real-world"
MAIN = (601, 1001)  # odd sizes: vips' level sizes round down, edge tiles are partial
SMALL = (301, 501)
APERIO_TILE = 240  # Aperio's JPEG 2000 tile size


def source_image(h: int, w: int) -> np.ndarray:
    """[h, w, 3] uint8: the pixels every fixture encodes, from a formula so the tests can
    recompute them. Pinkish "tissue" with slow gradients (a tile put in the wrong place
    differs by tens of levels), fine stripes, and dark "nuclei" whose edges make a
    one-pixel shift visible; no random numbers, whose streams may change with numpy."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 235 - 70 * (y / h) + 8 * np.sin(x / 7.0)
    g = 190 - 90 * (x / w) + 8 * np.sin((x + y) / 5.0)
    b = 215 - 35 * np.sin(y / 23.0) * np.cos(x / 31.0)
    img = np.stack([r, g, b], -1)
    cy, cx = y // 32, x // 32  # one nucleus in two of three 32-px cells, placed by a hash of the cell
    hy = (cy * 7919 + cx * 104729) % 13 - 6
    hx = (cy * 6271 + cx * 3571) % 13 - 6
    nucleus = ((y - (cy * 32 + 16 + hy)) ** 2 + (x - (cx * 32 + 16 + hx)) ** 2 <= 30) & ((cy * 31 + cx * 17) % 3 != 0)
    img[nucleus] = img[nucleus] * np.array([0.45, 0.3, 0.65])
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def block_mean(img: np.ndarray, f: int) -> np.ndarray:
    """``img`` reduced ``f`` times by averaging f x f blocks, the last partial block dropped
    (as vips' pyramid levels and the Aperio fixture's level 1 are made)."""
    h, w = img.shape[0] // f, img.shape[1] // f
    return img[: h * f, : w * f].astype(np.float64).reshape(h, f, w, f, -1).mean((1, 3))


def rgb_to_ycbcr(rgb: np.ndarray) -> np.ndarray:
    """JFIF (full-range BT.601) YCbCr, what Aperio's 33003 tiles hold."""
    r, g, b = (rgb[..., i].astype(np.float64) for i in range(3))
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = 128 - 0.168736 * r - 0.331264 * g + 0.5 * b
    cr = 128 + 0.5 * r - 0.418688 * g - 0.081312 * b
    return np.clip(np.round(np.stack([y, cb, cr], -1)), 0, 255).astype(np.uint8)


def _run(*cmd: str) -> None:
    print("+", " ".join(cmd))
    subprocess.run(cmd, check=True)


def vips_fixtures(out: Path, tmp: Path) -> None:
    from PIL import Image

    main, small = tmp / "main.png", tmp / "small.png"
    Image.fromarray(source_image(*MAIN)).save(main)
    Image.fromarray(source_image(*SMALL)).save(small)
    tiles = ("--tile", "--tile-width", "256", "--tile-height", "256", "--compression", "jpeg")
    # vips takes --xres/--yres in pixels per millimetre and writes pixels per centimetre
    # (ResolutionUnit 3) unless --resunit inch: 4000 px/mm is 0.25 um/px.
    _run("vips", "tiffsave", str(main), str(out / "vips-jpeg-pyramid.tif"), *tiles, "--pyramid",
         "--xres", "4000", "--yres", "4000")
    _run("vips", "tiffsave", str(small), str(out / "vips-bigtiff.tif"), *tiles, "--pyramid", "--bigtiff",
         "--resunit", "inch", "--xres", "2004.008", "--yres", "2004.008")  # 0.499 um/px, as px/inch
    _run("vips", "tiffsave", str(small), str(out / "vips-subifd.tif"), *tiles, "--pyramid", "--subifd",
         "--xres", "2000", "--yres", "2000")  # 0.5 um/px; levels as SubIFDs, which OpenSlide does not see
    _run("vips", "tiffsave", str(small), str(out / "vips-nonsquare.tif"), *tiles, "--pyramid",
         "--xres", "2000", "--yres", "4000")  # 0.5 um/px across, 0.25 um/px down


def _j2k_ycbcr422(tile_rgb: np.ndarray, tmp: Path) -> bytes:
    """One Aperio 33003 tile: a J2K codestream of Y, Cb, Cr planes, chroma halved across."""
    ycc = rgb_to_ycbcr(tile_rgb)
    h, w = ycc.shape[:2]
    raw, j2k = tmp / "tile.raw", tmp / "tile.j2k"
    raw.write_bytes(ycc[..., 0].tobytes() + ycc[:, ::2, 1].tobytes() + ycc[:, ::2, 2].tobytes())
    subprocess.run(["opj_compress", "-i", str(raw), "-o", str(j2k), "-F", f"{w},{h},3,8,u@1x1:2x1:2x1",
                    "-r", "12", "-mct", "0"], check=True, capture_output=True)
    return j2k.read_bytes()


def _tiles(img: np.ndarray, t: int):
    """Full-size tiles in row-major order, edge tiles padded by repeating the last pixels."""
    h, w = img.shape[:2]
    padded = np.pad(img, ((0, -h % t), (0, -w % t), (0, 0)), mode="edge")
    for r in range(0, h, t):
        for c in range(0, w, t):
            yield padded[r : r + t, c : c + t]


def aperio_jp2k_fixture(out: Path, tmp: Path) -> None:
    """An SVS laid out as Aperio's: level 0 (tiled), thumbnail (stripped), level 1 (4x
    smaller, tiled), label and macro; tiles are 33003 codestreams from opj_compress."""
    import tifffile

    h, w = SMALL
    img = source_image(h, w)
    level1 = np.round(block_mean(img, 4)).astype(np.uint8)
    head = "Aperio Image Library v12.0.15 \r\n"
    desc = f"{head}{w}x{h} [0,0 {w}x{h}] ({APERIO_TILE}x{APERIO_TILE}) J2K/YUV16 Q=70|AppMag = 20|MPP = 0.4990"
    with tifffile.TiffWriter(out / "aperio-jp2k-33003.svs") as tw:
        for k, lv in enumerate((img, level1)):
            codestreams = [_j2k_ycbcr422(t, tmp) for t in _tiles(lv, APERIO_TILE)]
            tw.write(iter(codestreams), shape=lv.shape, dtype=np.uint8, tile=(APERIO_TILE, APERIO_TILE),
                     compression=33003, photometric="rgb", description=desc if k == 0 else None, metadata=None)
            if k == 0:
                thumb = np.round(block_mean(img, 8)).astype(np.uint8)
                tw.write(thumb, photometric="rgb", compression="jpeg", metadata=None,
                         description=f"{head}{w}x{h} -> {thumb.shape[1]}x{thumb.shape[0]} - |AppMag = 20|MPP = 0.4990")
        tw.write(np.full((60, 80, 3), 200, np.uint8), photometric="rgb", compression="lzw", rowsperstrip=16,
                 subfiletype=1, description=f"{head}label 80x60", metadata=None)
        tw.write(np.full((60, 160, 3), 150, np.uint8), photometric="rgb", compression="jpeg", rowsperstrip=16,
                 subfiletype=9, description=f"{head}macro 160x60", metadata=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    missing = [tool for tool in ("vips", "opj_compress") if shutil.which(tool) is None]
    if missing:
        print(f"needs {' and '.join(missing)}: apt-get install -y libvips-tools libopenjp2-tools", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        vips_fixtures(args.out, Path(tmp))
        aperio_jp2k_fixture(args.out, Path(tmp))
    for path in sorted(args.out.iterdir()):
        print(f"{path.stat().st_size:>8,}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
