"""The generation APIs the proxy speaks, each turned into the one Request the router routes.

    API          path                  prompt (what the worker tokenizes)    output limit
    completions  /v1/completions       `prompt`: text, token ids, a batch     max_tokens
    chat         /v1/chat/completions  `messages` (+ `tools`), chat template  max_completion_tokens
                                                                            or max_tokens
                 /v1/chat/completions  `messages`: a list of conversations,  the same, for each
                 /batch (vLLM)         each one choice; no stream or tools
    responses    /v1/responses         `instructions` + `input` items         max_output_tokens
                                       (+ tools), chat template
    messages     /v1/messages          `system` + `messages` (+ tools),       max_tokens (required)
                 (Anthropic)           chat template

Each prompt becomes the token ids the worker will see, as vLLM 0.32 builds them: the Responses
items and Anthropic blocks are converted to chat messages the way vLLM's own servers convert
them (tool calls as assistant `tool_calls`, tool results as `tool` messages), then rendered with
the model's chat template. So prefix locality, fairness charging, classes, budgets, adapters and
split fleets treat every API alike, and a conversation resent turn after turn, in any of them,
keeps its prefix. Each API reads its usage from its own fields and stream events (sse.py) and
answers errors in its clients' shape (errors.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.proxy import split
from router.proxy.errors import ANTHROPIC, ANTHROPIC_EVENTS, DONE, OPENAI, RESPONSES_EVENTS
from router.proxy.prompts import MAX_BATCH, PromptEncoder, PromptError
from router.proxy.sse import (
    MessagesAccount,
    ResponsesAccount,
    StreamAccount,
    Usage,
    chat_usage,
    client_wants_usage,
    messages_usage,
    responses_usage,
    with_usage_requested,
)

# Claude Code puts a per-request hash in a system block that starts so; vLLM drops the block,
# which would otherwise defeat every prefix hit (vllm/entrypoints/anthropic/serving.py).
BILLING_HEADER = "x-anthropic-billing-header"


@dataclass(frozen=True)
class API:
    name: str
    path: str
    errors: str = OPENAI  # the error shape its clients parse (errors.py)
    framing: str = DONE  # how its streams frame an error event
    batches: bool = False  # a body may hold several prompts and `n` choices
    limit: str = "max_tokens"  # its output limit, which a split fleet's prefill sets to 1

    def prompts(self, encoder: PromptEncoder, body: dict, max_len: int) -> list[list[int]]:
        raise NotImplementedError

    def max_tokens_key(self, body: dict) -> str:
        return self.limit

    def default_max_tokens(self, prompt_len: int, max_len: int, configured: int) -> int | None:
        """The output limit when the body sets none (None: the field is required)."""
        return max_len - prompt_len

    def upstream(self, body: dict) -> dict:
        """The body a worker is sent, from the client's (proxy-only fields dropped)."""
        return split.client_body(body)

    def usage(self, answer: object) -> Usage | None:
        """A whole answer's usage."""
        raise NotImplementedError

    def account(self, body: dict) -> StreamAccount | ResponsesAccount | MessagesAccount:
        raise NotImplementedError

    def begun(self, head: bytes) -> bool:
        """Whether a stream's first bytes hold a token (or its end): what the proxy commits
        to the client at (forward.py). Completions and chat streams begin with one."""
        return True


class Completions(API):
    def prompts(self, encoder: PromptEncoder, body: dict, max_len: int) -> list[list[int]]:
        if "prompt" not in body:
            raise PromptError("'prompt' is required", "prompt")
        return encoder.completion_prompts(body["prompt"], max_len)

    def default_max_tokens(self, prompt_len: int, max_len: int, configured: int) -> int | None:
        return configured  # vLLM's completions default (16), as the proxy is configured

    def upstream(self, body: dict) -> dict:
        return with_usage_requested(split.client_body(body))

    def usage(self, answer: object) -> Usage | None:
        return chat_usage(answer) if isinstance(answer, dict) else None

    def account(self, body: dict) -> StreamAccount:
        return StreamAccount(forward_usage=client_wants_usage(body))


class Chat(Completions):
    def prompts(self, encoder: PromptEncoder, body: dict, max_len: int) -> list[list[int]]:
        return [encoder.chat_ids(body.get("messages"), max_len, tools=_tools(body, "tools"))]

    def max_tokens_key(self, body: dict) -> str:
        return "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"

    def default_max_tokens(self, prompt_len: int, max_len: int, configured: int) -> int | None:
        return max_len - prompt_len


class ChatBatch(Chat):
    """vLLM's batch form of chat: `messages` holds conversations, conversation i answered as
    choice i, routed as one request as a completions batch is. vLLM serves it whole only, with
    no tools and one choice each: the rest is refused here, naming the field."""

    def prompts(self, encoder: PromptEncoder, body: dict, max_len: int) -> list[list[int]]:
        conversations = body.get("messages")
        if not isinstance(conversations, list) or not conversations:
            raise PromptError("'messages' must be a non-empty list of conversations", "messages")
        if len(conversations) > MAX_BATCH:
            raise PromptError(
                f"a batch holds at most {MAX_BATCH} conversations, not {len(conversations)}",
                "messages",
            )
        if body.get("stream"):
            raise PromptError("this endpoint answers whole: 'stream' must be false", "stream")
        if body.get("tools"):
            raise PromptError("this endpoint takes no 'tools'", "tools")
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise PromptError("this endpoint answers one choice per conversation: 'n' is 1", "n")
        return [encoder.chat_ids(c, max_len) for c in conversations]


class Responses(API):
    def prompts(self, encoder: PromptEncoder, body: dict, max_len: int) -> list[list[int]]:
        messages = responses_messages(body)
        tools = [
            _function_tool(t) for t in _tools(body, "tools") or () if t.get("type") == "function"
        ]
        # vLLM 0.32 tokenizes a rendered Responses prompt with the tokenizer's special tokens
        # added on top of the template's (a second BOS: 21 tokens where chat's are 20).
        return [encoder.chat_ids(messages, max_len, tools=tools or None, special_tokens=True)]

    def upstream(self, body: dict) -> dict:
        # The proxy keeps conversation state itself (conversations.py): a worker never stores
        # a response (its store is per server, in memory and unbounded), nor is asked to.
        out = split.client_body(body)
        return {**out, "store": False}

    def usage(self, answer: object) -> Usage | None:
        return responses_usage(answer) if isinstance(answer, dict) else None

    def account(self, body: dict) -> ResponsesAccount:
        return ResponsesAccount()

    def begun(self, head: bytes) -> bool:
        return ResponsesAccount.begun(head)


class Messages(API):
    def prompts(self, encoder: PromptEncoder, body: dict, max_len: int) -> list[list[int]]:
        tools = [_anthropic_tool(t) for t in _tools(body, "tools") or ()]
        return [encoder.chat_ids(anthropic_messages(body), max_len, tools=tools or None)]

    def default_max_tokens(self, prompt_len: int, max_len: int, configured: int) -> int | None:
        return None  # Anthropic's API requires it

    def usage(self, answer: object) -> Usage | None:
        return messages_usage(answer) if isinstance(answer, dict) else None

    def account(self, body: dict) -> MessagesAccount:
        return MessagesAccount()

    def begun(self, head: bytes) -> bool:
        return MessagesAccount.begun(head)


COMPLETIONS = Completions("completions", "/v1/completions", batches=True)
CHAT = Chat("chat", "/v1/chat/completions", batches=True)
CHAT_BATCH = ChatBatch("chat", "/v1/chat/completions/batch")
RESPONSES = Responses(
    "responses", "/v1/responses", framing=RESPONSES_EVENTS, limit="max_output_tokens"
)
MESSAGES = Messages("messages", "/v1/messages", errors=ANTHROPIC, framing=ANTHROPIC_EVENTS)
APIS = (COMPLETIONS, CHAT, CHAT_BATCH, RESPONSES, MESSAGES)


# ----------------------------------------------------------------------------- Responses input


def responses_messages(body: dict) -> list[dict]:
    """A Responses request as chat messages, as vLLM builds them: `instructions` as the system
    message, then the `input` (text: one user message; items: messages, function calls merged
    into the assistant message before them, function call outputs as tool messages)."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise PromptError("'instructions' must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise PromptError("'input' must not be empty", "input")
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise PromptError("'input' must be a non-empty string or list of items", "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PromptError(f"input[{i}] must be an object", "input")
        _add_item(messages, i, item)
    if not messages:
        raise PromptError("'input' holds nothing to answer", "input")
    return messages


def _add_item(messages: list[dict], i: int, item: dict) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind == "function_call":
        call = {
            "id": _string(item, "call_id", i),
            "type": "function",
            "function": {
                "name": _string(item, "name", i),
                "arguments": _string(item, "arguments", i),
            },
        }
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise PromptError(f"input[{i}].output must be a string", "input")
        messages.append(
            {"role": "tool", "content": output, "tool_call_id": _string(item, "call_id", i)}
        )
    elif kind == "reasoning":
        texts = item.get("content") or item.get("summary") or []
        text = (
            texts[0].get("text", "")
            if isinstance(texts, list) and texts and isinstance(texts[0], dict)
            else ""
        )
        if last is not None and "reasoning" not in last:
            last["reasoning"] = text
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": text})
    elif kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise PromptError(
                f"input[{i}].role must be user, assistant, system or developer", "input"
            )
        content = _item_content(item.get("content"), i)
        if role == "assistant" and last is not None and last.get("content") is None:
            last["content"] = content
        else:
            messages.append({"role": role, "content": content})
    else:
        raise PromptError(f"input[{i}]: unsupported item type {str(kind)[:40]!r}", "input")


def _item_content(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"input[{i}].content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PromptError(f"input[{i}].content[{j}] must have a 'type'", "input")
        if part["type"] in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise PromptError(f"input[{i}].content[{j}].text must be a string", "input")
            texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise PromptError(f"input[{i}].{key} must be a string", "input")
    return value


def _function_tool(tool: dict) -> dict:
    """A Responses function tool in the chat shape a template reads."""
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


# ----------------------------------------------------------------------------- Anthropic input


def anthropic_messages(body: dict) -> list[dict]:
    """An Anthropic Messages request as chat messages, as vLLM builds them: the `system` text
    (billing-header blocks dropped), then each message's blocks (text; `tool_use` as the
    assistant's `tool_calls`; a user's `tool_result` as a `tool` message before the rest of
    that user turn; `thinking` as reasoning)."""
    messages: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system)
        if text:
            messages.append({"role": "system", "content": text})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise PromptError("'messages' must be a non-empty list", "messages")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant", "system"):
            raise PromptError(f"messages[{i}] needs a role (user or assistant)", "messages")
        role, content = turn["role"], turn.get("content")
        if role == "system":
            text = _system_text(content)
            if text:
                messages.append({"role": "system", "content": text})
        elif isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif isinstance(content, list):
            _add_blocks(messages, i, role, content)
        else:
            raise PromptError(f"messages[{i}].content must be text or a list of blocks", "messages")
    return messages


def _system_text(system: object) -> str:
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    if not isinstance(system, list):
        raise PromptError("'system' must be text or a list of text blocks", "system")
    parts = []
    for block in system:
        if not isinstance(block, dict):
            raise PromptError("'system' blocks must be objects", "system")
        text = block.get("text")
        is_text = block.get("type") == "text" and isinstance(text, str) and text
        if is_text and not text.startswith(BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _add_blocks(messages: list[dict], i: int, role: str, blocks: list) -> None:
    texts: list[str] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise PromptError(f"messages[{i}].content[{j}] must have a 'type'", "messages")
        kind = block["type"]
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise PromptError(f"messages[{i}].content[{j}].text must be a string", "messages")
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            name = block.get("name") if isinstance(block.get("name"), str) else ""
            calls.append(
                {
                    "id": str(block.get("id") or ""),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            result = _tool_result_text(block.get("content"))
            if role == "user":
                tool = {"role": "tool", "tool_call_id": str(block.get("tool_use_id") or "")}
                messages.append({**tool, "content": result})
            else:
                texts.append(f"Tool result: {result}")
    message: dict = {"role": role}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if texts:
        message["content"] = "".join(texts)
    elif calls or reasoning:
        message["content"] = None
    else:
        return  # a turn of tool results only: its tool messages stand for it
    messages.append(message)


def _tool_result_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            c["text"]
            for c in content
            if isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
        )
    return ""


def _anthropic_tool(tool: object) -> dict:
    if not isinstance(tool, dict):
        raise PromptError("'tools' must be a list of objects", "tools")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tools(body: dict, key: str) -> list | None:
    tools = body.get(key)
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise PromptError(f"'{key}' must be a list of objects", key)
    return tools
