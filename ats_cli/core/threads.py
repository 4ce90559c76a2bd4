"""Named thread pools, one per process, for reads that release the GIL (file reads, zlib,
image codecs).

Why named: a batch's sources are read on one pool and each slide's tiles on another, so
a read of the first kind can wait for reads of the second without ever waiting for a
thread of its own pool (one pool for both could fill every thread with waiting readers).
Why per process: a DataLoader worker is a fork, and a pool copied by ``fork`` has no
threads behind it (tasks submitted to it never run), so a pool is started again in any
process other than the one that started it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["READ_THREADS", "thread_pool"]

READ_THREADS = 8  # enough to overlap the waits of a batch's reads; the decoding itself is short
_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}
_lock = threading.Lock()


def thread_pool(name: str) -> ThreadPoolExecutor:
    """This process's pool ``name`` of :data:`READ_THREADS` threads, started on first use."""
    with _lock:
        pid, pool = _pools.get(name, (None, None))
        if pid != os.getpid():
            pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix=f"ats-{name}")
            _pools[name] = (os.getpid(), pool)
        return pool
