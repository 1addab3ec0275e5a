//! Built-in rule rewards: functions of the completion text (and of the
//! dataset row) that need no model.
//!
//! - [`Length`]: the completion's length, or its distance to a target length;
//! - [`Count`]: how often a regex or a literal substring occurs;
//! - [`Lexicon`]: positive minus negative words from two word lists;
//! - [`ExactMatch`]: 1 when the completion (or the answer extracted from it)
//!   equals a column of the dataset row, else 0.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::{DType, Device};
use regex::{Regex, RegexBuilder};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::config::{finite, one, RewardTable};
use super::{RewardSource, Sample};
use crate::error::{read_to_string, Error, Result};

/// `type = "length"`: `scale * len`, or `scale * -|len - target|`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LengthSpec {
    /// Metric name; default `length`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// `tokens` (policy tokens, the default) or `chars`.
    #[serde(default)]
    pub unit: LengthUnit,
    /// When set, the reward is minus the distance to this length.
    pub target: Option<f32>,
    /// Multiplies the length (or the distance).
    #[serde(default = "one")]
    pub scale: f32,
}

impl RewardTable for LengthSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        finite("scale", self.scale)?;
        if let Some(t) = self.target {
            if !(t.is_finite() && t >= 0.0) {
                return Err(Error::Invalid(format!("target must be a length >= 0, got {t}")));
            }
        }
        Ok(Box::new(Length::new(name, self.unit, self.target, self.scale)))
    }
}

/// `type = "count"`: matches of `pattern` or `substring`, capped at `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountSpec {
    /// Metric name; default `count`.
    pub name: Option<String>,
    /// Weight in the total score (negative to penalise).
    #[serde(default = "one")]
    pub weight: f32,
    /// A regular expression (Rust `regex` syntax).
    pub pattern: Option<String>,
    /// Literal text; give this or `pattern`.
    pub substring: Option<String>,
    /// Match regardless of case.
    #[serde(default)]
    pub case_insensitive: bool,
    /// Count at most this many matches.
    pub max: Option<u32>,
}

impl RewardTable for CountSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        let needle = match (&self.pattern, &self.substring) {
            (Some(p), None) => Needle::Pattern(p.clone()),
            (None, Some(t)) => Needle::Substring(t.clone()),
            (Some(_), Some(_)) => {
                return Err(Error::Invalid(
                    "give either `pattern` (a regex) or `substring` (literal text), \
                     not both"
                        .into(),
                ))
            }
            (None, None) => {
                return Err(Error::Invalid("give `pattern` (a regex) or `substring` (literal text) to count".into()))
            }
        };
        Ok(Box::new(Count::new(name, &needle, self.case_insensitive, self.max)?))
    }
}

/// `type = "lexicon"`: `#positive - #negative` words.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LexiconSpec {
    /// Metric name; default `lexicon`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// Positive words, inline.
    #[serde(default)]
    pub positive: Vec<String>,
    /// Negative words, inline.
    #[serde(default)]
    pub negative: Vec<String>,
    /// A file of positive words, one per line (`#`/`;` comment lines).
    pub positive_file: Option<PathBuf>,
    /// A file of negative words, one per line.
    pub negative_file: Option<PathBuf>,
    /// Divide by the number of words in the completion.
    #[serde(default)]
    pub normalize: bool,
}

impl RewardTable for LexiconSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        let mut positive = self.positive.clone();
        let mut negative = self.negative.clone();
        if let Some(path) = &self.positive_file {
            positive.extend(read_list("positive_file", path)?);
        }
        if let Some(path) = &self.negative_file {
            negative.extend(read_list("negative_file", path)?);
        }
        Ok(Box::new(Lexicon::new(name, &positive, &negative, self.normalize)?))
    }
}

/// `type = "exact_match"`: 1.0 when the completion's answer equals the
/// row's `column`, else 0.0; rows without the column are unscorable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExactMatchSpec {
    /// Metric name; default `exact_match`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// The dataset column holding the reference answer.
    pub column: String,
    /// Compare lower-cased.
    #[serde(default)]
    pub case_insensitive: bool,
    /// Compare only the text after the last occurrence of this marker
    /// (GSM8K's `####`).
    pub marker: Option<String>,
    /// Compare only the last number (as a number).
    #[serde(default)]
    pub last_number: bool,
}

impl RewardTable for ExactMatchSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        Ok(Box::new(ExactMatch::new(
            name,
            self.column.clone(),
            self.case_insensitive,
            self.marker.clone(),
            self.last_number,
        )?))
    }
}

fn read_list(key: &str, path: &Path) -> Result<Vec<String>> {
    read_word_list(path).map_err(|e| Error::Invalid(format!("{key}: {e}")))
}

/// What [`Length`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthUnit {
    /// Policy tokens (`completion_ids`).
    #[default]
    Tokens,
    /// Unicode scalar values of the completion text.
    Chars,
}

/// `scale * len`, or `scale * -|len - target|` with a target: the reward
/// then peaks at the target length and falls off linearly on both sides.
#[derive(Debug, Clone)]
pub struct Length {
    name: String,
    unit: LengthUnit,
    target: Option<f32>,
    scale: f32,
}

impl Length {
    pub fn new(name: impl Into<String>, unit: LengthUnit, target: Option<f32>, scale: f32) -> Self {
        Length { name: name.into(), unit, target, scale }
    }

    fn score_one(&self, sample: &Sample) -> f32 {
        // Lengths are far below 2^24, so the conversion is exact.
        let len = match self.unit {
            LengthUnit::Tokens => sample.completion_ids.len(),
            LengthUnit::Chars => sample.completion.chars().count(),
        } as f32;
        let raw = match self.target {
            Some(target) => -(len - target).abs(),
            None => len,
        };
        self.scale * raw
    }
}

impl RewardSource for Length {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        Ok(samples.iter().map(|s| Some(self.score_one(s))).collect())
    }
}

/// What [`Count`] looks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Needle {
    /// A regular expression (Rust `regex` syntax).
    Pattern(String),
    /// A literal string.
    Substring(String),
}

/// The number of non-overlapping matches of a regex or substring in the
/// completion (as `str::matches` counts), capped at `max` when given.
#[derive(Debug, Clone)]
pub struct Count {
    name: String,
    regex: Regex,
    max: Option<u32>,
}

impl Count {
    /// Compiles the needle; a literal substring becomes an escaped regex so
    /// that both kinds share one case-insensitive matcher. The error names the
    /// pattern.
    pub fn new(name: impl Into<String>, needle: &Needle, case_insensitive: bool, max: Option<u32>) -> Result<Count> {
        let (text, source, what) = match needle {
            Needle::Pattern(p) => (p, p.clone(), "pattern"),
            Needle::Substring(s) => (s, regex::escape(s), "substring"),
        };
        if text.is_empty() {
            return Err(Error::Invalid(format!("{what} is empty; it would match between every two characters")));
        }
        let regex = RegexBuilder::new(&source)
            .case_insensitive(case_insensitive)
            .build()
            .map_err(|e| Error::Invalid(format!("{what} `{text}` is not a valid regex: {e}")))?;
        Ok(Count { name: name.into(), regex, max })
    }
}

impl RewardSource for Count {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        Ok(samples
            .iter()
            .map(|s| {
                let n = self.regex.find_iter(s.completion).count();
                let n = self.max.map_or(n, |m| n.min(m as usize));
                Some(n as f32)
            })
            .collect())
    }
}

/// Word-list sentiment: `#positive - #negative` over the lower-cased words of
/// the completion, divided by the number of words when `normalize` is set
/// (an empty completion scores 0). Every occurrence counts: "good good" is 2.
#[derive(Debug, Clone)]
pub struct Lexicon {
    name: String,
    positive: HashSet<String>,
    negative: HashSet<String>,
    normalize: bool,
}

impl Lexicon {
    /// Builds the lexicon from two word lists (lower-cased here). An entry
    /// that is not one word, or that is in both lists, is an error: it could
    /// never match, or would cancel itself out.
    pub fn new(name: impl Into<String>, positive: &[String], negative: &[String], normalize: bool) -> Result<Lexicon> {
        let positive = word_set(positive, "positive")?;
        let negative = word_set(negative, "negative")?;
        if positive.is_empty() && negative.is_empty() {
            return Err(Error::Invalid("both word lists are empty; give `positive`/`negative` words or files".into()));
        }
        let mut both: Vec<&String> = positive.intersection(&negative).collect();
        if !both.is_empty() {
            both.sort();
            return Err(Error::Invalid(format!("{} in both the positive and the negative list", quote_list(&both))));
        }
        Ok(Lexicon { name: name.into(), positive, negative, normalize })
    }

    fn score_one(&self, text: &str) -> f32 {
        let (mut n, mut sum) = (0usize, 0i64);
        for w in words(text) {
            n += 1;
            if self.positive.contains(&w) {
                sum += 1;
            } else if self.negative.contains(&w) {
                sum -= 1;
            }
        }
        match (self.normalize, n) {
            (false, _) => sum as f32,
            (true, 0) => 0.0,
            (true, n) => sum as f32 / n as f32,
        }
    }
}

impl RewardSource for Lexicon {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        Ok(samples.iter().map(|s| Some(self.score_one(s.completion))).collect())
    }
}

/// The lower-cased words of `text`: maximal runs of letters, digits,
/// apostrophes and hyphens, with apostrophes and hyphens trimmed from both
/// ends, so that "Don't" gives `don't`, "well-made," gives `well-made` and a
/// quote 'good' gives `good`.
pub fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !(c.is_alphanumeric() || is_joiner(c)))
        .map(|w| w.trim_matches(is_joiner))
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
}

fn is_joiner(c: char) -> bool {
    matches!(c, '\'' | '\u{2019}' | '-')
}

fn word_set(list: &[String], which: &str) -> Result<HashSet<String>> {
    let mut set = HashSet::new();
    for entry in list {
        let found: Vec<String> = words(entry).collect();
        match found.as_slice() {
            [w] if w == &entry.trim().to_lowercase() => {
                set.insert(w.clone());
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "{which} word `{entry}` is not a single word: completions are split into \
                     words of letters, digits, inner apostrophes and hyphens, so it would never \
                     match"
                )))
            }
        }
    }
    Ok(set)
}

/// Reads a word list: one word per line; blank lines and lines starting with
/// `#` or `;` (the comment style of common opinion lexicons) are skipped. An
/// entry that is not one word is an error naming the file and line.
pub fn read_word_list(path: &Path) -> Result<Vec<String>> {
    let text = read_to_string(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let entry = line.trim();
        if entry.is_empty() || entry.starts_with('#') || entry.starts_with(';') {
            continue;
        }
        word_set(&[entry.to_string()], "the").map_err(|e| Error::bad_row(path, i + 1, e.to_string()))?;
        out.push(entry.to_string());
    }
    Ok(out)
}

fn quote_list(items: &[&String]) -> String {
    items.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ")
}

/// 1.0 when the completion's answer equals the dataset row's `column`, else
/// 0.0; rows without the column (or with a null, list or object there) are
/// unscorable.
///
/// The answer is found in the same way in the completion and in the column:
/// 1. with a `marker` (GSM8K's `####`), the text after its last occurrence;
///    a completion without the marker gave no answer and scores 0, a column
///    without it is used whole (a bare `42`);
/// 2. with `last_number`, the last number in that text (`-1,234.5`, commas
///    dropped), compared as a number so that `42.0` equals `42`; a
///    completion without a number scores 0;
/// 3. trimmed, and lower-cased when `case_insensitive`.
#[derive(Debug, Clone)]
pub struct ExactMatch {
    name: String,
    column: String,
    case_insensitive: bool,
    marker: Option<String>,
    last_number: bool,
}

impl ExactMatch {
    pub fn new(
        name: impl Into<String>,
        column: impl Into<String>,
        case_insensitive: bool,
        marker: Option<String>,
        last_number: bool,
    ) -> Result<ExactMatch> {
        let column = column.into();
        if column.is_empty() {
            return Err(Error::Invalid("column is empty".into()));
        }
        if marker.as_deref() == Some("") {
            return Err(Error::Invalid("marker is empty; leave it out to compare the whole completion".into()));
        }
        Ok(ExactMatch { name: name.into(), column, case_insensitive, marker, last_number })
    }

    /// The column's text, `None` when the row has no usable value.
    fn reference<'r>(&self, row: &'r Map<String, Value>) -> Option<std::borrow::Cow<'r, str>> {
        match row.get(&self.column)? {
            Value::String(s) => Some(s.as_str().into()),
            Value::Number(n) => Some(n.to_string().into()),
            Value::Bool(b) => Some(b.to_string().into()),
            Value::Null | Value::Array(_) | Value::Object(_) => None,
        }
    }

    /// The answer in `text`; `None` when the completion gave none.
    /// `strict`: the marker and number must be present (completions); a
    /// column falls back to its whole text.
    fn answer(&self, text: &str, strict: bool) -> Option<Answer> {
        let mut text = text;
        if let Some(marker) = &self.marker {
            match text.rfind(marker.as_str()) {
                Some(at) => text = &text[at + marker.len()..],
                None if strict => return None,
                None => {}
            }
        }
        if self.last_number {
            match number_regex().find_iter(text).last() {
                Some(m) => {
                    let digits = m.as_str().replace(',', "");
                    if let Ok(x) = digits.parse::<f64>() {
                        return Some(Answer::Number(x));
                    }
                }
                None if strict => return None,
                None => {}
            }
        }
        let text = text.trim();
        Some(Answer::Text(if self.case_insensitive { text.to_lowercase() } else { text.to_string() }))
    }

    fn no_column_error(&self, rows: &[&Map<String, Value>]) -> Error {
        let columns =
            rows.first().map(|r| r.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")).unwrap_or_default();
        Error::Invalid(format!(
            "exact_match reward `{}`: no dataset row has a value in column `{}` \
             (the first row has {})",
            self.name,
            self.column,
            if columns.is_empty() { "no columns".to_string() } else { format!("columns {columns}") }
        ))
    }
}

#[derive(Debug, PartialEq)]
enum Answer {
    Number(f64),
    Text(String),
}

/// An optionally negative integer or decimal, with optional thousands commas.
fn number_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"-?\d+(?:,\d{3})*(?:\.\d+)?").expect("valid regex"))
}

impl RewardSource for ExactMatch {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        if !samples.is_empty() && samples.iter().all(|s| self.reference(s.row).is_none()) {
            let rows: Vec<_> = samples.iter().map(|s| s.row).collect();
            return Err(self.no_column_error(&rows));
        }
        Ok(samples
            .iter()
            .map(|s| {
                let reference = self.reference(s.row)?;
                let want = self.answer(&reference, false);
                let got = self.answer(s.completion, true);
                Some(if got.is_some() && got == want { 1.0 } else { 0.0 })
            })
            .collect())
    }

    fn check_rows(&self, rows: &[&Map<String, Value>]) -> Result<()> {
        if !rows.is_empty() && rows.iter().all(|r| self.reference(r).is_none()) {
            return Err(self.no_column_error(rows));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::test_support::*;
    use serde_json::json;

    fn score(source: &dyn RewardSource, owned: &[Owned]) -> Vec<Option<f32>> {
        source.score(&samples(owned)).unwrap()
    }

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn length_counts_tokens_or_chars() {
        let owned = vec![Owned::text("p", "héllo").with_ids(&[1, 2]), Owned::text("p", "").with_ids(&[])];
        let tokens = Length::new("len", LengthUnit::Tokens, None, 1.0);
        assert_eq!(score(&tokens, &owned), [Some(2.0), Some(0.0)]);
        let chars = Length::new("len", LengthUnit::Chars, None, 0.5);
        assert_eq!(score(&chars, &owned), [Some(2.5), Some(0.0)], "é is one char");
    }

    #[test]
    fn length_with_target_is_minus_the_distance_times_scale() {
        let owned = vec![
            Owned::text("p", "").with_ids(&[0; 7]),
            Owned::text("p", "").with_ids(&[0; 10]),
            Owned::text("p", "").with_ids(&[0; 12]),
        ];
        let l = Length::new("len", LengthUnit::Tokens, Some(10.0), 0.1);
        let got: Vec<f32> = score(&l, &owned).into_iter().map(Option::unwrap).collect();
        let want = [-0.3, 0.0, -0.2];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }

    #[test]
    fn count_matches_regex_non_overlapping_and_caps_at_max() {
        let owned = completions(&["aaaa", "Wow! wow!! ok", "nothing"]);
        let aa = Count::new("c", &Needle::Pattern("aa".into()), false, None).unwrap();
        assert_eq!(score(&aa, &owned)[0], Some(2.0), "aaaa holds 2 non-overlapping aa");
        let bang = Count::new("c", &Needle::Pattern("!+".into()), false, Some(1)).unwrap();
        assert_eq!(score(&bang, &owned), [Some(0.0), Some(1.0), Some(0.0)]);
        let wow = Count::new("c", &Needle::Pattern(r"\bwow\b".into()), true, None).unwrap();
        assert_eq!(score(&wow, &owned), [Some(0.0), Some(2.0), Some(0.0)]);
    }

    #[test]
    fn count_substring_is_literal_and_optionally_case_insensitive() {
        let owned = completions(&["a.b A.B axb"]);
        let exact = Count::new("c", &Needle::Substring("a.b".into()), false, None).unwrap();
        assert_eq!(score(&exact, &owned), [Some(1.0)], "the dot is literal");
        let folded = Count::new("c", &Needle::Substring("a.b".into()), true, None).unwrap();
        assert_eq!(score(&folded, &owned), [Some(2.0)]);
    }

    #[test]
    fn count_rejects_bad_and_empty_patterns() {
        let err = Count::new("c", &Needle::Pattern("(unclosed".into()), false, None).unwrap_err().to_string();
        assert!(err.starts_with("pattern `(unclosed` is not a valid regex: "), "{err}");
        let err = Count::new("c", &Needle::Substring(String::new()), false, None).unwrap_err().to_string();
        assert_eq!(err, "substring is empty; it would match between every two characters");
    }

    #[test]
    fn words_are_lowercased_runs_with_inner_apostrophes_and_hyphens() {
        let got: Vec<String> = words("Don't stop -- it's WELL-made, 'good' (3x)!").collect();
        assert_eq!(got, ["don't", "stop", "it's", "well-made", "good", "3x"], "{got:?}");
    }

    #[test]
    fn lexicon_is_positive_minus_negative_words() {
        let lex = Lexicon::new("s", &strings(&["Great", "good"]), &strings(&["bad", "boring"]), false).unwrap();
        let owned = completions(&["A great, GREAT film; not bad.", "Boring and bad", "", "goodness gracious"]);
        // 2 - 1; 0 - 2; no words; "goodness" is not "good".
        assert_eq!(score(&lex, &owned), [Some(1.0), Some(-2.0), Some(0.0), Some(0.0)]);
    }

    #[test]
    fn lexicon_normalised_divides_by_the_number_of_words() {
        let lex = Lexicon::new("s", &strings(&["good"]), &strings(&["bad"]), true).unwrap();
        let owned = completions(&["good good bad fine", "", "?!"]);
        // (2 - 1) / 4 words; no words scores 0 rather than 0/0.
        assert_eq!(score(&lex, &owned), [Some(0.25), Some(0.0), Some(0.0)]);
    }

    #[test]
    fn lexicon_rejects_phrases_overlaps_and_empty_lists() {
        let err = Lexicon::new("s", &strings(&["not good"]), &[], false).unwrap_err().to_string();
        assert!(err.starts_with("positive word `not good` is not a single word"), "{err}");
        let err =
            Lexicon::new("s", &strings(&["ok", "Fine"]), &strings(&["fine", "ok"]), false).unwrap_err().to_string();
        assert_eq!(err, "`fine`, `ok` in both the positive and the negative list");
        let err = Lexicon::new("s", &[], &[], false).unwrap_err().to_string();
        assert_eq!(err, "both word lists are empty; give `positive`/`negative` words or files");
    }

    #[test]
    fn word_list_files_skip_comments_and_name_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pos.txt");
        std::fs::write(&path, "; opinion lexicon\n# comment\n\ngood\n  Great  \n").unwrap();
        assert_eq!(read_word_list(&path).unwrap(), ["good", "Great"]);
        std::fs::write(&path, "good\na+\n").unwrap();
        let err = read_word_list(&path).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:2: the word `a+` is not a single word", path.display())), "{err}");
        let missing = dir.path().join("none.txt");
        let err = read_word_list(&missing).unwrap_err().to_string();
        assert!(err.starts_with(&missing.display().to_string()), "{err}");
    }

    fn answer_rows(completions: &[(&str, Value)]) -> Vec<Owned> {
        completions.iter().map(|(c, row)| Owned::text("q", c).with_row(row.clone())).collect()
    }

    #[test]
    fn exact_match_compares_trimmed_text_with_the_column() {
        let owned = answer_rows(&[
            ("  Paris\n", json!({"answer": "Paris"})),
            ("paris", json!({"answer": "Paris"})),
            ("42", json!({"answer": 42})),
            ("Lyon", json!({"answer": "Paris"})),
        ]);
        let exact = ExactMatch::new("em", "answer", false, None, false).unwrap();
        assert_eq!(score(&exact, &owned), [Some(1.0), Some(0.0), Some(1.0), Some(0.0)]);
        let folded = ExactMatch::new("em", "answer", true, None, false).unwrap();
        assert_eq!(score(&folded, &owned), [Some(1.0), Some(1.0), Some(1.0), Some(0.0)]);
    }

    #[test]
    fn exact_match_after_marker_and_last_number_reads_gsm8k_answers() {
        let gsm = json!({"answer": "She sold 48/2 = 24 clips.\n#### 72"});
        let owned = answer_rows(&[
            ("48 + 24 = 72 clips\n#### 72", gsm.clone()),
            ("#### 72.0", gsm.clone()),
            ("The answer is 72", gsm.clone()), // no marker: no answer
            ("#### 1,072", json!({"answer": "1072"})),
            ("#### -3 apples", json!({"answer": -3})),
            ("#### seventy-two", gsm),
        ]);
        let em = ExactMatch::new("em", "answer", false, Some("####".into()), true).unwrap();
        assert_eq!(score(&em, &owned), [Some(1.0), Some(1.0), Some(0.0), Some(1.0), Some(1.0), Some(0.0)]);
        let last = ExactMatch::new("em", "answer", false, None, true).unwrap();
        let owned = answer_rows(&[("so 3 + 4 = 7.", json!({"answer": "7"})), ("7 or maybe 8", json!({"answer": "7"}))]);
        assert_eq!(score(&last, &owned), [Some(1.0), Some(0.0)]);
    }

    #[test]
    fn exact_match_rows_without_the_column_are_unscorable() {
        let owned = answer_rows(&[
            ("x", json!({"answer": "x"})),
            ("x", json!({"other": "x"})),
            ("x", json!({"answer": null})),
            ("x", json!({"answer": ["x"]})),
        ]);
        let em = ExactMatch::new("em", "answer", false, None, false).unwrap();
        assert_eq!(score(&em, &owned), [Some(1.0), None, None, None]);
    }

    #[test]
    fn exact_match_errors_when_no_row_has_the_column() {
        let owned = answer_rows(&[("x", json!({"prompt": "q", "solution": "x"}))]);
        let em = ExactMatch::new("em", "answer", false, None, false).unwrap();
        let err = em.score(&samples(&owned)).unwrap_err().to_string();
        assert_eq!(
            err,
            "exact_match reward `em`: no dataset row has a value in column `answer` \
             (the first row has columns `prompt`, `solution`)"
        );
        let rows: Vec<_> = owned.iter().map(|o| &o.row).collect();
        assert_eq!(em.check_rows(&rows).unwrap_err().to_string(), err);
        let good = json!({"answer": 1});
        let good = good.as_object().unwrap();
        em.check_rows(&[&owned[0].row, good]).unwrap();
    }
}
