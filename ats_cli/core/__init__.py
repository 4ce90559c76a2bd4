"""The attention-sampling method: sampling and the estimator, patches, the patch source and
where a patch is, the model."""

from ats_cli.core.model import ATSModel, ATSOutput
from ats_cli.core.patches import extract_patches
from ats_cli.core.sampling import (
    ESTIMATORS,
    Draw,
    attention_distribution,
    entropy,
    estimator_weights,
    expectation,
    sample,
)
from ats_cli.core.source import (
    PatchSource,
    TensorSource,
    gather_patches,
    low_res_size,
    low_res_view,
    positions_to_offsets,
)

__all__ = [
    "ESTIMATORS",
    "Draw",
    "ATSModel",
    "ATSOutput",
    "PatchSource",
    "TensorSource",
    "attention_distribution",
    "entropy",
    "estimator_weights",
    "expectation",
    "extract_patches",
    "gather_patches",
    "low_res_size",
    "low_res_view",
    "positions_to_offsets",
    "sample",
]
