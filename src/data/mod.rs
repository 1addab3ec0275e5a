//! Dataset rows to token ids: JSONL readers, prompts, chat templates, tokenizers.
