"""The incremental detokenizer (engine/detokenizer.py) gives, after every token, exactly the text a full
decode of the output gives (where a character is still split at the end, the token holding its first bytes is held back): SmolLM2's byte-level BPE tokenizer on text with multi-byte characters split
across tokens, special tokens kept and skipped, forks and changed params starting a stream afresh."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

TEXTS = ["Hello, world! The capital of France is Paris.", "naïve café — 東京タワー 🚀🎉 ok", "  spaces\n\nand\ttabs  ",
         "def f(x):\n    return {'a': [1, 2]}\n", "Ελληνικά и русский, עברית"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def _seq(seq_id, prompt, params):
    return Sequence(seq_id=seq_id, request_id="r", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    params=params, index=0, arrival_order=0)


def _outputs(tokenizer, rng):
    for text in TEXTS:
        yield tokenizer.encode(text, add_special_tokens=False)
    specials = tokenizer.all_special_ids
    for _ in range(20):  # random ids: byte pieces that only join into characters later, specials between
        yield [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randrange(1, 60))]


@pytest.mark.parametrize("skip", [True, False])
def test_stream_text_equals_the_full_decode_after_every_token(tokenizer, skip):
    detok = Detokenizer(tokenizer)
    assert detok._backend is not None  # this tokenizer streams
    params = SamplingParams(max_tokens=100, skip_special_tokens=skip)
    for i, output in enumerate(_outputs(tokenizer, random.Random(0))):
        seq = _seq(f"s{i}", [1, 2, 3], params)
        for token in output:
            seq.token_ids.append(token)
            text, full = detok.text(seq), detok.decode(seq)
            if full.endswith("\ufffd"):  # a character still split: its token is held back
                assert full.startswith(text)
            else:
                assert text == full
        detok.release(seq.seq_id)
    assert not detok._streams  # released


def test_a_fork_or_a_reused_id_starts_its_stream_again(tokenizer):
    detok = Detokenizer(tokenizer)
    params = SamplingParams(max_tokens=100)
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    seq = _seq("a", [5], params)
    for token in ids:
        seq.token_ids.append(token)
        detok.text(seq)
    other = _seq("a", [5], params)  # the same id, another output (a beam that took a sibling's place)
    other.token_ids += tokenizer.encode("five six", add_special_tokens=False)
    assert detok.text(other) == "five six"
    fork = _seq("b", [5], params)
    fork.token_ids += ids + tokenizer.encode(" seven", add_special_tokens=False)
    assert detok.text(fork) == "one two three four seven"


def test_a_tokenizer_that_cleans_up_spaces_keeps_full_decodes(tokenizer):
    class Cleaning:
        backend_tokenizer = type("B", (), {"model": type("WordPiece", (), {})()})()
        clean_up_tokenization_spaces = True

    assert Detokenizer(Cleaning())._backend is None
    assert Detokenizer(tokenizer)._backend is not None  # BPE: transformers never cleans it up
