"""Engine adapters shaped like the public engine code written against Huawei's EMS SDK (omni-infer's vLLM
adapters: a V0 adapter of August 2025, V1 adapters of October and December 2025). Written for these tests from
what those adapters call, in which order and with which arguments; they use only `import ems` as such an engine
does, never this package's internals.

* `V0Engine`: `CcConfig` + `EmsConfig(access_id, access_key="")`; plain `str` keys
  `"<llm_engine>@<access_id>@pp<N>@tp<N>@<rank>@<block hash>"`; values are lists of raw `KvBufferWrapper(data_ptr,
  nbytes)` over the engine's cache tensors, per block one buffer per layer for K and one for V (MLA: K and V of
  different sizes); `async_save(option, keys, values)` / `async_load(...)` resolved with `future.result()`.
* `V1Engine`: `CcConfig_v1(...)` with `kvcache_type = KVCacheType.MLA` set after construction when the model is
  MLA; `Ems.init` inside `try/except EmsException` looking for `EMS_RECOVERD_ERROR` (retry later); the cache
  registered as a list of per-layer `[K, V]`; `async_save` / `async_load(slot_mapping=, hashes=, offsets=,
  option=)` with whole-block slot mappings; results polled from the engine loop with `is_ready` / `get_result`
  and taken as `success * block_size` tokens; a daemon thread calling `Ems.check_health()` periodically.
* `V1TokenEngine`: the same engine on the token semantics of the SDK's 2025-09 edition: `async_save` /
  `async_load(slot_mapping=, token_ids=, mask=, option=)` over a prompt's tokens, no hashes, `mask` 0 for the
  prefix the engine holds already; results count tokens, so a load's computed tokens are that prefix + `success`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ems import (
    CcConfig,
    CcConfig_v1,
    CcKvOption,
    ContextCache_v1,
    Ems,
    EmsConfig,
    EmsErrorCode,
    EmsException,
    KvBufferWrapper,
)
from ems.cc_v1.cc_config import KVCacheType

MODEL_ID = "cc_kvstore@_@ds_default_ns_001"  # identifiers as real deployments write them
ACCESS_ID = "cc_kvstore@_@ds_default_ns_001"
LLM_ENGINE = "vllm@deepseek"


def chained_block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Per full block, Python's `hash()` of (previous hash, the block's tokens): signed, often negative."""
    hashes, previous = [], seed
    for b in range(len(token_ids) // block_size):
        previous = hash((previous, *token_ids[b * block_size : (b + 1) * block_size]))
        hashes.append(previous)
    return hashes


def whole_block_slots(block_ids: Sequence[int], block_size: int) -> list[int]:
    return (np.asarray(block_ids)[:, None] * block_size + np.arange(block_size)).ravel().tolist()


def option() -> CcKvOption:
    return CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)


class HealthChecker:
    """A daemon thread calling `Ems.check_health()` every `interval_s` (adapters use 10-30 s), recording answers."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.answers: list[bool] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ems-health", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.answers.append(Ems.check_health())
            except BaseException as exc:
                self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5.0)


class V0Engine:
    """The V0 generation: str keys, raw buffers over the engine's own cache tensors."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        rank: int = 0,
        tp_size: int = 1,
        pool_nodes: list[str] | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.block_size = int(kv_caches[0][0].shape[1])
        cc_config = CcConfig(model_id=MODEL_ID, rank_id=rank, device_id=0)
        extra = {"pool_nodes": pool_nodes} if pool_nodes else {}
        Ems.init(EmsConfig(access_id=ACCESS_ID, access_key="", cc_config=cc_config, **extra))
        self.cc = Ems.get_cc()
        self.key_prefix = "@".join(["vllm", ACCESS_ID, "pp1", f"tp{tp_size}", str(rank)])
        # per block: [K of layer 0, V of layer 0, K of layer 1, ...] as raw ranges (MLA: two sizes)
        self.k_bytes = kv_caches[0][0][0].numel() * kv_caches[0][0].element_size()
        self.v_bytes = kv_caches[0][1][0].numel() * kv_caches[0][1].element_size()

    def keys(self, hashes: Sequence[int]) -> list[str]:
        return [f"{self.key_prefix}@{h}" for h in hashes]

    def values(self, block_ids: Sequence[int]) -> list[list[KvBufferWrapper]]:
        return [
            [
                buffer
                for k, v in self.kv_caches
                for buffer in (KvBufferWrapper(k[b].data_ptr(), self.k_bytes), KvBufferWrapper(v[b].data_ptr(), self.v_bytes))
            ]
            for b in block_ids
        ]

    def save(self, hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        future = self.cc.async_save(option(), self.keys(hashes), self.values(block_ids))
        return future.result().success

    def load(self, hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Blocks loaded; the engine takes `blocks * block_size` tokens as computed."""
        future = self.cc.async_load(option(), self.keys(hashes), self.values(block_ids))
        return future.result().success


@dataclass
class Pending:
    future: object
    submitted: float = field(default_factory=time.perf_counter)


class V1Engine:
    """The V1 generation: CcConfig_v1, slot_mapping semantics, futures polled from the engine loop."""

    def __init__(
        self,
        *,
        rank_in_tp: int = 0,
        tp_size: int = 1,
        is_mla: bool = False,
        pool_nodes: list[str] | None = None,
        access_key: str = "",
        connect_timeout_ms: int = 3000,
        health_interval_s: float | None = None,
    ) -> None:
        self.config = CcConfig_v1(
            rank_id=rank_in_tp,
            device_id=rank_in_tp,
            model_id=MODEL_ID,
            tp_world_size=tp_size,
            pp_world_size=1,
            rank_in_tp_group=rank_in_tp,
            rank_in_pp_group=0,
            llm_engine=LLM_ENGINE,
        )
        if is_mla:
            self.config.kvcache_type = KVCacheType.MLA  # set after construction, as the adapters do
        extra: dict[str, object] = {"connect_timeout_ms": connect_timeout_ms}
        if pool_nodes:
            extra["pool_nodes"] = pool_nodes
        self.ems_config = EmsConfig(access_id=ACCESS_ID, access_key=access_key, cc_config_v1=self.config, **extra)
        self.context_caching: ContextCache_v1 | None = None
        self.need_reinit = False
        self.init_error: EmsException | None = None
        self.init_ems()
        self.block_size = 0
        self.load_futures: dict[str, tuple[Pending, int]] = {}
        self.save_futures: dict[str, Pending] = {}
        self.health = HealthChecker(health_interval_s) if health_interval_s else None

    def init_ems(self) -> bool:
        try:
            Ems.init(self.ems_config)
            self.context_caching = Ems.get_cc()
            self.need_reinit, self.init_error = False, None
            return True
        except EmsException as e:
            self.init_error = e
            if e.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR:
                self.need_reinit = True
            return False

    def register_kv_caches(self, kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        as_list = [[layer[i] for i in range(len(layer))] for layer in kv_caches.values()]
        self.block_size = int(as_list[0][0].shape[1])
        assert self.context_caching is not None
        self.context_caching.register_kvcache(as_list)

    def async_save(self, req_id: str, hashes: Sequence[int], block_ids: Sequence[int]) -> None:
        assert self.context_caching is not None
        future = self.context_caching.async_save(
            slot_mapping=whole_block_slots(block_ids, self.block_size),
            hashes=list(hashes),
            offsets=[self.block_size] * len(block_ids),
            option=option(),
        )
        self.save_futures[req_id] = Pending(future)

    def async_load(self, req_id: str, hashes: Sequence[int], block_ids: Sequence[int], computed_blocks: int = 0) -> None:
        assert self.context_caching is not None
        future = self.context_caching.async_load(
            slot_mapping=whole_block_slots(block_ids, self.block_size),
            hashes=list(hashes),
            offsets=[self.block_size] * len(block_ids),
            option=option(),
        )
        self.load_futures[req_id] = (Pending(future), computed_blocks)

    def finished_saves(self) -> list[tuple[str, int]]:
        """(req_id, tokens saved) of the saves that are done; never blocks (is_ready, then get_result)."""
        cc = self.context_caching
        done = []
        for req_id, pending in list(self.save_futures.items()):
            if not cc.is_ready(pending.future):
                continue
            done.append((req_id, cc.get_result(pending.future).success * self.block_size))
            del self.save_futures[req_id]
        return done

    def finished_loads(self) -> list[tuple[str, int]]:
        """(req_id, computed tokens = loaded blocks * block_size + locally computed) of the loads that are done."""
        cc = self.context_caching
        done = []
        for req_id, (pending, computed_blocks) in list(self.load_futures.items()):
            if not cc.is_ready(pending.future):
                continue
            result = cc.get_result(pending.future)
            done.append((req_id, (result.success + computed_blocks) * self.block_size))
            del self.load_futures[req_id]
        return done

    def drain(self, timeout_s: float = 30.0) -> tuple[dict[str, int], dict[str, int]]:
        """Run the engine loop (poll, 'compute', poll) until every save and load finished."""
        saved: dict[str, int] = {}
        loaded: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        while self.save_futures or self.load_futures:
            saved.update(self.finished_saves())
            loaded.update(self.finished_loads())
            if time.monotonic() > deadline:
                raise TimeoutError(f"still pending: {list(self.save_futures)} {list(self.load_futures)}")
            time.sleep(0.001)  # the engine's forward step
        return saved, loaded

    def close(self) -> None:
        if self.health is not None:
            self.health.stop()


def token_slots(block_ids: Sequence[int], n: int, block_size: int) -> list[int]:
    """The slots of a request's first n tokens in its blocks (the last block may be partly filled)."""
    return whole_block_slots(block_ids, block_size)[:n]


class V1TokenEngine(V1Engine):
    """The V1 engine on token semantics: prompts as token ids and a mask, no hashes; results in tokens."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.held: dict[str, int] = {}  # per request: the tokens it held before the call (the mask's zeros)

    def _token_args(self, token_ids: Sequence[int] | torch.Tensor, block_ids: Sequence[int], held: int) -> dict:
        n = len(token_ids)
        return {
            "slot_mapping": token_slots(block_ids, n, self.block_size),
            "token_ids": token_ids,
            "mask": [0] * held + [1] * (n - held),
            "option": option(),
        }

    def async_save_tokens(
        self, req_id: str, token_ids: Sequence[int] | torch.Tensor, block_ids: Sequence[int], held: int
    ) -> None:
        assert self.context_caching is not None
        self.save_futures[req_id] = Pending(self.context_caching.async_save(**self._token_args(token_ids, block_ids, held)))
        self.held[req_id] = held

    def async_load_tokens(
        self, req_id: str, token_ids: Sequence[int] | torch.Tensor, block_ids: Sequence[int], held: int
    ) -> None:
        assert self.context_caching is not None
        future = self.context_caching.async_load(**self._token_args(token_ids, block_ids, held))
        self.load_futures[req_id] = (Pending(future), 0)
        self.held[req_id] = held

    def finished_saves(self) -> list[tuple[str, int]]:
        """(req_id, tokens the pool holds for the request from its start: the held prefix + the tokens saved)."""
        done = self._done(self.save_futures)
        for req_id, _ in done:
            del self.save_futures[req_id]
        return done

    def finished_loads(self) -> list[tuple[str, int]]:
        """(req_id, computed tokens = the held prefix + the tokens loaded) of the loads that are done."""
        done = self._done({req_id: pending for req_id, (pending, _) in self.load_futures.items()})
        for req_id, _ in done:
            del self.load_futures[req_id]
        return done

    def _done(self, calls: dict[str, Pending]) -> list[tuple[str, int]]:
        """The calls that are done (never blocks: is_ready, then get_result), with held + success tokens each."""
        cc = self.context_caching
        assert cc is not None
        return [
            (req_id, self.held.pop(req_id) + cc.get_result(pending.future).success)
            for req_id, pending in calls.items()
            if cc.is_ready(pending.future)
        ]
