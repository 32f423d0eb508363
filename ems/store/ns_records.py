"""Namespace records: what one key namespace is made of, kept in the pool as an ordinary value of its tenant.

Two engines of one model share blocks only when every input to their key namespace agrees (`ems.datapath.keys.
namespace`; the vLLM connector's `ems.integrations.vllm.namespace`). A record says what those inputs were, so that an
engine that never hits can be told which part differs from another engine's, and an operator can see them
(`ems-pool status --namespaces`).

Contract:
* A `NamespaceRecord` is `model` (what engines of "the same model" share: the SDK's `model_id`, or the vLLM model
  path), `namespace` (the 16-byte digest its keys start with) and `parts` (name -> text: every input of that digest
  and of the keys within it, e.g. tp size, block size, dtype, layout, overrides, epoch). A part's text longer than
  `MAX_PART_CHARS` is kept as its digest (`digest:` + 16 hex digits): two records still tell equal from different.
* Stored as an ordinary value (header, checksum: `ems.store.value_format`, kind `NS_RECORD`) under a reserved key
  form, `RECORD_MARK` (a reserved 16-byte namespace no digest takes, and the form byte `FORM_RECORD`) + an 8-byte
  digest of the tenant and the model + a slot in `0..SLOTS-1` (`record_key`). Why no new protocol op: a record is then
  read, written, checksummed, authenticated and kept per tenant exactly like any value, by every backend, with no
  new surface for a raw client to probe: a pool node prefixes every key with the authenticated connection's tenant
  (`ems.pool.node_store.tenant_prefix`), and on Mooncake (`ems.backends.mooncake`: the record is the Mooncake key
  `ems/` + the record key in hex, stored by `MooncakePool.put` as any value; Mooncake has no per-tenant
  authentication) the tenant in the digest keeps tenants' records apart as the tenant in every namespace digest
  keeps their blocks apart. So an engine is never told of another tenant's namespaces. Records route by the model's
  digest (`ems.datapath.keys.route_key_of`: every slot of a model on the same owners, so publishing touches
  `pool_replicas` nodes however large the pool), so a node's repair places them where clients look. What a node
  alone can do (bounds, listing) it does on the reserved form (`ems.pool.namespaces`).
* Bounds: a record's value is at most `MAX_RECORD_BYTES` (`encode_record` refuses more, with `ValueError`; a pool node
  refuses a larger value under a record key, `ems.pool.namespaces`), a model has at most `SLOTS` records, and a pool
  node keeps at most `MAX_RECORDS_PER_TENANT` per tenant (a new one beyond is refused).
* `decode_record(value)` gives the record of a stored value, or None for anything that is not a well-formed record.
* `differences(mine, other)` lists the parts that differ; `advice(name)` what to change for one; `diagnosis(mine,
  others)` the message an engine that never hits logs (None when no record of the same model explains it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ems.buffers import Buffer
from ems.store.value_format import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    ValueKind,
    header_struct,
    is_well_formed,
    parse_header,
    part_checksum,
)

RECORD_NAMESPACE = b"ems\x00ns-records\x00\x00"  # 16 bytes: reserved, never a BLAKE2b namespace digest in practice
FORM_RECORD = b"\xee"  # the form byte of a record key (other forms: `ems.datapath.keys`)
RECORD_MARK = RECORD_NAMESPACE + FORM_RECORD  # what every record key starts with (17 bytes)
MODEL_DIGEST_BYTES = 8
RECORD_KEY_BYTES = len(RECORD_MARK) + MODEL_DIGEST_BYTES + 1
SLOTS = 32  # records per model (one per namespace, namespaces beyond share slots: the last written stays)
MAX_RECORD_BYTES = 4096  # a record's whole value, header included
MAX_RECORDS_PER_TENANT = 256  # on one pool node
MAX_PART_CHARS = 96  # a longer part is kept as its digest
MAX_PARTS = 64
MAX_NAME_CHARS = 64
RECORD_VERSION = 1
DIGEST_PREFIX = "digest:"

if len(RECORD_NAMESPACE) != 16:  # (the namespace width every key form shares)
    raise RuntimeError("RECORD_NAMESPACE must be 16 bytes")


def model_digest(tenant: str | None, model: str) -> bytes:
    text = f"{len(tenant or '')}:{tenant or ''}:{model}"  # (length-prefixed: no two (tenant, model) pairs meet)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=MODEL_DIGEST_BYTES, person=b"ems-ns-model").digest()


def record_key(tenant: str | None, model: str, slot: int) -> bytes:
    """The storage key of slot `slot` (0..SLOTS-1) of the tenant's records of `model` (also its routing key)."""
    if not 0 <= slot < SLOTS:
        raise ValueError(f"slot must be in 0..{SLOTS - 1}, got {slot}")
    return RECORD_MARK + model_digest(tenant, model) + bytes([slot])


def record_keys(tenant: str | None, model: str) -> list[bytes]:
    """Every slot's key of the tenant's records of `model`, slot order."""
    prefix = RECORD_MARK + model_digest(tenant, model)
    return [prefix + bytes([slot]) for slot in range(SLOTS)]


def home_slot(namespace: bytes) -> int:
    """The slot a namespace's record goes to when no slot is free nor already its own."""
    return namespace[0] % SLOTS if namespace else 0


def is_record_key(key: bytes) -> bool:
    return key.startswith(RECORD_MARK)


def short_part(text: str) -> str:
    """A part's text as a record keeps it: itself, or its digest when longer than `MAX_PART_CHARS`."""
    if len(text) <= MAX_PART_CHARS:
        return text
    return DIGEST_PREFIX + hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


@dataclass(frozen=True)
class NamespaceRecord:
    """What one key namespace is made of (see the module contract)."""

    model: str
    namespace: bytes  # 16 bytes
    parts: Mapping[str, str] = field(default_factory=dict)

    @property
    def namespace_hex(self) -> str:
        return self.namespace.hex()

    def to_json(self) -> dict:
        return {"model": self.model, "namespace": self.namespace_hex, "parts": dict(self.parts)}


def make_record(model: str, namespace: bytes, parts: Mapping[str, object]) -> NamespaceRecord:
    """A record of `parts` (texts shortened as the contract says), names checked."""
    if len(namespace) != 16:
        raise ValueError(f"namespace must be 16 bytes, got {len(namespace)}")
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a namespace record holds at most {MAX_PARTS} parts, got {len(parts)}")
    kept: dict[str, str] = {}
    for name, value in parts.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"part names are 1..{MAX_NAME_CHARS} characters, got {name!r}")
        kept[name] = short_part(str(value))
    return NamespaceRecord(short_part(model) if len(model) > 256 else model, bytes(namespace), kept)


def encode_record(record: NamespaceRecord) -> bytes:
    """The stored value of `record`; ValueError when it would exceed `MAX_RECORD_BYTES`."""
    payload = json.dumps({"v": RECORD_VERSION, **record.to_json()}, sort_keys=True, separators=(",", ":")).encode()
    if HEADER_SIZE + len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"a namespace record is at most {MAX_RECORD_BYTES} bytes, this one {HEADER_SIZE + len(payload)}")
    header = header_struct.pack(MAGIC, VERSION, int(ValueKind.NS_RECORD), 0, 0, len(payload), part_checksum(payload))
    return header + payload


def decode_record(value: Buffer | None) -> NamespaceRecord | None:
    """The record a stored value holds, or None (absent, too large, damaged, another kind, malformed JSON)."""
    if value is None or len(value) > MAX_RECORD_BYTES or not is_well_formed(value):
        return None
    header = parse_header(value)
    if header is None or int(header["kind"]) != int(ValueKind.NS_RECORD):
        return None
    try:
        data = json.loads(bytes(memoryview(value)[HEADER_SIZE:]).decode("utf-8"))
        namespace = bytes.fromhex(data["namespace"])
        parts = data["parts"]
        model = data["model"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    if (
        data.get("v") != RECORD_VERSION
        or len(namespace) != 16
        or not isinstance(model, str)
        or not isinstance(parts, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in parts.items())
    ):
        return None
    return NamespaceRecord(model, namespace, parts)


# ---- what differs, and what to change ----

_ADVICE = {
    "model": "both engines must serve the same model (path or model_id)",
    "model_id": "set the same model_id (CcConfig.model_id, or kv_connector_extra_config.model_id) on both engines, "
    "or leave it to be derived on both",
    "tp_size": "run both engines with the same tensor-parallel size (blocks are kept per TP rank, MLA excepted)",
    "tp_rank": "ranks of one engine keep separate blocks: compare with an engine's rank of the same number",
    "pp": "run both engines with the same pipeline-parallel size and rank",
    "block_size": "set the same block size on both engines (vLLM --block-size)",
    "dtype": "set the same model dtype on both engines (vLLM --dtype)",
    "kv_cache_dtype": "set the same KV cache dtype on both engines (vLLM --kv-cache-dtype)",
    "layout": "register the same KV cache layout (layers, dtype, heads, head size, block size per group) on both",
    "layout_groups": "register the same layer groups (layers, dtype, heads, head size) on both engines",
    "hf_overrides": "give both engines the same --hf-overrides",
    "hf_config": "the model configs differ (another revision or --hf-overrides): use the same model files and overrides",
    "hf_text_config": "the model configs differ (another revision or --hf-overrides): use the same model files and overrides",
    "revision": "load the same model --revision on both engines",
    "code_revision": "load the same --code-revision on both engines",
    "quantization": "use the same --quantization on both engines",
    "quantization_config": "use the same quantization config on both engines",
    "load_format": "load the weights with the same --load-format on both engines",
    "dummy_seed": "dummy weights differ by --seed: use real weights, or the same seed",
    "attention_backend": "pin the same attention backend on both engines (vLLM --attention-backend)",
    "attention_config": "give both engines the same attention settings (--attention-config)",
    "kv_cache_layout": "use the same KV cache layout (VLLM_KV_CACHE_LAYOUT) on both engines",
    "cache_config": "the cache settings differ (block size, KV cache dtype, scales): make them equal",
    "vllm": "run the same vLLM version on both engines (the KV layout may change between versions)",
    "platform": "engines on different device types never share blocks",
    "epoch": "the namespace epoch differs: one engine reset the prefix cache (blocks saved before a reset never hit) "
    "or has not read the current epoch yet (it does within epoch_refresh_s)",
    "placement": "run the same ems version (placement version) on both engines",
    "prefix_hash": "set the same vLLM --prefix-caching-hash-algo and PYTHONHASHSEED on both engines",
}


def advice(name: str) -> str:
    """What to change so that part `name` agrees."""
    return _ADVICE.get(name, f"make {name!r} equal on both engines")


def differences(mine: NamespaceRecord, other: NamespaceRecord) -> list[tuple[str, str | None, str | None]]:
    """(part, this engine's text, the other's) of each part that differs, sorted by name (None: absent there)."""
    names = sorted(set(mine.parts) | set(other.parts))
    return [(n, mine.parts.get(n), other.parts.get(n)) for n in names if mine.parts.get(n) != other.parts.get(n)]


def _shown(text: str | None) -> str:
    if text is None:
        return "(absent)"
    return text if len(text) <= 48 else text[:45] + "..."


def diagnosis(mine: NamespaceRecord, others: Sequence[NamespaceRecord]) -> str | None:
    """The message for an engine whose lookups found nothing (`mine` its record) while `others` are its tenant's
    records: the record of the same model in another namespace that differs in the fewest parts (a record that differs
    only in `tp_rank` is a sibling rank, not an explanation), which parts differ and what to change; None when no such
    record exists."""
    same = [o for o in others if o.model == mine.model]
    candidates = []
    for other in same:
        diff = differences(mine, other)
        names = {d[0] for d in diff}
        if not diff or names == {"tp_rank"}:
            continue
        if other.namespace == mine.namespace:
            continue  # a record of this very namespace (another rank's, an older one): it explains no miss
        candidates.append((len(diff), other.namespace_hex, other, diff))
    if not candidates:
        return None
    _, _, other, diff = min(candidates, key=lambda c: (c[0], c[1]))
    lines = [
        f"no lookup of this engine hit while the pool holds model {mine.model!r} under another namespace "
        f"({other.namespace_hex[:16]}; this engine's {mine.namespace_hex[:16]}): {len(diff)} part(s) differ:"
    ]
    for name, ours, theirs in diff:
        lines.append(f"  {name}: this engine {_shown(ours)}, the other {_shown(theirs)} -> {advice(name)}")
    return "\n".join(lines)
