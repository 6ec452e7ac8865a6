"""The emulated server's /metrics: the vllm:* series a router reads, with vLLM's names and
labels (router/proxy/monitor.py scrapes them)."""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from simulator.engine import Engine


class VLLMMetrics:
    """The vllm:* series a router reads, with vLLM's names and labels."""

    def __init__(
        self, model: str, block_size: int, num_blocks: int, max_loras: int | None = None
    ) -> None:
        r = self.registry = CollectorRegistry()
        labels = ["engine", "model_name"]
        self.labels = ("0", model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1")
        self.queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up")
        self.hits = counter("vllm:prefix_cache_hits", "Prompt tokens found cached")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.success = counter("vllm:request_success", "Finished requests")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", labels, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "E2E latency", labels, registry=r)
        # A finished request's phases by the engine's clock, as vLLM times them: arrival to
        # first scheduled, then to first token, first token to last, first scheduled to last.
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time in the waiting queue", labels, registry=r
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds", "Time in the prefill phase", labels, registry=r
        )
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds", "Time in the decode phase", labels, registry=r
        )
        self.inference_time = Histogram(
            "vllm:request_inference_time_seconds", "Time running", labels, registry=r
        )
        info = Gauge(
            "vllm:cache_config_info", "Cache config", ["block_size", "num_gpu_blocks"], registry=r
        )
        info.labels(str(block_size), str(num_blocks)).set(1)
        self.max_loras = max_loras
        self.lora_info = None
        if max_loras is not None:  # vLLM has it only with LoRA enabled, with no engine label
            self.lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                registry=r,
            )

    def set_lora_info(self, engine: Engine) -> None:
        """vLLM's LoRA gauge: its value the time it was set, one series per label set ever seen
        (a reader takes the newest). Both labels name the same adapters, those with a request
        scheduled at least once and not finished (running, or preempted): vLLM counts a request
        from its first scheduling, so one still waiting for a slot is not named."""
        if self.lora_info is None:
            return
        seqs = itertools.chain(
            engine.running, (s for s in engine.waiting.values() if s.admitted_at is not None)
        )
        names = ",".join(dict.fromkeys(s.req.adapter for s in seqs if s.req.adapter))
        self.lora_info.labels(str(self.max_loras), names, names).set_to_current_time()

    def page(self, engine: Engine) -> bytes:
        """The page a scrape reads: the gauges set from `engine` now, then every series."""
        self.running.labels(*self.labels).set(len(engine.running))
        self.waiting.labels(*self.labels).set(len(engine.waiting))
        self.kv_usage.labels(*self.labels).set(engine.blocks.num_used / engine.blocks.num_blocks)
        self.set_lora_info(engine)
        return generate_latest(self.registry)
