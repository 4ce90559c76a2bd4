"""Inputs behind a URL: ``http(s)://``, ``s3://``, ``gs://``, ``file://`` and any other
protocol fsspec knows, read through fsspec (``pip install ats[remote]``: fsspec and aiohttp
for HTTP; s3fs, gcsfs, ... for the clouds, each from its own package).

Why fsspec: it is the one interface the Python imaging stack reads object storage through
(tiffslide, zarr, xarray), with one file object per protocol that fetches byte ranges on
demand. What is fetched, and why:

* **Slides and TIFFs** are read by tifffile from fsspec's file object, lazily as from a
  local file: the header and IFDs, then only the strips/tiles the low-res view's level and
  the sampled patches touch (:class:`~ats_cli.data.slides.TiffReader`). tifffile parses
  the header and IFDs through a file object that fetches blocks of :data:`BLOCK_BYTES` and
  keeps the last :data:`CACHE_BLOCKS` of them in memory (fsspec's ``blockcache``: the many
  small reads of an IFD cost one request; memory per open slide is bounded, 8 MiB,
  whatever the file's size). A tile or strip is then fetched as exactly its byte range
  (:meth:`RemoteFile.read_range`), several at once: a block around each would fetch its
  neighbours too, which sparse patches rarely use (a 64 KiB block around each 20 KB JPEG
  tile fetched three times the bytes), and ranges fetched concurrently hide the round
  trips a remote store costs. OpenSlide reads only local paths (it opens the file itself, by name), so a vendor
  suffix (``.svs``, ...) behind a URL is read by tifffile when it is a TIFF (an Aperio SVS
  is) and refused by name otherwise: download such a file first.
* **Ordinary images** (PNG, JPEG, ...) are decoded whole anyway, so they are fetched whole,
  into memory, under the pixel budget (checked from the header, as for a local file) and a
  byte limit: :data:`MAX_FETCH_BYTES` (1 GiB; a 64 M pixel PNG is at most 256 MB).
* **OME-Zarr stores** are read by zarr through an asynchronous fsspec file system
  (:func:`async_filesystem`), chunk by chunk, only the chunks the view's level and the
  patches touch (:mod:`ats_cli.data.omezarr`); their metadata documents through
  :func:`fetch_document`, bounded. **Virtual slides** are not read from a URL: refused by name.

A URL that cannot be read (404, a refused connection, no answer within
``ATS_URL_TIMEOUT`` seconds, default 60, a protocol whose package is not installed) is a
:class:`~ats_cli.data.images.RemoteReadError`: one line naming the URL and what happened.

Caches (the view cache of :mod:`ats_cli.data.inputs`, the prepared store of
:mod:`ats_cli.data.prepared`) key a URL by itself and by what the server says of the bytes
behind it (:func:`remote_stat`): the size and the ETag and/or Last-Modified. A server that
gives neither cannot prove that a URL still names the same bytes, so nothing read from such
a URL is stored: it is read again each time, never served stale.

Standard library only at import (the dataset loader and the CLI's parsing ask
:func:`is_url`); fsspec is imported when a URL is opened.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ImageReadError", "RemoteReadError",
           "is_url", "input_path", "url_suffix", "url_name", "open_remote", "remote_stat", "fetch_bytes",
           "fetch_document", "async_filesystem", "not_found",
           "BLOCK_BYTES", "CACHE_BLOCKS", "MAX_FETCH_BYTES", "TIMEOUT_ENV"]

# scheme "://": two letters at least, so that a Windows drive (C:/...) is never a URL
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
BLOCK_BYTES = 64 << 10  # bytes fetched per request of the header/IFD reads (a level's IFD in one or two)
CACHE_BLOCKS = 128  # blocks kept per open file: 8 MiB of memory per remote slide, whatever its size
LARGE_READ_BLOCKS = 4  # a read of more blocks than this is fetched as one range (RemoteFile.read)
MAX_FETCH_BYTES = 1 << 30  # an image fetched whole (PNG, JPEG) may be at most this large
TIMEOUT_ENV = "ATS_URL_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0


class ImageReadError(ValueError):
    """An image file that cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str):
        self.path = input_path(path)  # a URL stays a URL
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class RemoteReadError(ImageReadError):
    """An input behind a URL that cannot be fetched (404, timeout, refused, a protocol
    without its package): the message names the URL."""


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``), not a local path. Only a string can be
    one: a :class:`~pathlib.Path` has already folded the ``//`` away."""
    return isinstance(path, str) and _URL.match(path) is not None


def input_path(path: str | os.PathLike[str]) -> str | Path:
    """An input's path as the readers keep it: a URL stays the string it is (``Path`` would
    fold ``http://host`` into ``http:/host``), anything else becomes a :class:`Path`."""
    return path if is_url(path) else Path(path)


def url_suffix(url: str) -> str:
    """The suffix of the URL's path (``.tif``), without its query (a signed S3 URL's
    ``?X-Amz-...``) or fragment, lower-cased: what chooses its reader."""
    return PurePosixPath(urlsplit(url).path).suffix.lower()


def url_name(url: str) -> str:
    """The last part of the URL's path (``slide.tif``), for output names."""
    return PurePosixPath(urlsplit(url).path).name or urlsplit(url).netloc


def _timeout() -> float:
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give a positive number of seconds, e.g. 60")
    return value


def _error(url: str, problem: str):

    return RemoteReadError(url, problem)


def _filesystem(url: str, asynchronous: bool = False) -> tuple[Any, str]:
    """(fsspec file system, its path) for ``url``; HTTP with a timeout on connecting and on
    each read (aiohttp's default waits 5 minutes for a stalled server). ``asynchronous``:
    the file system zarr's store reads through (:func:`async_filesystem`), made async if its
    protocol is not."""
    try:
        import fsspec
    except ImportError:
        raise _error(url, "reading a URL needs fsspec: pip install 'ats[remote]'") from None
    protocol = urlsplit(url).scheme.lower()
    options: dict[str, Any] = {"asynchronous": True} if asynchronous else {}
    try:
        if protocol in ("http", "https"):
            import aiohttp

            t = _timeout()
            options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, connect=t, sock_read=t)}
        fs, where = fsspec.core.url_to_fs(url, **options)
        if asynchronous and not fs.async_impl:  # file://, and the other synchronous protocols
            try:
                from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
            except ImportError:  # fsspec before 2024.12
                raise _error(url, f"zarr reads {protocol}:// through fsspec's AsyncFileSystemWrapper, new in "
                             f"fsspec 2024.12 (this is {fsspec.__version__}): pip install -U fsspec") from None
            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        return fs, where
    except ImportError as e:  # fsspec names the package a protocol needs
        fix = "pip install 'ats[remote]'" if protocol in ("http", "https") else "its fsspec package"
        raise _error(url, f"the {protocol}:// protocol needs a package that is not installed ({e}): {fix}") from None
    except ValueError as e:  # an unknown protocol; a bad ATS_URL_TIMEOUT
        raise _error(url, f"not a URL fsspec can read ({e})" if "protocol" in str(e).lower() else str(e)) from None


def describe(url: str, e: BaseException) -> str:
    """One line for what went wrong fetching ``url``: the status of an HTTP error, "does
    not exist" for a 404 or a missing object, "no answer within N s" for a timeout."""
    import asyncio

    if isinstance(e, FileNotFoundError) and isinstance(e.__cause__, Exception):
        return describe(url, e.__cause__)  # fsspec's HTTP info says "not found" for any failure: the cause says why
    status = getattr(e, "status", None) or getattr(e, "code", None)
    if not_found(e):
        return "does not exist (HTTP 404 or no such object)"
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return f"no answer within {_timeout():g} s (timed out; {TIMEOUT_ENV}=SECONDS waits longer)"
    if isinstance(status, int):
        message = getattr(e, "message", "") or ""
        return f"the server answered HTTP {status}{' ' + message if message else ''}"
    if isinstance(e, PermissionError):
        return f"access denied ({e})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"cannot be fetched ({type(e).__name__}{': ' + text if text else ''})"


def not_found(e: BaseException) -> bool:
    """Whether ``e`` says that nothing is at the URL (HTTP 404, no such object), as
    :func:`describe` words it, rather than that the server could not be asked."""
    if isinstance(e, FileNotFoundError) and isinstance(e.__cause__, Exception):
        return not_found(e.__cause__)
    status = getattr(e, "status", None) or getattr(e, "code", None)
    return isinstance(e, FileNotFoundError) or status == 404


def fetch_document(url: str, limit: int) -> bytes | None:
    """The content of a small object at ``url`` (an OME-Zarr store's metadata document), or
    None when there is none (HTTP 404, no such object). Refused by name, before it is
    fetched, when the server says it is larger than ``limit`` bytes; any other failure is a
    RemoteReadError naming the URL."""
    fs, where = _filesystem(url)
    try:
        size = fs.info(where).get("size")
    except Exception as e:  # noqa: BLE001 - see remote_stat
        if not_found(e):
            return None
        raise _error(url, describe(url, e)) from None
    if size is not None and size > limit:
        raise _error(url, f"is {size:,} bytes, more than the {limit:,} a metadata document may have")
    try:
        data = fs.cat_file(where) if size is not None else fs.cat_file(where, 0, limit + 1)
    except Exception as e:  # noqa: BLE001 - see remote_stat
        if not_found(e):
            return None
        raise _error(url, describe(url, e)) from None
    if len(data) > limit:
        raise _error(url, f"sent more than the {limit:,} bytes a metadata document may have")
    return data


def async_filesystem(url: str) -> tuple[Any, str]:
    """(an asynchronous fsspec file system, its path) for ``url``: what zarr's
    ``FsspecStore`` reads an OME-Zarr store behind a URL through (the HTTP timeout of
    :func:`remote_stat`'s; a synchronous protocol, as ``file://``, wrapped)."""
    return _filesystem(url, asynchronous=True)


def remote_stat(url: str) -> dict[str, Any]:
    """What the server says of the bytes behind ``url``: ``{"url", "bytes", "etag",
    "last_modified"}`` ("" where it says nothing). Raises RemoteReadError naming the URL."""
    fs, where = _filesystem(url)
    try:
        info = fs.info(where)
    except Exception as e:  # noqa: BLE001 - fsspec and its backends raise many types; named in one line
        raise _error(url, describe(url, e)) from None
    size = info.get("size")
    if size is None:
        raise _error(url, "the server does not say its size, so it cannot be read in parts")
    etag = info.get("ETag") or info.get("etag") or info.get("ETAG") or ""
    modified = info.get("Last-Modified") or info.get("LastModified") or info.get("mtime") or info.get("updated") or ""
    return {"url": url, "bytes": int(size), "etag": str(etag), "last_modified": str(modified)}


def proves_unchanged(stat: dict[str, Any]) -> bool:
    """Whether ``stat`` (:func:`remote_stat`) can tell a changed file: the server gave a
    validator (ETag or Last-Modified). Without one, nothing read from the URL is cached."""
    return bool(stat.get("etag") or stat.get("last_modified"))


class RemoteFile:
    """A read-only file object over ``url`` whose I/O errors are one line naming the URL:
    what tifffile reads a remote TIFF from. Wraps fsspec's file (``blockcache``: the last
    :data:`CACHE_BLOCKS` blocks of :data:`BLOCK_BYTES`); not thread-safe (the reader locks)."""

    def __init__(self, url: str, block_size: int = BLOCK_BYTES, blocks: int = CACHE_BLOCKS):
        self.url = url
        fs, where = self._fs, self._where = _filesystem(url)
        try:
            self._f = fs.open(where, "rb", block_size=block_size, cache_type="blockcache",
                              cache_options={"maxblocks": blocks})
        except Exception as e:  # noqa: BLE001 - see remote_stat
            raise _error(url, describe(url, e)) from None
        self.size = self._f.size
        self.name = url

    def _call(self, what, *args):
        try:
            return what(*args)
        except Exception as e:  # noqa: BLE001 - see remote_stat
            raise _error(self.url, describe(self.url, e)) from None

    def read_range(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset``, fetched as exactly that range (not through the block
        cache, and without moving the file position): safe from several threads at once."""
        data = self._call(self._fs.cat_file, self._where, offset, offset + n)
        if len(data) != n:
            raise _error(self.url, f"sent {len(data):,} bytes for the {n:,} at offset {offset:,}; the file changed "
                         "or the server ignores byte ranges")
        return data

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, n)`` of ``ranges``, fetched in one concurrent batch
        (fsspec's ``cat_ranges``), ranges that touch or overlap merged into one request:
        a tiled TIFF stores a row of tiles one after the other, so a region's tiles cost a
        request per row of them, all in flight at once, rather than one round trip each."""
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        spans: list[list[int]] = []  # [start, end, members...]
        for i in order:
            off, n = ranges[i]
            if spans and off <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], off + n)
                spans[-1].append(i)
            else:
                spans.append([off, off + n, i])
        blobs = self._call(self._fs.cat_ranges, [self._where] * len(spans), [s[0] for s in spans],
                           [s[1] for s in spans])
        out: list[bytes] = [b""] * len(ranges)
        for span, blob in zip(spans, blobs, strict=True):
            if isinstance(blob, Exception):
                raise _error(self.url, describe(self.url, blob))
            if len(blob) != span[1] - span[0]:
                raise _error(self.url, f"sent {len(blob):,} bytes for the {span[1] - span[0]:,} at offset "
                             f"{span[0]:,}; the file changed or the server ignores byte ranges")
            for i in span[2:]:
                off, n = ranges[i]
                out[i] = blob[off - span[0]: off - span[0] + n]
        return out

    def read(self, n: int = -1) -> bytes:
        """``n`` bytes from the position: a small read through the block cache, a large one
        (more than :data:`LARGE_READ_BLOCKS` blocks: a 100k² level's 2.4 MB tile table) as
        one range, which the cache would fetch one block after another."""
        pos = self._f.tell()
        if n is None or n < 0:
            n = self.size - pos
        n = max(0, min(n, self.size - pos))
        if n > LARGE_READ_BLOCKS * self._f.blocksize:
            data = self.read_range(pos, n)
            self._f.seek(pos + n)
            return data
        return self._call(self._f.read, n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer)[: len(data)] = data
        return len(data)

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._f.closed

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_remote(url: str) -> RemoteFile:
    """``url`` as a seekable binary file read in blocks (:class:`RemoteFile`)."""
    return RemoteFile(url)


def fetch_bytes(url: str, limit: int = MAX_FETCH_BYTES) -> bytes:
    """The whole content of ``url`` (an image decoded whole anyway), refused by name when
    the server says it is larger than ``limit`` bytes, before any of it is fetched."""
    stat = remote_stat(url)
    if stat["bytes"] > limit:
        raise _error(url, f"is {stat['bytes']:,} bytes, over the {limit:,} an image fetched whole may be "
                     "(a slide is read in parts as a tiled TIFF)")
    fs, where = _filesystem(url)
    try:
        data = fs.cat_file(where)
    except Exception as e:  # noqa: BLE001 - see remote_stat
        raise _error(url, describe(url, e)) from None
    if len(data) > limit:
        raise _error(url, f"sent more than {limit:,} bytes")
    return data
