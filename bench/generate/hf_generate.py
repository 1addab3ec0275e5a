#!/usr/bin/env python3
"""Time transformers' `generate` on the benchmark model.

Samples NUM_RETURN_SEQUENCES completions of exactly MAX_NEW_TOKENS tokens for
every prompt of DIR/prompts.jsonl (or --prompts FILE) in one batch (left-padded), after one
untimed warm-up call on a small batch, and prints one JSON line:
{"tokens": ..., "seconds": ..., "tokens_per_s": ...}. Only generation is
timed (not model loading or tokenization).

Usage: hf_generate.py MODEL_DIR [--prompts FILE] [--seed N] [--threads 2]
       [--num-return-sequences 4] [--max-new-tokens 64] [--device cuda --bf16]
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-return-sequences", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval().to(args.device)

    with open(args.prompts or args.model_dir / "prompts.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]

    gen_kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=args.num_return_sequences,
        pad_token_id=tokenizer.pad_token_id,
    )

    with torch.inference_mode():
        # Untimed warm-up on a small batch.
        warm = tokenizer(prompts[:4], return_tensors="pt", padding=True).to(args.device)
        model.generate(**warm, max_new_tokens=8, min_new_tokens=8, **gen_kwargs)

        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(args.device)
        start = time.perf_counter()
        out = model.generate(
            **batch,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            **gen_kwargs,
        )
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start

    rows = out.shape[0]
    new_per_row = out.shape[1] - batch["input_ids"].shape[1]
    tokens = rows * new_per_row
    expected = len(prompts) * args.num_return_sequences * args.max_new_tokens
    if tokens != expected:
        raise SystemExit(f"generated {tokens} tokens, expected {expected}")
    result = {"tokens": tokens, "rows": rows, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
    if args.device == "cuda":
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
