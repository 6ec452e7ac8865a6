"""The tiktoken twin of a byte-level BPE tokenizer gives the tokenizer's own ids, or is refused
with a reason (and the proxy keeps the tokenizer)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from router.proxy import fast_bpe
from router.proxy.prompts import PromptEncoder
from tests.live_helpers import BLOCK, tokenizer_dir


@pytest.fixture(scope="module")
def spec() -> dict:
    return json.loads((tokenizer_dir() / "tokenizer.json").read_text())


def _twin(spec: dict) -> fast_bpe.Twin:
    return fast_bpe.twin(Tokenizer.from_str(json.dumps(spec)), spec)


@pytest.fixture(scope="module")
def pair(spec: dict) -> tuple[Tokenizer, fast_bpe.Encode]:
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    made = fast_bpe.twin(tokenizer, spec)
    assert made.encode is not None, made.reason
    return tokenizer, made.encode


# Text as users send it: any script, emoji, whitespace runs, code, and the tokenizer's own
# special tokens written into the text (which both match as special tokens).
TEXT = st.lists(
    st.one_of(
        st.text(min_size=1, max_size=40),
        st.sampled_from(
            ["<s>", "</s>", "<pad>", "<|eot_id|>", " ", "\n\n", "  \t", "'s", "'ll", "123", "☃"]
        ),
    ),
    max_size=12,
).map("".join)


@pytest.fixture(scope="module", params=["pair", "split_pair"])
def either_pair(request) -> tuple[Tokenizer, fast_bpe.Encode]:
    """The tiny model's tokenizer and its twin, then one in Llama 3's shape and its twin."""
    return request.getfixturevalue(request.param)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, special=st.booleans())
def test_the_twin_gives_the_tokenizers_ids(
    either_pair: tuple[Tokenizer, fast_bpe.Encode], text: str, special: bool
) -> None:
    tokenizer, encode = either_pair
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: refused before tokenizing (prompts.py)
        return
    assert encode(text, special) == tokenizer.encode(text, add_special_tokens=special).ids


def test_the_post_processors_tokens_come_with_the_sequence(pair) -> None:
    tokenizer, encode = pair
    bos = tokenizer.token_to_id("<s>")
    assert encode("hello", True)[0] == bos and bos not in encode("hello", False)


def test_the_proxy_encodes_with_the_twin_and_the_same_ids() -> None:
    encoder = PromptEncoder(tokenizer_dir(), BLOCK)
    assert encoder._fast is not None
    text = "benchmark " * 100
    assert encoder.completion_ids(text) == encoder.tokenizer.encode(text).ids


def _unsupported(spec: dict, change) -> str:
    changed = copy.deepcopy(spec)
    change(changed)
    made = _twin(changed)
    assert made.encode is None
    return made.reason


def test_what_tiktoken_cannot_say_exactly_is_refused_with_its_reason(spec: dict) -> None:
    def normalizer(s):
        s["normalizer"] = {"type": "NFC"}

    def prefix_space(s):
        s["pre_tokenizer"]["add_prefix_space"] = True

    def merge_order(s):
        merges = s["model"]["merges"]
        merges[0], merges[-1] = merges[-1], merges[0]

    def dropout(s):
        s["model"]["dropout"] = 0.1

    def stripping(s):
        s["added_tokens"][0]["lstrip"] = True

    def overlapping(s):
        s["added_tokens"].append({**s["added_tokens"][0], "id": 3999, "content": "<s>x"})

    def whitespace(s):
        s["pre_tokenizer"] = {"type": "Whitespace"}

    assert "normalizes" in _unsupported(spec, normalizer)
    assert "prefix space" in _unsupported(spec, prefix_space)
    assert "rank order" in _unsupported(spec, merge_order)
    assert "dropout" in _unsupported(spec, dropout)
    assert "strips" in _unsupported(spec, stripping)
    assert "starts another" in _unsupported(spec, overlapping)
    assert "pre-tokenizer" in _unsupported(spec, whitespace)


def test_a_twin_that_disagrees_on_the_probe_corpus_is_refused(spec: dict) -> None:
    # One vocabulary entry's id moved: the twin would be built, but its ids differ.
    changed = copy.deepcopy(spec)
    vocab = changed["model"]["vocab"]
    a, b = "Ġthe", "the"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer = Tokenizer.from_str(json.dumps(spec))  # the original: they no longer agree
    made = fast_bpe.twin(tokenizer, changed)
    assert made.encode is None
    assert "differently" in made.reason or "rank order" in made.reason


def test_a_tokenizer_without_a_twin_still_encodes(tmp_path, spec: dict) -> None:
    for name in ("tokenizer_config.json", "config.json"):
        source = tokenizer_dir() / name
        if source.exists():
            (tmp_path / name).write_text(source.read_text())
    changed = copy.deepcopy(spec)
    changed["pre_tokenizer"]["add_prefix_space"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(changed))
    encoder = PromptEncoder(tmp_path, BLOCK)
    assert encoder._fast is None
    text = "hello world"
    assert encoder.completion_ids(text) == encoder.tokenizer.encode(text).ids


# Llama 3's pre-tokenizer regex; Llama 3 and Qwen 2 split with one such regex, then map bytes.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def split_pair() -> tuple[Tokenizer, fast_bpe.Encode]:
    """A byte-level BPE trained here with Llama 3's shape: a Split regex, then ByteLevel, and a
    begin-of-text token put before each sequence."""
    from tokenizers import Regex, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    specials = ["<|begin_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog 1234567 times.",
        "def route(request):\n    return min(workers, key=load)\n",
        "Prefix caching lets a server reuse the KV cache of a shared prompt prefix.",
        "naïve café 東京 Ελληνικά — it's we'll they'd",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[(specials[0], 0)]
    )
    spec = json.loads(tokenizer.to_str())
    made = fast_bpe.twin(tokenizer, spec)
    assert made.encode is not None, made.reason
    return tokenizer, made.encode


def test_a_regex_tiktoken_cannot_compile_is_refused(spec: dict) -> None:
    changed = copy.deepcopy(spec)
    changed["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(\\p{L}+"}, "behavior": "Isolated"},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
        ],
    }
    made = fast_bpe.twin(Tokenizer.from_str(json.dumps(spec)), changed)
    assert made.encode is None and "cannot build" in made.reason
