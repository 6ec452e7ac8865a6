"""An emulated vLLM server: the simulator's engine model run in wall-clock time behind vLLM's
HTTP API and /metrics names, for load tests and fast tests where no real vLLM fits.

    python -m workers.emulated --port 8100 --model-dir DIR [--preset llama-3-8b --gpu a100-80g]
        [--kv-events ipc:///tmp/kv-0 [--kv-events-drop 0.5] [--kv-events-drop-after 100]]
        [--enable-lora [--max-loras 4] [--adapter-load-time 0.05] [--lora-modules a=DIR ...]]
        [--scheduling-policy priority]
        [--role prefill|decode|mixed --kv-shape handshake|shared [--kv-shared-dir DIR]
         --topology dgx-h100 --topology-gpu I --topology-gpus N]

One module per job:

    engine.py       the SimPy engine driven from the asyncio loop in wall-clock time
    completions.py  /v1/completions and /v1/chat/completions, streamed or whole
    routes.py       vLLM's other endpoints: health, models, metrics, prefix-cache reset, LoRA
    adapters.py     the LoRA adapters registered (`--enable-lora`)
    kv_events.py    vLLM's KV events over ZMQ (`--kv-events`), lossy on purpose if asked
    metrics.py      the vllm:* series a router reads
    split.py        the prefill and decode roles of a split fleet (vLLM's KV connectors)
    state.py        what the handlers share: the application's keys
    app.py          one server's application, from its settings
    cli.py          its command line: the argv that starts it, and the parser that reads it

Tokens are vocabulary pieces drawn from a seed of the prompt, so that every server answers a
prompt alike (as greedy decoding would); timing, batching, prefix caching and preemption follow
the engine model, one event per step (no fast-forward: each step's tokens stream as it ends).

With `--scheduling-policy priority` it schedules as vLLM's priority policy: a request's
`priority` (the body's field, or vLLM's X-Vllm-Priority header) puts it in a strict band of the
waiting queue (lower first, router.bands over FCFS), and when running requests need KV blocks
the victim is the lowest-priority one. Under fcfs (the default) the priority is ignored.
"""
