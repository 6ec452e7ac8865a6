"""Turning OpenAI request bodies into token ids and chained block hashes, as the worker will.

Live prompts go through the served model's tokenizer (the `tokenizers` library; chat messages
rendered with the model's chat template first) and are hashed with the simulator's chained block
hash, so the live index and the simulated one speak the same language. A byte-level BPE tokenizer
is run by its tiktoken twin instead when that gives the same ids (router/proxy/fast_bpe.py).

Hostile input is refused before it costs anything: text longer than `max_model_len` tokens could
possibly hold (characters over the longest vocabulary entry, the bound vLLM applies) is rejected
without tokenizing; token ids must be in the vocabulary; text must be valid Unicode (a lone
surrogate cannot be tokenized, or sent on). Every refusal is a PromptError naming the parameter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

from router.proxy import fast_bpe
from router.request import BlockHash, hash_token_blocks

log = logging.getLogger(__name__)

MAX_BATCH = 1024  # prompts in one /v1/completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS)


class PromptError(ValueError):
    """A request body the router cannot turn into a prompt (becomes an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptEncoder:
    def __init__(self, model_dir: str | Path, block_size: int) -> None:
        model_dir = Path(model_dir)
        raw = (model_dir / "tokenizer.json").read_text()
        self.tokenizer = Tokenizer.from_str(raw)
        twin = fast_bpe.twin(self.tokenizer, json.loads(raw))
        if twin.encode is None:
            log.info("%s: tokenizing with the tokenizers library (%s)", model_dir, twin.reason)
        else:
            log.info("%s: tokenizing with its tiktoken twin (the same ids)", model_dir)
        self._fast = twin.encode
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.block_size = block_size
        self.special = {k: config.get(k) for k in ("bos_token", "eos_token")}
        template = config.get("chat_template")
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        env.globals["raise_exception"] = _raise_exception  # HF templates call it
        self._chat = env.from_string(template) if template else None
        self.max_model_len = int(config.get("model_max_length") or 1 << 30)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        # No token covers more characters than the longest vocabulary entry, so a text of more
        # than n x this many characters has more than n tokens (vLLM bounds prompts the same way).
        self.max_chars_per_token = max(len(t) for t in vocab)
        # Ids up to the model's vocabulary are valid too (it may be padded past the tokenizer's).
        model_config = model_dir / "config.json"
        model = json.loads(model_config.read_text()) if model_config.exists() else {}
        self.max_token_id = max(len(vocab), int(model.get("vocab_size") or 0)) - 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Tokenizing is the proxy's costliest step before routing. Both paths release the GIL,
        # so a long prompt can be encoded off the event loop; the batch path of the tokenizers
        # library skips the character offsets the router never reads.
        if self._fast is not None:
            return self._fast(text, add_special_tokens)
        batch = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def check_text(self, text: str, max_tokens: int, param: str) -> None:
        """Refuse text that cannot be tokenized or cannot fit in `max_tokens` tokens."""
        limit = max_tokens * self.max_chars_per_token
        if len(text) > limit:
            raise PromptError(
                f"This model's maximum context length is {max_tokens} tokens. However, your "
                f"prompt has {len(text)} characters, more than the {limit} that {max_tokens} "
                "tokens can hold. Please reduce the length of the prompt.",
                param,
            )
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise PromptError(
                    f"'{param}' is not valid Unicode (a lone surrogate)", param
                ) from None

    def check_ids(self, ids: list, max_tokens: int, param: str) -> list[int]:
        if len(ids) > max_tokens:
            raise PromptError(
                f"This model's maximum context length is {max_tokens} tokens. However, your "
                f"prompt has {len(ids)} tokens. Please reduce the length of the prompt.",
                param,
            )
        if not all(type(t) is int for t in ids):  # bool is an int subclass: not a token
            raise PromptError(f"'{param}' token ids must be integers", param)
        if ids and (min(ids) < 0 or max(ids) > self.max_token_id):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise PromptError(f"Token id {bad} is out of vocabulary", param)
        return ids

    def completion_ids(self, prompt: object, max_tokens: int | None = None) -> list[int]:
        """Token ids of one prompt (a string or token ids); a batch is refused."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            raise PromptError("'prompt' must be a string or a list of token ids", "prompt")
        return self.completion_prompts(prompt, max_tokens)[0]

    def completion_prompts(self, prompt: object, max_tokens: int | None = None) -> list[list[int]]:
        """Token ids of each prompt in a /v1/completions body: a string, a list of token ids,
        or a batch (a list of strings or of token-id lists), as vLLM accepts."""
        max_tokens = max_tokens or self.max_model_len
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("'prompt' must not be empty", "prompt")
            return [self._text_ids(prompt, max_tokens)]
        if not isinstance(prompt, list) or not prompt:
            raise PromptError(
                "'prompt' must be a non-empty string, list of token ids, list of strings or "
                "list of token-id lists",
                "prompt",
            )
        if not isinstance(prompt[0], (str, list)):  # one prompt as token ids
            return [self._prompt_ids(self.check_ids(prompt, max_tokens, "prompt"))]
        if len(prompt) > MAX_BATCH:
            raise PromptError(
                f"a batch holds at most {MAX_BATCH} prompts, not {len(prompt)}", "prompt"
            )
        if all(isinstance(p, str) for p in prompt):
            return [self._text_ids(p, max_tokens) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [self._prompt_ids(self.check_ids(p, max_tokens, "prompt")) for p in prompt]
        raise PromptError("a batch of prompts must be all strings or all token-id lists", "prompt")

    def chat_ids(
        self,
        messages: object,
        max_tokens: int | None = None,
        tools: list | None = None,
        special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of chat `messages` rendered with the model's template (and `tools`, for
        templates that describe them). `special_tokens`: the tokenizer's added on top of what
        the template wrote, as vLLM does for some APIs."""
        max_tokens = max_tokens or self.max_model_len
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list", "messages")
        flat = [_flatten(i, m) for i, m in enumerate(messages)]
        if self._chat is None:
            raise PromptError("the served model has no chat template; use /v1/completions")
        # The rendered text is at least as long as the messages: bound them before rendering.
        self.check_text("".join(m["content"] for m in flat), max_tokens, "messages")
        try:
            text = self._chat.render(
                messages=flat, tools=tools, add_generation_prompt=True, **self.special
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise PromptError(
                f"the chat template cannot render these messages: {e}", "messages"
            ) from None
        self.check_text(text, max_tokens, "messages")
        # The template already wrote the BOS token: as a rule the tokenizer adds no other.
        return self.encode(text, add_special_tokens=special_tokens)

    def block_hashes(self, ids: list[int], root: BlockHash | None = None) -> list[BlockHash]:
        """`root`: the cache identity's (router.request.cache_root)."""
        return hash_token_blocks(ids, self.block_size, root)

    def _text_ids(self, text: str, max_tokens: int) -> list[int]:
        self.check_text(text, max_tokens, "prompt")
        return self.encode(text)

    @staticmethod
    def _prompt_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise PromptError("a prompt of token ids must not be empty", "prompt")
        return ids


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _flatten(i: int, message: object) -> dict:
    """A message with its content as one string, checked as vLLM's server checks it: content is
    text or a list of content parts (text parts' text kept); an assistant turn that only calls
    tools has null content."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise PromptError(f"messages[{i}] needs a 'role' and 'content'", "messages")
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        content = ""
    elif isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise PromptError(f"messages[{i}].content[{j}] must have a 'type'", "messages")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise PromptError(
                        f"messages[{i}].content[{j}].text must be a string", "messages"
                    )
                texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise PromptError(f"messages[{i}].content must be text", "messages")
    return {**message, "content": content}
