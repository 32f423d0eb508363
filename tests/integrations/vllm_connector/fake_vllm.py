"""Stand-ins for the vLLM objects the connector's halves read (requests, allocated blocks, a step's schedule), and a
`ConnectorContext` on the embedded pool: the halves' tests run without vLLM, one process playing the scheduler and
the worker as vLLM's single-process mode does. The fields are the ones vLLM 0.32 gives (`vllm.v1.request.Request`,
`KVCacheBlocks`, `SchedulerOutput`, `CachedRequestData`); the engine tests (test_engine.py) run the real ones."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ems import Ems
from ems.integrations import kv_layouts
from ems.integrations.connector_config import ConnectorConfig
from ems.integrations.transfer_stats import StatsSink
from ems.integrations.vllm.context import ConnectorContext

BLOCK = 4
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def block_hashes(prompt: list[int], block_size: int = BLOCK) -> list[bytes]:
    """Chained sha256 per full block, as vLLM's are (equal hashes: equal prefixes)."""
    hashes, parent = [], b""
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + str(prompt[start : start + block_size]).encode()).digest()
        hashes.append(parent)
    return hashes


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    num_computed_tokens: int = 0
    kv_transfer_params: dict | None = None  # a P/D proxy's, from the producer's response

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt

    @property
    def block_hashes(self) -> list[bytes]:
        return block_hashes(self.prompt)


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewRequest:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Schedule:
    """One step's `SchedulerOutput`, as much of it as the connector reads."""

    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequests = field(default_factory=CachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @classmethod
    def prefill(cls, request: Request, blocks: list[int]) -> Schedule:
        """A new request's whole prompt past what it has computed (its local hit, or what it loaded)."""
        todo = request.num_prompt_tokens - request.num_computed_tokens
        return cls(
            scheduled_new_reqs=[NewRequest(request.request_id, (blocks,), request.num_computed_tokens)],
            num_scheduled_tokens={request.request_id: todo},
        )


def kv_caches(num_blocks: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each layer's KV cache in vLLM's CPU attention layout `[blocks, kv_heads, block_size, 2 * head_size]`, random."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn((num_blocks, 2, BLOCK, 16), generator=gen).to(torch.bfloat16) for name in LAYERS}


def make_context(model_id: str = "halves", num_blocks: int = 32, **extra: object) -> ConnectorContext:
    """A context on the embedded pool of this process (`Ems.init`), for a cache like `kv_caches(num_blocks)`."""
    config = ConnectorConfig.from_extra({"local_pool": "off", "read_cache_capacity": 0, **extra})
    pool = config.resolve_pool()
    Ems.init(config.ems_config(model_id, "MHA", pool))
    cc = Ems.get_cc()
    assert cc is not None
    planes = kv_layouts.block_planes(next(iter(kv_caches(num_blocks).values())), num_blocks)
    shape = kv_layouts.shape_of(planes)
    return ConnectorContext(
        config=config,
        block_size=BLOCK,
        hash_stride=1,
        tp_size=1,
        mla=False,
        num_blocks=num_blocks,
        layer_names=LAYERS,
        shapes=(shape,) * len(LAYERS),
        backend="CPU_ATTN",
        model_id=model_id,
        pool=pool,
        cc=cc,
        stats=StatsSink(),
    )


class Events:
    """A KV event sink (`scheduler.EventSink`) that keeps what it is told."""

    def __init__(self) -> None:
        self.runs: list[tuple[list[bytes], bytes | None, int]] = []  # each BlockStored: hashes, parent, tokens
        self.clears = 0

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None:
        self.runs.append((list(hashes), parent, len(token_ids)))

    def cleared(self) -> None:
        self.clears += 1
