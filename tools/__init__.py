"""Maintainers' scripts that make shipped files (fixtures, figures); each runs as
``python tools/NAME.py``. A package so that the tests import a script as a module by its name."""
