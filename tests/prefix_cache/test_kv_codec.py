"""The Redis value format: round trip, and every kind of bad value is detected, never used."""
from __future__ import annotations

import pickle
import struct

import pytest

from prefix_cache.hashing import block_key
from prefix_cache.kv_codec import (
    CORRUPT,
    FOREIGN,
    TRUNCATED,
    BlockMeta,
    KVLayout,
    KVValueError,
    decode_block,
    digest,
    encode_block,
)

LAYOUT = KVLayout("prefixserve:kv:v1:abc:float32:bs4:tp0of1", "float32", (2, 2, 4, 1, 2))  # 128 bytes
PARENT = block_key(None, [1, 2, 3, 4])
KEY = block_key(PARENT, [5, 6, 7, 8])
META = BlockMeta(KEY, PARENT, (5, 6, 7, 8), digest(b"ns"))
PAYLOAD = bytes(range(128))


def _reason(value: bytes, layout: KVLayout = LAYOUT, key: bytes = KEY) -> str:
    with pytest.raises(KVValueError) as info:
        decode_block(value, layout, key)
    return info.value.reason


def test_round_trip():
    value = encode_block(LAYOUT, META, PAYLOAD)
    block = decode_block(value, LAYOUT, KEY)
    assert block.meta == META
    assert bytes(block.payload) == PAYLOAD
    first = BlockMeta(PARENT, None, (1, 2, 3, 4), digest(b"ns"))  # a first block has no parent
    assert decode_block(encode_block(LAYOUT, first, PAYLOAD), LAYOUT, PARENT).meta == first


def test_bfloat16_layout_round_trip():
    layout = KVLayout("ns:bf16", "bfloat16", (2, 2, 4, 1, 2))
    assert layout.nbytes == 64
    block = decode_block(encode_block(layout, META, PAYLOAD[:64]), layout, KEY)
    assert bytes(block.payload) == PAYLOAD[:64]


def test_fp8_layout_round_trip_and_never_read_as_the_model_dtype():
    """An fp8 KV cache's blocks: one byte per element, under their own namespace; a value of one never decodes
    under a model-dtype layout, even one with the same namespace (the dtype in the header differs)."""
    fp8 = KVLayout("prefixserve:kv:v1:abc:float32-float8_e4m3fn:bs4:tp0of1", "float8_e4m3fn", (2, 2, 4, 1, 2))
    assert fp8.nbytes == 32
    value = encode_block(fp8, META, PAYLOAD[:32])
    assert bytes(decode_block(value, fp8, KEY).payload) == PAYLOAD[:32]
    assert _reason(value, LAYOUT) == FOREIGN  # another namespace
    assert _reason(value, KVLayout(fp8.namespace, "float32", fp8.shape)) == FOREIGN  # same namespace, float32
    assert _reason(encode_block(LAYOUT, META, PAYLOAD), fp8) == FOREIGN


def test_encode_rejects_a_payload_of_the_wrong_size():
    with pytest.raises(ValueError):
        encode_block(LAYOUT, META, PAYLOAD[:-1])


def test_every_truncation_is_detected():
    value = encode_block(LAYOUT, META, PAYLOAD)
    for n in range(len(value)):
        assert _reason(value[:n]) == TRUNCATED, n


def test_every_single_byte_corruption_is_detected():
    value = encode_block(LAYOUT, META, PAYLOAD)
    for i in range(len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x41
        reason = _reason(bytes(bad))
        if i < 6:  # magic or format version: not ours
            assert reason == FOREIGN, i
        else:  # a length field may make it look cut short; anything else fails the checksum or structure
            assert reason in (CORRUPT, TRUNCATED), (i, reason)


def test_trailing_bytes_are_corrupt():
    assert _reason(encode_block(LAYOUT, META, PAYLOAD) + b"\0") == CORRUPT


def test_foreign_values():
    value = encode_block(LAYOUT, META, PAYLOAD)
    assert _reason(b"") == TRUNCATED
    assert _reason(pickle.dumps({"k": PAYLOAD})) == FOREIGN
    assert _reason(PAYLOAD) == FOREIGN
    assert _reason(b"PSKV" + struct.pack("<H", 2) + value[6:]) == FOREIGN  # a future format version
    # intact, but written for another model / dtype / shape / key
    other_model = KVLayout("prefixserve:kv:v1:xyz:float32:bs4:tp0of1", "float32", LAYOUT.shape)
    assert _reason(value, other_model) == FOREIGN
    same_ns_other_shape = KVLayout(LAYOUT.namespace, "float32", (2, 2, 4, 2, 1))
    assert _reason(value, same_ns_other_shape) == FOREIGN
    same_ns_other_dtype = KVLayout(LAYOUT.namespace, "float16", (2, 2, 4, 1, 4))
    assert _reason(value, same_ns_other_dtype) == FOREIGN
    assert _reason(value, LAYOUT, PARENT) == FOREIGN


def test_layout_validation():
    with pytest.raises(ValueError):
        KVLayout("ns", "int8", (1,))
    with pytest.raises(ValueError):
        KVLayout("ns", "float32", (0, 2))
