//! Prompt-only datasets for RL: rows in either of the two formats users
//! bring (a `prompt` string, or a `prompt` list of chat messages with an
//! optional system message), or built from other columns with a template
//! such as `"Summarize: {post}"`; tokenized once, filtered by length, and
//! served in a seeded order that depends only on the step.

use serde_json::Value;

use super::prompt::{Message, Prompt};
use super::rows::Row;
use super::source::DatasetSpec;
use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};
use crate::rng::streams;
use crate::rng::Rng;

/// How rows become prompts.
#[derive(Debug, Clone, Default)]
pub struct PromptSpec {
    pub prompt_column: String,
    pub template: Option<String>,
    /// Wrap templated (or plain-text) prompts as a user chat message.
    pub chat: bool,
    pub system_prompt: Option<String>,
    pub max_prompt_length: Option<usize>,
    /// The longest prompt the model's context leaves room for (its
    /// positions less the completion's); longer ones are skipped or errors
    /// like those over `max_prompt_length`.
    pub context_room: Option<ContextRoom>,
    /// Stop with an error on a long prompt instead of skipping it.
    pub error_on_long: bool,
    /// Drop prompts of more tokens than this, always (`filter_length`: 0.9
    /// of the completion length, for tasks whose answer should be shorter
    /// than the input).
    pub length_filter: Option<usize>,
}

/// The model's context (`max_position_embeddings`) and the completion
/// length that must fit beside a prompt.
#[derive(Debug, Clone, Copy)]
pub struct ContextRoom {
    pub positions: usize,
    pub completion: usize,
}

impl ContextRoom {
    /// The room `model`'s context leaves for prompts followed by
    /// `completion` tokens; `None` when its config states no context.
    pub fn of(model: &crate::model::ModelConfig, completion: usize) -> Option<Self> {
        model.context_length().map(|positions| Self { positions, completion })
    }
}

/// The `filter_length` limit: prompts of more than 0.9 x `response_length`
/// tokens are dropped.
pub fn length_filter(response_length: usize) -> usize {
    response_length * 9 / 10
}

/// One usable prompt.
#[derive(Debug, Clone)]
pub struct PromptRow {
    /// The dataset row, for rewards that read other columns.
    pub row: Row,
    pub prompt: Prompt,
    pub ids: Vec<u32>,
}

#[derive(Debug)]
pub struct PromptDataset {
    /// The dataset's name, configuration and split, for messages.
    pub label: String,
    pub rows: Vec<PromptRow>,
    /// Prompts left out for their length.
    pub skipped_long: usize,
}

impl PromptDataset {
    pub fn load(dataset: &DatasetSpec, spec: &PromptSpec, tokenizer: &Tokenizer) -> Result<Self> {
        let label = dataset.label();
        let mut rows = dataset.rows()?;
        let mut out = Vec::new();
        let mut skipped_long = 0;
        for row in rows.by_ref() {
            let row = row?;
            if out.is_empty()
                && skipped_long == 0
                && spec.template.is_none()
                && row.column(&spec.prompt_column).is_err()
            {
                return Err(row.error(format!(
                    "no `{}` column (columns: {}); set data.prompt_column or data.template",
                    spec.prompt_column,
                    row.column_names()
                )));
            }
            let prompt = build_prompt(&row, spec).map_err(|e| row.error(e))?;
            let ids = tokenizer.encode_prompt(&prompt).map_err(|e| row.error(e.to_string()))?;
            if ids.is_empty() {
                return Err(row.error("the prompt is empty after tokenization"));
            }
            if spec.length_filter.is_some_and(|max| ids.len() > max) {
                skipped_long += 1;
                continue;
            }
            let over_max = spec
                .max_prompt_length
                .filter(|&max| ids.len() > max)
                .map(|max| format!("the prompt has {} tokens, more than max_prompt_length = {max}", ids.len()));
            let over_context = spec.context_room.filter(|c| ids.len() + c.completion > c.positions).map(|c| {
                format!(
                    "the prompt has {} tokens: with {} completion tokens it exceeds the model's context of {} positions",
                    ids.len(),
                    c.completion,
                    c.positions
                )
            });
            if let Some(why) = over_max.or(over_context) {
                if spec.error_on_long {
                    return Err(row.error(why));
                }
                skipped_long += 1;
                continue;
            }
            out.push(PromptRow { row, prompt, ids });
        }
        rows.log_filtered(&label);
        if out.is_empty() && skipped_long == 0 {
            return Err(Error::Invalid(format!("{label}: {}", rows.why_empty())));
        }
        if out.is_empty() {
            return Err(Error::Invalid(format!(
                "{label}: all {skipped_long} prompts are longer than max_prompt_length, filter_length or the model's context"
            )));
        }
        if skipped_long > 0 {
            tracing::warn!(
                "{label}: skipped {skipped_long} prompts longer than max_prompt_length, filter_length or the model's context"
            );
        }
        Ok(Self { label, rows: out, skipped_long })
    }

    /// Rows whose `prompt` column (text or chat messages) is taken as it
    /// is, as `generate` and `eval` read them; a prompt with no room for
    /// its completion in `context` is an error naming its row.
    pub fn from_prompt_column(
        dataset: &DatasetSpec,
        tokenizer: &Tokenizer,
        context: Option<ContextRoom>,
    ) -> Result<Self> {
        let spec = PromptSpec {
            prompt_column: "prompt".into(),
            context_room: context,
            error_on_long: true,
            ..Default::default()
        };
        Self::load(dataset, &spec, tokenizer)
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// A digest (FNV-1a, 64 bits) of every prompt's token ids in order: a
    /// resumed run checks it to be training on the same prompts.
    pub fn digest(&self) -> String {
        super::token_digest(self.rows.iter().map(|row| row.ids.as_slice()))
    }

    /// The prompts of rollout step `step`: positions `step * n ..` of an
    /// endless stream that walks the dataset epoch after epoch, each epoch in
    /// its own seeded order. Depends only on (seed, step), so a resumed run
    /// sees the same prompts.
    pub fn batch(&self, step: usize, n: usize, seed: u64, shuffle: bool) -> Vec<usize> {
        let len = self.rows.len();
        let mut epoch_order: Option<(usize, Vec<usize>)> = None;
        (step * n..(step + 1) * n)
            .map(|j| {
                let (epoch, pos) = (j / len, j % len);
                if !shuffle {
                    return pos;
                }
                if epoch_order.as_ref().map(|(e, _)| *e) != Some(epoch) {
                    epoch_order =
                        Some((epoch, Rng::stream(seed, &[streams::PROMPT_ORDER, epoch as u64]).permutation(len)));
                }
                epoch_order.as_ref().map_or(pos, |(_, order)| order[pos])
            })
            .collect()
    }
}

fn build_prompt(row: &Row, spec: &PromptSpec) -> std::result::Result<Prompt, String> {
    let prompt = match &spec.template {
        Some(template) => Prompt::Text(fill_template(template, row)?),
        None => {
            let value = row.column(&spec.prompt_column)?;
            Prompt::from_value(value).map_err(|e| format!("column `{}`: {e}", spec.prompt_column))?
        }
    };
    Ok(match prompt {
        Prompt::Text(text) if spec.chat => with_system(vec![Message::new("user", text)], spec),
        Prompt::Messages(messages) => with_system(messages, spec),
        text => text,
    })
}

fn with_system(mut messages: Vec<Message>, spec: &PromptSpec) -> Prompt {
    if let Some(system) = &spec.system_prompt {
        if messages.first().is_none_or(|m| m.role != "system") {
            messages.insert(0, Message::new("system", system.clone()));
        }
    }
    Prompt::Messages(messages)
}

/// Replaces `{column}` with the row's value; `{{` and `}}` are literal braces.
pub fn fill_template(template: &str, row: &Row) -> std::result::Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
        } else if tail.starts_with('}') {
            return Err(format!("template {template:?}: unmatched `}}`"));
        } else {
            let end = tail.find('}').ok_or_else(|| format!("template {template:?}: unclosed `{{`"))?;
            let column = &tail[1..end];
            match row.fields.get(column) {
                Some(Value::String(s)) => out.push_str(s),
                Some(Value::Null) | None => {
                    return Err(format!(
                        "template {template:?} needs column `{column}`, which this row lacks (columns: {})",
                        row.column_names()
                    ))
                }
                Some(other) => out.push_str(&other.to_string()),
            }
            rest = &tail[end + 1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RowPlace;
    use serde_json::json;

    fn row(v: Value) -> Row {
        Row::new(
            std::sync::Arc::from(std::path::Path::new("d.jsonl")),
            RowPlace::Line(3),
            v.as_object().unwrap().clone(),
        )
    }

    #[test]
    fn templates_fill_columns_and_escape_braces() {
        let r = row(json!({"post": "long text", "n": 3}));
        assert_eq!(fill_template("Summarize: {post} ({n}) {{x}}", &r).unwrap(), "Summarize: long text (3) {x}");
        let err = fill_template("{title}", &r).unwrap_err();
        assert!(err.contains("`title`"), "{err}");
    }

    #[test]
    fn both_prompt_formats_and_system_messages() {
        let spec = PromptSpec {
            prompt_column: "prompt".into(),
            system_prompt: Some("Be brief.".into()),
            ..Default::default()
        };
        let text = build_prompt(&row(json!({"prompt": "What is 2+2?"})), &spec).unwrap();
        assert_eq!(text, Prompt::Text("What is 2+2?".into()));
        let chat = build_prompt(&row(json!({"prompt": [{"role": "user", "content": "Hi"}]})), &spec).unwrap();
        assert_eq!(chat, Prompt::Messages(vec![Message::new("system", "Be brief."), Message::new("user", "Hi")]));
        let kept = build_prompt(
            &row(json!({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]})),
            &spec,
        )
        .unwrap();
        assert_eq!(kept, Prompt::Messages(vec![Message::new("system", "S"), Message::new("user", "Hi")]));
    }

    #[test]
    fn batches_depend_only_on_seed_and_step_and_cover_each_epoch() {
        let ds = PromptDataset {
            label: "x".into(),
            rows: (0..10)
                .map(|i| PromptRow { row: row(json!({"i": i})), prompt: Prompt::Text(String::new()), ids: vec![1] })
                .collect(),
            skipped_long: 0,
        };
        let epoch: Vec<usize> = (0..5).flat_map(|s| ds.batch(s, 2, 7, true)).collect();
        let mut sorted = epoch.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "one epoch visits every prompt once");
        assert_eq!(ds.batch(3, 2, 7, true), ds.batch(3, 2, 7, true));
        assert_ne!(ds.batch(5, 10, 7, true), ds.batch(0, 10, 7, true), "epochs are reshuffled");
        assert_eq!(ds.batch(1, 4, 7, false), vec![4, 5, 6, 7]);
    }
}
