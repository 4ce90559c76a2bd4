"""What made a predictions file, and who may write it: ``FILE.ats.json`` and ``FILE.ats.lock``.

A predictions CSV holds numbers only; nothing in it says which model, seed or sample
count produced them. Without that, a rerun with another model found "20 of 20 already
done" and kept the old rows, and an interrupted run resumed with other settings mixed
two models' rows in one file, all with exit status 0. So every ``--out FILE`` gets a
**record** next to it, ``FILE.ats.json`` (written atomically before the first row), that
every resume compares with its own before it counts a row of ``FILE`` or of a part file
as done:

* ``model``: the checkpoint's path (for people) and ``settings.model_sha256``, the
  sha256 of the checkpoint file (what decides: a retrained ``best.pt`` at the same path
  is another model);
* ``classes``: the model's class names (the CSV's columns);
* ``settings`` (:func:`settings`): whatever changes a probability: the effective
  n_patches, estimator, samples, batch_size, seed and reading options;
* ``inputs``: how many inputs and the sha256 of their absolute paths in order, so the
  file answers for one list of inputs.

A record that differs, or a CSV with rows and no record (written by something else, or
by an ats that kept none), is refused (:class:`ats_cli.predict.cohort.CohortError`, one
line naming the file, ``--overwrite`` and another ``--out``).

One writer at a time: the process that writes ``FILE`` (rank 0) holds ``FILE.ats.lock``
from before it reads what is there until the CSV is merged: the lock of ``ats train``'s
run directories (:class:`ats_cli.runtime.RunLock`: an OS lock the OS drops when the
process dies, however it dies), taken on a file next to ``FILE`` rather than on the whole
directory, so that two outputs in one folder do not block each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ats_cli.io import atomic_write_text
from ats_cli.runtime import RunDirError, RunLock, _holder_text

__all__ = ["RECORD_FORMAT", "OutLock", "inputs_digest", "lock_path", "model_digest", "read_record", "record",
           "record_differences", "record_path", "settings", "write_record"]

RECORD_FORMAT = "ats-predictions/1"
SETTINGS = ("n_patches", "estimator", "samples", "batch_size", "seed", "device")


def record_path(out: str | os.PathLike[str]) -> Path:
    out = Path(out)
    return out.with_name(f"{out.name}.ats.json")


def lock_path(out: str | os.PathLike[str]) -> Path:
    out = Path(out)
    return out.with_name(f"{out.name}.ats.lock")


def model_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of the checkpoint file: the same bytes are the same model, wherever they lie.
    A model directory in the Hub's form (:mod:`ats_cli.hub`): of its config and weights,
    each name before its bytes (its model card changes no probability)."""
    from ats_cli.hub import CONFIG, WEIGHTS

    path = Path(path)
    files = [path / CONFIG, path / WEIGHTS] if path.is_dir() else [path]
    h = hashlib.sha256()
    for file in files:
        if path.is_dir():
            h.update(f"{file.name}\n".encode())
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023  (read before the next file)
                h.update(block)
    return h.hexdigest()


def inputs_digest(keys: Sequence[str]) -> str:
    """sha256 of the inputs' keys (absolute paths), in order."""
    return hashlib.sha256("\n".join(keys).encode("utf-8")).hexdigest()


def settings(model_sha256: str, values: Mapping[str, Any], reading: Mapping[str, Any], world_size: int
             ) -> dict[str, Any]:
    """The settings that change a probability, as recorded in the record and in every
    part file's first line. ``values``: the effective n_patches, estimator, samples,
    batch_size and seed, and the device type (``cpu``, ``cuda``: the same seed draws other
    patches from a CUDA generator than from a CPU one); ``reading``: the options inputs
    are opened with.

    Left out on purpose: ``max_pixels`` (it decides whether an input is read at all, not
    what a read input predicts: a rerun with a larger budget may retry the inputs that
    were refused), which GPU, and prefetching. The number of processes is left out with
    ``batch_size`` 1: the sampling generator is re-seeded with ``seed`` for every batch,
    whatever the rank or the number of ranks, so each input's draws are its own. With a
    larger batch_size it is recorded: ranks batch their own share, so the number of
    processes decides which inputs share a batch, and with it their draws."""
    out = {"model_sha256": model_sha256, **{k: values[k] for k in SETTINGS},
           "reading": {k: v for k, v in sorted(reading.items()) if k != "max_pixels"}}
    if values["batch_size"] > 1:
        out["world_size"] = world_size
    if values.get("threshold") is not None:  # multi-label: it decides the prediction column
        out["threshold"] = values["threshold"]
    return json.loads(json.dumps(out))  # as read back from JSON, so that records compare equal


def record(model_path: str | os.PathLike[str], classes: Sequence[str], settings: Mapping[str, Any],
           input_keys: Sequence[str]) -> dict[str, Any]:
    """The record of this run (see the module docstring)."""
    return {"format": RECORD_FORMAT, "model": str(Path(model_path).resolve()), "classes": list(classes),
            "settings": dict(settings), "inputs": {"count": len(input_keys), "sha256": inputs_digest(input_keys)}}


def read_record(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``out``'s record, None when there is none; ValueError for one that is not a record."""
    path = record_path(out)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path}: not a record of ats predict")
    return data


def record_differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> str:
    """What differs between two records, in words ('' when they describe the same run)."""
    said = []
    a, b = theirs.get("settings") or {}, ours.get("settings") or {}
    if a.get("model_sha256") != b.get("model_sha256"):
        said.append(f"another model ({_model(theirs)}; now {_model(ours)})")
    if list(theirs.get("classes") or []) != list(ours.get("classes") or []):
        said.append(f"classes {','.join(map(str, theirs.get('classes') or []))[:60]}")
    said += [f"{k} {a.get(k)!r} (now {b.get(k)!r})" for k in sorted(set(a) | set(b))
             if k != "model_sha256" and a.get(k) != b.get(k)]
    ia, ib = theirs.get("inputs") or {}, ours.get("inputs") or {}
    if ia.get("sha256") != ib.get("sha256"):
        said.append(f"another list of inputs ({ia.get('count')}; now {ib.get('count')})")
    return ", ".join(said[:3])


def _model(rec: Mapping[str, Any]) -> str:
    digest = f"sha256 {str((rec.get('settings') or {}).get('model_sha256'))[:12]}"
    return f"{rec['model']}, {digest}" if rec.get("model") else digest


def write_record(out: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``out``'s record atomically; an OSError names the record, not its temporary file."""
    path = record_path(out)
    try:
        atomic_write_text(path, json.dumps(dict(data), indent=1) + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


class OutLock(RunLock):
    """:class:`ats_cli.runtime.RunLock` on ``FILE.ats.lock``: one writer per ``--out FILE``.
    ``acquire()`` raises :class:`RunDirError` naming the live holder, or the reason the
    lock file cannot be written (a full disk: no empty lock file is left behind)."""

    def __init__(self, out: str | os.PathLike[str]):
        super().__init__(Path(out).parent)
        self.out = Path(out)
        self.path = lock_path(out)

    def _busy(self, holder: dict[str, Any] | None) -> RunDirError:
        return RunDirError(f"{self.out}: being written by {_holder_text(holder)} (lock file {self.path}); two runs "
                           "cannot write one --out: wait for it to finish or stop it, or choose another --out")

    def acquire(self) -> OutLock:
        try:
            super().acquire()
        except OSError as e:  # RunLock writes its record into the lock file: a full disk fails there
            with contextlib.suppress(OSError):
                if self.path.stat().st_size == 0:  # ours, never written (a holder's has its record)
                    self.path.unlink()
            raise RunDirError(f"cannot write {self.path}: {e.strerror or e}") from None
        return self


@contextlib.contextmanager
def holding(out: str | os.PathLike[str], enabled: bool = True) -> Iterator[OutLock | None]:
    """Hold ``out``'s lock for the body (``enabled``: on the process that writes ``out``)."""
    if not enabled:
        yield None
        return
    with OutLock(out) as lock:
        yield lock
