//! A completion's text as it grows token by token: incremental decoding
//! that never splits a character or loses the spaces a tokenizer drops at
//! the start of a decode, and stop strings that end the text before them.
//! Text that could still be the start of a stop string is held back, so
//! what has been sent never has to be taken back.

use crate::data::Tokenizer;
use crate::error::Result;

pub struct TextStream {
    ids: Vec<u32>,
    /// Decoding window: `ids[prefix..read]` is text already appended, kept
    /// as context so the next tokens decode with their leading spaces.
    prefix: usize,
    read: usize,
    text: String,
    /// Bytes of `text` handed out so far.
    sent: usize,
    stops: Vec<String>,
    /// Bytes held back: one less than the longest stop string.
    hold: usize,
    /// A stop string ended the text.
    stopped: bool,
}

/// What one token adds.
#[derive(Debug, Default, PartialEq)]
pub struct Piece {
    /// Text now safe to send (may be empty).
    pub text: String,
    /// A stop string appeared: the completion ends, without it.
    pub stopped: bool,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let hold = stops.iter().map(String::len).max().unwrap_or(0).saturating_sub(1);
        TextStream { ids: Vec::new(), prefix: 0, read: 0, text: String::new(), sent: 0, stops, hold, stopped: false }
    }

    /// Adds a generated token.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Piece> {
        self.ids.push(id);
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the
        // token that completes it.
        self.decode_pending(tokenizer, false)?;
        // A stop string that ends here starts after what was sent, since
        // `hold` bytes were held back.
        let found = self.stops.iter().filter_map(|s| self.text[self.sent..].find(s.as_str())).min();
        if let Some(at) = found {
            let end = self.sent + at;
            self.text.truncate(end);
            self.stopped = true;
            return Ok(Piece { text: self.take(end), stopped: true });
        }
        let safe = floor_char_boundary(&self.text, self.text.len().saturating_sub(self.hold)).max(self.sent);
        Ok(Piece { text: self.take(safe), stopped: false })
    }

    /// What is left to send once the completion has ended: the text held
    /// back and that of tokens still waiting to complete a character
    /// (nothing after a stop string).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.decode_pending(tokenizer, true)?;
        Ok(self.take(self.text.len()))
    }

    /// Appends the text of the tokens not yet decoded, unless it ends in
    /// the middle of a character and `whole` is false.
    fn decode_pending(&mut self, tokenizer: &Tokenizer, whole: bool) -> Result<()> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let after = tokenizer.decode(&self.ids[self.prefix..], true)?;
        let complete = whole || !after.ends_with('\u{FFFD}');
        if after.len() > before.len() && complete && after.is_char_boundary(before.len()) {
            self.text.push_str(&after[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(())
    }

    fn take(&mut self, end: usize) -> String {
        let piece = self.text[self.sent..end].to_string();
        self.sent = end;
        piece
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tokenizer() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama-causal");
        Tokenizer::from_dir(&dir).unwrap()
    }

    /// Feeds `text`'s tokens one at a time and returns what was sent
    /// piece by piece and whether a stop string ended it.
    fn stream(text: &str, stops: &[&str]) -> (Vec<String>, bool) {
        let tok = tokenizer();
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut stream = TextStream::new(&stops);
        let mut pieces = Vec::new();
        for id in tok.encode(text).unwrap() {
            let piece = stream.push(&tok, id).unwrap();
            pieces.push(piece.text);
            if piece.stopped {
                return (pieces, true);
            }
        }
        pieces.push(stream.finish(&tok).unwrap());
        (pieces, false)
    }

    #[test]
    fn pieces_add_up_to_the_decoded_text() {
        let text = "Hello world, it's a fine day: ünïcödé and 日本語 too.";
        let (pieces, stopped) = stream(text, &[]);
        assert!(!stopped);
        let tok = tokenizer();
        assert_eq!(pieces.concat(), tok.decode(&tok.encode(text).unwrap(), true).unwrap());
        assert!(pieces.iter().filter(|p| !p.is_empty()).count() > 5, "{pieces:?}");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_and_nothing_after_it_is_sent() {
        let (pieces, stopped) = stream("one two three. Four five", &[". F", "zzz"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "one two three");
    }

    #[test]
    fn text_that_may_start_a_stop_string_is_held_back_until_it_cannot() {
        let (pieces, stopped) = stream("abc END", &["END!"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "abc END");
        // The last three bytes could have begun "END!": they come at the end.
        assert!(pieces.last().unwrap().ends_with("END"), "{pieces:?}");
    }
}
