"""Draw an `ats` attention GeoJSON over its image's thumbnail, from the GeoJSON file alone.

    .venv/bin/python tools/render_geojson.py SLIDE.geojson SLIDE.tif OUT.png [--max-side 1024] [--colors 256]

It shows what QuPath shows after File > Import objects: the attention cells filled in the
colours the file gives them, the sampled patches outlined and numbered in draw order, the
boxes a dataset CSV records (dashed) and a colour bar for the cells. docs/img/qupath-geojson.png
is made with it (docs/slides.md, "Attention in QuPath").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ats_cli.geojson import render_geojson  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("geojson", type=Path)
    parser.add_argument("image", type=Path, help="the image or slide the GeoJSON was made from")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--max-side", type=int, default=1024, help="thumbnail size (pixels, longer side)")
    parser.add_argument("--colors", type=int, default=256,
                        help="save with a palette of this many colours, dithered (a quarter of the bytes for the "
                             "docs); 0 = full colour")
    args = parser.parse_args(argv)
    width, height = render_geojson(args.geojson, args.image, args.out, max_side=args.max_side)
    if args.colors:
        import io

        from PIL import Image

        from ats_cli.io import atomic_write_bytes

        with Image.open(args.out) as im:
            small = im.convert("RGB").quantize(colors=args.colors, method=Image.Quantize.FASTOCTREE,
                                               dither=Image.Dither.FLOYDSTEINBERG)
        buffer = io.BytesIO()
        small.save(buffer, format="PNG", optimize=True)
        atomic_write_bytes(args.out, buffer.getvalue())
    print(f"wrote {args.out} ({width}x{height} px, {args.out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
