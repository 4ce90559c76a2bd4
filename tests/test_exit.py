"""How the ``ats`` console script ends (ats_cli.cli.exit_now): the status, the output, the
atexit handlers and the threads still running are what Python's own exit gives; only the
interpreter's teardown (about a second of CPU once torch is loaded) is skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ats_cli import __version__

# A process that runs `ats ARGS` through the console script's main(), with a thread that is
# not a daemon still working, an atexit handler, and an object whose finaliser only
# Python's teardown would run.
SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    out = Path(sys.argv[1])

    def late():
        time.sleep(0.5)
        (out / "thread").write_text("done")

    threading.Thread(target=late).start()
    atexit.register(lambda: (out / "atexit").write_text("ran"))

    class Finalised:
        def __del__(self):
            (out / "teardown").write_text("ran")

    kept = Finalised()
    from ats_cli.cli import main
    sys.argv = ["ats", *sys.argv[2:]]
    main()
""")


def _ats(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *args], capture_output=True, text=True,
                          timeout=120)


def test_the_status_and_output_are_those_of_the_command_and_exit_handlers_and_threads_are_not_cut(tmp_path):
    done = _ats(tmp_path, "--version")
    assert done.returncode == 0 and done.stdout == f"ats {__version__}\n", done
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"  # waited for, as Python's exit waits
    assert not (tmp_path / "teardown").exists()  # the teardown was skipped: what saves the second


def test_a_refused_command_keeps_its_status_and_its_message(tmp_path):
    usage = _ats(tmp_path, "train", "--no-such-flag")  # click's usage error
    assert usage.returncode == 2 and "No such option" in usage.stdout + usage.stderr, usage
    missing = _ats(tmp_path, "info", str(tmp_path / "nowhere.png"))
    assert missing.returncode == 1 and "nowhere.png" in missing.stdout + missing.stderr, missing
    assert (tmp_path / "atexit").read_text() == "ran"


def test_a_plain_exit_runs_the_teardown_the_console_script_skips(tmp_path):
    """Negative control for the finaliser check above: Python's own exit does run it."""
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("main()", "sys.exit(0)"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done
    assert (tmp_path / "teardown").read_text() == "ran"
