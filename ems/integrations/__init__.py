"""Engine integrations built on the public `ems` API only (never imported by `import ems`).

* `ems.integrations.kv_layouts`: engines' paged KV tensors → the planes `ContextCaching.register_kvcache` accepts.
* `ems.integrations.block_transfer`: whole-block save/load/lookup through `ContextCaching`, rank-tagged block keys,
  transfer statistics. No engine imports.
* `ems.integrations.local_pool`: find or start the host's shared local pool node (`python -m ems.pool`).
* `ems.integrations.vllm`: `EmsConnector`, vLLM's `KVConnectorBase_V1` (imports vllm; install `ems-kvcache[vllm]`).
"""
