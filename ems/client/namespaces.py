"""An engine's namespace record, and the one-time diagnosis of an engine that never hits.

Contract:
* `NamespaceWatch(pool, tenant, cc_config)` belongs to one `ContextCaching`. `registered(namespace, layout)` (each
  `register_kvcache`) publishes the record of the V1 namespace (`ems.store.ns_records`): the SDK's parts (`model_id`,
  `tp_size`, `tp_rank`, `pp`, `layout` and, read from the layout's signature, `dtype` and `layout_groups`) merged
  with what the engine described (`describe(model, parts)`: an integration's own, e.g. the vLLM connector's model
  path, block size, dtype, overrides, epoch; its `model` replaces `model_id` as what "the same model" means, and the
  `model_id` part, a digest of those parts, is left out). Publishing reads the model's record slots (one request)
  and writes one record, unless a slot already holds this namespace with every part this engine states equal (so
  a worker and its scheduler do not overwrite each other). Never raises; a pool that fails is said in a debug line.
* `observe(hits)`: one V1 lookup (`exists`, or a load) of this namespace and its hits. The first
  `DIAGNOSE_AFTER_LOOKUPS` lookups, or every lookup within `DIAGNOSE_AFTER_S` of registering, finding nothing sets off
  the diagnosis once, on a daemon thread (never on the caller's): the engine's record is published again, the
  model's records are read, and `ns_records.diagnosis` is logged as ONE warning (which parts differ from the
  closest other namespace of the same model, and what to change). When no record explains it (this engine came
  first: nothing else was there yet), the watch starts again over twice as many lookups and twice the time, up to
  `MAX_ROUNDS` times, so an engine that starts before the one it should share with is still told. A lookup that
  hits settles the watch for good: an engine that hits once is sharing. Cost on the lookup path: one
  attribute test once settled.
* A pool in this process's memory (`PoolBackend.in_place`: the embedded pool) is never shared with another engine:
  there the watch publishes nothing and diagnoses nothing.
* V0 lookups are not observed: V0 values are named by the engine's own keys (and the vLLM connector's epoch record is
  one), so their hits say nothing about sharing blocks.
* Records live under the tenant's keys like any value: an engine reads only its own tenant's records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ems.backends.base import PoolBackend, PoolCall
from ems.config import CcConfig
from ems.datapath.keys import PLACEMENT, route_key_of
from ems.store.ns_records import (
    NamespaceRecord,
    decode_record,
    diagnosis,
    encode_record,
    home_slot,
    make_record,
    record_keys,
)
from ems.types import CcKvOption

if TYPE_CHECKING:
    from ems.datapath.layout import RegisteredLayout

logger = logging.getLogger("ems")

DIAGNOSE_AFTER_LOOKUPS = 100
DIAGNOSE_AFTER_S = 60.0
RECORD_TIMEOUT_MS = 2000
MAX_ROUNDS = 8  # diagnoses that found nothing to say, each over twice the lookups and time of the one before


def sdk_parts(cc_config: CcConfig, layout: RegisteredLayout | None) -> dict[str, str]:
    """The parts `ems.datapath.keys.namespace` derives a namespace from (the tenant aside: a record is its tenant's),
    with the layout spelt out where the signature alone would say only "differs"."""
    shared = cc_config.shares_kv_across_tp
    parts = {
        "model_id": cc_config.model_id,
        "tp_size": str(cc_config.tp_world_size),
        "tp_rank": "shared" if shared else str(cc_config.tp_rank),
        "pp": f"{cc_config.pp_rank}/{cc_config.pp_world_size}",
        "layout": "raw" if layout is None else f"{layout.signature:016x}",
        "placement": PLACEMENT,
    }
    if layout is not None:
        dtypes = sorted({str(t.dtype).replace("torch.", "") for g in layout.groups for t in g.planes.planes})
        parts["dtype"] = ",".join(dtypes)
        parts["layout_groups"] = " | ".join(g.describe() for g in layout.groups)
    return parts


class NamespaceWatch:
    """See the module contract."""

    def __init__(
        self,
        pool: PoolBackend,
        tenant: str | None,
        cc_config: CcConfig,
        after_lookups: int = DIAGNOSE_AFTER_LOOKUPS,
        after_s: float = DIAGNOSE_AFTER_S,
        timeout_ms: int = RECORD_TIMEOUT_MS,
    ) -> None:
        self._pool = pool
        self._tenant = tenant
        self._cc_config = cc_config
        self.after_lookups = after_lookups
        self.after_s = after_s
        self._option = CcKvOption(write_rcache=False, timeout=timeout_ms)
        self._lock = threading.Lock()
        self._model: str | None = None
        self._extra: dict[str, str] = {}
        self._namespace: bytes | None = None
        self._layout: RegisteredLayout | None = None
        self.settled = True  # nothing to watch before a namespace is registered
        self.shared = pool.in_place is None  # a pool another engine can use (not the embedded one)
        self._lookups = 0
        self._since = time.monotonic()
        self._round = 0  # diagnoses run for this namespace
        self.thread: threading.Thread | None = None
        self.diagnosis: str | None = None  # what the diagnosis logged (None: nothing, or not run)

    # ---- what the record says ----

    def describe(self, model: str | None = None, parts: Mapping[str, str] | None = None) -> None:
        """An integration's own parts (and its model name); published again at once when registered."""
        with self._lock:
            if model is not None:
                self._model = model
            self._extra.update({k: str(v) for k, v in (parts or {}).items()})
            registered = self._namespace is not None
        if registered:
            self.publish()

    def record(self) -> NamespaceRecord | None:
        """This engine's record now (None before registration)."""
        with self._lock:
            if self._namespace is None:
                return None
            parts = sdk_parts(self._cc_config, self._layout)
            if self._model is not None:
                parts.pop("model_id")
            parts.update(self._extra)
            return make_record(self._model or self._cc_config.model_id, self._namespace, parts)

    # ---- the pool ----

    def _read(self, model: str) -> tuple[list[bytes], list[NamespaceRecord | None]]:
        keys = record_keys(self._tenant, model)
        outcome = self._pool.get(PoolCall([route_key_of(k) for k in keys], keys, self._option))
        return keys, [decode_record(v) for v in outcome.results]

    def publish(self) -> NamespaceRecord | None:
        """Write this engine's record (see the module contract); the record, or None when none was published."""
        if not self.shared:
            return None
        try:
            mine = self.record()
            if mine is None:
                return None
            keys, records = self._read(mine.model)
            slot = None
            for i, r in enumerate(records):
                if r is not None and r.namespace == mine.namespace:
                    if all(r.parts.get(k) == v for k, v in mine.parts.items()):
                        return mine  # already there (with this engine's parts equal)
                    slot = i
                    break
            if slot is None:
                free = [i for i, r in enumerate(records) if r is None]
                slot = free[0] if free else home_slot(mine.namespace)
            value = encode_record(mine)
            outcome = self._pool.put(PoolCall([route_key_of(keys[slot])], [keys[slot]], self._option), [[value]])
            if not all(outcome.results):
                logger.debug("the pool did not keep this engine's namespace record")
                return None
            return mine
        except Exception as exc:  # a record is a diagnostic aid: it never fails the engine
            logger.debug("could not publish this engine's namespace record: %s", exc)
            return None

    def others(self) -> list[NamespaceRecord]:
        """The records of this engine's model in the pool (its tenant's), its own included."""
        mine = self.record()
        if mine is None:
            return []
        return [r for r in self._read(mine.model)[1] if r is not None]

    # ---- the engine's lookups ----

    def registered(self, namespace: bytes, layout: RegisteredLayout | None) -> None:
        """A (new) V1 namespace: publish its record and watch its lookups afresh (on a shared pool)."""
        with self._lock:
            self._namespace = namespace
            self._layout = layout
            self._lookups = 0
            self._since = time.monotonic()
            self._round = 0
            self.settled = not self.shared  # (the embedded pool: the record is known, never published)
        if self.shared:
            self.publish()

    def observe(self, hits: int) -> None:
        """One V1 lookup of the registered namespace, and how many blocks it found."""
        if self.settled:
            return
        with self._lock:
            if self.settled:
                return
            self._lookups += 1
            if hits > 0:
                self.settled = True
                return
            scale = 1 << self._round
            if self._lookups < self.after_lookups * scale and time.monotonic() - self._since < self.after_s * scale:
                return
            self.settled = True
            self.thread = threading.Thread(target=self.diagnose, name="ems-namespace-diagnosis", daemon=True)
        self.thread.start()

    def diagnose(self) -> str | None:
        """Publish this engine's record again, compare it with the model's others, log what differs (once per call;
        `observe` calls it once); the message, or None."""
        try:
            mine = self.publish() or self.record()
            if mine is None:
                return None
            message = diagnosis(mine, self.others())
        except Exception as exc:
            logger.debug("namespace diagnosis failed: %s", exc)
            return None
        if message is not None:
            self.diagnosis = message
            logger.warning("%s", message)
            return message
        with self._lock:  # nothing explains it yet: watch again, over twice as long (see the module contract)
            self._round += 1
            if self._round < MAX_ROUNDS and self._namespace == mine.namespace:
                self._lookups = 0
                self._since = time.monotonic()
                self.settled = False
        return None
