//! Training a byte-level BPE tokenizer (GPT-2 style) on a corpus, so a task
//! that ships no tokenizer gets one that transformers loads as is.

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{Error, Result};
use crate::io::write_atomic;

/// The end-of-text token, also used for padding.
pub const EOS: &str = "<|endoftext|>";

/// Trains on `texts` and writes `tokenizer.json` and `tokenizer_config.json`
/// into `dir`. Deterministic for the same texts and size.
pub fn train_byte_level_bpe(texts: &[String], vocab_size: usize, dir: &Path) -> Result<Tokenizer> {
    let fail = |e: tokenizers::Error| Error::Invalid(format!("tokenizer training: {e}"));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(EOS, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer.train(&mut trainer, texts.iter()).map_err(fail)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let json = tokenizer.to_string(true).map_err(fail)?;
    write_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": null,
        "add_bos_token": false,
        "model_max_length": 1024,
    });
    write_atomic(
        &dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config).unwrap_or_default().as_bytes(),
    )?;
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trained_tokenizer_round_trips_text_and_loads_back() {
        let tmp = tempfile::tempdir().unwrap();
        let texts: Vec<String> =
            (0..200).map(|i| format!("The film number {i} was wonderful and the music was lovely.")).collect();
        train_byte_level_bpe(&texts, 300, tmp.path()).unwrap();
        let tok = crate::data::Tokenizer::from_dir(tmp.path()).unwrap();
        assert!(tok.vocab_size() <= 300);
        let ids = tok.encode(" The music was lovely.").unwrap();
        assert!(ids.len() < 10, "merges learned: {ids:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), " The music was lovely.");
        assert_eq!(tok.eos_token_id(), tok.token_to_id(EOS));
    }
}
