"""TextStream: the deltas concatenate to the tokenizer's decode of every id (byte-level BPE
whose characters span tokens included), and a stop string ends the text just before its
first occurrence, checked against a cut of the whole decoded text."""

from __future__ import annotations

import random

import pytest
import serve_fixtures as sf

from moelora.serve.text import TextStream


def byte_bpe():
    """A byte-level BPE tokenizer trained here on a few sentences with multi-byte characters
    (no download): single tokens can hold part of a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    text = ["naïve café über straße", "日本語のテキスト", "emoji 🙂 and 🚀 rockets", "plain words"]
    core.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=core)


TOKENIZERS = {"words": lambda: sf.word_tokenizer(96), "byte-bpe": byte_bpe}

CASES = [
    # (id, tokenizer, stop strings drawn from the text): the edge each covers
    ("words-no-stop", "words", 0),  # deltas only
    ("words-stop", "words", 1),  # a stop string spanning tokens, held back until known
    ("bpe-no-stop", "byte-bpe", 0),  # partial characters held back
    ("bpe-two-stops", "byte-bpe", 2),  # the earliest of two wins
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_deltas_concatenate_to_the_decode_cut_at_the_first_stop(case, seed):
    _, kind, count = case
    tok = TOKENIZERS[kind]()
    rng = random.Random(seed)
    for _ in range(20):
        ids = [rng.randrange(1, len(tok)) for _ in range(rng.randrange(1, 30))]
        whole = tok.decode(ids, skip_special_tokens=True)
        stops = tuple(s for s in (_stop_in(whole, rng) for _ in range(count)) if s)
        ref = whole[: min([whole.find(s) for s in stops] or [len(whole)])]
        stream = TextStream(tok, stops)
        out = ""
        for token in ids:
            out += stream.push(token)
            if stream.stopped:
                break
        out += stream.finish()
        assert out == ref, (ids, stops, out, ref)
        assert stream.stopped == bool(stops)  # each stop is in the text


def _stop_in(text: str, rng: random.Random) -> str:
    """A substring of the text (so the stop is met), 1-4 characters long; none where the
    text holds U+FFFD (random bytes that are no character: no user types that stop)."""
    if not text or "\ufffd" in text:
        return ""
    start = rng.randrange(len(text))
    return text[start : start + rng.randrange(1, 5)]
