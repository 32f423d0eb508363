"""Namespace records (`ems.store.ns_records`): a record survives the value format, anything else is not a record,
records are bounded, and the diagnosis names exactly the parts that differ."""

from __future__ import annotations

import pytest

from ems.store.ns_records import (
    MAX_PART_CHARS,
    MAX_RECORD_BYTES,
    RECORD_KEY_BYTES,
    RECORD_MARK,
    SLOTS,
    decode_record,
    diagnosis,
    differences,
    encode_record,
    is_record_key,
    make_record,
    record_key,
    record_keys,
)
from ems.store.value_format import HEADER_SIZE, is_well_formed

NS_A, NS_B, NS_C = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
PARTS = {"model_id": "m", "tp_size": "1", "tp_rank": "0", "pp": "0/1", "block_size": "16", "dtype": "bfloat16"}


def test_a_record_is_a_well_formed_value_and_decodes_back():
    record = make_record("m", NS_A, PARTS)
    value = encode_record(record)
    assert is_well_formed(value) and len(value) <= MAX_RECORD_BYTES
    assert decode_record(value) == record
    assert decode_record(bytearray(value)) == record


def test_anything_else_is_not_a_record():
    value = bytearray(encode_record(make_record("m", NS_A, PARTS)))
    assert decode_record(None) is None
    damaged = bytearray(value)
    damaged[-2] ^= 0x20  # a payload byte: the checksum no longer holds
    assert decode_record(bytes(damaged)) is None
    assert decode_record(bytes(value[:-1])) is None
    other_kind = bytearray(value)
    other_kind[6] = 1  # ValueKind.RAW_V0: a block's value, not a record
    assert decode_record(bytes(other_kind)) is None
    assert decode_record(b"\x00" * (HEADER_SIZE + 8)) is None


def test_records_are_bounded():
    long_part = "x" * (MAX_PART_CHARS + 1)
    record = make_record("m", NS_A, {"hf_config": long_part})
    assert record.parts["hf_config"].startswith("digest:") and len(record.parts["hf_config"]) < MAX_PART_CHARS
    assert make_record("m", NS_A, {"hf_config": long_part + "y"}).parts["hf_config"] != record.parts["hf_config"]
    with pytest.raises(ValueError, match="at most 64 parts"):
        make_record("m", NS_A, {f"p{i}": "v" for i in range(65)})
    with pytest.raises(ValueError, match="part names"):
        make_record("m", NS_A, {"": "v"})
    with pytest.raises(ValueError, match="16 bytes"):
        make_record("m", b"short", PARTS)
    big = make_record("m", NS_A, {f"part-{i:02d}-{'n' * 50}": "v" * MAX_PART_CHARS for i in range(40)})
    with pytest.raises(ValueError, match=f"at most {MAX_RECORD_BYTES} bytes"):
        encode_record(big)


def test_record_keys_are_a_reserved_form_per_tenant_and_model():
    keys = record_keys("alpha", "m")
    assert len(keys) == SLOTS == len(set(keys))
    assert all(is_record_key(k) and len(k) == RECORD_KEY_BYTES and k.startswith(RECORD_MARK) for k in keys)
    assert keys[3] == record_key("alpha", "m", 3)
    assert set(keys).isdisjoint(record_keys("beta", "m")) and set(keys).isdisjoint(record_keys("alpha", "m2"))
    assert set(record_keys("a", "b:m")).isdisjoint(record_keys("a:b", "m"))
    with pytest.raises(ValueError):
        record_key("alpha", "m", SLOTS)


def test_the_diagnosis_names_the_one_part_that_differs_and_what_to_change():
    mine = make_record("m", NS_A, {**PARTS, "block_size": "32"})
    other = make_record("m", NS_B, PARTS)
    assert differences(mine, other) == [("block_size", "32", "16")]
    message = diagnosis(mine, [mine, other])
    assert message is not None
    assert "block_size: this engine 32, the other 16" in message and "--block-size" in message
    assert "tp_size" not in message and NS_B.hex()[:16] in message


def test_the_diagnosis_picks_the_closest_namespace_of_the_same_model_and_ignores_sibling_ranks():
    mine = make_record("m", NS_A, {**PARTS, "tp_size": "2"})
    sibling = make_record("m", NS_C, {**PARTS, "tp_size": "2", "tp_rank": "1"})  # rank 1 of this very engine
    far = make_record("m", NS_B, {**PARTS, "dtype": "float16", "block_size": "64"})
    near = make_record("m", b"\x04" * 16, PARTS)
    other_model = make_record("m2", b"\x05" * 16, PARTS)
    assert diagnosis(mine, [mine, sibling, other_model]) is None
    message = diagnosis(mine, [sibling, far, near, other_model])
    assert message is not None and "1 part(s) differ" in message and "tp_size: this engine 2, the other 1" in message
