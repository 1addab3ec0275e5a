#!/usr/bin/env python3
"""Random-weight policy and reward model with a real config's shape.

  make_models.py SIZE OUT_DIR   SIZE: 410m or 1b (EleutherAI/pythia-*-deduped),
                                      qwen3-8b (Qwen/Qwen3-8B), qwen3-0.6b
                                      (Qwen/Qwen3-0.6B: two query heads a
                                      key/value head), or tiny and qwen3-tiny
                                      (a Pythia and a Qwen3 of hidden 128,
                                      for dry runs on the CPU)

Writes OUT_DIR/policy (a causal LM) and OUT_DIR/reward (a sequence
classifier, one label) with a WordLevel tokenizer of exactly the config's
vocabulary in synthetic words (no EOS in the generation config, so every
completion runs to full length), OUT_DIR/prompts.jsonl (64 prompts of 64 to
128 tokens) and OUT_DIR/shape.json (the policy's parameter counts and shape,
for FLOP and byte counts). Pythia shapes: both models GPT-NeoX of that
shape, f32. qwen3-8b: the policy Qwen3-8B's config, the reward model the
same family at Qwen3-0.6B's shape, both bf16, made on the GPU when there is
one; qwen3-0.6b: both of Qwen3-0.6B's shape, bf16. Deterministic for a
given torch build.
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

SEED = 1234
SPECIAL = ["<|endoftext|>", "<|padding|>", "<unk>"]  # EOS 0, pad 1
# The shapes of EleutherAI/pythia-410m-deduped and pythia-1b-deduped.
PYTHIA = dict(
    vocab_size=50304, rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048,
    initializer_range=0.02, layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=1,
)
SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
    "410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
}
# Qwen/Qwen3-8B's config.json and, for the reward model, Qwen/Qwen3-0.6B's shape.
QWEN3 = dict(
    vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.02, attention_bias=False, attention_dropout=0.0,
    bos_token_id=0, eos_token_id=None, pad_token_id=1,
)
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, intermediate_size=12288,
                tie_word_embeddings=False)
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072,
                 tie_word_embeddings=True)
# For a dry run of the 8B arm on the CPU: its vocabulary and grouped heads, at hidden 128.
QWEN3_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=384, tie_word_embeddings=False)


def words(n, rng):
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 5)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def models_of(size):
    """(name, class, config, dtype) of the policy and the reward model."""
    if size in SHAPES:
        policy = GPTNeoXConfig(**PYTHIA, **SHAPES[size])
        reward = GPTNeoXConfig(**PYTHIA, **SHAPES[size], num_labels=1)
        return [("policy", GPTNeoXForCausalLM, policy, torch.float32),
                ("reward", GPTNeoXForSequenceClassification, reward, torch.float32)]
    qwen3 = {"qwen3-8b": (QWEN3_8B, QWEN3_06B), "qwen3-0.6b": (QWEN3_06B, QWEN3_06B),
             "qwen3-tiny": (QWEN3_TINY, QWEN3_TINY)}
    if size in qwen3:
        policy, reward = qwen3[size]
        return [("policy", Qwen3ForCausalLM, Qwen3Config(**{**QWEN3, **policy}), torch.bfloat16),
                ("reward", Qwen3ForSequenceClassification, Qwen3Config(**{**QWEN3, **reward}, num_labels=1),
                 torch.bfloat16)]
    sys.exit(f"unknown size {size}: 410m, 1b, qwen3-8b, qwen3-0.6b, tiny or qwen3-tiny")


def shape_of(model, config):
    """What FLOP and byte counts need: parameters (all, and those of the input
    embedding, which a token only indexes unless the LM head is tied to it)
    and the attention's shape."""
    embedding = model.get_input_embeddings().weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return dict(
        parameters=sum(p.numel() for p in model.parameters()),
        embedding_parameters=embedding,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        attention_heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
    )


def main():
    size, out = sys.argv[1], Path(sys.argv[2])
    rng = random.Random(SEED)
    specs = models_of(size)
    vocab_size = specs[0][2].vocab_size
    vocab_words = words(vocab_size - len(SPECIAL), rng)
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL + vocab_words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIAL[0], eos_token=SPECIAL[0], unk_token="<unk>", pad_token=SPECIAL[1],
        padding_side="left", model_max_length=2048,
    )
    torch.manual_seed(SEED)
    # An 8B model initialised on the CPU takes minutes: on the GPU, seconds.
    device = "cuda" if torch.cuda.is_available() and size.startswith("qwen3") else "cpu"
    for name, cls, config, dtype in specs:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = cls(config).eval()
        torch.set_default_dtype(torch.float32)
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        (out / name / "generation_config.json").write_text(json.dumps({"pad_token_id": 1}) + "\n")
        if name == "policy":
            shape = shape_of(model, config)
        print(f"{out / name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
        del model
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt": " ".join(rng.choice(vocab_words) for _ in range(rng.randint(64, 128)))}) + "\n")
    # Last: bench/gpu/run.sh takes a folder with its shape as made.
    (out / "shape.json").write_text(json.dumps(shape, indent=1) + "\n")


if __name__ == "__main__":
    main()
