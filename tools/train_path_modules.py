"""How many ats_cli modules run code between `ats train` and the first gradient step.

    python tools/train_path_modules.py DATA --out RUN [ats train flags]

A profile hook records every ats_cli module one of whose functions is called at run time
(import-time code, i.e. module bodies and the calls they make, is left out), from the
command line to the first ``optimizer.step``, where the run is stopped. It is the number of
modules a reader follows from the flag to the first step; the import count is printed
beside it. Writes RUN (a run stopped before its first step).
"""

from __future__ import annotations

import sys

from torch.optim.optimizer import register_optimizer_step_pre_hook

ran: list[str] = []


class FirstStep(BaseException):
    """Raised at the first optimizer step: the path ends there."""


def profile(frame, event, arg):
    if event != "call":
        return
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("ats_cli") or name in ran or not frame.f_code.co_flags & 1:  # CO_OPTIMIZED: a function
        return
    f = frame.f_back
    while f is not None:  # a call made while a module body runs is import-time, not the run's
        if f.f_code.co_name == "<module>" and f.f_globals.get("__name__") != "__main__":
            return
        f = f.f_back
    ran.append(name)


def stop(optimizer, args, kwargs):
    sys.setprofile(None)
    raise FirstStep


def main() -> None:
    register_optimizer_step_pre_hook(stop)
    sys.setprofile(profile)
    from ats_cli.cli import main as ats

    sys.argv = ["ats", "train", *sys.argv[1:]]
    try:
        ats()
    except FirstStep:
        pass
    except SystemExit as e:
        sys.setprofile(None)
        print(f"ats train exited with {e.code} before its first step")
    imported = sorted(m for m in sys.modules if m.startswith("ats_cli"))
    print(f"{len(ran)} ats_cli modules ran code before the first optimizer step ({len(imported)} imported):")
    print("\n".join(f"  {m}" for m in ran))


if __name__ == "__main__":
    main()
