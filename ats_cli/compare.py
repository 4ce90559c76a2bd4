"""`ats compare`: train each method on the user's dataset and set accuracy against cost.

Why a command: each paper (attention sampling, Deep MIL, IPS, CLAM) reports on its own
data, and a user choosing between them needs the comparison on theirs, every cost
counted: the wall time from the command to the trained model (data preparation and any
feature extraction included), the peak memory, and the test accuracy reached by then.

What one method's run is: ``ats train DATA --out OUT/METHOD --method METHOD`` with the
settings every method shares (epochs, seed, batch size, the encoder: ``--feature-net``,
``--feature-weights``, ``feature_train``; a recipe, ``--config``, ``--set``), each
method's own defaults otherwise, in a process of its own:

* so that its peak resident set is its own: the process's ``VmHWM`` (Linux; its high-water
  mark since ``exec``), read every :data:`POLL_S` while it runs; not ``ru_maxrss``,
  which the kernel carries across ``exec`` from the parent, so every method would show
  at least this process's size. The training process alone: the loader's worker
  processes are not added;
* so that one method that fails (refused settings, out of memory, killed) costs its row,
  not the comparison: its row says why in one line, the next method starts;
* and it is what the user would run: ``OUT/METHOD`` is an ordinary run directory
  (``ats predict --model OUT/METHOD/best.pt``), its log ``OUT/METHOD.log``.

Each method prepares the images itself, into a store of its own
(``ATS_PREPARED=OUT/.prepared/METHOD``, removed when it ends), so that the first method
does not pay the decoding for the others: every wall time includes its own preparation.
``ATS_PREPARED=off`` in the environment is kept (nothing is prepared, for any method).

Per epoch (``OUT/compare.csv``): the wall time since the process started, taken when
the epoch's line lands in ``metrics.jsonl`` (polled every :data:`POLL_S`; the file's
modification time), the peak RSS so far (``VmHWM`` then), the GPU peak so far (CUDA: the records'
``max_memory_allocated``), and the validation and test accuracy of ``best.pt`` as it is
then: the epoch chosen so far on the validation split (the test split where the dataset
has no val.csv), as ``ats train`` chooses it (:func:`ats_cli.train.selection_score`).
The test figure is that epoch's own evaluation, which is what ``best.pt`` scores.

Resuming (``OUT/compare.json``): each method's record holds the digest of the dataset
(:func:`data_digest`) and the configuration its run was asked for (before anything was
settled from the data). A rerun skips a method that finished with the same two; one that
finished with others is refused (name the difference; ``overwrite`` trains it again); one
that failed or was interrupted is trained again from the start, with a note (a resumed
run's wall time would not be one run's).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ats_cli.io import atomic_save_png, atomic_write_text

__all__ = ["CompareError", "MethodResult", "allowed_methods", "parse_methods", "data_digest", "train_argv",
           "run_compare", "csv_rows", "write_csv", "plot_compare", "STATE", "CSV_COLUMNS"]

STATE, CSV_NAME, PNG_NAME = "compare.json", "compare.csv", "compare.png"
STATE_VERSION = 1
POLL_S = 0.1  # how often a running method's metrics.jsonl is looked at
STOP_GRACE_S = 3.0  # after Ctrl-C, how long a method's process has to stop on its own (_stop)
CSV_COLUMNS = ("method", "epoch", "wall_s", "peak_mb", "gpu_peak_mb", "best_epoch", "val_acc", "test_acc", "error")


class CompareError(ValueError):
    """A comparison that cannot start: an unknown method, or an output directory holding
    finished runs made with other settings or data. One line, naming what to change."""


def allowed_methods() -> tuple[str, ...]:
    """What ``ats train --method`` accepts: the config's allowed values, so a method added
    there is compared without a change here."""
    from ats_cli.config import allowed_values

    return allowed_values()["method"]


def parse_methods(text: str) -> list[str]:
    """``"ats,deepmil"`` as a list in the order given, repeats dropped; an unknown name
    raises CompareError naming it and the methods there are."""
    names = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    allowed = allowed_methods()
    unknown = [m for m in names if m not in allowed]
    if unknown or not names:
        what = f"unknown method(s) {', '.join(unknown)}" if unknown else "no method given"
        raise CompareError(f"--methods {text}: {what}; ats train --method accepts {', '.join(allowed)}")
    return names


def data_digest(root: str | os.PathLike[str]) -> str:
    """A digest of what a comparison's results depend on in the dataset at ``root``: its
    classes and every split's rows (path relative to ``root``, label, in order: the
    identity ``ats train --resume`` checks), ``dataset.json``, and each file's size, so a
    file rewritten in place with other content (of another size) is noticed without
    reading every image. Raises the dataset's own errors (DatasetError) for one that cannot
    be read."""
    from ats_cli.data.dataset import load_dataset
    from ats_cli.runtime import run_data_identity

    data = load_dataset(root)
    h = hashlib.sha256(json.dumps(run_data_identity(data), sort_keys=True).encode())
    meta = Path(root) / "dataset.json"
    if meta.is_file():
        h.update(meta.read_bytes())
    for split in sorted(data.splits):
        for r in data.splits[split]:
            try:
                size = os.stat(r.path).st_size
            except OSError:
                size = -1
            h.update(f"{split}\t{os.path.relpath(r.path, root)}\t{size}\n".encode())
    return h.hexdigest()


@dataclass
class MethodResult:
    """One method's run: ``status`` done, failed or interrupted; ``epochs`` the per-epoch
    rows (:data:`CSV_COLUMNS` less method and error); ``wall_s`` the process's whole wall
    time; ``peak_mb`` its peak RSS; ``error`` why it failed (one line); ``skipped`` True
    when a previous run's record was reused; ``note`` what a rerun did and why."""

    method: str
    status: str
    epochs: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float | None = None
    peak_mb: float | None = None
    gpu_peak_mb: float | None = None
    error: str = ""
    feature_net: str = ""
    feature_train: str = ""
    batch_size: int | None = None
    data_digest: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False
    note: str = ""

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("skipped", "note"):  # of this command's run, not of the method's
            out.pop(key)
        return out

    @classmethod
    def from_record(cls, method: str, record: Mapping[str, Any]) -> MethodResult:
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__ and k != "method"}
        return cls(method=method, **known)

    @property
    def best(self) -> dict[str, Any] | None:
        return self.epochs[-1] if self.epochs else None


def train_argv(data: str | os.PathLike[str], run: str | os.PathLike[str], method: str, *,
               train_args: Sequence[str] = ()) -> list[str]:
    """The ``ats train`` command a method runs (this Python, so the same installation):
    ``train_args`` are the shared settings as ``ats train`` flags."""
    return [sys.executable, "-m", "ats_cli", "train", str(data), "--out", str(run), "--method", method,
            "--overwrite", *train_args]


def _error_line(log: Path, returncode: int) -> str:
    """Why a method's process failed, in one line: the signal that killed it (the kernel's
    SIGKILL: most often out of memory), else its last ``error`` line, else its last line
    (a traceback's: the exception)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
    errors = [ln for ln in lines if ln.lower().startswith("error")]
    line = errors[-1] if errors else (lines[-1] if lines else f"exit status {returncode}")
    line = " ".join(line.split())
    return (line[:237] + "...") if len(line) > 240 else line


def _vm_hwm_mb(pid: int) -> float | None:
    """The process's peak resident set so far (Linux ``VmHWM``), None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _maxrss_mb(ru: Any) -> float:
    """``ru_maxrss`` of a reaped process, where VmHWM cannot be read (no ``/proc``). An
    over-estimate: the kernel keeps a process's high-water mark across ``exec``, so it
    is at least what the parent (this process, torch loaded) held when it started it."""
    return ru.ru_maxrss / 2**20 if sys.platform == "darwin" else ru.ru_maxrss / 2**10


def _read_records(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written: read at the next look
            break
    return out


def epoch_row(history: Sequence[Mapping[str, Any]], wall_s: float, peak_mb: float | None,
              gpu_peak_mb: float | None) -> dict[str, Any]:
    """The CSV row of the last epoch in ``history``: best.pt as it then is (chosen as
    ``ats train`` chooses it), with the cost so far."""
    from ats_cli.train import selection_score

    best = max(history, key=selection_score)
    return {"epoch": history[-1]["epoch"], "wall_s": round(wall_s, 3),
            "peak_mb": None if peak_mb is None else round(peak_mb, 1),
            "gpu_peak_mb": None if gpu_peak_mb is None else round(gpu_peak_mb, 1),
            "best_epoch": best["epoch"], "val_acc": best.get("val_acc"), "test_acc": best.get("test_acc")}


def run_method(method: str, argv: Sequence[str], run: Path, log_path: Path, *, prepared: Path | None,
               on_epoch: Callable[[dict[str, Any]], None] = lambda row: None) -> MethodResult:
    """Run one method's training process (``argv``, writing ``run``, its output to
    ``log_path``), following its epochs as they land; returns its result (done or
    failed). KeyboardInterrupt: the process (which got the signal too, in the same
    process group) is waited for, then the interrupt goes on."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    package_root = str(Path(__file__).resolve().parents[1])  # the child runs this very ats_cli
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    if prepared is not None:
        env["ATS_PREPARED"] = str(prepared)
    metrics = run / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    gpu_peak: float | None = None
    rss_peak: float | None = None  # the process's VmHWM, as last read
    seen = 0

    def look(pid: int | None) -> None:
        nonlocal seen, gpu_peak, rss_peak
        hwm = _vm_hwm_mb(pid) if pid is not None else None
        if hwm:  # None: no /proc; 0: a process already exiting
            rss_peak = max(rss_peak or 0.0, hwm)
        try:
            landed = metrics.stat().st_mtime - t0
        except OSError:
            return
        if landed < 0:  # an older run's, not yet moved aside (or never: the process failed first)
            return
        history = _read_records(metrics)
        if len(history) <= seen:
            return
        for n in range(seen + 1, len(history) + 1):
            record = history[n - 1]
            cuda = str(record.get("device", "cpu")).startswith("cuda")
            if cuda and record.get("peak_mem_mb") is not None:
                gpu_peak = max(gpu_peak or 0.0, float(record["peak_mem_mb"]))
            row = epoch_row(history[:n], landed, rss_peak, gpu_peak)
            rows.append(row)
            on_epoch(row)
        seen = len(history)

    with open(log_path, "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env)
        interrupted = False
        while True:
            try:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                look(proc.pid)
                time.sleep(POLL_S)
            except KeyboardInterrupt:
                interrupted = True
                status, ru = _stop(proc.pid, look)
                break
        wall = time.time() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    look(None)
    # no /proc: ru_maxrss (see _maxrss_mb); none read on Linux: a process gone before the first look
    peak = rss_peak if rss_peak is not None or Path("/proc/self/status").exists() else _maxrss_mb(ru)
    result = MethodResult(method, "done", rows, round(wall, 3), None if peak is None else round(peak, 1), gpu_peak)
    settled = run / "config.json"
    try:
        cfg = json.loads(settled.read_text())
        result.feature_net, result.feature_train = str(cfg.get("feature_net", "")), str(cfg.get("feature_train", ""))
        result.batch_size = cfg.get("batch_size")
    except (OSError, ValueError):
        pass
    if prepared is not None:
        shutil.rmtree(prepared, ignore_errors=True)
    if interrupted:
        result.status, result.error = "interrupted", "interrupted (Ctrl-C); a rerun trains it again"
        raise _Interrupted(result)
    if proc.returncode != 0:
        result.status, result.error = "failed", _error_line(log_path, proc.returncode)
    elif not rows:
        result.status, result.error = "failed", "no epoch finished (metrics.jsonl is empty)"
    return result


def _stop(pid: int, look: Callable[[int], None]) -> tuple[int, Any]:
    """After Ctrl-C (or SIGTERM) here: the training process, in the same process group, got
    the terminal's Ctrl-C too and saves and stops on its own; given :data:`STOP_GRACE_S`
    without stopping (the signal was this process's alone: ``kill``, a scheduler), it is
    sent SIGTERM, which ``ats train`` takes as Ctrl-C. Its epochs are still followed
    (``look``). Returns its wait status and usage."""
    deadline = time.monotonic() + STOP_GRACE_S
    while True:
        done, status, ru = os.wait4(pid, os.WNOHANG)
        if done:
            return status, ru
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGTERM)
            deadline = None
        look(pid)
        time.sleep(POLL_S)


class _Interrupted(KeyboardInterrupt):
    def __init__(self, result: MethodResult):
        super().__init__(result.method)
        self.result = result


def _load_state(out: Path) -> dict[str, Any]:
    path = out / STATE
    if not path.exists():
        return {"version": STATE_VERSION, "methods": {}}
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("methods"), dict):
            raise ValueError("no methods table")
    except (OSError, ValueError) as e:
        raise CompareError(f"{path}: not a comparison's record ({e}); give another --out") from None
    return state


def _differences(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(then) | set(now))
    return [f"{k} {then.get(k)!r} then, {now.get(k)!r} now" for k in keys if then.get(k) != now.get(k)]


def plan_methods(state: Mapping[str, Any], methods: Sequence[str], configs: Mapping[str, Mapping[str, Any]],
                 digest: str, *, overwrite: bool) -> dict[str, str]:
    """What a (re)run does with each method: ``skip`` (finished with this data and these
    settings), ``run``, or ``rerun: WHY``. Raises CompareError for a finished method whose
    data or settings differ, unless ``overwrite``."""
    plan: dict[str, str] = {}
    for m in methods:
        rec = state["methods"].get(m)
        if rec is None:
            plan[m] = "run"
            continue
        if rec.get("status") != "done":
            plan[m] = f"rerun: its last run {rec.get('status', 'did not finish')} ({rec.get('error') or 'no reason'})"
            continue
        changed = []
        if rec.get("data_digest") != digest:
            changed.append("the dataset (its rows, dataset.json or a file's size)")
        diff = _differences(rec.get("config", {}), configs[m])
        if diff:
            changed.append("settings: " + "; ".join(diff[:3]) + (" ..." if len(diff) > 3 else ""))
        if not changed:
            plan[m] = "skip"
        elif overwrite:
            plan[m] = f"rerun: --overwrite, and it finished with other {' and '.join(changed)}"
        else:
            raise CompareError(f"{m} finished in this --out with other {' and '.join(changed)}; give another --out, "
                               "or --overwrite to train it again")
    return plan


def run_compare(data: str | os.PathLike[str], out: str | os.PathLike[str], methods: Sequence[str],
                configs: Mapping[str, Mapping[str, Any]], *, train_args: Sequence[str] = (),
                overwrite: bool = False, say: Callable[[str], None] = print,
                on_epoch: Callable[[str, dict[str, Any]], None] = lambda method, row: None) -> list[MethodResult]:
    """Train each of ``methods`` on the dataset ``data`` in turn (see the module's
    docstring), recording each in ``OUT/compare.json`` as it ends; returns their results
    in the order given. ``configs``: each method's requested configuration (the resume
    check); ``train_args``: the shared ``ats train`` flags. Writes the CSV and the PNG
    (:func:`write_csv`, :func:`plot_compare`) after every method, so an interrupted
    comparison still shows what finished. Raises CompareError before anything runs when
    the output directory's record disagrees (:func:`plan_methods`)."""
    out = Path(out)
    digest = data_digest(data)
    state = _load_state(out)
    plan = plan_methods(state, methods, configs, digest, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    chance = _chance(data)
    results: dict[str, MethodResult] = {}
    prepare_root = None if os.environ.get("ATS_PREPARED", "").strip().lower() in ("off", "0", "none", "no") \
        else out / ".prepared"

    def save() -> None:
        atomic_write_text(out / STATE, json.dumps(state, indent=2) + "\n")
        done = [results[m] for m in methods if m in results]
        write_csv(done, out / CSV_NAME)
        plot_compare(done, out / PNG_NAME, chance=chance)

    for i, m in enumerate(methods, 1):
        tag = f"[{i}/{len(methods)}] {m}"
        if plan[m] == "skip":
            results[m] = MethodResult.from_record(m, state["methods"][m])
            results[m].skipped, results[m].note = True, f"finished before ({out / STATE}): not trained again"
            say(f"{tag}: finished before with the same data and settings, not trained again")
            continue
        note = plan[m].partition(": ")[2]
        if note:
            say(f"{tag}: training again: {note}")
        run = out / m
        say(f"{tag}: training (log {out / f'{m}.log'})")
        argv = train_argv(data, run, m, train_args=train_args)
        try:
            result = run_method(m, argv, run, out / f"{m}.log",
                                prepared=None if prepare_root is None else prepare_root / m,
                                on_epoch=lambda row, m=m: on_epoch(m, row))
        except _Interrupted as stop:
            result = stop.result
            result.data_digest, result.config = digest, dict(configs[m])
            state["methods"][m] = result.record()
            results[m] = result
            save()
            raise KeyboardInterrupt from None
        result.data_digest, result.config, result.note = digest, dict(configs[m]), note
        state["methods"][m] = result.record()
        results[m] = result
        what = (f"done in {result.wall_s:.1f} s, peak RSS {fmt(result.peak_mb, '.0f')} MB" if result.status == "done"
                else f"failed: {result.error}")
        say(f"{tag}: {what}")
        save()
    if prepare_root is not None:
        shutil.rmtree(prepare_root, ignore_errors=True)
    out_results = [results[m] for m in methods]
    save()
    return out_results


def _chance(data: str | os.PathLike[str]) -> float | None:
    """The test split's majority-class share: what a model that learned nothing scores."""
    from collections import Counter

    from ats_cli.data.dataset import load_dataset

    try:
        test = load_dataset(data).splits.get("test") or []
        labels = [r.label_name for r in test]
    except Exception:  # noqa: BLE001 -- only a reference line on the plot
        return None
    return max(Counter(labels).values()) / len(labels) if labels else None


def csv_rows(results: Sequence[MethodResult]) -> list[dict[str, Any]]:
    """One row per method per finished epoch; a failed or interrupted method also a last
    row with its total wall time, its peak and why (``epoch`` empty)."""
    rows = []
    for r in results:
        for e in r.epochs:
            rows.append({"method": r.method, **e, "error": ""})
        if r.status != "done":
            rows.append({"method": r.method, "epoch": None, "wall_s": r.wall_s, "peak_mb": r.peak_mb,
                         "gpu_peak_mb": r.gpu_peak_mb, "best_epoch": None, "val_acc": None, "test_acc": None,
                         "error": r.error})
    return rows


def write_csv(results: Sequence[MethodResult], path: str | os.PathLike[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in csv_rows(results):
        writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in CSV_COLUMNS})
    atomic_write_text(path, buf.getvalue())


def plot_compare(results: Sequence[MethodResult], path: str | os.PathLike[str], *,
                 chance: float | None = None) -> None:
    """The PNG: left, each method's best.pt test accuracy against its cumulative wall
    time (log axis), one line per method, a failed method's epochs dashed; right, each
    method's peak RSS (a bar; a failed method's bar hatched, its reason under it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = False
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        pts = [(e["wall_s"], e["test_acc"]) for e in r.epochs if e.get("test_acc") is not None and e["wall_s"] > 0]
        label = r.method + ("" if r.status == "done" else f" ({r.status})")
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, "o-" if r.status == "done" else "x--", color=color, label=label)
            drawn = True
        else:
            ax.plot([], [], "x--", color=color, label=f"{label}: no epoch")
    if chance is not None:
        ax.axhline(chance, color="gray", ls=":", lw=1, label=f"largest class ({chance:.2f})")
    if drawn:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_xscale("log")  # seconds as numbers (3, 40, 500), not 4x10^0; minor ticks labelled over a short span
        times = [e["wall_s"] for r in results for e in r.epochs if e["wall_s"] > 0]
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        span = max(times) / min(times)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}") if span < 3 else
                                     FuncFormatter(_minor_label) if span < 30 else NullFormatter())
    else:
        ax.text(0.5, 0.5, "no method finished an epoch", transform=ax.transAxes, ha="center", va="center")
    ax.set(xlabel="wall time since the start (s, log; preparation included)", ylabel="test accuracy of best.pt",
           title="Accuracy against wall time", ylim=(0, 1.02))
    ax.grid(alpha=0.3, which="both")
    if results or chance is not None:
        ax.legend(loc="best", fontsize=8)
    names = [r.method for r in results]
    peaks = [r.peak_mb or 0.0 for r in results]
    handles = bars.bar(range(len(results)), peaks, color=[colors[i % len(colors)] for i in range(len(results))])
    for i, (h, r) in enumerate(zip(handles, results, strict=True)):
        if r.status != "done":
            h.set_hatch("//")
            h.set_alpha(0.5)
            bars.text(i, 0, "\n".join(_wrap(r.error or r.status, 24)[:3]), ha="center", va="bottom", fontsize=7,
                      rotation=90 if len(results) > 3 else 0)
        elif r.peak_mb:
            bars.text(i, r.peak_mb, f"{r.peak_mb:.0f}", ha="center", va="bottom", fontsize=8)
    bars.set_xticks(range(len(results)), names)
    bars.set(ylabel="peak RSS (MB)", title="Peak memory (training process)")
    if peaks and max(peaks) > 0:
        bars.set_ylim(0, max(peaks) * 1.15)
    bars.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    atomic_save_png(fig, path)


def _minor_label(x: float, _pos: Any = None) -> str:
    """A log axis's minor tick: labelled at 2, 3 and 5 times a power of ten, so a span of
    less than a decade or two still reads, without the labels running together."""
    lead = x / 10 ** math.floor(math.log10(x)) if x > 0 else 0
    return f"{x:g}" if any(abs(lead - d) < 1e-6 for d in (2, 3, 5)) else ""


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line] if line else lines


def fmt(value: float | None, spec: str = ".3f") -> str:
    """A table cell: the number, or a dash where there is none (a failed method's)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
