"""ats: classify megapixel and whole-slide images with attention sampling.

Attention sampling (Katharopoulos & Fleuret, ICML 2019) looks at a low-resolution
view with a small attention network, samples a few patch positions from the
resulting distribution, and runs the feature network only on those patches at full
resolution. Cost and memory depend on the number and size of the patches, not on
the size of the image.

The method lives in :mod:`ats_cli.core`, the thesis's baselines in
:mod:`ats_cli.baselines`; networks and extensions are created by name through one
registry (:mod:`ats_cli.registry`; :mod:`ats_cli.nets`), and
models (ATS or a baseline) from a checkpoint's spec through
:func:`ats_cli.models.create_model`, with what a task adds to the method as named
extensions (:mod:`ats_cli.extensions`); the command line (:mod:`ats_cli.cli`) is a thin shell.
"""

__version__ = "0.1.0"
