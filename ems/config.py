"""Configuration: `EmsConfig`, `CcConfig`, `CcConfig_v1`: what an engine builds and hands to `Ems.init`.

The SDK's fields keep their names, order and defaults. `EmsConfig`'s pool settings (`POOL_SETTINGS`, keyword-only)
are this package's additions; `ems.settings.resolve_settings` applies their environment variables and defaults at
`Ems.init` into `ems.settings.Settings` (docs/reference/configuration.md's table lists each one). This module reads
no environment; it holds the value checks the settings share (`parse_size`, `check_identifier`, `check_int`).

Identifiers, as deployments write them (`model_id="cc_kvstore@_@ds_default_ns_001"`, `llm_engine="vllm@deepseek"`):
`model_id` and `llm_engine` are 1-512 printable characters (no control characters); `access_id` is 1-512
printable ASCII characters (it travels to the pool nodes). They are hashed into the key namespace, so any such
value is safe. `access_key` is 32-256 of `[0-9A-Za-z+/=]`, or None / "" for a pool without keys (anonymous: no
proof is sent; a node with keys then refuses the client at `Ems.init`).

Configs are mutable, as in the EMS SDK (an engine may set `cfg.kvcache_type = KVCacheType.MLA` after building
it): fields are checked when a config is built and again, all of them, at `Ems.init` (`check_config`), which
keeps a checked snapshot; changing a config after `Ems.init` has no effect on the running SDK.
"""

from __future__ import annotations

import copy
import enum
import re
from dataclasses import dataclass, field

from ems.errors import invalid_argument

MAX_IDENTIFIER_CHARS = 512
MAX_SIZE = 1 << 60  # bytes: the largest size setting (far past any host; sums and products of sizes stay in int64)
_ACCESS_ID_RE = re.compile(rf"[\x20-\x7e]{{1,{MAX_IDENTIFIER_CHARS}}}")  # printable ASCII
_KEY_RE = re.compile(r"[0-9A-Za-z+/=]{32,256}")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)


def parse_size(name: str, value: object) -> int:
    """Bytes from an int or a string such as "512MiB", "4GiB", "1.5GB", "4096", at most MAX_SIZE (so that no
    arithmetic on a size can leave int64)."""
    if isinstance(value, bool):
        raise invalid_argument(f"{name} must be a size, got a bool")
    if isinstance(value, int):
        if value < 0:
            raise invalid_argument(f"{name} must be >= 0, got {value}")
        if value > MAX_SIZE:
            raise invalid_argument(f"{name} = {value} bytes is more than the largest size, {MAX_SIZE} (1 EiB)")
        return value
    if not isinstance(value, str):
        raise invalid_argument(f"{name} must be an int or a size string like '512MiB', got {type(value).__name__}")
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise invalid_argument(f"{name}: cannot read {value!r} as a size (e.g. 512MiB, 4GiB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    base = 1024 if "I" in unit else 1000
    scale = 1 if unit in ("", "B") else base ** ("KMGT".index(unit[0]) + 1)
    if not number * scale <= MAX_SIZE:  # (an overlong number of digits reads as infinity)
        raise invalid_argument(f"{name}: {value!r} is more than the largest size, {MAX_SIZE} bytes (1 EiB)")
    return int(number * scale)


def check_identifier(field_name: str, value: object, ascii_only: bool = False) -> str:
    """An identifier (model_id, llm_engine, access_id): 1-512 printable characters, no control characters;
    printable ASCII with `ascii_only`. Raises EMS_INVALID_ARGUMENT naming the field and the fault."""
    if not isinstance(value, str):
        raise invalid_argument(f"{field_name} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_IDENTIFIER_CHARS:
        raise invalid_argument(f"{field_name} must be 1-{MAX_IDENTIFIER_CHARS} characters, got {len(value)}")
    if ascii_only and _ACCESS_ID_RE.fullmatch(value) is None:
        bad = next(c for c in value if not " " <= c <= "~")
        raise invalid_argument(f"{field_name} must be printable ASCII; it holds {bad!r} at index {value.index(bad)}")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise invalid_argument(
            f"{field_name} must not hold control or unprintable characters; it holds {bad!r} at index {value.index(bad)}"
        )
    return value


def check_int(field_name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid_argument(f"{field_name} must be an int >= {minimum}, got {value!r}")


class KvCacheType(str, enum.Enum):
    GQA = "GQA"
    MHA = "MHA"
    MLA = "MLA"  # every TP rank holds the same latent KV: ranks share keys
    MQA = "MQA"


KVCacheType = KvCacheType  # the EMS SDK's name (`ems.cc_v1.cc_config.KVCacheType`): one type, two names


@dataclass
class CcConfig:
    """`CcConfig(rank_id, device_id, model_id, tp_world_size=1, pp_world_size=1)`; mutable, checked at build time
    and again at `Ems.init`."""

    rank_id: int
    device_id: int
    model_id: str
    tp_world_size: int = 1
    pp_world_size: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (raises EMS_INVALID_ARGUMENT naming it); normalises `kvcache_type` in CcConfig_v1."""
        cls = type(self).__name__
        check_int(f"{cls}.rank_id", self.rank_id, 0)
        check_int(f"{cls}.device_id", self.device_id, 0)
        check_identifier(f"{cls}.model_id", self.model_id)
        check_int(f"{cls}.tp_world_size", self.tp_world_size, 1)
        check_int(f"{cls}.pp_world_size", self.pp_world_size, 1)

    @property
    def tp_rank(self) -> int:
        return self.rank_id % self.tp_world_size

    @property
    def pp_rank(self) -> int:
        return (self.rank_id // self.tp_world_size) % self.pp_world_size

    @property
    def shares_kv_across_tp(self) -> bool:
        return False


@dataclass
class CcConfig_v1(CcConfig):
    """`CcConfig` plus `rank_in_tp_group=0, rank_in_pp_group=0, llm_engine="vllm", kvcache_type=MHA`.

    `kvcache_type` is a `KVCacheType` (or its name, any case); engines often set it after construction."""

    rank_in_tp_group: int = 0
    rank_in_pp_group: int = 0
    llm_engine: str = "vllm"
    kvcache_type: KvCacheType | str = KvCacheType.MHA

    def validate(self) -> None:
        super().validate()
        check_int("CcConfig_v1.rank_in_tp_group", self.rank_in_tp_group, 0)
        check_int("CcConfig_v1.rank_in_pp_group", self.rank_in_pp_group, 0)
        if self.rank_in_tp_group >= self.tp_world_size:
            raise invalid_argument(
                f"CcConfig_v1.rank_in_tp_group ({self.rank_in_tp_group}) must be < tp_world_size ({self.tp_world_size})"
            )
        if self.rank_in_pp_group >= self.pp_world_size:
            raise invalid_argument(
                f"CcConfig_v1.rank_in_pp_group ({self.rank_in_pp_group}) must be < pp_world_size ({self.pp_world_size})"
            )
        check_identifier("CcConfig_v1.llm_engine", self.llm_engine)
        try:
            kind = KvCacheType(self.kvcache_type.upper() if isinstance(self.kvcache_type, str) else self.kvcache_type)
        except ValueError:
            raise invalid_argument(
                f"CcConfig_v1.kvcache_type must be one of GQA, MHA, MLA, MQA, got {self.kvcache_type!r}"
            ) from None
        self.kvcache_type = kind

    @property
    def tp_rank(self) -> int:
        return self.rank_in_tp_group

    @property
    def pp_rank(self) -> int:
        return self.rank_in_pp_group

    @property
    def shares_kv_across_tp(self) -> bool:
        return self.kvcache_type == KvCacheType.MLA


POOL_SETTINGS = (
    "pool_nodes",
    "pool_capacity",
    "pool_prefault",
    "pool_prefault_ahead",
    "read_cache_capacity",
    "staging_capacity",
    "max_inflight",
    "kernel_backend",
    "connect_timeout_ms",
    "device",
    "pool_etcd",
    "pool_cluster",
    "pool_replicas",
    "pool_hedge",
    "pool_backend",
    "mooncake_master",
    "mooncake_metadata",
    "mooncake_protocol",
    "mooncake_devices",
    "mooncake_hostname",
    "mooncake_buffer",
    "mooncake_segment",
)


@dataclass(init=False, eq=True)
class EmsConfig:
    """`EmsConfig(access_id=None, access_key=None, cc_config=None, cc_config_v1=None, **pool_settings)`.

    The pool settings are keyword-only; docs/reference/configuration.md's table lists each one. An unknown keyword raises
    `EmsException(EMS_INVALID_ARGUMENT)`.
    """

    access_id: str | None = None
    access_key: str | None = field(default=None, repr=False)  # a secret: never in logs
    cc_config: CcConfig | None = None
    cc_config_v1: CcConfig_v1 | None = None
    pool_nodes: list[str] | None = None
    pool_capacity: int | str | None = None
    pool_prefault: int | str | None = None
    pool_prefault_ahead: int | str | None = None
    read_cache_capacity: int | str | None = None
    staging_capacity: int | str | None = None
    max_inflight: int | None = None
    kernel_backend: str | None = None
    connect_timeout_ms: int | None = None
    device: str | None = None
    pool_etcd: str | None = None
    pool_cluster: str | None = None
    pool_replicas: int | None = None
    pool_hedge: str | bool | None = None
    pool_backend: str | None = None
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    mooncake_protocol: str | None = None
    mooncake_devices: str | None = None
    mooncake_hostname: str | None = None
    mooncake_buffer: int | str | None = None
    mooncake_segment: int | str | None = None

    def __init__(
        self,
        access_id: str | None = None,
        access_key: str | None = None,
        cc_config: CcConfig | None = None,
        cc_config_v1: CcConfig_v1 | None = None,
        **pool_settings: object,
    ) -> None:
        unknown = sorted(set(pool_settings) - set(POOL_SETTINGS))
        if unknown:
            raise invalid_argument(f"EmsConfig: unknown settings {unknown}; known: {list(POOL_SETTINGS)}")
        self.access_id = access_id
        self.access_key = access_key
        self.cc_config = cc_config
        self.cc_config_v1 = cc_config_v1
        for name in POOL_SETTINGS:
            setattr(self, name, pool_settings.get(name))

    @property
    def context_caching_config(self) -> CcConfig | None:
        return self.cc_config_v1 if self.cc_config_v1 is not None else self.cc_config


def check_config(config: object) -> EmsConfig:
    """Check the SDK fields of an `EmsConfig`, its CcConfig included (configs are mutable: whatever was changed
    after construction is checked here), and return a checked snapshot: a deep copy with `access_key` "" turned
    into None (anonymous) and `kvcache_type` normalised. The pool settings are checked by `resolve_settings`."""
    if not isinstance(config, EmsConfig):
        raise invalid_argument(f"config must be an EmsConfig, got {type(config).__name__}")
    if config.access_key is not None and not isinstance(config.access_key, str):
        raise invalid_argument(f"EmsConfig.access_key must be a str or None, got {type(config.access_key).__name__}")
    anonymous = config.access_key in (None, "")
    if not anonymous and config.access_id is None:
        raise invalid_argument("EmsConfig.access_key needs an access_id: give access_id and access_key together")
    if config.access_id is not None:
        check_identifier("EmsConfig.access_id", config.access_id, ascii_only=True)
    if not anonymous and _KEY_RE.fullmatch(config.access_key or "") is None:
        raise invalid_argument(
            "EmsConfig.access_key must be 32-256 characters of [0-9A-Za-z+/=], or empty for a pool without keys"
        )
    if config.cc_config is not None and config.cc_config_v1 is not None:
        raise invalid_argument("give one of EmsConfig.cc_config and EmsConfig.cc_config_v1, not both")
    if config.cc_config is not None and not isinstance(config.cc_config, CcConfig):
        raise invalid_argument(f"EmsConfig.cc_config must be a CcConfig, got {type(config.cc_config).__name__}")
    if config.cc_config_v1 is not None and not isinstance(config.cc_config_v1, CcConfig_v1):
        raise invalid_argument(f"EmsConfig.cc_config_v1 must be a CcConfig_v1, got {type(config.cc_config_v1).__name__}")
    snapshot = copy.deepcopy(config)
    if snapshot.context_caching_config is not None:
        snapshot.context_caching_config.validate()
    if anonymous:
        snapshot.access_key = None
    return snapshot
