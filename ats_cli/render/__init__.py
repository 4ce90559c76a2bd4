"""Pictures and files of what the model looked at, drawn from plain records.

The renderers here take numbers and pixels (:mod:`ats_cli.render.records`): attention
maps, patch offsets, the estimator weights and contributions the model reported, class
probabilities, boxes, image pixels. They import no model code, so that whatever runs the
model (``ats visualize``, ``ats predict --save-attention``) hands them what it knew once,
and nothing here recomputes it; matplotlib is imported only where a figure is drawn.

* :mod:`~ats_cli.render.figure`: one image's attention and sampled patches (PNG);
* :mod:`~ats_cli.render.evolution`: the attention across training epochs (PNG);
* :mod:`~ats_cli.render.geojson`: the same as GeoJSON objects for QuPath;
* :mod:`~ats_cli.render.qupath`: a preview of such a GeoJSON over the image (PNG).
"""
