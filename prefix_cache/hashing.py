"""Block identity: deterministic 128-bit keys for full KV blocks.

A full block's key is ``xxh3_128(parent_key, token ids, extra keys)``.  Because the parent key
is folded in, a key names the whole prefix up to and including the block, not just the block's
own tokens.  Keys must be identical across processes, machines and Python versions (they are
shared through Redis between replicas), so the byte layout below is fixed and Python's
randomised ``hash()`` is never used.

Byte layout hashed for one block (all integers little-endian)::

    parent key (16 bytes; 16 zero bytes for the first block of a sequence)
    u32 number of tokens, then each token id as u32
    encoded extra keys (see ``encode_extra_keys``)

Changing this layout invalidates every key stored anywhere; bump ``KEY_FORMAT_VERSION`` and the
golden value in the tests together if it ever has to change.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

BlockKey = bytes
"""A 16-byte xxh3_128 digest naming a full block together with its whole prefix."""

KEY_FORMAT_VERSION = 1
KEY_SIZE = 16
ROOT_PARENT_KEY: BlockKey = bytes(KEY_SIZE)
"""Parent key used for the first block of a sequence."""

MAX_TOKEN_ID = 2**32 - 1

# array typecode with 4-byte items; 'I' is 4 bytes on every mainstream platform, but the C
# standard only promises >= 2, so pick whichever code really is 4 bytes wide.
_U32_CODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
_U32 = struct.Struct("<I")

# One-byte type tags for extra keys.  A tag + length prefix per item makes the encoding
# injective: ("ab", "c") and ("a", "bc") or 1 and "1" can never encode to the same bytes.
_TAG_NONE = b"n"
_TAG_BOOL = b"?"
_TAG_INT = b"i"
_TAG_STR = b"s"
_TAG_BYTES = b"b"
_TAG_TUPLE = b"t"


def _encode_item(item: object, out: list[bytes]) -> None:
    # bool before int: bool is an int subclass, and True must not collide with 1.
    if item is None:
        out.append(_TAG_NONE)
    elif isinstance(item, bool):
        out.append(_TAG_BOOL + (b"\x01" if item else b"\x00"))
    elif isinstance(item, int):
        raw = item.to_bytes((item.bit_length() + 8) // 8 or 1, "little", signed=True)
        out.append(_TAG_INT + _U32.pack(len(raw)) + raw)
    elif isinstance(item, str):
        raw = item.encode("utf-8")
        out.append(_TAG_STR + _U32.pack(len(raw)) + raw)
    elif isinstance(item, (bytes, bytearray, memoryview)):
        raw = bytes(item)
        out.append(_TAG_BYTES + _U32.pack(len(raw)) + raw)
    elif isinstance(item, tuple):
        out.append(_TAG_TUPLE + _U32.pack(len(item)))
        for sub in item:
            _encode_item(sub, out)
    else:
        raise TypeError(
            f"extra key of type {type(item).__name__!r} is not supported "
            "(use str, int, bytes, bool, None or tuples of those)"
        )


def encode_extra_keys(extra_keys: tuple = ()) -> bytes:
    """Serialize extra keys (model fingerprint, dtype, cache_salt, ...) to stable bytes."""
    if not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys must be a tuple, got {type(extra_keys).__name__}")
    out: list[bytes] = []
    _encode_item(extra_keys, out)
    return b"".join(out)


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        packed = array(_U32_CODE, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return _U32.pack(len(packed)) + packed.tobytes()


def block_key_encoded(parent: BlockKey | None, token_ids: Sequence[int], encoded_extra: bytes) -> BlockKey:
    """``block_key`` with the extra keys already encoded (hot path: encode once per sequence)."""
    if parent is None:
        parent = ROOT_PARENT_KEY
    elif len(parent) != KEY_SIZE:
        raise ValueError(f"parent key must be {KEY_SIZE} bytes, got {len(parent)}")
    return xxhash.xxh3_128_digest(bytes(parent) + _pack_tokens(token_ids) + encoded_extra)


def block_key(parent: BlockKey | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockKey:
    """Key of one block: its parent's key (None for the first block), its tokens, extra keys.

    Deterministic across processes.  Raises ValueError for token ids outside [0, 2**32) and
    TypeError for unsupported extra key types.
    """
    return block_key_encoded(parent, token_ids, encode_extra_keys(extra_keys))


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of the FULL blocks of ``token_ids`` (a trailing partial block gets no key)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    encoded = encode_extra_keys(extra_keys)
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key_encoded(parent, token_ids[start : start + block_size], encoded)
        keys.append(parent)
    return keys
