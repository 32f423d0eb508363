"""What `EmsConnector` tells the rest of vLLM: KV events for KV-aware routers, and Prometheus counters.

Contract:
* `KvEventLog`: the scheduler records a `BlockStored` (medium `MEDIUM`) for every run of blocks it sends to the
  workers to save (hashes as vLLM publishes its own, parent hash, token ids, block size), and `AllBlocksCleared`
  on a reset; `take()` hands them over once (vLLM's `take_events`, published with its KV events when
  `kv_events_config` is set). A stored event is a hint, as for any cache: a save that fails or a block the pool
  evicts later is a miss, never a wrong block.
* `EmsPromMetrics`: one Prometheus counter per `TransferStats` field (`vllm:ems_<field>_total`, per engine),
  incremented by what each `EmsConnectorStats` carries (vLLM calls `observe` with every aggregated interval).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from ems.integrations.transfer_stats import TransferStats

MEDIUM = "EMS"


class KvEventLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None:
        event = BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes],
            parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
        )
        with self._lock:
            self._events.append(event)

    def cleared(self) -> None:
        with self._lock:
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class EmsPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for f in fields(TransferStats):
            counter = self._counter_cls(
                name=f"vllm:ems_{f.name}_total",
                documentation=f"EmsConnector: {f.name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[f.name] = {engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = TransferStats.from_dict(transfer_stats_data)
        for name, per_engine in self._counters.items():
            value = getattr(stats, name)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
