"""Turning OpenAI request bodies into token ids and chained block hashes, as the worker will.

Live prompts go through the served model's tokenizer (the `tokenizers` library; chat messages
rendered with the model's chat template first) and are hashed with the simulator's chained block
hash, so the live index and the simulated one speak the same language.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

from router.request import BlockHash, hash_token_blocks


class PromptError(ValueError):
    """A request body the router cannot turn into a prompt (becomes an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptEncoder:
    def __init__(self, model_dir: str | Path, block_size: int) -> None:
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.block_size = block_size
        self.special = {k: config.get(k) for k in ("bos_token", "eos_token")}
        template = config.get("chat_template")
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        self._chat = env.from_string(template) if template else None
        self.max_model_len = int(config.get("model_max_length") or 1 << 30)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The fast batch path skips character offsets the router never reads: a third less
        # time on the proxy's costliest step per request (measured, 130 -> 83 us for 400 tokens).
        batch = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def completion_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # already token ids
        raise PromptError("'prompt' must be a string or a list of token ids", "prompt")

    def chat_ids(self, messages: object) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise PromptError(f"messages[{i}] needs a 'role' and 'content'", "messages")
            if not isinstance(m.get("content"), (str, list)):
                raise PromptError(f"messages[{i}].content must be text", "messages")
        if self._chat is None:
            raise PromptError("the served model has no chat template; use /v1/completions")
        text = self._chat.render(
            messages=[_flatten(m) for m in messages], add_generation_prompt=True, **self.special
        )
        # The template already wrote the BOS token: do not let the tokenizer add another.
        return self.encode(text, add_special_tokens=False)

    def block_hashes(self, ids: list[int]) -> list[BlockHash]:
        return hash_token_blocks(ids, self.block_size)


def _flatten(message: dict) -> dict:
    content = message["content"]
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "content": content}
