"""The store side of a PUT (`ems.pool.handlers.NodeHandlers` runs the request around it): the buffers its data is
received into, the values stored from them, and a shared-memory PUT's copies into the store.

Contract:
* `receive_values(store, channel, request, keys)`: the PUT's data is received into buffers recycled from evicted
  values where the store has them (no first-touch page faults), every receive's length verified
  (`RequestChannel.receive_frames`), so a recycled buffer's old bytes can never be stored. A value alone in its
  segment is stored as that buffer: room for it is reserved first, so a full node's evictions hand their buffers
  straight to the next receive (steady-state recycling); packed values are copied out, so a small value never pins
  its whole segment in memory (the store charges only the value's bytes), and their segments are recycled. Returns
  each value and the reservation made for it; on any failure every buffer and reservation is given back, once
  every receive into it has ended.
* `put_but(store, refused, keys, values, reserved)`: stores the values not `refused` (namespace records past their
  bounds), giving back the refused ones' buffers and reservations.
* `store_copies(store, namespaces, metrics, array, keys, request)`: a shared-memory PUT: each value copied out of
  the region into a buffer of the store's and stored, copy and check in one pass (the copies are checked, never
  the region, which the client can still write); every buffer is recycled on every error path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ems.pool.namespaces import NamespaceBook
from ems.pool.node_store import NodeStore
from ems.transport import metas, protocol
from ems.transport.handler import RequestChannel
from ems.transport.shm import RangedRequest

if TYPE_CHECKING:
    from ems.pool.metrics import NodeMetrics


async def receive_values(
    store: NodeStore, channel: RequestChannel, request: metas.PutRequest, keys: list[bytes]
) -> tuple[list, list[int]]:
    """(values, reserved): each value of the PUT, received (see the module docstring), and the store's reservation
    made for it (0: none)."""
    sizes = request.segment_sizes
    lone = request.value_lens == sizes[request.plan]  # each value: alone in its segment
    reserves = np.zeros(sizes.size, dtype=np.int64)
    lens = protocol.key_lens(keys)
    reserves[request.plan[lone]] = [store.charge_of(int(k), int(n)) for k, n in zip(lens[lone], request.value_lens[lone])]
    reserves[reserves > store.capacity_bytes] = 0  # refused by `put_owned` anyway: nothing to reserve
    segments: list = []
    try:
        for size, reserve in zip(sizes.tolist(), reserves.tolist()):
            segments.append(store.allocate(int(size), reserve=int(reserve)))
        await _receive_put(channel, request, segments)
    except BaseException:
        for seg, reserve in zip(segments, reserves.tolist()):
            store.recycle(seg, reserved=int(reserve))  # every receive into it has ended
        raise
    values = _split_values(segments, request.plan, request.value_offsets, request.value_lens, sizes)
    reserved = np.where(lone, reserves[request.plan], 0).tolist()
    for seg, reserve in zip(segments, reserves.tolist()):
        if reserve == 0:  # a packed segment: its values were copied out
            store.recycle(seg)
    return values, reserved


def put_but(store: NodeStore, refused: set[int], keys: list[bytes], values: list, reserved: list[int]) -> list[bool]:
    """`put_owned_each` of the values not `refused` (by index: namespace records past their bounds, small); the
    refused ones' buffers and reservations given back (a value alone in its segment is the store's buffer)."""
    kept = [i for i in range(len(keys)) if i not in refused]
    for i in refused:
        if isinstance(values[i], np.ndarray):
            store.recycle(values[i], reserved=int(reserved[i]))
    verdicts = store.put_owned_each([keys[i] for i in kept], [values[i] for i in kept], [reserved[i] for i in kept])
    stored = [False] * len(keys)
    for i, ok in zip(kept, verdicts):
        stored[i] = ok
    return stored


def store_copies(
    store: NodeStore,
    namespaces: NamespaceBook,
    metrics: NodeMetrics | None,
    array: np.ndarray,
    keys: list[bytes],
    request: RangedRequest,
) -> list[bool]:
    """Copy each value out of the region `array` into a buffer of the store's and store it, copy and check in one
    pass (`NodeStore.put_copied_each`: the copies are checked, never the region, which the client can still
    write). Every buffer is recycled on every error path."""
    over_bounds = namespaces.refused(keys, request.lens)  # namespace records past their bounds
    fits: list[int] = []  # the values the store can hold at all
    buffers: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    charges: list[int] = []
    try:
        for i, (key, offset, n) in enumerate(zip(keys, request.offsets.tolist(), request.lens.tolist())):
            charge = store.charge_of(len(key), n)
            if charge > store.capacity_bytes or i in over_bounds:
                continue
            buffers.append(store.allocate(n, reserve=charge))
            charges.append(charge)
            sources.append(array[offset : offset + n])
            fits.append(i)
        verdicts = store.put_copied_each([keys[i] for i in fits], buffers, sources, charges)
    except BaseException:
        for buffer, charge in zip(buffers, charges):
            store.recycle(buffer, reserved=charge)
        raise
    stored = [False] * len(keys)
    for i, ok in zip(fits, verdicts):
        stored[i] = ok
    refused = [b for b, ok in zip(buffers, (stored[i] for i in fits)) if not ok]  # for the metrics: maybe damaged
    if refused and metrics is not None:
        metrics.count_damaged(refused, [False] * len(refused))
    return stored


async def _receive_put(channel: RequestChannel, request: metas.PutRequest, segments: list) -> None:
    """Fill every byte of `segments` with the PUT's data: from the (verified) head when it came inline, else
    by length-verified receives. Returns only once every receive has ended (so a failed request's buffers can
    be recycled: UCX writes into none of them any more)."""
    inline = channel.inline_data()
    if inline is not None:
        starts = np.cumsum(request.segment_sizes) - request.segment_sizes
        for seg, start, size in zip(segments, starts.tolist(), request.segment_sizes.tolist()):
            seg[:] = np.frombuffer(inline, dtype=np.uint8, count=size, offset=start)
        return
    views = [memoryview(s) for s in segments]
    ends = (request.frame_offsets + request.frame_lens).tolist()
    await channel.receive_frames(
        [views[s][a:b] for s, a, b in zip(request.frame_segments.tolist(), request.frame_offsets.tolist(), ends)],
        request.frame_ends,
    )


def _split_values(segments: list[np.ndarray], plan: np.ndarray, offsets: np.ndarray, lens: np.ndarray, sizes: np.ndarray) -> list:
    """Each value of a PUT: a value alone in its segment is stored as the receive buffer itself (so the store can
    recycle it once evicted); packed ones are copied out, so a small value never pins its whole segment in memory
    (the store charges only the value's bytes)."""
    out: list = []
    for seg, off, n in zip(plan.tolist(), offsets.tolist(), lens.tolist()):
        if n == int(sizes[seg]):
            out.append(segments[seg])
        else:
            out.append(bytes(memoryview(segments[seg])[off : off + n]))
    return out
