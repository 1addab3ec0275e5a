#!/usr/bin/env python3
"""TRL's RLOOTrainer on the benchmark task; prints one JSON line with the
wall time of every optimizer step and the mean completion length.

Usage: trl_rloo.py --model DIR --prompts FILE (--words DIR | --reward-model DIR)
                   [--steps 6] [--threads 2] [--seed 1] [--output DIR]
                   [--device cuda --bf16 --micro-batch N]
                   [--lora-r R] [--gradient-checkpointing] [--weights-bf16]

With --weights-bf16 the models load in bf16 (as a LoRA run of a large
model does) instead of TRL's default f32 weights under autocast.

With --lora-r, TRL trains PEFT LoRA adapters of rank R (alpha 2R) on every
linear layer, and its KL reference is the policy with the adapters off.

The line also holds each phase's seconds per step (generation, scoring,
reference, training: the step less generating and scoring its batch) and,
on a GPU, the peak GPU memory PyTorch allocated.
"""

import argparse
import json
import re
import tempfile
import time

import torch


def word_list_reward(positive, negative):
    """Positive minus negative words, the same words rloo's lexicon reward counts."""
    pos, neg = set(positive), set(negative)

    def lexicon(completions, **kwargs):
        scores = []
        for text in completions:
            words = [w.strip("'-").lower() for w in re.findall(r"[\w'\u2019-]+", text)]
            scores.append(float(sum((w in pos) - (w in neg) for w in words)))
        return scores

    return lexicon


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--words")
    ap.add_argument("--reward-model")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--learning-rate", type=float, default=1e-5)
    ap.add_argument("--output")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--micro-batch", type=int, help="completions per forward/backward [all of a step's]")
    ap.add_argument("--lora-r", type=int, help="train LoRA adapters of this rank on every linear layer")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--weights-bf16", action="store_true", help="load the models in bf16 [f32, under autocast]")
    args = ap.parse_args()
    if (args.words is None) == (args.reward_model is None):
        ap.error("give exactly one of --words and --reward-model")

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    prompts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    if args.words:
        read = lambda name: [w.strip() for w in open(f"{args.words}/{name}.txt") if w.strip()]
        reward = word_list_reward(read("positive"), read("negative"))
    else:
        reward = args.reward_model

    per_step = args.prompts_per_step * args.k
    micro = args.micro_batch or per_step
    if per_step % micro:
        ap.error(f"--micro-batch {micro} does not divide the {per_step} completions of a step")
    config = RLOOConfig(
        output_dir=args.output or tempfile.mkdtemp(prefix="trl-rloo-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=args.k,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        beta=args.beta,
        num_iterations=1,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=args.bf16,
        fp16=False,
        use_cpu=args.device == "cpu",
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        log_completions=False,
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch.bfloat16} if args.weights_bf16 else None,
    )

    def synchronized():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def timed(obj, name, bucket, inside=None):
        """Adds the seconds `obj.name` takes to `phases[bucket][-1]` (only
        while `inside` runs, if given)."""
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            if inside is not None and not active[inside]:
                return inner(*a, **k)
            synchronized()
            t, active[bucket] = time.perf_counter(), True
            try:
                return inner(*a, **k)
            finally:
                synchronized()
                active[bucket] = False
                phases[bucket][-1] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    phases = {k: [] for k in ["generation", "scoring", "reference", "rollout"]}
    active = dict.fromkeys(phases, False)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.lengths, self._t = [], [], None

        def on_step_begin(self, *a, **k):
            for v in phases.values():
                v.append(0.0)
            synchronized()
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            synchronized()
            self.seconds.append(time.perf_counter() - self._t)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    timer = StepTimer()
    trainer = RLOOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
        peft_config=peft_config,
    )
    # TRL 1.x's rollout: generate, score, then the reference's (and, past one
    # iteration, the old policy's) log-probs; what is left of a step trains.
    timed(trainer, "_generate_and_score_completions", "rollout")
    timed(trainer, "_generate", "generation")
    timed(trainer, "_calculate_rewards", "scoring")
    timed(trainer, "_get_per_token_logps_and_entropies", "reference", inside="rollout")
    trainer.train()
    rollout = phases.pop("rollout")
    phases["training"] = [s - r for s, r in zip(timer.seconds, rollout)]
    result = {
        "phase_seconds": phases,
        "step_seconds": timer.seconds,
        "completions_per_step": per_step,
        "mean_completion_length": sum(timer.lengths) / max(len(timer.lengths), 1),
    }
    if args.device == "cuda":
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
