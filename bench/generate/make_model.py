#!/usr/bin/env python3
"""Build the benchmark model directory, deterministically.

A Pythia-shaped GPT-NeoX causal LM with random weights, a WordLevel
tokenizer of exactly 8192 tokens over synthetic words, a generation config
without EOS (so both generators always produce the full length) and a file
of 32 prompts of varied lengths.

Usage: make_model.py [OUT_DIR] [SHAPE]   (default: bench/.cache/pythia-bench, tiny)

SHAPE: tiny (hidden 128, 6 layers), or the layer shapes of EleutherAI's
pythia-160m (hidden 768, 12 layers) or pythia-410m (hidden 1024, 24 layers),
all with the 8192-token vocabulary.
"""

import json
import os
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

SEED = 1234
VOCAB_SIZE = 8192
NUM_PROMPTS = 32
PROMPT_TOKENS = (8, 40)
SPECIAL = ["<|endoftext|>", "<|padding|>", "<unk>"]  # ids 0, 1, 2 (as in Pythia: EOS 0, pad 1)

SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512),
    "160m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}

BENCH_DIR = Path(__file__).resolve().parent.parent
DEFAULT_OUT = BENCH_DIR / ".cache" / "pythia-bench"


def synthetic_words(n, rng):
    """n distinct lowercase words made of consonant-vowel syllables."""
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    words, seen = [], set()
    while len(words) < n:
        word = "".join(
            rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4))
        )
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    shape = SHAPES[sys.argv[2] if len(sys.argv) > 2 else "tiny"]
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)

    # Tokenizer: WordLevel over synthetic words, split on whitespace.
    words = synthetic_words(VOCAB_SIZE - len(SPECIAL), rng)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
    assert len(vocab) == VOCAB_SIZE
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        pad_token="<|padding|>",
        padding_side="left",
        model_max_length=2048,
    )
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    tokenizer.save_pretrained(out)

    # Model: Pythia layout, untied head, f32, random weights.
    config = GPTNeoXConfig(
        vocab_size=VOCAB_SIZE,
        **shape,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        max_position_embeddings=2048,
        initializer_range=0.02,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        use_parallel_residual=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=1,
    )
    torch.manual_seed(SEED)
    model = GPTNeoXForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)

    # Generation config: no EOS anywhere, so generation always runs to max_new_tokens.
    (out / "generation_config.json").write_text(
        json.dumps({"pad_token_id": 1}, indent=2) + "\n"
    )

    # Prompts: 32 rows of 8..40 words, each word one token.
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(NUM_PROMPTS):
            n = rng.randint(*PROMPT_TOKENS)
            text = " ".join(rng.choice(words) for _ in range(n))
            f.write(json.dumps({"prompt": text}) + "\n")

    # Sanity: the tokenizer round-trips through transformers with the right size.
    reloaded = PreTrainedTokenizerFast.from_pretrained(out)
    assert len(reloaded) == VOCAB_SIZE, len(reloaded)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({n_params / 1e6:.2f}M parameters, vocab {VOCAB_SIZE})")


if __name__ == "__main__":
    main()
