"""Networks, created by name: ``ats_cli.nets.create("mnist-features", in_channels=1)``."""

from ats_cli.nets import attention as _attention  # noqa: F401  (registers block-attention)
from ats_cli.nets import encoders as _encoders  # noqa: F401  (registers timm: and torchvision:; imports neither)
from ats_cli.nets import mnist as _mnist  # noqa: F401  (registers the Megapixel MNIST nets)
from ats_cli.nets import resnet as _resnet  # noqa: F401  (registers the CNN baseline's ResNet)
from ats_cli.nets import small as _small  # noqa: F401  (registers small-cnn)
from ats_cli.nets.registry import UnknownNetworkError, available, check, create, register, register_prefix

__all__ = ["create", "check", "available", "register", "register_prefix", "UnknownNetworkError"]
