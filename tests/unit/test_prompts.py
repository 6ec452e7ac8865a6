"""Prompts become the token ids the worker will see."""

from __future__ import annotations

import pytest

from router.proxy.prompts import PromptEncoder, PromptError
from tests.live_helpers import BLOCK, tokenizer_dir

TEXTS = ["benchmark " * 100, "naïve café — 東京 🚀 tabs\tand\nnewlines", " leading space", "x"]


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(tokenizer_dir(), BLOCK)


@pytest.mark.parametrize("text", TEXTS)
def test_fast_path_gives_the_tokenizers_own_ids(encoder: PromptEncoder, text: str) -> None:
    assert encoder.completion_ids(text) == encoder.tokenizer.encode(text).ids
    assert encoder.encode(text, add_special_tokens=False) == (
        encoder.tokenizer.encode(text, add_special_tokens=False).ids
    )


def test_token_ids_pass_through_and_bad_prompts_are_named(encoder: PromptEncoder) -> None:
    assert encoder.completion_ids([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(PromptError, match="'prompt' must be"):
        encoder.completion_ids({"text": "hi"})
    with pytest.raises(PromptError, match="messages"):
        encoder.chat_ids([])
