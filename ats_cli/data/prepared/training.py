"""``ats train --prepare`` (the default): the dataset prepared before the first epoch, once.

Before the first epoch rather than during it: the preparation then runs in as many
processes as the loader has workers, reports what it did (and what it could not read,
by name) in one line before any training, and the first epoch already reads prepared
entries. Everything that goes wrong with the store itself (a full disk, a directory that
cannot be written) costs one warning and the run trains from the source files, which
gives the same result, only slower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ats_cli.data.prepared.prepare import prepare
from ats_cli.data.prepared.store import PreparedStore, store_folder

__all__ = ["prepare_for_run"]


def prepare_for_run(enabled: bool, data: Any, reading: dict[str, Any], *, workers: int = 1,
                    log: Callable[[str], None] = print, splits: Sequence[str] | None = None) -> PreparedStore | None:
    """The prepared store the run's datasets read from (prepared now where needed), or
    None: not ``enabled`` (``--no-prepare``), ``ATS_PREPARED=off``, every file read lazily anyway (a reader,
    level or mpp asked for), or no store could be made. ``data``: the loaded
    :class:`~ats_cli.data.dataset.Dataset`; ``reading``: the datasets' reading options."""
    if not enabled or any(reading.get(k) is not None for k in ("reader", "level", "mpp")):
        return None
    folder, why = store_folder(data.root)
    if folder is None:
        log(f"not preparing the images: {why}")
        return None
    store = PreparedStore(folder, data.root, channels=reading["channels"], scale=reading["scale"])
    sources = [r.path for split in (splits or list(data.splits)) for r in data.splits[split]]
    if not any(store.applies(s) for s in sources):
        return None
    try:
        report = prepare(store, sources, workers=max(1, workers), log=log)
    except OSError as e:
        log(f"warning: cannot prepare the images in {folder} ({e.strerror or e}); reading the source files "
            "(same results, slower; --no-prepare hides this)")
        return store  # whatever entries exist are used, the rest is read from the sources
    if report.prepared or report.restamped or report.failed or report.no_room:
        log(report.line() + ("" if why == "beside the dataset" else f" ({why})"))
    return store
