#!/usr/bin/env python3
"""Random-weight policy and reward model with a real Pythia config's shape.

  make_models.py SIZE OUT_DIR      SIZE: 410m or 1b (EleutherAI/pythia-*-deduped)

Writes OUT_DIR/policy (GPTNeoXForCausalLM) and OUT_DIR/reward
(GPTNeoXForSequenceClassification, one label), both f32 safetensors with a
WordLevel tokenizer of exactly 50304 synthetic words (no EOS in the
generation config, so every completion runs to full length), and
OUT_DIR/prompts.jsonl: 64 prompts of 64 to 128 tokens. Deterministic.
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification, PreTrainedTokenizerFast

SEED = 1234
VOCAB_SIZE = 50304
SPECIAL = ["<|endoftext|>", "<|padding|>", "<unk>"]  # as in Pythia: EOS 0, pad 1
# The shapes of EleutherAI/pythia-410m-deduped and pythia-1b-deduped.
SHAPES = {
    "410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
}


def words(n, rng):
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 5)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def main():
    size, out = sys.argv[1], Path(sys.argv[2])
    rng = random.Random(SEED)
    vocab_words = words(VOCAB_SIZE - len(SPECIAL), rng)
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL + vocab_words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIAL[0], eos_token=SPECIAL[0], unk_token="<unk>", pad_token=SPECIAL[1],
        padding_side="left", model_max_length=2048,
    )
    config = dict(
        vocab_size=VOCAB_SIZE, rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048,
        initializer_range=0.02, layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=1, **SHAPES[size],
    )
    torch.manual_seed(SEED)
    for name, cls, extra in [("policy", GPTNeoXForCausalLM, {}), ("reward", GPTNeoXForSequenceClassification, {"num_labels": 1})]:
        model = cls(GPTNeoXConfig(**config, **extra)).to(torch.float32).eval()
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        (out / name / "generation_config.json").write_text(json.dumps({"pad_token_id": 1}) + "\n")
        print(f"{out / name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt": " ".join(rng.choice(vocab_words) for _ in range(rng.randint(64, 128)))}) + "\n")


if __name__ == "__main__":
    main()
