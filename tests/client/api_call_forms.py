"""Every call form of the public API that works, written as an engine writes it: `mypy` (pyproject's files list)
checks this module against the typed overloads, and test_api_call_forms.py runs it, so a form the types accept
also works, and a form that works also type-checks. `_refused_forms` must NOT type-check: each line carries an
ignore that mypy (warn_unused_ignores) reports as unused the day the overloads accept it."""

from __future__ import annotations

import numpy as np
import torch

from ems import CcKvOption, CcResult, ContextCaching, KvBufferWrapper, PrimaryKey


def exercise(cc: ContextCaching, buffer: torch.Tensor) -> list[CcResult]:
    """`cc` has a registered cache of one layer group with at least 8 slots; `buffer` is >= 64 bytes on its device."""
    option = CcKvOption(timeout=2000)
    results: list[CcResult] = []
    # V1, slot_mapping form: lists, numpy and torch; the option positional, by keyword, or absent
    results.append(cc.save([0, 1, 2, 3], [11, 12], [2, 2]))
    results.append(cc.save([0, 1, 2, 3], [11, 12], [2, 2], option))
    results.append(cc.save(np.array([0, 1]), np.array([13], dtype=np.uint64), np.array([2]), option=option))
    results.append(cc.save(slot_mapping=torch.tensor([0, 1]), hashes=[14], offsets=torch.tensor([2])))
    results.append(cc.load([4, 5, 6, 7], [11, 12], [2, 2], option))
    results.append(cc.get_result(cc.async_save([0, 1], (15,), (2,))))
    results.append(cc.get_result(cc.async_load([4, 5], [15], [2], option)))
    # V1, chunk_descs form: keywords only
    results.append(cc.save(hashes=[16, 17], chunk_descs=[[(0, 2), (2, 2)]]))
    results.append(cc.load(hashes=[16, 17], chunk_descs=[[[4, 2], [6, 2]]], option=option))
    results.append(cc.get_result(cc.async_save(hashes=[18], chunk_descs=[[(0, 1)]], option=option)))
    results.append(cc.get_result(cc.async_load(hashes=[18], chunk_descs=[[(4, 1)]])))
    # V1, token form (the SDK's 2025-09 edition): slot_mapping with token_ids and mask by keyword; lists or tensors
    results.append(cc.save([0, 1, 2], token_ids=[7, 8, 9], mask=[1, 1, 1]))
    results.append(cc.save(slot_mapping=[0, 1, 2], token_ids=torch.tensor([7, 8, 9]), mask=[0, 1, 1], option=option))
    results.append(cc.load([4, 5, 6], token_ids=np.array([7, 8, 9]), mask=[True, True, True], option=option))
    results.append(cc.get_result(cc.async_save(torch.tensor([0, 1]), token_ids=(5, 6), mask=torch.tensor([1, 1]))))
    results.append(cc.get_result(cc.async_load([4, 5], token_ids=[5, 6], mask=np.array([0, 1]), option=option)))
    # V0: positional or by keyword
    keys = [PrimaryKey("doc", "a"), PrimaryKey("doc", "b")]
    values = [[KvBufferWrapper(buffer.data_ptr(), 16)], [KvBufferWrapper(buffer.data_ptr() + 16, 16)]]
    results.append(cc.save(option, keys, values))
    results.append(cc.load(option=option, key_list=keys, value_list=values))
    results.append(cc.get_result(cc.async_save(option, keys, values)))
    results.append(cc.get_result(cc.async_load(option, keys, values)))
    str_keys = ["vllm@tenant@pp0@tp0@0@abc", "vllm@tenant@pp0@tp0@0@def"]  # the SDK's older plain-str keys
    results.append(cc.save(option, str_keys, values))
    results.append(cc.load(option, str_keys, values))
    # exists: V1 hashes in any container, or V0 keys
    results.append(cc.exists([11, 12]))
    results.append(cc.exists(np.array([11, 12], dtype=np.int64), option))
    results.append(cc.exists(keys, option=option))
    results.append(cc.exists(str_keys))
    return results


def _refused_forms(cc: ContextCaching) -> None:  # never called: only type-checked
    cc.save([0, 1], [11])  # type: ignore[call-overload]
    cc.save(CcKvOption(), [11], [2])  # type: ignore[list-item]
    cc.load(hashes=[1], chunk_descs=[[(0, 1)]], offsets=[1])  # type: ignore[call-overload]
    cc.async_save("0, 1", [11], [2])  # type: ignore[arg-type]
    cc.save([0, 1], token_ids=[1, 2])  # type: ignore[call-overload]
    cc.load([0, 1], [11], [2], token_ids=[1, 2], mask=[1, 1])  # type: ignore[call-overload]
    cc.async_load([0, 1], token_ids="12", mask=[1, 1])  # type: ignore[arg-type]
