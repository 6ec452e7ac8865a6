"""Build a tiny LoRA adapter for the tiny test model: no hub, no PEFT, so tests make their own.

    python -m workers.tiny_lora BASE_DIR OUT_DIR [--seed N] [--rank 8]   # needs torch and
                                                  # safetensors: run it with the vLLM venv

It writes what PEFT's `save_pretrained` would: `adapter_config.json` and
`adapter_model.safetensors` with `lora_A`/`lora_B` for every attention and MLP projection of
every layer, shapes read from the base model's config.json. PEFT starts `lora_B` at zero, which
makes a fresh adapter a no-op; here both matrices are random and large enough that greedy output
differs from the base model's, and each seed gives a different adapter, so a test can tell which
adapter (or none) served a request. Like tiny_model.py, it imports nothing from Fairway.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STD = 0.1  # of A and B entries: the update is about alpha/r * sqrt(r) * STD**2, beside 0.02 base


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection in a Llama-style layer."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build_adapter(base: Path, out: Path, seed: int = 0, rank: int = 8) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in TARGETS:
            group = "self_attn" if name in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
            fan_in, fan_out = shapes[name]
            for part, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                weight = torch.randn(shape, generator=gen) * STD
                tensors[f"{prefix}.{part}.weight"] = weight.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "base_model_name_or_path": str(base.resolve()),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def is_built(out: Path) -> bool:
    return all((out / n).exists() for n in ("adapter_config.json", "adapter_model.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    if not (args.base / "config.json").exists():
        parser.error(f"no config.json in {args.base}: build the tiny model first")
    build_adapter(args.base, args.out, args.seed, args.rank)
    print(f"tiny LoRA adapter (seed {args.seed}, rank {args.rank}) in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
