"""OME-Zarr stores behind a URL (ats_cli.data.omezarr over zarr's FsspecStore), served from
127.0.0.1 by the test itself (tests/httpserve.py: a count of the bytes sent per file):
``ats info URL``, ``ats predict URL`` (the local store's CSV, a small fraction of the store
fetched), a dataset CSV listing a store's URL, ``file://``, and the one line naming the
URL for a store that is not there or a chunk that is missing."""

from __future__ import annotations

import csv
import hashlib
import shutil
from pathlib import Path

import pytest
import tifffile
from typer.testing import CliRunner

zarr = pytest.importorskip("zarr")

from ats_cli.cli import app  # noqa: E402
from ats_cli.data.images import ImageReadError  # noqa: E402
from ats_cli.data.inputs import ViewCache  # noqa: E402
from ats_cli.data.slides import open_image  # noqa: E402
from tests.httpserve import serve  # noqa: E402
from tests.test_omezarr import _image, _tiny_model, write_ome_zarr  # noqa: E402
from tests.test_urls import make_model, write_pyramid  # noqa: E402

runner = CliRunner()


def write_omezarr_copy(tif: Path, store: Path) -> None:
    """``tif``'s pyramid as an OME-Zarr store (NGFF 0.5, Zarr v3, axes c, y, x; one dataset
    per TIFF level, its chunks the TIFF's tiles, zarr's default codec: zstd) holding the
    same pixels: each tile decoded by tifffile, as the TIFF reader decodes it, and
    written as the chunk at its place. A tile whose bytes were seen before is written as
    the chunk bytes zarr encoded for it the first time (:func:`write_pyramid` repeats five
    tiles), so a 100k² copy (benchmarks/slides.py --omezarr) costs its disk writes, not
    150,000 encodings."""
    tmp = store.with_name(store.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tifffile.TiffFile(tif) as tf:
        pages = [p for p in tf.pages if p.is_tiled]
        tags = pages[0].tags
        per = {2: 25_400.0, 3: 1e4}.get(int(tags["ResolutionUnit"].value) if "ResolutionUnit" in tags else 1)
        num, den = tags["XResolution"].value if "XResolution" in tags else (1, 1)
        mpp = per * den / num if per else 1.0  # microns per pixel, or 1 with axes of no unit
        group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        datasets, fh = [], tf.filehandle
        for k, page in enumerate(pages):
            h, w, _ = page.shape
            th, tw = page.tilelength, page.tilewidth
            arr = group.create_array(str(k), shape=(3, h, w), chunks=(3, th, tw), dtype="uint8",
                                     dimension_names=["c", "y", "x"])
            encoded: dict[bytes, bytes] = {}
            gw = -(-w // tw)
            for i, (off, n) in enumerate(zip(page.dataoffsets, page.databytecounts, strict=True)):
                ty, tx = divmod(i, gw)
                fh.seek(off)
                data = fh.read(n)
                digest = hashlib.blake2b(data, digest_size=16).digest()
                key = tmp / str(k) / arr.metadata.encode_chunk_key((0, ty, tx))
                y0, x0 = ty * th, tx * tw
                inside = y0 + th <= h and x0 + tw <= w  # an edge chunk is written by zarr, cut to the array
                if inside and digest in encoded:
                    key.parent.mkdir(parents=True, exist_ok=True)
                    key.write_bytes(encoded[digest])
                    continue
                tile = page.decode(data, i, jpegtables=page.jpegtables)[0][0].transpose(2, 0, 1)
                arr[:, y0:min(y0 + th, h), x0:min(x0 + tw, w)] = tile[:, :min(th, h - y0), :min(tw, w - x0)]
                if inside:
                    encoded[digest] = key.read_bytes()
            scale = mpp * pages[0].shape[0] / h
            datasets.append({"path": str(k), "coordinateTransformations": [{"type": "scale",
                                                                            "scale": [1.0, scale, scale]}]})
        unit = {"unit": "micrometer"} if per else {}
        axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space", **unit},
                {"name": "x", "type": "space", **unit}]
        group.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets,
                                                                 "name": tif.name}]}
    tmp.rename(store)


def store_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file())


def sent_for(server, name: str) -> int:
    """Body bytes the server sent for the files of the store ``name``."""
    return sum(v for k, v in server.sent.items() if k.startswith(name + "/"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The served folder: the URL tests' 8k² JPEG pyramid as an OME-Zarr store with the
    same pixels (0.5 µm/px, levels 8192, 2048, 512; ~40 MB), a model beside it, not served."""
    root = tmp_path_factory.mktemp("zsite")
    work = tmp_path_factory.mktemp("ztif")
    write_pyramid(work / "slide.tif", side=8192)
    write_omezarr_copy(work / "slide.tif", root / "slide.ome.zarr")
    model = work / "model.pt"
    make_model(model)
    with serve(root) as server:
        server.model, server.tif = model, work / "slide.tif"
        yield server


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def test_the_copy_holds_the_tiffs_pixels(site):
    tif, store = open_image(site.tif), open_image(site.root / "slide.ome.zarr")
    assert store.levels == tif.levels and store.mpp == tif.mpp == (0.5, 0.5)
    for level, (r, c) in ((0, (4000, 3000)), (0, (8192 - 100, 8192 - 300)), (1, (0, 0)), (2, (0, 0))):
        assert (store.read_region(r, c, 100, 300, level) == tif.read_region(r, c, 100, 300, level)).all()


def test_ats_info_reads_a_store_behind_a_url_from_its_metadata(site):
    site.reset()
    url = site.url("slide.ome.zarr")
    result = runner.invoke(app, ["info", url, (site.root / "slide.ome.zarr").as_uri()])
    assert result.exit_code == 0, result.output
    assert url in result.output and "reader: omezarr" in result.output and "ome-zarr 0.5" in result.output
    assert result.output.count("8,192") == 4 and "mpp: 0.5 x 0.5" in result.output  # both URLs
    assert set(site.sent) <= {"slide.ome.zarr/zarr.json"} | {f"slide.ome.zarr/{k}/zarr.json" for k in range(3)}


def test_predict_on_a_store_url_gives_the_local_store_s_csv_fetching_a_small_fraction(site, tmp_path):
    local, remote = tmp_path / "local.csv", tmp_path / "remote.csv"
    path = site.root / "slide.ome.zarr"
    result = runner.invoke(app, ["predict", str(path), "-m", str(site.model), "--out", str(local)])
    assert result.exit_code == 0, result.output
    site.reset()
    url = site.url("slide.ome.zarr")
    listed = tmp_path / "listed.csv"  # a dataset CSV that lists the store's URL
    listed.write_text(f"path,label\n{url},a\n")
    result = runner.invoke(app, ["predict", str(listed), "-m", str(site.model), "--out", str(remote)])
    assert result.exit_code == 0, result.output
    (header, *rows), (header2, *rows2) = _rows(local), _rows(remote)
    assert header2[:-1] == header and len(rows) == len(rows2) == 1
    assert rows2[0][0] == url and rows2[0][1:-1] == rows[0][1:]  # the same prediction and probabilities
    fetched, size = sent_for(site, "slide.ome.zarr"), store_bytes(path)
    assert 0 < fetched < 0.10 * size, (fetched, size)
    chunks = {k: n for k, n in site.sent.items() if "/c/" in k}
    assert chunks and all(n == (site.root / k).stat().st_size for k, n in chunks.items())  # each fetched once


def test_a_store_url_that_404s_is_one_line_naming_it(site, tmp_path):
    url = site.url("no-such-slide.ome.zarr")
    said = f"{url}: does not exist (HTTP 404 or no such object"
    result = runner.invoke(app, ["info", url])
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if url in line] == \
        [f"error: {said}: no zarr.json or .zattrs below it, so no OME-Zarr store)"]
    result = runner.invoke(app, ["predict", url, "-m", str(site.model), "--out", str(tmp_path / "p.csv")])
    assert result.exit_code != 0 and said in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("version", ["0.4", "0.5"])
def test_a_chunk_missing_behind_a_url_is_one_line_naming_the_url_and_the_chunk(tmp_path, version):
    """A store served with a chunk left out: zarr would read it as the fill value (black),
    and give a prediction on a slide that is partly not there; it is an error naming the
    URL, the chunk and where it is, as for a local store."""
    path = tmp_path / "site" / "bad.ome.zarr"
    write_ome_zarr(path, _image(), version=version, chunks=64)
    chunk = "0/0.1.2" if version == "0.4" else "0/c/0/1/2"  # (c, y, x): rows 64-127, columns 128-191
    (path / chunk).unlink()
    model = _tiny_model(tmp_path)
    with serve(tmp_path / "site") as server:
        url = server.url("bad.ome.zarr")
        listed = tmp_path / "in.csv"
        listed.write_text(f"path\n{url}\n")
        out = tmp_path / "p.csv"
        result = runner.invoke(app, ["predict", str(listed), "--model", str(model), "--out", str(out), "--level",
                                     "0", "--tissue-mask", "off", "--n-patches", "200", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    said = f"{url}: chunk {chunk} of level 0 (row 64, column 128) is missing"
    assert len([line for line in result.output.splitlines() if said in line]) == 1, result.output
    assert "0 predicted, 1 failed" in result.output and not out.read_text().splitlines()[1:]
    assert "Traceback" not in result.output


def test_the_view_of_a_store_behind_a_url_is_never_stored(tmp_path):
    """No one object's ETag says that a store's chunk was rewritten, and a server lists no
    chunks: the view is read from the store each time, never served stale."""
    write_ome_zarr(tmp_path / "site" / "s.ome.zarr", _image(), version="0.5")
    cache = ViewCache(tmp_path / "views")
    with serve(tmp_path / "site") as server:
        slide = open_image(server.url("s.ome.zarr"))
        low, mask = cache.view(slide, 0.1)
    local = open_image(tmp_path / "site" / "s.ome.zarr")
    assert (low == local.low_res_view(0.1)).all()
    assert not (tmp_path / "views").exists() or not any((tmp_path / "views").iterdir())


def test_a_sharded_store_behind_a_url_fetches_the_inner_chunks_a_patch_touches(tmp_path):
    """NGFF 0.5 stores of whole slides are sharded (Zarr v3: many chunks in one object, an
    index at its end): zarr asks the server for the index and the chunks' byte ranges, so
    a patch costs its chunks, not its shard; a missing shard is named as a missing chunk."""
    import numpy as np
    import torch

    image = np.random.default_rng(0).integers(0, 256, (3, 512, 768), dtype=np.uint8)
    store = tmp_path / "site" / "sharded.ome.zarr"
    group = zarr.open_group(str(store), mode="w", zarr_format=3)
    group.create_array("0", shape=image.shape, chunks=(3, 64, 64), shards=(3, 256, 256), dtype="uint8")[...] = image
    axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space"}, {"name": "x", "type": "space"}]
    group.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": [
        {"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 1, 1]}]}]}]}
    with serve(tmp_path / "site") as server:
        slide = open_image(server.url("sharded.ome.zarr"))
        server.reset()
        got = slide.read_patches(torch.tensor([[10, 20], [300, 400]]), (64, 64))
        assert np.array_equal(got[0].numpy(), image[:, 10:74, 20:84])
        assert np.array_equal(got[1].numpy(), image[:, 300:364, 400:464])
        shard = store / "0" / "c" / "0" / "1" / "1"
        assert set(server.sent) == {"sharded.ome.zarr/0/c/0/0/0", "sharded.ome.zarr/0/c/0/1/1"}
        assert server.sent["sharded.ome.zarr/0/c/0/1/1"] < 0.3 * shard.stat().st_size  # 4 of its 16 chunks
        shard.unlink()
        with pytest.raises(ImageReadError, match="chunk 0/c/0/1/1 of level 0 \\(row 256, column 256\\) is missing"):
            open_image(server.url("sharded.ome.zarr")).read_patches(torch.tensor([[300, 400]]), (64, 64))
