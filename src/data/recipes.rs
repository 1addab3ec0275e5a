//! Recipes: one published dataset's rows to the rows rloo's trainers take.
//! Each turns an upstream row into an [`Example`] (a prompt, the columns
//! worth keeping beside it, and its answers), or says why the row is left
//! out; [`super::prepare`] does the rest the same way for all of them.

use serde_json::{json, Map, Value};

use super::prompt::Prompt;
use super::rows::Row;

/// The datasets `rloo data prepare` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recipe {
    /// nvidia/HelpSteer3, `preference` configuration.
    Helpsteer3,
    /// Anthropic/hh-rlhf (any of its `*-base`, `helpful-*` directories).
    Hh,
    /// OpenAI's TL;DR summarization: comparisons (`prompt`, `chosen`,
    /// `rejected`, as CarperAI/openai_summarize_comparisons) or the SFT
    /// form (`prompt`, `label`, as CarperAI/openai_summarize_tldr).
    Tldr,
    /// stanfordnlp/imdb: reviews to short prompts for positive continuations.
    Imdb,
}

/// What one upstream row gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// A string or chat messages, as the trainers read a `prompt` column.
    pub prompt: Value,
    /// Upstream columns kept in the prompt rows (for filters, rewards and
    /// judged evaluation).
    pub extra: Map<String, Value>,
    pub answers: Answers,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Answers {
    /// A preference: the SFT row takes the chosen answer.
    Pair { chosen: String, rejected: String },
    /// A demonstration only.
    Demo(String),
    /// A prompt only.
    None,
}

/// A row the recipe leaves out on purpose, counted by reason.
pub type Skip = &'static str;

/// How a row turned out: an example, a counted skip, or an error message.
pub type Converted = std::result::Result<std::result::Result<Example, Skip>, String>;

/// Recipe options that only some recipes read.
#[derive(Debug, Clone, Copy)]
pub struct RecipeOptions {
    /// Words of a review that make an IMDB prompt.
    pub prompt_words: usize,
}

impl Recipe {
    /// The configuration (sub-directory) read when none is given and the
    /// dataset has it.
    pub fn default_config(self) -> Option<&'static str> {
        match self {
            Recipe::Helpsteer3 => Some("preference"),
            Recipe::Imdb => Some("plain_text"),
            Recipe::Hh | Recipe::Tldr => None,
        }
    }

    /// The upstream splits read, in order, when present.
    pub fn splits(self) -> &'static [&'static str] {
        match self {
            Recipe::Helpsteer3 => &["train", "validation"],
            Recipe::Hh => &["train", "test"],
            Recipe::Tldr => &["train", "valid1", "valid2", "validation", "test"],
            Recipe::Imdb => &["train", "test"],
        }
    }

    pub fn convert(self, row: &Row, opts: &RecipeOptions) -> Converted {
        match self {
            Recipe::Helpsteer3 => helpsteer3(row),
            Recipe::Hh => hh(row),
            Recipe::Tldr => tldr(row),
            Recipe::Imdb => imdb(row, opts.prompt_words),
        }
    }
}

fn text<'a>(row: &'a Row, column: &str) -> std::result::Result<&'a str, String> {
    match row.column(column)? {
        Value::String(s) => Ok(s),
        other => Err(format!("column `{column}` must be a string, got {}", super::prompt::describe_json(other))),
    }
}

/// An integer column, also from a CSV cell's text.
fn integer(row: &Row, column: &str) -> std::result::Result<i64, String> {
    let value = row.column(column)?;
    let n = match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    n.filter(|x| x.fract() == 0.0)
        .map(|x| x as i64)
        .ok_or_else(|| format!("column `{column}` must be an integer, got {}", super::prompt::describe_json(value)))
}

fn keep(row: &Row, columns: &[&str]) -> Map<String, Value> {
    columns.iter().filter_map(|c| row.fields.get(*c).map(|v| (c.to_string(), v.clone()))).collect()
}

/// HelpSteer3 preference rows: `context` (chat messages ending on a user
/// turn), `response1`, `response2`, `overall_preference` from -3 to 3
/// (negative: response 1 is better; 0: a tie, left out).
fn helpsteer3(row: &Row) -> Converted {
    let context = row.column("context")?;
    match Prompt::from_value(context).map_err(|e| format!("column `context`: {e}"))? {
        Prompt::Messages(m) if m.last().is_some_and(|m| m.role == "user") => {}
        _ => return Err("column `context` must be chat messages ending on a user turn".into()),
    }
    let preference = integer(row, "overall_preference")?;
    if !(-3..=3).contains(&preference) {
        return Err(format!("column `overall_preference` must be from -3 to 3, got {preference}"));
    }
    let (one, two) = (text(row, "response1")?, text(row, "response2")?);
    let answers = match preference.signum() {
        -1 => Answers::Pair { chosen: one.into(), rejected: two.into() },
        1 => Answers::Pair { chosen: two.into(), rejected: one.into() },
        _ => return Ok(Err("a tie (overall_preference 0)")),
    };
    Ok(Ok(Example { prompt: context.clone(), extra: keep(row, &["domain", "language"]), answers }))
}

const HUMAN: &str = "\n\nHuman:";
const ASSISTANT: &str = "\n\nAssistant:";

/// Anthropic HH rows: `chosen` and `rejected` whole transcripts sharing
/// everything up to the last `\n\nAssistant:`.
fn hh(row: &Row) -> Converted {
    let (chosen, rejected) = (text(row, "chosen")?, text(row, "rejected")?);
    let Some(cut) = chosen.rfind(ASSISTANT).map(|i| i + ASSISTANT.len()) else {
        return Err("column `chosen` has no \"\\n\\nAssistant:\" turn".into());
    };
    let prefix = &chosen[..cut];
    let Some(rejected_answer) = rejected.strip_prefix(prefix) else {
        return Ok(Err("chosen and rejected differ before the last assistant turn"));
    };
    if rejected_answer.contains(HUMAN) {
        return Ok(Err("chosen and rejected differ before the last assistant turn"));
    }
    let messages = transcript_messages(&prefix[..prefix.len() - ASSISTANT.len()])?;
    let answers = Answers::Pair { chosen: answer(&chosen[cut..]), rejected: answer(rejected_answer) };
    Ok(Ok(Example { prompt: messages, extra: Map::new(), answers }))
}

fn answer(text: &str) -> String {
    text.strip_prefix(' ').unwrap_or(text).to_string()
}

/// `\n\nHuman: a\n\nAssistant: b\n\nHuman: c` as chat messages.
fn transcript_messages(transcript: &str) -> std::result::Result<Value, String> {
    let mut messages = Vec::new();
    let mut rest = transcript;
    while !rest.is_empty() {
        let (role, body) = if let Some(body) = rest.strip_prefix(HUMAN) {
            ("user", body)
        } else if let Some(body) = rest.strip_prefix(ASSISTANT) {
            ("assistant", body)
        } else {
            return Err(format!("the transcript does not start with {HUMAN:?} or {ASSISTANT:?}"));
        };
        let end = [body.find(HUMAN), body.find(ASSISTANT)].into_iter().flatten().min().unwrap_or(body.len());
        messages.push(json!({"role": role, "content": body[..end].trim()}));
        rest = &body[end..];
    }
    if messages.last().and_then(|m| m["role"].as_str()) != Some("user") {
        return Err("the prompt must end on a human turn".into());
    }
    Ok(Value::Array(messages))
}

/// TL;DR rows: comparisons (`prompt` ending in "TL;DR:", `chosen` and
/// `rejected` starting with "TL;DR: ") or the SFT form (`prompt`, `label`).
fn tldr(row: &Row) -> Converted {
    let prompt = text(row, "prompt")?;
    if !prompt.trim_end().ends_with("TL;DR:") {
        return Err("column `prompt` must end with \"TL;DR:\"".into());
    }
    let summary = |column: &str| -> std::result::Result<String, String> {
        let s = text(row, column)?;
        let s = s.strip_prefix("TL;DR:").unwrap_or(s).trim();
        Ok(format!(" {s}"))
    };
    let answers = if row.fields.contains_key("chosen") {
        Answers::Pair { chosen: summary("chosen")?, rejected: summary("rejected")? }
    } else if row.fields.contains_key("label") {
        Answers::Demo(summary("label")?)
    } else {
        return Err(format!("expected `chosen` and `rejected`, or `label` (columns: {})", row.column_names()));
    };
    let reference = match &answers {
        Answers::Pair { chosen, .. } | Answers::Demo(chosen) => chosen.trim().to_string(),
        Answers::None => unreachable!("set above"),
    };
    let extra = Map::from_iter([("reference".to_string(), Value::String(reference))]);
    Ok(Ok(Example { prompt: Value::String(prompt.trim_end().to_string()), extra, answers }))
}

/// IMDB rows (`text`, `label` 1 = positive): the first words of a review
/// make a prompt; positive reviews are also demonstrations.
fn imdb(row: &Row, prompt_words: usize) -> Converted {
    let review = text(row, "text")?.replace("<br />", " ");
    let label = integer(row, "label")?;
    let words: Vec<&str> = review.split_whitespace().collect();
    if words.len() <= prompt_words {
        return Ok(Err("a review no longer than the prompt"));
    }
    let prompt = words[..prompt_words].join(" ");
    let answers =
        if label == 1 { Answers::Demo(format!(" {}", words[prompt_words..].join(" "))) } else { Answers::None };
    Ok(Ok(Example { prompt: Value::String(prompt), extra: keep(row, &["label"]), answers }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RowPlace;

    fn row(v: Value) -> Row {
        Row::new(std::sync::Arc::from(std::path::Path::new("d")), RowPlace::Line(1), v.as_object().unwrap().clone())
    }

    const OPTS: RecipeOptions = RecipeOptions { prompt_words: 3 };

    #[test]
    fn helpsteer3_sign_picks_the_chosen_response_and_ties_are_skipped() {
        let r = |p: i64| {
            row(json!({"domain": "code", "language": "english", "context": [{"role": "user", "content": "q"}],
                       "response1": "one", "response2": "two", "overall_preference": p}))
        };
        let ex = Recipe::Helpsteer3.convert(&r(-2), &OPTS).unwrap().unwrap();
        assert_eq!(ex.answers, Answers::Pair { chosen: "one".into(), rejected: "two".into() });
        assert_eq!(ex.extra["language"], json!("english"));
        let ex = Recipe::Helpsteer3.convert(&r(3), &OPTS).unwrap().unwrap();
        assert_eq!(ex.answers, Answers::Pair { chosen: "two".into(), rejected: "one".into() });
        assert_eq!(Recipe::Helpsteer3.convert(&r(0), &OPTS).unwrap(), Err("a tie (overall_preference 0)"));
        assert!(Recipe::Helpsteer3.convert(&r(5), &OPTS).unwrap_err().contains("from -3 to 3"));
    }

    #[test]
    fn hh_transcripts_split_into_messages_and_final_answers() {
        let chosen = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a fact.\n\nAssistant: Water is wet.";
        let rejected = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a fact.\n\nAssistant: No.";
        let ex = Recipe::Hh.convert(&row(json!({"chosen": chosen, "rejected": rejected})), &OPTS).unwrap().unwrap();
        assert_eq!(
            ex.prompt,
            json!([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "Tell me a fact."}])
        );
        assert_eq!(ex.answers, Answers::Pair { chosen: "Water is wet.".into(), rejected: "No.".into() });
        let other = row(json!({"chosen": chosen, "rejected": "\n\nHuman: Other\n\nAssistant: x"}));
        assert_eq!(
            Recipe::Hh.convert(&other, &OPTS).unwrap(),
            Err("chosen and rejected differ before the last assistant turn")
        );
    }

    #[test]
    fn tldr_reads_comparisons_and_the_sft_form() {
        let prompt = "SUBREDDIT: r/cats\nTITLE: t\nPOST: p\nTL;DR:";
        let ex = Recipe::Tldr
            .convert(&row(json!({"prompt": prompt, "chosen": "TL;DR: good", "rejected": "TL;DR: bad"})), &OPTS)
            .unwrap()
            .unwrap();
        assert_eq!(ex.prompt, json!(prompt));
        assert_eq!(ex.answers, Answers::Pair { chosen: " good".into(), rejected: " bad".into() });
        assert_eq!(ex.extra["reference"], json!("good"));
        let ex = Recipe::Tldr.convert(&row(json!({"prompt": prompt, "label": "short"})), &OPTS).unwrap().unwrap();
        assert_eq!(ex.answers, Answers::Demo(" short".into()));
    }

    #[test]
    fn imdb_prompts_are_the_first_words_and_positive_reviews_demonstrate() {
        let ex = Recipe::Imdb
            .convert(&row(json!({"text": "A fine<br />film, truly moving.", "label": 1})), &OPTS)
            .unwrap()
            .unwrap();
        assert_eq!(ex.prompt, json!("A fine film,"));
        assert_eq!(ex.answers, Answers::Demo(" truly moving.".into()));
        let ex =
            Recipe::Imdb.convert(&row(json!({"text": "Dull and long, avoid.", "label": "0"})), &OPTS).unwrap().unwrap();
        assert_eq!(ex.answers, Answers::None);
    }
}
