"""Patch-level supervision: ``ats pretrain`` teaches a model from regions the dataset
records (where each object is, and its class), before or instead of ``ats train``.

Why: in attention sampling the feature network learns only through the image's label,
pooled over the sampled patches. When most of an image is clutter, some of it looking
like the objects (fragments of other digits, printed glyphs, pen strokes on Megapixel
MNIST), that signal is weak: from the labels alone the feature net never learns that a
fragment of a 7 is not a 7. Where the data records its objects' regions, the feature net
can be taught that directly (stage 1, :mod:`ats_cli.pretrain.stage1`): a patch holding one
whole object is labelled with its class, a patch holding no part of one with an extra
class, "none"; patches where an object is cut in half or two meet are left out
(:mod:`ats_cli.pretrain.patches`). And the attention net can be taught where the objects
are (stage 1b, :mod:`ats_cli.pretrain.attention`): each object of the image gets the same
mass, because the label is the majority of the objects and the pooled estimate follows
the mass-weighted vote.

The output is an ordinary ats checkpoint of the model ``ats train`` builds with the same
network settings: ``ats train --set init=CKPT`` starts from it, and ``ats export`` makes it a model to
predict with (:mod:`ats_cli.export`). Not the thesis's setting, which trains from the
image labels only: a model trained this way should say so in its card.

Modules: :mod:`~ats_cli.pretrain.regions` (a row's regions), :mod:`~ats_cli.pretrain.patches`
(labelled patches), :mod:`~ats_cli.pretrain.stage1` (feature net and head),
:mod:`~ats_cli.pretrain.attention` (stage 1b), :mod:`~ats_cli.pretrain.internals` (every
touch of the model's parts), :mod:`~ats_cli.pretrain.run` (the two stages on a dataset).
Torch is imported inside functions: ``ats --help`` stays quick.
"""

from __future__ import annotations


class PretrainError(ValueError):
    """A dataset, region or option ``ats pretrain`` cannot use; the message is one line
    naming the file."""
