"""The emulated server's /v1/realtime: vLLM's realtime transcription protocol over a websocket,
with a transcript of vocabulary pieces (the emulated model hears nothing).

    server: session.created          client: session.update {model}
    client: input_audio_buffer.append {audio} ... input_audio_buffer.commit
    server: transcription.delta ... transcription.done {text, usage}
"""

from __future__ import annotations

import base64
import binascii
import json
import random
import time
import uuid

from aiohttp import WSMsgType, web

from workers.emulated.state import MODEL, VOCAB

BYTES_PER_TOKEN = 3200  # 0.1 s of 16 kHz PCM16: one emulated word


async def realtime(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    created = {
        "type": "session.created",
        "id": f"sess-{uuid.uuid4().hex}",
        "created": int(time.time()),
    }
    await ws.send_json(created)
    model, heard, rng = None, 0, random.Random(0)
    async for message in ws:
        if message.type != WSMsgType.TEXT:
            break
        try:
            event = json.loads(message.data)
        except ValueError:
            await ws.send_json({"type": "error", "error": "Invalid JSON", "code": "invalid_json"})
            continue
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "session.update":
            model = event.get("model")
            if model != request.app[MODEL]:
                error = f"The model `{model}` does not exist."
                await ws.send_json({"type": "error", "error": error, "code": "model_not_found"})
        elif kind == "input_audio_buffer.append":
            try:
                heard += len(base64.b64decode(event.get("audio") or "", validate=True))
            except (binascii.Error, ValueError):
                await ws.send_json({"type": "error", "error": "audio is not base64"})
        elif kind == "input_audio_buffer.commit":
            if model is None:
                error = "no model: send session.update first"
                await ws.send_json({"type": "error", "error": error, "code": "model_not_validated"})
                continue
            words = [
                rng.choice(request.app[VOCAB]) for _ in range(max(1, heard // BYTES_PER_TOKEN))
            ]
            for word in words:
                await ws.send_json({"type": "transcription.delta", "delta": word})
            usage = {"prompt_tokens": heard // BYTES_PER_TOKEN, "completion_tokens": len(words)}
            await ws.send_json(
                {"type": "transcription.done", "text": "".join(words), "usage": usage}
            )
            heard = 0
    return ws
