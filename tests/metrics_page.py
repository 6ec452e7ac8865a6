"""What a Prometheus /metrics page says (the proxy's, or a worker's), read in tests."""

from __future__ import annotations

import re

import aiohttp


async def samples(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """Every sample of metric `name` on `url`/metrics, by its label set ("" for none)."""
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200, f"{url}/metrics answered {r.status}"
        text = await r.text()
    found = re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return {labels: float(value) for labels, value in found}


async def total(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """Metric `name` on `url`/metrics, summed over its label sets."""
    return sum((await samples(session, url, name)).values())
