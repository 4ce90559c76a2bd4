"""Datasets: the one on-disk format, and the generators and converters that produce it.

* :mod:`ats_cli.data.dataset` - the format (``train.csv``/``test.csv``/``val.csv`` +
  ``dataset.json``), :func:`load_dataset` (validating) and :func:`write_dataset`; and
  what its files may be: the suffix table (which files are inputs, which backend reads
  each) and the plausible microns per pixel.
* :mod:`ats_cli.data.folder` - an ImageFolder-style tree -> the format.
* :mod:`ats_cli.data.megapixel_mnist` - the Megapixel MNIST generator.
* :mod:`ats_cli.data.mnist` - where its digits come from (IDX/npz, torchvision, bundled).

Importing this package (the modules above) does not import torch; the optional MNIST
download imports torchvision lazily, and :mod:`~ats_cli.data.images` (the PIL backend,
which the from-folder converter uses for headers) only where it returns tensors. These
modules import torch and are not imported here: :mod:`~ats_cli.data.inputs` (reading
an input for a model, one image or a training batch), :mod:`~ats_cli.data.prepared`
(images decoded once into tiles), :mod:`~ats_cli.data.slides` (lazy slide readers) and
:mod:`~ats_cli.data.synthetic_slides` (the slide generator).
"""

from ats_cli.data.dataset import Dataset, DatasetError, Problem, Record, load_dataset, write_dataset
from ats_cli.data.folder import dataset_from_folder
from ats_cli.data.megapixel_mnist import (
    PRESETS,
    GenerationReport,
    Layout,
    MegapixelMNISTConfig,
    generate_megapixel_mnist,
    make_config,
    render_image,
)
from ats_cli.data.mnist import DigitSet, DigitSourceError, load_bundled_digits, load_mnist, read_idx, resolve_digits

__all__ = [
    "PRESETS",
    "Dataset",
    "DatasetError",
    "DigitSet",
    "DigitSourceError",
    "GenerationReport",
    "Layout",
    "MegapixelMNISTConfig",
    "Problem",
    "Record",
    "dataset_from_folder",
    "generate_megapixel_mnist",
    "load_bundled_digits",
    "load_dataset",
    "load_mnist",
    "make_config",
    "read_idx",
    "render_image",
    "resolve_digits",
    "write_dataset",
]
