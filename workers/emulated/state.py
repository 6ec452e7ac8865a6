"""What one emulated server's handlers share: the aiohttp application's keys, set by
`create_app` (workers/emulated/app.py) and read by the routes."""

from __future__ import annotations

from aiohttp import web

from router.proxy.catalog import Catalog
from router.proxy.prompts import PromptEncoder
from router.proxy.settings import ProxySettings
from workers.emulated.adapters import Adapters
from workers.emulated.engine import WallClockEngine
from workers.emulated.kv_events import KVEventPublisher
from workers.emulated.split import Connector

ENGINE = web.AppKey("engine", WallClockEngine)
ENCODER = web.AppKey("encoder", PromptEncoder)
KV_EVENTS = web.AppKey("kv_events", KVEventPublisher)
MODEL = web.AppKey("model", str)
MODEL_DIR = web.AppKey("model_dir", str)
LIMITS = web.AppKey("limits", ProxySettings)
CATALOG = web.AppKey("catalog", Catalog)
VOCAB = web.AppKey("vocab", list)
ADAPTERS = web.AppKey("adapters", Adapters)
PRIORITY_SCHEDULING = web.AppKey("priority_scheduling", bool)
CONNECTOR = web.AppKey("connector", Connector)
