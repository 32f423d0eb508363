"""Engine-connector settings: the keys of vLLM's `kv_connector_extra_config`, checked, and the `EmsConfig` they make.

Contract (no engine imports): `ConnectorConfig.from_extra(extra, device_type)` reads every key below (an unknown key
or a bad value raises `EmsException(EMS_INVALID_ARGUMENT)` naming it; `device_type`, the engine's, e.g. "cpu", picks
defaults that depend on where the KV cache lives); `ems_config(model_id, kvcache_type, pool)` builds the
`EmsConfig` every process of one engine passes to `Ems.init` (equal configs, so a process that hosts both the
scheduler's and a worker's connector initialises once). With no pool nodes in the config nor in `EMS_POOL_NODES`
and `local_pool="auto"`, the host's shared local pool node (`local_pool.ensure_local_pool`) is used, with this
user's local key (`resolve_pool()` returns the nodes and the credentials to use).

| key                 | default                    | meaning                                                       |
|---------------------|----------------------------|---------------------------------------------------------------|
| pool_nodes          | `EMS_POOL_NODES`, else none | "host:port" list (or comma-separated string) of pool nodes     |
| local_pool          | "auto"                     | "auto": no nodes → share the host's local node; "off": embedded|
| local_pool_dir      | `EMS_LOCAL_POOL_DIR`/tmp    | where the local node's address is recorded                    |
| local_pool_capacity | "2GiB"                     | capacity of a local node this engine starts                   |
| model_id            | derived from the model     | key namespace: engines that share blocks must agree           |
| timeout_ms          | 5000                       | `CcKvOption.timeout` of every lookup, load and save           |
| load_failure_policy | "recompute"                | vLLM's `kv_load_failure_policy` where the top level says vLLM's default |
| lease_ms            | 10000                      | how long the pool keeps a lookup's blocks for its load (0: no lease) |
| epoch_refresh_s     | 5.0                        | how often the scheduler re-reads the namespace epoch (reset)  |
| lookup_timeout_ms   | 500                        | the scheduler's lookup timeout: the most a hung node costs a step |
| breaker_cooldown_s  | 2.0                        | how often a pool counted as down is asked again              |
| lookup_cache_s      | 1.0                        | how long a waiting request's lookup answer is reused          |
| save_wait_ms        | 2000                       | wait for blocks on their way (saved, or loaded by another request) |
| producer_response   | "after_save"               | a producer's step ends once its saves are in the pool, or at once |
| producer_wait_ms    | 500                        | the bound of that wait: the most a slow or hung pool holds a step |
| step_policy         | "auto"                     | lookups and loads in the step or asynchronously (`step_policy`) |
| in_step_ms          | 50 (150: a CPU KV cache)   | the bound of a step's in-step lookups; its in-step loads planned within |
| access_id, access_key | none                     | tenant credentials (`EMS_ACCESS_KEY` may hold the key)        |
| cross_layer_blocks  | false                      | ask vLLM for its block-outermost layout BLHNC: one copy a block |
| max_inflight        | `EMS_MAX_INFLIGHT`, else 8  | async calls at once: the client's limit and each worker's budget |
| transfer_granularity | "step"                    | "layer": blocks copied out and in layer by layer during the forward |
| layer_buffer_mb     | 256                        | "layer": the host mirror the pool's values pass through (MiB)  |
| every other `EmsConfig` pool setting (pool_capacity, pool_replicas, ...) | as `EmsConfig` | docs/reference/configuration.md |

With `pool_backend="mooncake"` (here or `EMS_POOL_BACKEND`) the pool is a Mooncake Store: no local pool is started.

`KvRole.of(kv_role)` reads vLLM's top-level `kv_role` (not an extra-config key): `kv_producer` saves and never
loads, `kv_consumer` loads and never saves, `kv_both` (or none) does both. `producer_response` (`ProducerResponse`)
says when a producer's step (and so its response) ends: `after_save`, once the pool has acknowledged the saves the
step sent (at most `producer_wait_ms`), or `immediate`, with the saves still on their way (the consumer's wait covers
them); `kv_both` engines never wait for their saves.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ems import CcConfig_v1, EmsConfig, EmsErrorCode, EmsException
from ems.config import POOL_SETTINGS
from ems.integrations.vllm.lookups.step_policy import StepMode
from ems.settings import DEFAULT_MAX_INFLIGHT, PoolBackendKind, Settings, access_key_from_environment, resolve_settings
from ems.transport.exists_holds import MAX_LEASE_MS

# A lookup's blocks are leased for the load that follows (`ems.transport.exists_holds`): long enough for a request that vLLM
# admits a few steps later (its answer is reused for `lookup_cache_s`) and for loads that wait for the in-flight
# budget; the load's read ends the lease at once.
DEFAULT_LEASE_MS = 10_000
# A lookup that finds fewer blocks than are on their way to the pool (a producer announced them, or this engine sent
# them to be saved) asks again each step for this long before the request computes them, and a request whose prefix
# another request of this engine is loading waits for that load at most this long (`save_wait_ms`: one bound for
# every wait of a request).
DEFAULT_SAVE_WAIT_MS = 2000
MAX_SAVE_WAIT_MS = 60_000
# The step policy's bound (`in_step_ms`): a step's in-step lookups together take at most this long, and its in-step
# loads are planned to (a decode step of a mid-size model on an accelerator is tens of milliseconds).
DEFAULT_IN_STEP_MS = 50
# ... with the KV cache in host memory (vLLM on CPU): there a load's copies run on the cores the forward runs on, so
# an asynchronous load overlaps nothing (the steps beside it take its CPU and the interpreter) and costs its request
# two steps more, and the requests sharing its prefix one more: a step may hold larger loads. Serving benchmark,
# 16 prompts at a time on 4 shared 1,120-token prefixes (perf/RESULTS.md, "the bound for a CPU KV cache"): pooled
# admissions took 4 steps against the prefix cache's 2 under 50 ms, 2-3 under 150.
DEFAULT_IN_STEP_MS_CPU = 150
# An in-step load that runs past `in_step_ms` goes on to this many times it before its blocks are recomputed: the
# recompute of a prompt costs the running requests far more than the wait (on the 2-core host, 0.8-2.4 s steps of
# 640-2,048 tokens after loads that ran 52-77 ms against a 50 ms bound: perf/RESULTS.md).
IN_STEP_LOAD_GRACE = 2
# Per request from measured costs, within `in_step_ms` (measured against "async" in real engines: docs/guides/vllm.md).
DEFAULT_STEP_MODE = StepMode.AUTO
MAX_IN_STEP_MS = 60_000
# A producer's step waits at most this long for the pool to acknowledge the saves it sent (`producer_wait_ms`): a
# slow or hung pool costs a step no more (then the consumer's wait covers the rest). A 24 MiB prompt's save takes
# 12-24 ms to a node on the same quiet host, 140-680 ms on a 2-core host under heavy load (perf/RESULTS.md).
DEFAULT_PRODUCER_WAIT_MS = 500


def invalid_argument(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)


# Every `EmsConfig` pool setting except `pool_nodes` (resolved here, with the local pool): one list, config's own.
EMS_SETTINGS = tuple(name for name in POOL_SETTINGS if name != "pool_nodes")
# The connector keys an engine plug-in takes besides its own (SGLang's HiCache, vLLM's offloading tier, LMCache): the
# pool, the tenant, the namespace and the timeouts; a plug-in has no scheduler steps, roles or epochs of its own.
PLUGIN_KEYS = (
    "pool_nodes",
    "local_pool",
    "local_pool_dir",
    "local_pool_capacity",
    "model_id",
    "timeout_ms",
    "lookup_timeout_ms",
    "lease_ms",
    "access_id",
    "access_key",
    *EMS_SETTINGS,
)
KEYS = (
    "pool_nodes",
    "local_pool",
    "local_pool_dir",
    "local_pool_capacity",
    "model_id",
    "timeout_ms",
    "load_failure_policy",
    "epoch_refresh_s",
    "lookup_timeout_ms",
    "breaker_cooldown_s",
    "lookup_cache_s",
    "lease_ms",
    "save_wait_ms",
    "producer_response",
    "producer_wait_ms",
    "step_policy",
    "in_step_ms",
    "access_id",
    "access_key",
    "cross_layer_blocks",
    "transfer_granularity",
    "layer_buffer_mb",
) + EMS_SETTINGS


class KvRole(str, enum.Enum):
    """vLLM's `kv_role`: what the connector does with the pool (disaggregated prefill/decode)."""

    BOTH = "kv_both"
    PRODUCER = "kv_producer"  # a prefill engine: saves, never loads
    CONSUMER = "kv_consumer"  # a decode engine: loads, never saves

    @property
    def loads(self) -> bool:
        return self is not KvRole.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not KvRole.CONSUMER

    @classmethod
    def of(cls, value: object) -> KvRole:
        """vLLM's `kv_transfer_config.kv_role` (None: both)."""
        if value is None:
            return cls.BOTH
        try:
            return cls(str(value))
        except ValueError:
            raise invalid_argument(f"kv_role must be one of {[r.value for r in cls]}, got {value!r}") from None


class ProducerResponse(str, enum.Enum):
    """When a producer's step ends, and so when its response is sent (`producer_response`)."""

    AFTER_SAVE = "after_save"  # once the pool has acknowledged the saves the step sent (at most producer_wait_ms)
    IMMEDIATE = "immediate"  # at once: the saves are still on their way, the consumer's lookup waits for them


DEFAULT_PRODUCER_RESPONSE = ProducerResponse.AFTER_SAVE


class TransferGranularity(str, enum.Enum):
    """How a worker moves a step's blocks between vLLM's KV cache and the pool (`transfer_granularity`): `step`,
    whole blocks once the forward is done (the SDK copies straight from the cache); `layer`, through a host mirror,
    each layer copied out as the forward writes it and copied in before its attention runs
    (`ems.integrations.vllm.layer_transfers`). The pool's values are the same either way."""

    STEP = "step"
    LAYER = "layer"


DEFAULT_LAYER_BUFFER_MB = 256
MAX_LAYER_BUFFER_MB = 1 << 20


class LocalPoolMode(str, enum.Enum):
    AUTO = "auto"
    OFF = "off"


@dataclass(frozen=True)
class ConnectorConfig:
    pool_nodes: tuple[str, ...] = ()
    local_pool: LocalPoolMode = LocalPoolMode.AUTO
    local_pool_dir: str | None = None
    local_pool_capacity: str = "2GiB"
    model_id: str | None = None
    timeout_ms: int = 5000
    load_failure_policy: str | None = None  # None: vLLM's own kv_load_failure_policy stands
    epoch_refresh_s: float = 5.0
    lookup_timeout_ms: int = 500
    breaker_cooldown_s: float = 2.0
    lookup_cache_s: float = 1.0
    lease_ms: int = DEFAULT_LEASE_MS
    save_wait_ms: int = DEFAULT_SAVE_WAIT_MS
    producer_response: ProducerResponse = DEFAULT_PRODUCER_RESPONSE
    producer_wait_ms: int = DEFAULT_PRODUCER_WAIT_MS
    step_policy: StepMode = DEFAULT_STEP_MODE
    in_step_ms: int = DEFAULT_IN_STEP_MS
    access_id: str | None = None
    access_key: str | None = field(default=None, repr=False)
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    cross_layer_blocks: bool = False
    transfer_granularity: TransferGranularity = TransferGranularity.STEP
    layer_buffer_mb: int = DEFAULT_LAYER_BUFFER_MB
    ems_settings: tuple[tuple[str, Any], ...] = ()
    pool_settings: Settings | None = None  # the pool settings resolved (`from_extra`)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, device_type: str | None = None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise invalid_argument(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(KEYS)}")
        # The EmsConfig pool settings, resolved as `Ems.init` will resolve them (their EMS_* variables included),
        # so a bad one stops the engine here, naming it, and nothing below re-reads the environment.
        try:
            pool = resolve_settings(EmsConfig(**{k: extra[k] for k in POOL_SETTINGS if k in extra}))
        except EmsException as exc:
            raise invalid_argument(f"kv_connector_extra_config: {exc.message()}") from None
        try:
            mode = LocalPoolMode(str(extra.get("local_pool", "auto")).lower())
        except ValueError:
            raise invalid_argument(
                f"kv_connector_extra_config.local_pool must be 'auto' or 'off', got {extra.get('local_pool')!r}"
            ) from None
        timeout = extra.get("timeout_ms", 5000)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise invalid_argument(f"kv_connector_extra_config.timeout_ms must be an int >= 0, got {timeout!r}")
        policy = extra.get("load_failure_policy")
        if policy not in (None, "recompute", "fail"):
            raise invalid_argument(f"kv_connector_extra_config.load_failure_policy must be 'recompute' or 'fail', got {policy!r}")
        seconds = {
            name: extra.get(name, default)
            for name, default in (("epoch_refresh_s", 5.0), ("breaker_cooldown_s", 2.0), ("lookup_cache_s", 1.0))
        }
        for name, value in seconds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise invalid_argument(f"kv_connector_extra_config.{name} must be a number > 0, got {value!r}")
        lookup_timeout = extra.get("lookup_timeout_ms", 500)
        if isinstance(lookup_timeout, bool) or not isinstance(lookup_timeout, int) or lookup_timeout < 1:
            raise invalid_argument(f"kv_connector_extra_config.lookup_timeout_ms must be an int >= 1, got {lookup_timeout!r}")
        lease_ms = _int_in(extra, "lease_ms", DEFAULT_LEASE_MS, 0, MAX_LEASE_MS)
        save_wait = _int_in(extra, "save_wait_ms", DEFAULT_SAVE_WAIT_MS, 0, MAX_SAVE_WAIT_MS)
        producer_response = _choice(extra, "producer_response", DEFAULT_PRODUCER_RESPONSE)
        producer_wait = _int_in(extra, "producer_wait_ms", DEFAULT_PRODUCER_WAIT_MS, 1, MAX_SAVE_WAIT_MS)
        step_policy = _choice(extra, "step_policy", DEFAULT_STEP_MODE)
        in_step_ms = _int_in(extra, "in_step_ms", default_in_step_ms(device_type), 0, MAX_IN_STEP_MS)
        inflight = pool.max_inflight
        cross_layer = extra.get("cross_layer_blocks", False)
        if not isinstance(cross_layer, bool):
            raise invalid_argument(f"kv_connector_extra_config.cross_layer_blocks must be true or false, got {cross_layer!r}")
        granularity = _choice(extra, "transfer_granularity", TransferGranularity.STEP)
        if granularity is TransferGranularity.LAYER and cross_layer:
            raise invalid_argument(
                "kv_connector_extra_config.transfer_granularity 'layer' moves a block one layer at a time: it cannot "
                "be combined with cross_layer_blocks (one copy a block)"
            )
        layer_buffer_mb = _int_in(extra, "layer_buffer_mb", DEFAULT_LAYER_BUFFER_MB, 1, MAX_LAYER_BUFFER_MB)
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not re.fullmatch(r"[0-9a-z._-]{1,512}", model_id)):
            raise invalid_argument(f"kv_connector_extra_config.model_id must be 1-512 of [0-9a-z._-], got {model_id!r}")
        return cls(
            pool_nodes=pool.pool_nodes,
            local_pool=mode,
            local_pool_dir=extra.get("local_pool_dir"),
            local_pool_capacity=str(extra.get("local_pool_capacity", "2GiB")),
            model_id=model_id,
            timeout_ms=timeout,
            load_failure_policy=policy,
            epoch_refresh_s=float(seconds["epoch_refresh_s"]),
            lookup_timeout_ms=lookup_timeout,
            breaker_cooldown_s=float(seconds["breaker_cooldown_s"]),
            lookup_cache_s=float(seconds["lookup_cache_s"]),
            lease_ms=lease_ms,
            save_wait_ms=save_wait,
            producer_response=producer_response,
            producer_wait_ms=producer_wait,
            step_policy=step_policy,
            in_step_ms=in_step_ms,
            access_id=extra.get("access_id"),
            access_key=extra.get("access_key") or (access_key_from_environment() if extra.get("access_id") else None),
            max_inflight=inflight,
            cross_layer_blocks=cross_layer,
            transfer_granularity=granularity,
            layer_buffer_mb=layer_buffer_mb,
            # max_inflight goes to the client explicitly: the workers' in-flight budget is exactly its limit
            ems_settings=tuple((k, extra[k]) for k in EMS_SETTINGS if k in extra and k != "max_inflight")
            + (("max_inflight", inflight),),
            pool_settings=pool,
        )

    def resolve_pool(self) -> ResolvedPool:
        """The pool nodes to use and the credentials to prove: the configured ones (with the configured
        credentials), else the host's local node (started if needed; this user's local key), else none (embedded
        pool, private to each process)."""
        if self.pool_nodes or self.local_pool == LocalPoolMode.OFF or self.uses_etcd or self.uses_mooncake:
            return ResolvedPool(self.pool_nodes, self.access_id, self.access_key)
        from ems.integrations.local_pool import ensure_local_pool

        local = ensure_local_pool(self.local_pool_dir, self.local_pool_capacity)
        return ResolvedPool((local.address,), local.access_id, local.access_key, local=True)

    @property
    def uses_etcd(self) -> bool:
        """Nodes come from etcd membership (`pool_etcd` here or `EMS_POOL_ETCD`): no local pool is started."""
        return self.pool_settings is not None and self.pool_settings.pool_etcd is not None

    @property
    def uses_mooncake(self) -> bool:
        """The pool is a Mooncake Store (`pool_backend` here or `EMS_POOL_BACKEND`): no local pool is started."""
        return self.pool_settings is not None and self.pool_settings.pool_backend == PoolBackendKind.MOONCAKE

    def ems_config(self, model_id: str, kvcache_type: str, pool: ResolvedPool) -> EmsConfig:
        cc = CcConfig_v1(rank_id=0, device_id=0, model_id=model_id, llm_engine="vllm", kvcache_type=kvcache_type)
        settings = dict(self.ems_settings)
        if pool.nodes:
            settings["pool_nodes"] = list(pool.nodes)
        return EmsConfig(access_id=pool.access_id, access_key=pool.access_key, cc_config_v1=cc, **settings)


@dataclass(frozen=True)
class ResolvedPool:
    """Where the connector's clients go and what they prove there."""

    nodes: tuple[str, ...]
    access_id: str | None = None
    access_key: str | None = field(default=None, repr=False)
    local: bool = False  # the host's local pool node, with this user's local key


def derive_model_id(model: str, parts: Mapping[str, str]) -> str:
    """A model id from everything that decides the bytes of the model's KV blocks (`parts`: name -> canonical
    text, e.g. `ems.integrations.vllm.namespace.namespace_parts`): the model path's readable tail plus a digest of
    every part (names included, in sorted order), within `[0-9a-z._-]`."""
    name = re.sub(r"[^0-9a-z._-]+", "-", str(model).rstrip("/").rsplit("/", 1)[-1].lower()).strip("-") or "model"
    text = "\n".join(f"{key}={parts[key]}" for key in sorted(parts))
    digest = hashlib.blake2b(f"model={model}\n{text}".encode(), digest_size=16).hexdigest()
    return f"{name[:64]}-{digest}"


_E = TypeVar("_E", bound=enum.Enum)


def default_in_step_ms(device_type: str | None) -> int:
    """`in_step_ms` where the config does not set it: larger with the KV cache in host memory (see above)."""
    return DEFAULT_IN_STEP_MS_CPU if device_type == "cpu" else DEFAULT_IN_STEP_MS


def _int_in(extra: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    """`kv_connector_extra_config[name]`: an int in low..high (a bool is not one), else `default` when absent."""
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid_argument(f"kv_connector_extra_config.{name} must be an int in {low}..{high}, got {value!r}")
    return value


def _choice(extra: Mapping[str, Any], name: str, default: _E) -> _E:
    """`kv_connector_extra_config[name]`: one of the values of `default`'s enum, else `default` when absent."""
    kind = type(default)
    try:
        return kind(extra.get(name, default.value))
    except ValueError:
        raise invalid_argument(
            f"kv_connector_extra_config.{name} must be one of {[m.value for m in kind]}, got {extra.get(name)!r}"
        ) from None
