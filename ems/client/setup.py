"""What a `ContextCaching` is set up with before its calls: its state, the engine's registered cache, its lifecycle.

`ClientSetup` is the base of `ems.client.context_caching.ContextCaching`; the calls themselves (save, load, exists,
their async forms) are there, and nothing here runs during a warm call. It holds what the calls read but never
change: the pool, the staging pool, the chunk executor, the job ledger and counters; the registered layout
(`register_kvcache`) and the V1 namespace made from it, the V0 namespace; the copy backend and the (copier, job path)
pair of each device, each chosen on the device's first call (`_backend_for`, `_new_path`), so that a call uses
them without choosing them.

Namespaces (`ems.client.namespaces.NamespaceWatch`): `register_kvcache` publishes the record of the V1 namespace in
the pool, every V1 `exists` and load is observed (an engine whose first lookups all miss while its tenant's pool holds
the same model under another namespace logs once which parts differ), and `describe_namespace` (this package's
addition) adds an integration's own parts to the record.

Counters (`metrics()`, `ems.client.metrics`): every finished call adds its job record (blocks, bytes, and bytes and
time per stage) once (no per-block work); they are registered with prometheus_client's default registry when it is
installed.

"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import torch

from ems.backends.base import PoolBackend
from ems.client.metrics import CcMetrics
from ems.client.namespaces import NamespaceWatch
from ems.client.warmup import warm_small_calls
from ems.config import CcConfig
from ems.datapath.copier import Copier, copier_for
from ems.datapath.devices import parse_device
from ems.datapath.executor import ChunkExecutor
from ems.datapath.jobs import JobPath, job_path
from ems.datapath.keys import namespace
from ems.datapath.layout import RegisteredLayout, register_layout
from ems.errors import EmsErrorCode, EmsException
from ems.kernels import CopyBackend, get_backend
from ems.records import JobLedger
from ems.settings import Settings
from ems.staging import StagingPool
from ems.types import StoreLayerGroupDesc

logger = logging.getLogger("ems")


class ClientSetup:
    """The state of one `ContextCaching` and its cold methods (see the module docstring). The subclass sets `_calls`
    (the calls running now: registering is one of them)."""

    _calls: AbstractContextManager[None]

    def __init__(self, cc_config: CcConfig, tenant: str | None, pool: PoolBackend, settings: Settings) -> None:
        self._cc_config = cc_config
        self._tenant = tenant
        self._pool = pool
        self._settings = settings
        self._backends: dict[torch.device, CopyBackend] = {}
        self._paths: dict[torch.device, tuple[Copier, JobPath]] = {}  # per device: its calls' copier and job path
        self._layout: RegisteredLayout | None = None
        self._v1_namespace = b""
        self._v0_namespace = namespace(tenant, cc_config, None)
        self._raw_device = parse_device(settings.device) if settings.device else None
        self._staging = StagingPool(
            settings.staging_capacity, on_new_buffer=pool.prepare_staging, on_drop_buffer=pool.release_staging
        )
        self._executor = ChunkExecutor()  # the threads its jobs' chunk calls run on (`JobContext.executor`)
        self.jobs = JobLedger()  # every finished job's record: what metrics and benchmarks read
        self._metrics = CcMetrics(self.jobs, cc_config.rank_id)
        self._namespaces = NamespaceWatch(pool, tenant, cc_config)

    # ---------------------------------------------------------------- registration

    def register_kvcache(
        self,
        kvcache: list[list[torch.Tensor]] | torch.Tensor,
        store_layer_group_desc: list[StoreLayerGroupDesc] | None = None,
    ) -> None:
        """Record the engine's paged KV cache: `kvcache[layer][0 or 1]` is that layer's K or V tensor,
        `[blocks, block_size, heads, head_size]` (a list of `[K, V]` lists, or one `[layers, 2, blocks, block_size,
        heads, head_size]` tensor). Views of storage that keeps each block's layers together (cross-layer blocks)
        are detected: a whole-block value then moves as one copy (`ems.datapath.layout`). Moves no data (a CPU
        layout's small-call path is warmed on a scratch cache: `ems.client.warmup`). Registering again replaces the
        layout."""
        with self._calls:
            layout = register_layout(kvcache, store_layer_group_desc)
            backend = self._backend_for(layout.device)
            warm_small_calls(layout, backend)
            self._layout = layout
            self._v1_namespace = namespace(self._tenant, self._cc_config, layout.signature)
        cross = [g.index for g in layout.groups if g.cross_layer]
        logger.info(
            "registered KV cache: %d layers in %d group(s) on %s, copy backend %s%s",
            layout.num_layers,
            len(layout.groups),
            layout.device,
            backend.describe(),
            f", cross-layer blocks in group(s) {cross} (a whole block is one copy)" if cross else "",
        )
        self._namespaces.registered(self._v1_namespace, layout)

    def describe_namespace(self, model: str | None = None, parts: dict[str, str] | None = None) -> None:
        """What an integration adds to this engine's namespace record (this package's addition; `model`: what
        engines of "the same model" share, e.g. vLLM's model path; `parts`: name -> text of each input that decides a
        block's bytes or its keys): `ems.client.namespaces`."""
        self._namespaces.describe(model, parts)

    @property
    def namespace_watch(self) -> NamespaceWatch:
        """This engine's namespace record and zero-hit diagnosis (`ems.client.namespaces`)."""
        return self._namespaces

    @property
    def layout(self) -> RegisteredLayout | None:
        return self._layout

    # ---------------------------------------------------------------- per device, chosen on its first call

    def _backend_for(self, device: torch.device) -> CopyBackend:
        # chosen once per device (a call's walk stays out of the backends' registry)
        backend = self._backends.get(device)
        if backend is not None:
            return backend
        try:
            backend = self._backends[device] = get_backend(device, self._settings.kernel_backend)
            return backend
        except RuntimeError as exc:  # e.g. triton forced where it cannot run: the setting is at fault
            raise EmsException(
                EmsErrorCode.EMS_INVALID_ARGUMENT,
                f"kernel_backend={self._settings.kernel_backend.value!r} cannot serve {device}: {exc}",
            ) from exc

    def _new_path(self, device: torch.device) -> tuple[Copier, JobPath]:
        """The copier and the job path of calls on `device` (`ContextCaching._path_for` keeps them)."""
        path = self._paths[device] = (copier_for(self._backend_for(device), device), job_path(self._pool, device))
        return path

    # ---------------------------------------------------------------- lifecycle

    def metrics(self) -> dict[str, float]:
        """This process's counters since start (this package's addition); keys in `ems.client.metrics`."""
        return self._metrics.snapshot()
