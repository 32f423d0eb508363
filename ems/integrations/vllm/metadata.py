"""What the scheduler half sends the worker half each step (`EmsConnectorMetadata`, vLLM's connector metadata).

Contract: plain data (pickled to worker processes by vLLM); `connector.py` registers `EmsConnectorMetadata` as a
`KVConnectorMetadata` (vLLM's base is an empty ABC), so this module needs no vLLM. Per step: the loads to start (each
request's blocks, their engine hashes and the epoch its lookup found them in; `in_step`: loaded before the step's
forward, the request computed in the same step; a load promised before a reset is `cancelled`: reported failed,
never loaded), the blocks the step computed to save, whether the step scheduled
nothing (`idle`), and the requests with saves in flight that its schedule preempted (`preempted`: the worker waits
for their copy-outs before the forward, `EmsWorker.handle_preemptions`) or whose sliding-window blocks it may have
freed (`flush`, hybrid models: the same wait). A hybrid model's transfers name each KV cache group's blocks with
group-tagged hashes (`engine_keys.group_hashes`), so the workers move them as any other blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# With nothing scheduled, vLLM's engine loop calls the connector again at once; a half whose lookups, loads or
# copy-outs are still running waits this long for one to end instead of spinning (which would take the CPU and the
# GIL from them).
IDLE_WAIT_S = 0.01


@dataclass
class BlockTransfer:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    epoch: bytes = b""  # the namespace epoch of its keys (`ems.integrations.epoch`)
    cancelled: bool = False  # a load promised before a reset: reported failed, never loaded
    in_step: bool = False  # loaded before this step's forward (vLLM's synchronous path), never reported finished
    # the hashes of the request's blocks before hashes[0], from its first block: the keys' placement units
    # (`block_transfer`'s `chain_prefix`); None: each key placed by itself (a hybrid model's interleaved groups)
    chain_prefix: list[bytes] | None = None


@dataclass
class EmsConnectorMetadata:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    idle: bool = False  # nothing scheduled this step (every request waits, e.g. for its load)
    # requests with saves sent, preempted by this step's schedule: their blocks may be handed to other requests
    # and written by this step's forward, so their copy-outs must end first (`handle_preemptions`)
    preempted: set[str] = field(default_factory=set)
    # requests that sent sliding-window blocks to be saved in the previous step: this step's schedule may have freed
    # them (the window moved) and its forward may write them for other requests, so their copy-outs end first too
    flush: set[str] = field(default_factory=set)
