"""Messages UCX received for tags nobody has posted a receive for ("unexpected" messages), found and discarded.

Contract:
* `oldest(worker, tag, mask)`: `(tag, length)` of the oldest unexpected message whose tag matches `tag` under
  `mask` (mask 0: any message), or None. It stays queued.
* `discard(worker, tag, mask, limit)`: removes up to `limit` unexpected messages matching `tag` under `mask`,
  oldest first, and returns how many and their bytes (`Discarded`). Each is received into a small scratch buffer
  that is never read, so UCX releases the descriptor that held it (a longer message completes as truncated, which
  is what ends it).
* Every call must come from the thread that progresses `worker` (a node's event loop thread, `ucx.progress`).

Why: UCX buffers every eager message that arrives before a matching receive is posted, without bound, and keeps it
until some receive takes it; a message on a tag nobody will ever receive on (sent by a client that then left, or on
a tag of no connection) stayed in a node's memory forever (+31 MiB per client that sent 4,000 messages of 4 KiB
before leaving). The node discards them (`ucx.connections`), as they arrive where it can tell at once that nobody
will receive them, so the memory UCX takes for them stays bounded (`ucx.progress`'s sweeper).
"""

from __future__ import annotations

from typing import Any, NamedTuple

SCRATCH_BYTES = 64  # what a discarded message is received into (the rest of it is dropped as truncated)
_scratch: list[Any] = []  # one scratch buffer (UCX may write into it from any discard; its bytes are never read)
_pending: list[Any] = []  # discards UCX has not completed yet (kept alive until it has)


def _api() -> Any:
    import ucxx._lib.libucxx as ucx_api

    return ucx_api


def oldest(worker: Any, tag: int, mask: int) -> tuple[int, int] | None:
    api = _api()
    probe = worker.tag_probe(api.UCXXTag(tag), api.UCXXTagMask(mask), remove=False)
    if not probe.matched:
        return None
    return int(probe.sender_tag.value), int(probe.length)


class Discarded(NamedTuple):
    messages: int
    nbytes: int


def discard(worker: Any, tag: int, mask: int, limit: int = 1 << 16) -> Discarded:
    api = _api()
    if not _scratch:
        import numpy as np
        from ucxx._lib.arr import Array

        _scratch.append(Array(np.zeros(SCRATCH_BYTES, dtype=np.uint8)))
    _pending[:] = [r for r in _pending if not r.completed]
    count = nbytes = 0
    while count < limit:
        probe = worker.tag_probe(api.UCXXTag(tag), api.UCXXTagMask(mask), remove=True)
        if not probe.matched:
            break
        nbytes += int(probe.length)
        request = worker.tag_recv_with_handle(_scratch[0], probe)
        if not request.completed:
            _pending.append(request)
        count += 1
    return Discarded(count, nbytes)
