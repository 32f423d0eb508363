"""The pool as a secondary tier of vLLM's native KV offloading: `EmsTier` (`tier.py`; docs/guides/vllm-offloading.md).

vLLM's `SecondaryTierFactory` imports this module and takes the class named by the tier's `type`:
`"secondary_tiers": [{"type": "EmsTier", "module_path": "ems.integrations.vllm_tier", "pool_nodes": [...]}]`.
"""

from ems.integrations.vllm_tier.tier import EmsTier

__all__ = ["EmsTier"]
