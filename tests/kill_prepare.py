"""``kill -9`` of ``ats make-dataset prepare`` at random moments, each followed by a
preparation that must complete with the same prepared content as an uninterrupted one.

Used by tests/test_fault_locks.py with a few kills (the suite's time); the full loop:

    PYTHONPATH=. python tests/kill_prepare.py [KILLS] [SEED]     # default 20 kills

It prints one line per kill (when it came, what the killed run had left, what the next
run said) and exits non-zero on the first failure: a preparation that hangs (the lock of
a killed preparer, or of its orphaned workers), a worker that outlives its parent, or
prepared content that differs from the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ATS = [sys.executable, "-m", "ats_cli"]
PREFIX = struct.Struct("<8sQQ")
FINISH_S = 120  # a preparation after a kill must finish within this (it takes a few seconds)
VOLATILE = ("mtime_ns", "ctime_ns", "stamped_ns", "header_crc")  # when it was stamped (and the CRC over it)


def make_dataset(root: Path, n: int = 24, size: int = 768) -> Path:
    """``n`` training + 4 test PNGs of noise (``n`` >= 16: preparing then uses worker processes)."""
    from ats_cli.data.dataset import write_dataset

    rng = np.random.default_rng(0)
    rows = {}
    for split, k in (("train", n), ("test", 4)):
        (root / split).mkdir(parents=True, exist_ok=True)
        rows[split] = []
        for i in range(k):
            Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8)).save(root / split / f"{i}.png")
            rows[split].append({"path": f"{split}/{i}.png", "label": "ab"[i % 2]})
    write_dataset(root, ["a", "b"], rows, hints={"channels": 1})
    return root


def content(store: Path) -> dict[str, tuple[bytes, dict]]:
    """Every entry of a prepared store: its pixels, view and index as bytes, and its header
    without the stamp's times (a re-stamped entry holds the same pixels)."""
    out = {}
    for path in sorted(store.glob("*.atsp")):
        data = path.read_bytes()
        _, at, length = PREFIX.unpack(data[:PREFIX.size])
        header = json.loads(data[at:at + length])
        out[path.name] = (data[PREFIX.size:at], {k: v for k, v in header.items() if k not in VOLATILE})
    return out


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def command(data: Path) -> list[str]:
    """The preparation every run here makes: the killed ones and the ones that finish alike
    (entries are named by the scale: a killed run at another scale leaves other entries)."""
    return [*ATS, "make-dataset", "prepare", str(data), "--workers", "2", "--scale", "0.25"]


def prepare(data: Path, env: dict, timeout: float = FINISH_S) -> subprocess.CompletedProcess:
    return subprocess.run(command(data), capture_output=True, text=True, env=env, timeout=timeout)


def kill_loop(data: Path, kills: int, seed: int = 0, say=print) -> list[dict]:
    """Kill a preparation of ``data`` ``kills`` times at random moments, each followed by a
    preparation that completes; raises AssertionError on the first failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("ATS_PREPARED", None)
    store = data / ".ats-prepared"
    shutil.rmtree(store, ignore_errors=True)
    start = time.monotonic()
    done = prepare(data, env)
    whole = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    reference = content(store)
    work = float(done.stdout.split(" in ")[-1].split(" s;")[0]) if " s;" in done.stdout else whole / 4
    assert len(reference) == len(list(data.glob("*/*.png"))), "the uninterrupted preparation left files out"
    rng = random.Random(seed)
    results = []
    for k in range(kills):
        shutil.rmtree(store, ignore_errors=True)
        proc = subprocess.Popen(command(data), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        if k % 2 == 0:  # any moment of the run: starting, locking, preparing, reporting
            at = rng.uniform(0.0, whole)
            time.sleep(at)
        else:  # a moment while its workers prepare (it holds the lock)
            t0 = time.monotonic()
            while len(children(proc.pid)) < 2 and time.monotonic() - t0 < FINISH_S and proc.poll() is None:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, work))
            at = time.monotonic() - t0
        workers = children(proc.pid)
        left = len(list(store.glob("*.atsp"))) if store.is_dir() else 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        orphans = [pid for pid in workers if alive(pid)]
        for pid in orphans:  # ours: never left running, whatever the verdict
            os.kill(pid, signal.SIGKILL)
        assert not orphans, f"kill {k + 1}: workers {orphans} outlived their killed parent"
        try:
            after = prepare(data, env)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kill {k + 1} at {at:.2f} s: the next preparation did not finish in "
                                 f"{FINISH_S} s") from None
        assert after.returncode == 0, after.stdout + after.stderr
        same = content(store) == reference
        line = (after.stdout + after.stderr).strip().splitlines()
        result = {"kill": k + 1, "at_s": round(at, 2), "workers": len(workers), "entries_left": left,
                  "next": line[-1][:150] if line else "", "took_over": any("taking over" in x for x in line),
                  "same_content": same}
        say(json.dumps(result))
        assert same, f"kill {k + 1} at {at:.2f} s: the prepared content differs from the uninterrupted run's"
        results.append(result)
    return results


if __name__ == "__main__":
    import tempfile

    kills = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        results = kill_loop(make_dataset(Path(tmp) / "data"), kills, seed)
        print(f"{len(results)} kills, each followed by a preparation that completed with the same content "
              f"({sum(r['workers'] > 0 for r in results)} with workers running, "
              f"{sum(r['took_over'] for r in results)} lock take-overs) in {time.monotonic() - t0:.0f} s")
