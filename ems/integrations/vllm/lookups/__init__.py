"""The connector's pool lookups, one package with one entry: `PoolLookups` (`pool_lookups`), which the scheduler half
asks how many blocks past vLLM's local hit the pool holds for a request.

Its parts (no vLLM imports; each module opens with its contract):
* `pool_lookups`: `PoolLookups`, the entry: answers per request, kept while fresh, waits for blocks on their way;
* `batcher`: the step's lookups asked in one batch, answered off the scheduler's thread (`LookupBatcher`);
* `breaker`: a short timeout and a circuit breaker, so a hung node cannot stall a step (`LookupBreaker`);
* `step_policy`: whether a lookup and its load run inside the step or asynchronously (`StepPolicy`, `StepMode`);
* `on_their_way`: blocks a producer announced or this engine sent, which a short answer waits for (`OnTheirWay`).

Names are imported when first asked for (the connector's settings import `StepMode` while the halves that use the
rest import the settings).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ems.integrations.vllm.lookups.on_their_way import OnTheirWay
    from ems.integrations.vllm.lookups.pool_lookups import LookupAnswer, PoolLookups
    from ems.integrations.vllm.lookups.step_policy import Placement, StepMode

_HOMES = {
    "PoolLookups": "pool_lookups",
    "LookupAnswer": "pool_lookups",
    "OnTheirWay": "on_their_way",
    "StepMode": "step_policy",
    "Placement": "step_policy",
}
__all__ = ["LookupAnswer", "OnTheirWay", "Placement", "PoolLookups", "StepMode"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
