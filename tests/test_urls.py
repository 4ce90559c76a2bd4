"""Inputs behind a URL (ats_cli.data.remote), served from 127.0.0.1 by the test itself
(tests/httpserve.py: byte ranges, ETag/Last-Modified, a count of the bytes it sends):
``ats info URL``, ``ats predict URL`` (the local file's CSV, a small fraction of the
slide fetched), a dataset CSV of URLs trained from, a dead URL's one line, and the caches
keyed by what the server says of the bytes."""

from __future__ import annotations

import csv
import json
import socket
import time

import imagecodecs
import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from typer.testing import CliRunner

from ats_cli.cli import app
from tests.httpserve import serve

runner = CliRunner()
TILE = 256
SIDE = 20_000


def write_pyramid(path, side: int = SIDE, seed: int = 0, glass: int = 245) -> None:
    """A side² RGB pyramid (levels /4 down to one tile, as separate IFDs; 0.5 µm/px) of
    256² JPEG tiles: glass, and an elliptical "tissue" of noise over about a third of it.
    The tiles are encoded once and written as they are (tifffile takes encoded tiles), so a
    20k² slide of ~50 MB is written in a fraction of a second."""
    rng = np.random.default_rng(seed)
    tissue = [imagecodecs.jpeg_encode(np.clip(np.array([200, 110, 170]) + rng.integers(-20, 21, (TILE, TILE, 3)),
                                              0, 255).astype(np.uint8), level=90) for _ in range(4)]
    glass = imagecodecs.jpeg_encode(np.full((TILE, TILE, 3), glass, np.uint8), level=90)

    def tiles(size):
        k = 0
        for r in range(0, size, TILE):
            for c in range(0, size, TILE):
                k += 1
                inside = ((r + TILE / 2) / size - 0.5) ** 2 + ((c + TILE / 2) / size - 0.5) ** 2 < 0.3 ** 2
                yield tissue[k % 4] if inside else glass

    sizes = [side]
    while sizes[-1] > 2 * TILE:
        sizes.append(sizes[-1] // 4)
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        for k, s in enumerate(sizes):
            tw.write(tiles(s), shape=(s, s, 3), dtype=np.uint8, tile=(TILE, TILE), photometric="rgb",
                     compression="jpeg", subfiletype=1 if k else 0, resolution=(2e4, 2e4), resolutionunit="CENTIMETER")


def make_model(path) -> None:
    """An untrained one-level model reading 20 patches of 64 px and a 1/100 view (as
    benchmarks/slides.py's)."""
    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.models import create_model, model_spec

    torch.manual_seed(0)
    cfg = TrainConfig(patch_size=64, scale=0.01, n_patches=20, eval_n_patches=0, feature_width=8)
    spec = model_spec(cfg, n_classes=2, channels=3)
    save_checkpoint(path, spec=spec, classes=["a", "b"], model=create_model(spec))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The served folder (a 20k² pyramid, a model beside it, not served) and its server."""
    root = tmp_path_factory.mktemp("site")
    write_pyramid(root / "slide.tif")
    model = tmp_path_factory.mktemp("model") / "model.pt"
    make_model(model)
    with serve(root) as server:
        server.model = model
        yield server


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def test_ats_info_reads_a_pyramid_behind_a_url_from_its_header(site):
    site.reset()
    url = site.url("slide.tif")
    result = runner.invoke(app, ["info", url])
    assert result.exit_code == 0, result.output
    assert url in result.output and "reader: tifffile" in result.output
    assert "20,000" in result.output and "mpp: 0.5 x 0.5" in result.output
    size = (site.root / "slide.tif").stat().st_size
    assert 0 < site.sent["slide.tif"] < 0.02 * size  # the IFDs and one tile, not the slide


def test_predict_on_a_url_gives_the_local_file_s_csv_fetching_a_small_fraction(site, tmp_path):
    local, remote = tmp_path / "local.csv", tmp_path / "remote.csv"
    result = runner.invoke(app, ["predict", str(site.root / "slide.tif"), "-m", str(site.model), "--out", str(local)])
    assert result.exit_code == 0, result.output
    site.reset()
    url = site.url("slide.tif")
    result = runner.invoke(app, ["predict", url, "-m", str(site.model), "--out", str(remote)])
    assert result.exit_code == 0, result.output
    (header, *rows), (header2, *rows2) = _rows(local), _rows(remote)
    assert header == header2 and len(rows) == len(rows2) == 1
    assert rows2[0][0] == url and rows2[0][1:] == rows[0][1:]  # the same prediction and probabilities
    size = (site.root / "slide.tif").stat().st_size
    assert 0 < site.sent["slide.tif"] < 0.10 * size, (site.sent, size)


def test_a_url_that_404s_is_one_line_naming_it(site, tmp_path):
    url = site.url("no-such-slide.tif")
    result = runner.invoke(app, ["info", url])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if url in line]
    assert lines == [f"error: {url}: does not exist (HTTP 404 or no such object)"]
    out = tmp_path / "p.csv"
    result = runner.invoke(app, ["predict", url, "-m", str(site.model), "--out", str(out)])
    assert result.exit_code != 0
    assert f"{url}: does not exist (HTTP 404 or no such object)" in result.output
    assert "Traceback" not in result.output


def test_a_url_that_does_not_answer_is_one_line_after_the_timeout(monkeypatch):
    """A server that accepts the connection and never answers: ATS_URL_TIMEOUT seconds,
    then one line naming the URL (aiohttp's own default would wait five minutes)."""
    monkeypatch.setenv("ATS_URL_TIMEOUT", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/slide.tif"
        start = time.perf_counter()
        result = runner.invoke(app, ["info", url])
        took = time.perf_counter() - start
    assert result.exit_code == 1
    assert f"error: {url}: no answer within 1 s" in result.output
    assert took < 10


def _png(path, colour, size=96):
    rng = np.random.default_rng(sum(colour))
    noise = rng.integers(-10, 11, (size, size, 3))
    Image.fromarray(np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)).save(path)


def test_train_from_a_dataset_csv_of_urls_and_predict_it(tmp_path):
    """A dataset whose CSVs list URLs (of PNGs, fetched whole): trained and predicted as
    the same dataset of local paths; the prepared copies are keyed by the URLs."""
    served = tmp_path / "served"
    served.mkdir()
    for i in range(4):
        _png(served / f"red{i}.png", (200, 40, 40))
        _png(served / f"blue{i}.png", (40, 40, 200))
    data = tmp_path / "data"
    data.mkdir()
    with serve(served) as server:
        for split, ids in (("train", (0, 1, 2)), ("test", (3,))):
            lines = ["path,label"] + [f"{server.url(f'{c}{i}.png')},{c}" for i in ids for c in ("red", "blue")]
            (data / f"{split}.csv").write_text("\n".join(lines) + "\n")
        (data / "dataset.json").write_text(json.dumps({"classes": ["red", "blue"]}))
        run = tmp_path / "run"
        result = runner.invoke(app, ["train", str(data), "--out", str(run), "--epochs", "1", "--batch-size", "2",
                                     "--patch-size", "16", "--n-patches", "2", "--scale", "0.25", "--workers", "0",
                                     "--feature-net", "small-cnn"])
        assert result.exit_code == 0, result.output
        assert "unreadable" not in result.output
        assert list((data / ".ats-prepared").glob("*.atsp")), "the URLs' images were prepared"
        out = tmp_path / "p.csv"
        result = runner.invoke(app, ["predict", str(data / "test.csv"), "-m", str(run), "--out", str(out)])
        assert result.exit_code == 0, result.output
        header, *rows = _rows(out)
        assert [r[0] for r in rows] == [server.url("red3.png"), server.url("blue3.png")]


def test_the_view_cache_keys_a_url_by_what_the_server_says_and_never_serves_a_stale_view(tmp_path):
    """A URL's cached view is named by the URL, its size, ETag and Last-Modified: read
    again without fetching the level; the file rewritten behind the same URL names another
    entry (the new view); a server that sends no validator has nothing stored."""
    from ats_cli.data.inputs import ViewCache
    from ats_cli.data.slides import open_image

    served = tmp_path / "served"
    served.mkdir()
    write_pyramid(served / "a.tif", side=2048, seed=0)
    cache = ViewCache(tmp_path / "views")
    with serve(served) as server:
        url = server.url("a.tif")
        with open_image(url) as slide:
            first, _ = cache.view(slide, 0.1)
            assert len(list(cache.folder.glob("*.npz"))) == 1
            server.reset()
            again, _ = cache.view(slide, 0.1)
            assert torch.equal(first, again) and server.sent["a.tif"] == 0  # from the cache: a HEAD, no bytes
        time.sleep(0.01)
        write_pyramid(served / "a.tif", side=2048, glass=235)  # other glass behind the same URL
        with open_image(url) as slide:
            changed, _ = cache.view(slide, 0.1)
        assert len(list(cache.folder.glob("*.npz"))) == 2 and not torch.equal(first, changed)
    bare = ViewCache(tmp_path / "bare")
    with serve(served, validators=False) as server, open_image(server.url("a.tif")) as slide:
        cache_view, _ = bare.view(slide, 0.1)
        assert torch.equal(cache_view, changed)
    assert not list(bare.folder.glob("*.npz"))  # nothing proves the URL unchanged: never stored


@pytest.mark.parametrize("validators", [True, False])
def test_a_prepared_copy_of_a_url_is_stale_once_the_bytes_behind_it_change(tmp_path, validators):
    """Rewritten behind the same URL at the same size (a BMP: uncompressed), an image's
    prepared copy is no longer used: by the ETag/Last-Modified, or without them by the
    content's digest (the stamp, the size, cannot tell)."""
    from ats_cli.data.prepared import PreparedStore, prepare

    served = tmp_path / "served"
    served.mkdir()
    _png(served / "a.bmp", (200, 40, 40))
    with serve(served, validators=validators) as server:
        url = server.url("a.bmp")
        store = PreparedStore(tmp_path / "prepared", tmp_path, channels=3, scale=0.25)
        report = prepare(store, [url], log=lambda _: None)
        assert (report.prepared, report.failed) == (1, [])
        assert store.is_fresh(url)
        size = (served / "a.bmp").stat().st_size
        time.sleep(0.01)
        _png(served / "a.bmp", (40, 40, 200))
        assert (served / "a.bmp").stat().st_size == size
        assert not store.is_fresh(url)
        assert store.open_input(url, patch_size=(16, 16)) is None  # read from the URL instead


def test_file_urls_and_protocols_without_their_package_or_unknown(tmp_path):
    """``file://`` reads a local slide through the same path; a protocol whose fsspec
    package is missing (gs:// without gcsfs) or unknown is one line naming the URL; no
    request leaves the machine."""
    write_pyramid(tmp_path / "a.tif", side=1024)
    file_url = (tmp_path / "a.tif").as_uri()
    urls = [file_url, "foo://bucket/a.tif"]
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        urls.append("gs://bucket/a.tif")
    result = runner.invoke(app, ["info", *urls])
    assert result.exit_code == 1
    assert file_url in result.output and "reader: tifffile" in result.output and "1,024" in result.output
    assert "error: foo://bucket/a.tif: not a URL fsspec can read (Protocol not known: foo)" in result.output
    if len(urls) == 3:
        line = [x for x in result.output.splitlines() if x.startswith("error: gs://")]
        assert len(line) == 1 and "gs:// protocol needs a package that is not installed" in line[0]
        assert "gcsfs" in line[0]
    assert f"{len(urls) - 1} of {len(urls)} file(s) failed" in result.output
