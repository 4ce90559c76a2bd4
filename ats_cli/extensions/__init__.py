"""Extensions of attention sampling: the named pieces a kind of data adds to the thesis's model.

:class:`ats_cli.core.model.ATSModel` is the method of the thesis. What a task needs beyond
it plugs into one of four slots, each with a registry of its own (in :mod:`ats_cli.registry`,
re-exported here):

* ``pooling`` -- what the estimator averages and how the logits are read from the estimate
  (:mod:`.pooling`: ``features``, the thesis's; :mod:`.pooling_votes`; :mod:`.pooling_counts`;
  :mod:`.pooling_highest`; :mod:`.pooling_topmost`);
* ``support`` -- which low-res cells may be sampled at all (:mod:`.support`; :mod:`.support_bright`);
* ``prior`` -- a fixed log-prior added to the attention scores (:mod:`.prior`; :mod:`.prior_rarity`);
* ``gain`` -- a per-patch factor on the unit-norm feature (:mod:`.gain`; :mod:`.gain_learned`).

Each is created from a plain spec, ``{"name": ..., **options}`` (:func:`create_extension`),
the form a checkpoint stores, so that a model is rebuilt without unpickling anything.

Adding one is adding a file to this package that registers what it defines with
:func:`register_extension` when it is imported: a configuration (a recipe) or a checkpoint
that names it finds it (:func:`ats_cli.registry.discover_extensions` imports the package's
modules when a name is not known). A shipped one also has a line in :data:`EXTENSIONS`
(:mod:`ats_cli.registry`, beside ``register_extension``) saying which module registers the
name (and what it does, in a few words). Why the table: the name is also a value of the
kind's flag (``--pooling``), and ``ats --help`` lists the values without importing torch,
which every extension module does; the table is read instead, and the modules are imported
when an extension is made or the registry is listed (:func:`available_extensions`). A test
holds the table and what the modules register to the same names and order. A module
outside this package that registers a name before the configuration is read
(``ats_cli.config``) adds its value too.

Why they all keep the estimator unbiased: its argument (step (*) of
:func:`ats_cli.core.sampling.expectation`) asks only that the value pooled for a cell be a
deterministic, differentiable function of the parameters and the input, the same whichever
cells are drawn, and that the draws come from the distribution the weights are computed
for. A support or a prior changes that distribution (the weights follow it); a gain or a
pooling changes the value of a cell. Each module says why its piece keeps both conditions;
tests/test_extensions.py checks each by Monte Carlo, beside a biased variant it rejects.
"""

from __future__ import annotations

from ats_cli.registry import (
    EXTENSIONS,
    KINDS,
    ExtensionError,
    UnknownExtensionError,
    available_extensions,
    create_extension,
    extension_choices,
    register_extension,
)

__all__ = ["EXTENSIONS", "KINDS", "ExtensionError", "UnknownExtensionError", "available_extensions",
           "create_extension", "extension_choices", "register_extension"]
