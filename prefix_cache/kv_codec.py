"""Self-describing bytes for one KV block stored outside this process (the Redis tier).

A value is read by other replicas, by later versions of this program and possibly by nothing we
wrote at all (a stale or foreign key, a half-written value, a flipped bit), so it carries
everything needed to reject it without trusting it.  Never pickle: decoding only parses
fixed-width integers and compares bytes.

Layout (all integers little-endian)::

    fixed part  (28 bytes)
      4s   magic b"PSKV"
      u16  format version (FORMAT_VERSION)
      u16  reserved, 0
      u32  meta length M
      16s  checksum: xxh3_128 of everything after this field (meta + payload)
    meta (M bytes)
      16s  layout digest: xxh3_128 of the layout namespace (model fingerprint, dtype, block size,
           tensor-parallel rank/size) -- a value copied under another model's key is foreign
      16s  block key the value was written for
      16s  parent block key (16 zero bytes for a first block)
      16s  namespace digest: xxh3_128 of the block's encoded extra keys (cache_salt included)
      u8   dtype name length, then the ASCII dtype name ("float32", "bfloat16", "float16", "float8_e4m3fn")
      u8   ndim, then ndim x u32 shape
      u32  number of tokens T, then T x u32 token ids (the hit is confirmed token by token)
      u64  payload length P
    payload (P bytes): the block's raw KV, C order, ``shape`` of ``dtype``

Decoding failures are classified: TRUNCATED (fewer bytes than declared), CORRUPT (checksum or
structure wrong), FOREIGN (not ours, another format version, or written for another layout or
key).  Torch-free: the payload is plain bytes; the engine turns it into a tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from .hashing import KEY_SIZE, ROOT_PARENT_KEY, BlockKey

MAGIC = b"PSKV"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHI16s")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # float8: an fp8 KV cache

TRUNCATED = "truncated"
CORRUPT = "corrupt"
FOREIGN = "foreign"


class KVValueError(ValueError):
    """A stored value that must not be used; ``reason`` is TRUNCATED, CORRUPT or FOREIGN."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def digest(data: bytes) -> bytes:
    """16-byte xxh3_128 digest (layout and namespace digests in the header)."""
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True)
class KVLayout:
    """What every block of one engine looks like: the namespace (model fingerprint, dtype, block
    size, tensor-parallel rank/size, as a string) and the per-block tensor dtype and shape."""

    namespace: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {sorted(ITEMSIZE)}")
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError(f"shape must be non-empty and positive, got {self.shape}")

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def digest(self) -> bytes:
        return digest(self.namespace.encode())


@dataclass(frozen=True)
class BlockMeta:
    """Identity of one cached block: its key, its parent's key, its tokens, its namespace digest."""

    key: BlockKey
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    ns_digest: bytes


@dataclass(frozen=True)
class DecodedBlock:
    meta: BlockMeta
    payload: memoryview  # raw KV bytes (a view into the value: no copy)


def encode_block(layout: KVLayout, meta: BlockMeta, payload: bytes | bytearray | memoryview) -> bytes:
    """The value stored for one block.  ``payload`` must hold exactly ``layout.nbytes`` bytes."""
    payload = memoryview(payload).cast("B")
    if payload.nbytes != layout.nbytes:
        raise ValueError(f"payload has {payload.nbytes} bytes, the layout needs {layout.nbytes}")
    if len(meta.key) != KEY_SIZE or len(meta.ns_digest) != 16:
        raise ValueError("block key and namespace digest must be 16 bytes")
    parent = meta.parent_key if meta.parent_key is not None else ROOT_PARENT_KEY
    dtype = layout.dtype.encode("ascii")
    parts = [
        layout.digest, meta.key, parent, meta.ns_digest,
        _U8.pack(len(dtype)), dtype,
        _U8.pack(len(layout.shape)), b"".join(_U32.pack(d) for d in layout.shape),
        _U32.pack(len(meta.token_ids)), struct.pack(f"<{len(meta.token_ids)}I", *meta.token_ids),
        _U64.pack(payload.nbytes),
    ]
    body = b"".join(parts)
    h = xxhash.xxh3_128()
    h.update(body)
    h.update(payload)
    return b"".join((_FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(body), h.digest()), body, payload))


class _Reader:
    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.view):
            raise KVValueError(CORRUPT, "meta shorter than its fields")
        out = self.view[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> int:
        return st.unpack(self.take(st.size))[0]


def decode_block(value: bytes | bytearray | memoryview, layout: KVLayout, key: BlockKey) -> DecodedBlock:
    """Parse and verify a value read under ``key``; raises KVValueError (never returns bad data)."""
    view = memoryview(value).cast("B")
    if len(view) < _FIXED.size:
        if bytes(view[:4]) != MAGIC[:len(view[:4])]:
            raise KVValueError(FOREIGN, "no prefixserve KV magic")
        raise KVValueError(TRUNCATED, f"{len(view)} bytes, shorter than the fixed header")
    magic, version, _reserved, meta_len, checksum = _FIXED.unpack(view[:_FIXED.size])
    if magic != MAGIC:
        raise KVValueError(FOREIGN, "no prefixserve KV magic")
    if version != FORMAT_VERSION:
        raise KVValueError(FOREIGN, f"format version {version}, this reader knows {FORMAT_VERSION}")
    if _reserved != 0:
        raise KVValueError(CORRUPT, "reserved header field is not 0")
    if len(view) < _FIXED.size + meta_len:
        raise KVValueError(TRUNCATED, "value ends inside the meta")
    r = _Reader(view[_FIXED.size:_FIXED.size + meta_len])
    layout_digest = bytes(r.take(16))
    stored_key = bytes(r.take(KEY_SIZE))
    parent = bytes(r.take(KEY_SIZE))
    ns_digest = bytes(r.take(16))
    try:
        dtype = bytes(r.take(r.unpack(_U8))).decode("ascii")
    except UnicodeDecodeError:
        raise KVValueError(CORRUPT, "dtype name is not ASCII") from None
    shape = tuple(r.unpack(_U32) for _ in range(r.unpack(_U8)))
    num_tokens = r.unpack(_U32)
    tokens = struct.unpack(f"<{num_tokens}I", r.take(4 * num_tokens))
    payload_len = r.unpack(_U64)
    if r.pos != meta_len:
        raise KVValueError(CORRUPT, "meta length does not match its fields")
    start = _FIXED.size + meta_len
    have = len(view) - start
    if have < payload_len:
        raise KVValueError(TRUNCATED, f"payload has {have} of {payload_len} bytes")
    if have > payload_len:
        raise KVValueError(CORRUPT, f"{have - payload_len} bytes after the payload")
    h = xxhash.xxh3_128()
    h.update(view[_FIXED.size:])
    if h.digest() != checksum:
        raise KVValueError(CORRUPT, "checksum mismatch")
    # Intact; now is it ours?
    if layout_digest != layout.digest:
        raise KVValueError(FOREIGN, "written for another model, dtype, block size or tensor-parallel rank")
    if dtype != layout.dtype or shape != layout.shape or payload_len != layout.nbytes:
        raise KVValueError(FOREIGN, f"block is {dtype}{list(shape)}, expected {layout.dtype}{list(layout.shape)}")
    if stored_key != key:
        raise KVValueError(FOREIGN, "value was written for another block key")
    meta = BlockMeta(stored_key, None if parent == ROOT_PARENT_KEY else parent, tokens, ns_digest)
    return DecodedBlock(meta, view[start:])
