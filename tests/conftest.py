"""Test-session settings.

One torch thread, here and in the subprocesses the tests start (they inherit
OMP_NUM_THREADS; set it to choose another count). The tests' tensors are tiny, where
intra-op parallelism costs more than it gives, and on a 2-core machine with anything
else running a second thread waits on a busy core.

The suite runs on two processes (pytest-xdist, ``-n 2`` in pyproject.toml): it spends
much of its time in tests that train or spawn processes, one core each.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing downloads in a test: the Hugging Face hub (timm's pretrained weights) is offline
# before huggingface_hub reads the variable, at its import.
os.environ["HF_HUB_OFFLINE"] = "1"
# and the caches are empty ones of the session's: with a developer's cached ImageNet weights,
# --feature-net auto would start RGB runs from them (ats_cli.config._feature_net) and the
# tests would run another model than CI's
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_EMPTY_CACHE = tempfile.mkdtemp(prefix="ats-tests-cache-")
atexit.register(shutil.rmtree, _EMPTY_CACHE, ignore_errors=True)
os.environ["HF_HUB_CACHE"] = os.path.join(_EMPTY_CACHE, "huggingface")
os.environ["TORCH_HOME"] = os.path.join(_EMPTY_CACHE, "torch")
# Output to a pipe keeps its natural width unless COLUMNS says otherwise
# (ats_cli.cli.OutputConsole); pytest-xdist's workers get COLUMNS=80, which would fold
# the tables whose long paths the tests look for. The tests that want a width set it.
os.environ.pop("COLUMNS", None)

import torch  # noqa: E402  (after the variable, which torch reads when it loads)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# ---- the package compiled once, for the processes the tests start
def pytest_configure(config):
    """Compile ``ats_cli`` to bytecode once, in the controlling process, before the workers
    start. Where PYTHONDONTWRITEBYTECODE is set (this machine's shell, CI), Python writes no
    ``__pycache__`` and every ``ats`` process a test starts (hundreds: the kill loops, the
    distributed runs, the benchmark's rows) compiled the modules it imports anew, ~0.3 s of
    CPU each; cached bytecode is read whatever the variable says. Up-to-date files are
    skipped, and ``__pycache__`` is ignored by git."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller did it
        return
    import compileall
    from pathlib import Path

    compileall.compile_dir(Path(__file__).resolve().parents[1] / "ats_cli", quiet=1)


# ---- the device: a test sees a GPU only when it asks for one
import pytest  # noqa: E402

_HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _no_cuda_unless_asked(request, monkeypatch):
    """On a machine with a GPU, every command's ``--device auto`` would pick it, and the
    suite would test another computation than the one its expected values were made with
    on CPU (CUDA draws other patches for the same seed, and its training is not bitwise
    repeatable: docs/training.md, ``--seed``); seen on an H100 (benchmarks/gpu.md).
    So ``auto`` means the CPU in a test, in this process and in the processes it starts,
    unless the test is marked ``uses_cuda`` (the kernels' and the host-sync tests)."""
    if _HAS_CUDA and request.node.get_closest_marker("uses_cuda") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# ---- curves.png: drawn where a test looks at it
@pytest.fixture(autouse=True)
def _curves_drawn_where_looked_at(request, monkeypatch):
    """Drawing curves.png (matplotlib: three panels, a tight layout, a 1400x400 PNG) costs
    ~0.35 s of CPU a run, more than most of the suite's tiny runs spend training; the ~150
    runs made in the tests' own processes spent ~50 s of the suite's CPU on pictures no test
    looked at. So ``ats_cli.train._plot_curves`` draws nothing in a test unless it is marked
    ``draws_curves`` (the tests that look for the file, or write it under a fault); runs in
    a subprocess draw as always."""
    if request.node.get_closest_marker("draws_curves") is None:
        import ats_cli.train

        monkeypatch.setattr(ats_cli.train, "_plot_curves", lambda history, path: None)


# ---- the order: the files that hold the longest tests first
# pytest-xdist hands the tests out in collection order (alphabetical files); a test of half a
# minute that starts last runs alone while the other worker idles, and the suite lasts that
# much longer. Started first, the long tests spread over both workers and the many short ones
# fill in around them. Whole files move (their module fixtures stay built once); the rest keep
# their order. Ordered by each file's longest test, measured with --durations (2 cores): add a
# file here when one of its tests takes more than ~5 s.
LONGEST_FIRST = [
    "test_kill_runs.py", "test_released_models.py", "test_real_pixels.py", "test_benchmark.py",
    "test_fault_locks.py", "test_encoders.py", "test_distributed.py", "test_predict_cohort.py", "test_nested.py",
    "test_faults.py", "test_noise.py", "test_predict_provenance.py", "test_train.py", "test_train_defaults.py",
    "test_pretrain.py", "test_nested_slides.py", "test_mpp.py", "test_slide_training.py", "test_prepared.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others in their order
