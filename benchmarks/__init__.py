"""The benchmark scripts (each run as ``python benchmarks/NAME.py``; benchmarks/README.md and
the pages it lists have their figures). A package so that the tests import a script as a module by its name."""
