"""Networks, created by name: ``ats_cli.nets.create("mnist-features", in_channels=1)``.

Importing this package registers every network module in it (:mod:`ats_cli.registry`
holds the registry); ``create``/``check``/``available`` are that registry's network
functions, under the names a caller of the package reads.
"""

from ats_cli.nets import attention as _attention  # noqa: F401  (registers block-attention)
from ats_cli.nets import mnist as _mnist  # noqa: F401  (registers the Megapixel MNIST nets and small-cnn)
from ats_cli.nets import resnet as _resnet  # noqa: F401  (registers the CNN baseline's ResNet)
from ats_cli.registry import UnknownNetworkError
from ats_cli.registry import available_nets as available
from ats_cli.registry import check_net as check
from ats_cli.registry import create_net as create

__all__ = ["create", "check", "available", "UnknownNetworkError"]
