"""The emulated server's command line: `emulated_command` builds the argv that starts one (for
the Ray pool, workers/launch.py, and the benchmarks); `main` reads it (`python -m
workers.emulated`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiohttp import web

from workers.emulated.adapters import ADAPTER_LOAD_TIME
from workers.emulated.app import create_app


def emulated_command(
    port: int,
    model_dir: str | Path,
    model_name: str = "tiny",
    block_size: int = 128,
    preset: str = "llama-3-8b",
    gpu: str = "a100-80g",
    speed: float = 1.0,
    enable_lora: bool = False,
    max_loras: int = 4,
    adapter_load_time: float = ADAPTER_LOAD_TIME,
    lora_modules: dict[str, str] | None = None,
    scheduling_policy: str = "fcfs",
) -> list[str]:
    """The argv that starts one emulated server (for the Ray pool and the benchmarks); a
    split fleet's role and network are added to it (workers/launch.py, SplitLaunch)."""
    argv = [sys.executable, "-m", "workers.emulated", "--port", str(port),
            "--model-dir", str(model_dir), "--served-model-name", model_name,
            "--block-size", str(block_size), "--preset", preset, "--gpu", gpu,
            "--speed", str(speed)]  # fmt: skip
    if enable_lora:
        argv += ["--enable-lora", "--max-loras", str(max_loras),
                 "--adapter-load-time", str(adapter_load_time)]  # fmt: skip
    if lora_modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    if scheduling_policy != "fcfs":
        argv += ["--scheduling-policy", scheduling_policy]
    return argv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m workers.emulated",
        description="emulated vLLM server (Fairway's engine model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model-dir", required=True, help="folder with tokenizer.json")
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--kv-blocks", type=int)
    p.add_argument("--kv-events", help="ZMQ endpoint to publish vLLM KV events on")
    p.add_argument("--kv-events-drop", type=float, default=0.0, help="share of them to lose")
    p.add_argument("--kv-events-drop-after", type=int, default=0, help="batches sent first")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident at once")
    p.add_argument(
        "--adapter-load-time",
        type=float,
        default=ADAPTER_LOAD_TIME,
        help="simulated seconds a step takes longer for each adapter it loads",
    )
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH")
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="priority: the waiting queue by the requests' priority, as vLLM's",
    )
    p.add_argument("--role", choices=("mixed", "prefill", "decode"), default="mixed")
    p.add_argument(
        "--kv-shape",
        choices=("handshake", "shared"),
        default="handshake",
        help="the KV connector's: kv_transfer_params (NIXL-like), or a shared folder",
    )
    p.add_argument("--kv-shared-dir", help="the shared connector's folder")
    p.add_argument("--topology", help="network preset or YAML file timing KV transfers")
    p.add_argument("--topology-gpu", type=int, default=0, help="this server's GPU in it")
    p.add_argument("--topology-gpus", type=int, default=1, help="GPUs in the network")
    args = p.parse_args(argv)
    modules = dict(m.partition("=")[::2] for m in args.lora_modules)
    if any(not name or not path for name, path in modules.items()):
        p.error("--lora-modules: each is NAME=PATH")
    try:
        app = create_app(
            args.model_dir,
            args.served_model_name,
            args.block_size,
            args.preset,
            args.gpu,
            args.speed,
            args.kv_blocks,
            args.kv_events,
            args.kv_events_drop,
            args.kv_events_drop_after,
            args.enable_lora,
            args.max_loras,
            args.adapter_load_time,
            modules,
            args.scheduling_policy,
            args.role,
            args.kv_shape,
            args.kv_shared_dir,
            args.topology,
            args.topology_gpu,
            args.topology_gpus,
            args.port,
        )
    except ValueError as e:
        p.error(str(e))
    # A client that hangs up cancels its handler, as in vLLM (which aborts the request then).
    web.run_app(
        app, host=args.host, port=args.port, print=None, access_log=None,
        handler_cancellation=True,
    )  # fmt: skip
