"""Build the tiny test model: no model hub is reachable, so tests make their own.

    python -m workers.tiny_model DIR            # tokenizer + random-weight Llama (needs torch,
                                                # transformers: run it with the vLLM venv)
    python -m workers.tiny_model DIR --tokenizer-only   # tokenizer files only (`tokenizers`)

The tokenizer is byte-level BPE (vocabulary 4,000) trained on text that is on every machine: the
Python standard library's sources. The model is a LlamaConfig (hidden 256, 4 layers, 4 heads,
2 KV heads, 4,096 positions) with random bf16 weights: its text is gibberish, but timing,
batching, prefix caching and KV events are real. This file imports nothing from Fairway, so the
vLLM venv (which does not install Fairway) can run it from the project root.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 4000
MAX_POSITIONS = 4096
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>"}


def training_text(limit_bytes: int = 8_000_000) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        files.append(str(path))
        total += path.stat().st_size
        if total > limit_bytes:
            break
    return files


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(training_text(), trainer)
    bos = tok.token_to_id(SPECIAL["bos"])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL['bos']} $A", special_tokens=[(SPECIAL["bos"], bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL["bos"],
        "eos_token": SPECIAL["eos"],
        "unk_token": SPECIAL["unk"],
        "pad_token": SPECIAL["pad"],
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({f"{k}_token": v for k, v in SPECIAL.items()}, indent=2)
    )


def build_weights(out: Path, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tok.token_to_id(SPECIAL["bos"]),
        eos_token_id=tok.token_to_id(SPECIAL["eos"]),
        pad_token_id=tok.token_to_id(SPECIAL["pad"]),
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))


def is_built(out: Path, tokenizer_only: bool = False) -> bool:
    needed = ["tokenizer.json", "tokenizer_config.json"]
    if not tokenizer_only:
        needed += ["config.json", "model.safetensors"]
    return all((out / n).exists() for n in needed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer-only", action="store_true")
    args = parser.parse_args(argv)
    if is_built(args.out, args.tokenizer_only):
        return 0
    if not (args.out / "tokenizer.json").exists():
        build_tokenizer(args.out)
    if not args.tokenizer_only:
        build_weights(args.out)
    print(f"tiny model in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
