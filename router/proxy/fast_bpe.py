"""A byte-level BPE tokenizer's twin in tiktoken: the same token ids, about three times faster.

Tokenizing the prompt is the proxy's costliest step before it can route (docs/benchmarks.md,
"Proxy"). Many current models tokenize with byte-level BPE (GPT-2's scheme: Llama 3, Qwen, the
tiny test model), which tiktoken also implements, faster. A `tokenizer.json` is taken over only
when tiktoken can say exactly what it says:

- no normalizer; the pre-tokenizer is ByteLevel with GPT-2's regex, or one Split regex then
  ByteLevel without its own; a BPE model without dropout, byte fallback or word affixes, every
  byte a token of its own (tiktoken needs them), merges in rank order (tiktoken merges the pair
  whose result has the lowest id, the `tokenizers` library the pair listed first: the same
  order when each merge's result has a higher id than the one before, as trained vocabularies
  and tiktoken-born ones have);
- added tokens matched as they are written (no lstrip, rstrip, single-word or normalization),
  none the start of another (tiktoken's alternation takes the first that matches, the
  `tokenizers` library the longest);
- a post-processor that adds nothing, or special tokens around the sequence;
- and the twin encodes a probe corpus (every vocabulary entry in context, whitespace, digits,
  punctuation, the added tokens, several scripts) to the same ids.

Otherwise `twin` returns None, with the reason, and the proxy tokenizes with the model's own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import tiktoken
from tokenizers import Tokenizer

# The ByteLevel pre-tokenizer's regex (use_regex=True): GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

Encode = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids


@dataclass(frozen=True)
class Twin:
    encode: Encode | None
    reason: str  # why there is none, or "" when there is


def twin(tokenizer: Tokenizer, spec: dict) -> Twin:
    """The tiktoken twin of `tokenizer`, whose `tokenizer.json` is `spec`, if exact."""
    try:
        encoding, prefix, suffix = _build(spec)
    except _Unsupported as e:
        return Twin(None, str(e))

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        ids = encoding.encode(text, allowed_special="all")
        return prefix + ids + suffix if add_special_tokens else ids

    # The special tokens a template adds are the same for any text: one text checks them.
    corpus = probe_corpus(spec)
    probes = [(text, False) for text in corpus] + [(corpus[0], True)]
    for text, special in probes:
        theirs = tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids
        if encode(text, special) != theirs:
            return Twin(None, f"tiktoken tokenizes {text[:40]!r} differently")
    return Twin(encode, "")


class _Unsupported(ValueError):
    pass


def _build(spec: dict) -> tuple[tiktoken.Encoding, list[int], list[int]]:
    if spec.get("normalizer") is not None:
        raise _Unsupported("it normalizes text first")
    pattern = _pattern(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise _Unsupported(f"its model is {model.get('type')}, not BPE")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise _Unsupported(f"its BPE model sets {key}")
    if model.get("byte_fallback"):
        raise _Unsupported("its BPE model falls back to byte tokens")
    added = spec.get("added_tokens") or []
    added_ids = {a["id"] for a in added}
    decode = {char: byte for byte, char in _bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for token, id_ in model["vocab"].items():
        if id_ in added_ids:
            continue
        try:
            ranks[bytes(decode[c] for c in token)] = id_
        except KeyError:
            raise _Unsupported(f"vocabulary entry {token!r} is not byte-level") from None
    if any(bytes([b]) not in ranks for b in range(256)):
        raise _Unsupported("not every byte is a token")
    _check_merge_order(model.get("merges") or [], model["vocab"])
    specials = _specials(added)
    prefix, suffix = _template(spec.get("post_processor"))
    try:
        encoding = tiktoken.Encoding(
            "fairway-twin", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
    except Exception as e:  # a regex construct tiktoken's engine lacks, say
        raise _Unsupported(f"tiktoken cannot build it: {e}") from None
    return encoding, prefix, suffix


def _pattern(pre: dict | None) -> str:
    if pre is None:
        raise _Unsupported("it has no pre-tokenizer")
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space"):
            raise _Unsupported("its ByteLevel pre-tokenizer adds a prefix space")
        if not pre.get("use_regex", True):
            raise _Unsupported("its ByteLevel pre-tokenizer splits on nothing")
        return GPT2_PATTERN
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2:
        split, level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if (
            split.get("type") == "Split"
            and regex is not None
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and level.get("type") == "ByteLevel"
            and not level.get("add_prefix_space")
            and not level.get("use_regex", True)
        ):
            return regex
    raise _Unsupported(f"its pre-tokenizer ({pre.get('type')}) is not byte-level BPE's")


def _check_merge_order(merges: list, vocab: dict[str, int]) -> None:
    last = -1
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None or merged <= last:
            raise _Unsupported(f"merge {left!r} + {right!r} is out of rank order")
        last = merged


def _specials(added: list[dict]) -> dict[str, int]:
    for a in added:
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            raise _Unsupported(f"added token {a['content']!r} strips or matches whole words")
    texts = [a["content"] for a in added]
    for t in texts:
        if any(o != t and o.startswith(t) for o in texts):
            raise _Unsupported(f"added token {t!r} starts another")
    return {a["content"]: a["id"] for a in added}


def _template(post: dict | None) -> tuple[list[int], list[int]]:
    """The ids added before and after a single sequence."""
    if post is None or post.get("type") == "ByteLevel":
        return [], []
    if post.get("type") != "TemplateProcessing":
        raise _Unsupported(f"its post-processor is {post.get('type')}")
    before: list[int] = []
    after: list[int] = []
    seen_sequence = False
    for piece in post["single"]:
        if "Sequence" in piece:
            seen_sequence = True
            continue
        ids = post["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
        (after if seen_sequence else before).extend(ids)
    return before, after


def probe_corpus(spec: dict, seed: int = 0) -> list[str]:
    """Texts a twin must tokenize as the original: the vocabulary's entries in runs, words
    with and without leading spaces, numbers, code, whitespace runs, several scripts, and the
    added tokens between words."""
    rng = random.Random(seed)
    decode = {char: byte for byte, char in _bytes_to_unicode().items()}
    words = []
    for token in spec["model"]["vocab"]:
        raw = bytes(decode.get(c, 32) for c in token)
        words.append(raw.decode("utf-8", errors="ignore"))
    rng.shuffle(words)
    runs = ["".join(words[i : i + 64]) for i in range(0, len(words), 64)]
    spaced = [" ".join(words[i : i + 64]) for i in range(0, len(words), 64)]
    added = [a["content"] for a in spec.get("added_tokens") or []]
    fixed = [
        "Hello, world! It's 2024-06-01T12:34:56Z; they'll say we'd've won 1,234.5 times.",
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tindented\r\n",
        "   leading and trailing   \n\n\n   ",
        "Ünïcödé — “quotes” ‘single’ … ½ € 日本語のテキスト 中文 한국어 العربية עברית Ελληνικά",
        "emoji 👩‍💻🚀 and combining e\u0301 and zero\u200bwidth",
        "numbers 0 00 000 0000 123456789 3.14159 -42 1e10 0x1F",
        "CAPS lowercase MiXeD snake_case kebab-case CamelCase",
        " " * 17 + "x" + "\n" * 5 + "y" + "\t" * 3,
    ]
    between = [f" {t} word{t}word {t}{t}" for t in added]
    return fixed + runs + spaced + between


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as the printable character byte-level vocabularies use."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table
