"""Tests of `ems.integrations.vllm` (the folder is not named `vllm`: tests/integrations is on sys.path, where a folder
of that name would shadow the vllm package). The halves' tests (test_scheduler.py, test_worker.py) run without vLLM;
test_connector.py runs real vLLM engines (vllm_engine.py) and test_namespace.py and test_observability.py real vLLM
configs where vllm is importable."""
