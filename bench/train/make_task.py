#!/usr/bin/env python3
"""Build the RLOO benchmark's task next to the policy made by
generate/make_model.py, deterministically:

- `train_prompts.jsonl`: 48 prompts of 8 to 24 words (6 steps x 8 prompts);
- `positive.txt`, `negative.txt`: the word-list reward, 300 words each;
- `reward-model/`: a GPT-NeoX sequence-classification model of the policy's
  shape (one label, random seeded weights) with the policy's tokenizer.

Usage: make_task.py POLICY_DIR TASK_DIR
"""

import json
import random
import shutil
import sys
from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

SEED = 4321
NUM_PROMPTS = 48
PROMPT_WORDS = (8, 24)
LIST_WORDS = 300
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def main():
    policy, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)

    vocab = json.load(open(policy / "tokenizer.json"))["model"]["vocab"]
    words = sorted(w for w, i in vocab.items() if not w.startswith("<"))
    picked = rng.sample(words, 2 * LIST_WORDS)
    (out / "positive.txt").write_text("\n".join(picked[:LIST_WORDS]) + "\n")
    (out / "negative.txt").write_text("\n".join(picked[LIST_WORDS:]) + "\n")

    with open(out / "train_prompts.jsonl", "w") as f:
        for _ in range(NUM_PROMPTS):
            n = rng.randint(*PROMPT_WORDS)
            f.write(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(n))}) + "\n")

    # The reward model: the policy's shape with a one-label score head.
    base = json.load(open(policy / "config.json"))
    config = GPTNeoXConfig(
        vocab_size=base["vocab_size"],
        hidden_size=base["hidden_size"],
        num_hidden_layers=base["num_hidden_layers"],
        num_attention_heads=base["num_attention_heads"],
        intermediate_size=base["intermediate_size"],
        rotary_pct=base.get("rotary_pct", 0.25),
        max_position_embeddings=base["max_position_embeddings"],
        num_labels=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(SEED)
    model = GPTNeoXForSequenceClassification(config).eval()
    rm_dir = out / "reward-model"
    model.save_pretrained(rm_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (policy / name).exists():
            shutil.copy(policy / name, rm_dir / name)
    print(f"task in {out}")


if __name__ == "__main__":
    main()
