"""The token form's block digests (`ems.datapath.tokens.chain_digests`): the compiled loop and the Python path agree
bit for bit, the digests are the documented chain (pinned by a known answer, so a change of key derivation, which
would orphan every stored token-form block, cannot pass unnoticed), and each digest depends on exactly the tokens up
to its block's end."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.datapath.tokens import CHAIN_SEED, chain_digests, chain_digests_in_python
from ems.kernels.host_copy import host_copy

INT64 = st.integers(-(2**63), 2**63 - 1)


def _hex(digests: np.ndarray) -> list[str]:
    return [bytes(row).hex() for row in digests]


def test_the_sdk_sample_has_these_keys():
    """Known answer: tokens [101 .. 106] in blocks of 4 (the SDK pages' sample): a full block, then a partial one."""
    tokens = np.array([101, 102, 103, 104, 105, 106])
    want = ["df97c3f2d8f3cbcdc8162b667969ed7d", "f60ca34313386292bdf0453db6db0b7f"]
    assert _hex(chain_digests(tokens, 4)) == want
    assert _hex(chain_digests_in_python(tokens, 4)) == want
    # the documented chain, spelled out
    first = xxhash.xxh3_128_digest(CHAIN_SEED + np.array([101, 102, 103, 104], dtype="<i8").tobytes())
    second = xxhash.xxh3_128_digest(first + np.array([105, 106], dtype="<i8").tobytes())
    assert [first.hex(), second.hex()] == want


@pytest.mark.skipif(host_copy() is None, reason="the compiled host copy does not build here")
@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(INT64, min_size=1, max_size=300), block=st.integers(1, 70))
def test_the_compiled_loop_is_the_python_chain(tokens, block):
    array = np.array(tokens, dtype=np.int64)
    compiled = chain_digests(array, block)
    assert compiled.shape == (-(-len(tokens) // block), 16)
    assert np.array_equal(compiled, chain_digests_in_python(array, block))


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(INT64, min_size=1, max_size=120), block=st.integers(1, 16), data=st.data())
def test_a_digest_depends_on_every_token_up_to_its_block_and_none_after(tokens, block, data):
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = changed[position] + 1 if changed[position] < 2**63 - 1 else 0
    a, b = chain_digests(np.array(tokens), block), chain_digests(np.array(changed), block)
    j = position // block
    assert np.array_equal(a[:j], b[:j])
    assert all(not np.array_equal(x, y) for x, y in zip(a[j:], b[j:]))
    # a prefix of the tokens has the same digests for its full blocks
    cut = data.draw(st.integers(1, len(tokens)))
    assert np.array_equal(chain_digests(np.array(tokens[:cut]), block)[: cut // block], a[: cut // block])


def test_integer_dtypes_give_the_same_digests():
    values = [0, 1, 7, 100, 127]
    want = chain_digests(np.array(values, dtype=np.int64), 2)
    for dtype in (np.int8, np.uint8, np.int16, np.int32, np.uint32, np.uint64):
        assert np.array_equal(chain_digests(np.array(values, dtype=dtype), 2), want)


def test_the_compiled_loop_checks_its_arguments():
    library = host_copy()
    if library is None:
        pytest.skip("the compiled host copy does not build here")
    with pytest.raises(ValueError):
        library.chain_digests(0, CHAIN_SEED, np.arange(4, dtype=np.int32), 2)
    with pytest.raises(ValueError):
        library.chain_digests(0, b"short", np.arange(4, dtype=np.int64), 2)
    with pytest.raises(ValueError):
        library.chain_digests(0, CHAIN_SEED, np.arange(4, dtype=np.int64), 0)
