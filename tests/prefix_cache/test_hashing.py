import os
import subprocess
import sys

import pytest

from prefix_cache import block_key, chain_keys
from prefix_cache.hashing import KEY_SIZE, ROOT_PARENT_KEY, encode_extra_keys


def test_key_is_16_bytes_and_deterministic():
    k1 = block_key(None, [1, 2, 3, 4], ("llama", "bf16"))
    k2 = block_key(None, (1, 2, 3, 4), ("llama", "bf16"))
    assert isinstance(k1, bytes) and len(k1) == KEY_SIZE
    assert k1 == k2


def test_golden_value_pins_the_byte_layout():
    # Keys are shared between replicas through Redis; a change here invalidates every stored
    # key, so it must be deliberate (bump KEY_FORMAT_VERSION).
    assert block_key(None, [1, 2, 3, 4], ("llama", "bf16")).hex() == "fae43adb239a55a35333c220767eb9e2"
    assert [k.hex() for k in chain_keys(list(range(10)), 4, ("m", 7, b"x", None, True))] == [
        "3c1164be7feef1a3c3cf4b4418f280f1",
        "a5b957c3a989728522ac4ba7bac605f5",
    ]


def test_none_parent_is_the_zero_root():
    assert block_key(None, [5, 6]) == block_key(ROOT_PARENT_KEY, [5, 6])
    with pytest.raises(ValueError):
        block_key(b"short", [1])


def test_parent_tokens_and_extras_all_change_the_key():
    base = block_key(None, [1, 2, 3, 4])
    other_parent = block_key(block_key(None, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert len({base, other_parent, block_key(None, [1, 2, 3, 5]), block_key(None, [1, 2, 3, 4], ("salt",))}) == 4


def test_token_count_is_part_of_the_key():
    assert block_key(None, [1, 2]) != block_key(None, [1, 2, 0])
    assert block_key(None, []) != block_key(None, [0])


@pytest.mark.parametrize(
    "a, b",
    [
        (("1",), (1,)),
        ((True,), (1,)),
        ((b"x",), ("x",)),
        (("ab", "c"), ("a", "bc")),
        ((None,), ()),
        ((("a", "b"),), ("a", "b")),
        ((0,), (False,)),
        ((-1,), (255,)),
    ],
)
def test_extra_key_encoding_is_injective(a, b):
    assert encode_extra_keys(a) != encode_extra_keys(b)
    assert block_key(None, [1], a) != block_key(None, [1], b)


def test_different_cache_salts_give_different_keys():
    tokens = list(range(16))
    assert chain_keys(tokens, 4, ("model", ("cache_salt", "a"))) != chain_keys(tokens, 4, ("model", ("cache_salt", "b")))


def test_token_ids_out_of_range_are_rejected():
    block_key(None, [0, 2**32 - 1])
    with pytest.raises(ValueError):
        block_key(None, [-1])
    with pytest.raises(ValueError):
        block_key(None, [2**32])
    with pytest.raises(TypeError):
        block_key(None, [1.5])


def test_unsupported_extra_key_type_is_rejected():
    with pytest.raises(TypeError):
        block_key(None, [1], (1.5,))
    with pytest.raises(TypeError):
        block_key(None, [1], ["not", "a", "tuple"])  # type: ignore[arg-type]


def test_chain_keys_covers_full_blocks_only_and_chains_parents():
    tokens = list(range(11))
    keys = chain_keys(tokens, 4, ("m",))
    assert len(keys) == 2
    k0 = block_key(None, tokens[0:4], ("m",))
    assert keys == [k0, block_key(k0, tokens[4:8], ("m",))]
    assert chain_keys(tokens[:3], 4) == []
    assert chain_keys(tokens[4:8], 4, ("m",), parent=k0) == keys[1:]
    with pytest.raises(ValueError):
        chain_keys(tokens, 0)


_SCRIPT = """
from prefix_cache import chain_keys
print(",".join(k.hex() for k in chain_keys(list(range(40)), 16, ("fp", "bf16", ("cache_salt", "tenant")))))
print(hash("tenant"))
"""


def test_keys_identical_across_processes_with_different_hash_seeds():
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True)
        outputs.append(proc.stdout.splitlines())
    assert outputs[0][0] == outputs[1][0]
    # sanity: the seeds really did change Python's own str hash
    assert outputs[0][1] != outputs[1][1]
