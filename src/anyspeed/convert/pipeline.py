"""Overlap reading and converting with writing: the next group is produced in a thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetch(items: Iterable[T], depth: int = 1) -> Iterator[T]:
    """``items``, produced ``depth`` ahead in a background thread (file reads and torch ops
    release the GIL, so a conversion reads group N+1 while it writes group N). Errors are
    re-raised here; memory is bounded by ``depth + 2`` items."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            q.put(_Failed(exc))

    thread = threading.Thread(target=produce, daemon=True, name="anyspeed-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
