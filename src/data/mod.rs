//! Dataset rows to token ids: JSONL readers, prompts, chat templates, tokenizers.

pub mod chat;
pub mod jsonl;
pub mod prompt;
pub mod prompts;
pub mod tokenizer;

pub use chat::ChatTemplate;
pub use jsonl::{read_rows, JsonlWriter, Row};
pub use prompt::{Message, Prompt};
pub use tokenizer::{copy_tokenizer_files, Tokenizer, TOKENIZER_FILES};
