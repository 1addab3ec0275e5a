//! Dataset rows to token ids: file readers, dataset names and splits,
//! filters, prompts, chat templates, tokenizers, and the recipes that turn
//! published datasets into the files the trainers read.

pub mod chat;
pub mod csv;
pub mod filter;
pub mod inspect;
pub mod jsonl;
pub mod prepare;
pub mod prompt;
pub mod prompts;
pub mod recipes;
pub mod rows;
pub mod source;
pub mod table;
pub mod tokenizer;

pub use chat::ChatTemplate;
pub use jsonl::JsonlWriter;
pub use prompt::{Message, Prompt};
pub use rows::{read_rows, Row};
pub use source::DatasetSpec;
pub use tokenizer::{copy_tokenizer_files, Tokenizer, TOKENIZER_FILES};

/// A digest of token sequences (FNV-1a over each one's length and ids),
/// which a checkpoint keeps so that a resume on other data is refused.
pub fn token_digest<'a>(sequences: impl IntoIterator<Item = &'a [u32]>) -> String {
    let mut h = FNV_START;
    for ids in sequences {
        h = fnv1a(h, &(ids.len() as u32).to_le_bytes());
        for id in ids {
            h = fnv1a(h, &id.to_le_bytes());
        }
    }
    format!("{h:016x}")
}

/// A digest of bytes (FNV-1a, in hex): what the processes of a job compare.
pub fn byte_digest(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a(FNV_START, bytes))
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// 64-bit FNV-1a continued over `bytes`.
fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The training rows and the evaluation rows: `eval` when a separate set was
/// given, else `fraction` of `rows` held out (see [`hold_out`]).
pub fn split_eval<T>(rows: Vec<T>, eval: Option<Vec<T>>, fraction: f64, rng: &mut crate::rng::Rng) -> (Vec<T>, Vec<T>) {
    match eval {
        Some(eval) => (rows, eval),
        None => hold_out(rows, fraction, rng),
    }
}

/// Shuffles `rows` with `rng` and holds out `fraction` of them (at least one
/// row stays for training): returns (train, held out).
pub fn hold_out<T>(rows: Vec<T>, fraction: f64, rng: &mut crate::rng::Rng) -> (Vec<T>, Vec<T>) {
    let held = ((fraction * rows.len() as f64).round() as usize).min(rows.len().saturating_sub(1));
    let mut shuffled = shuffle(rows, rng);
    let eval = shuffled.split_off(shuffled.len() - held);
    (shuffled, eval)
}

/// `rows` in an order drawn from `rng`.
pub fn shuffle<T>(rows: Vec<T>, rng: &mut crate::rng::Rng) -> Vec<T> {
    let order = rng.permutation(rows.len());
    let mut slots: Vec<Option<T>> = rows.into_iter().map(Some).collect();
    order.iter().filter_map(|&i| slots[i].take()).collect()
}
