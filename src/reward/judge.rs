//! `type = "judge"`: an LLM asked through an OpenAI-compatible
//! chat-completions endpoint (vLLM, SGLang, TGI, OpenAI) to score
//! completions.
//!
//! - `pointwise`: one request per completion; the template sees `{prompt}`,
//!   `{completion}` and dataset columns `{column}`; the first group of
//!   `score_pattern` in the answer is the score.
//! - `pairwise` (GenRM): within each prompt's group, completions are
//!   compared two at a time (`{completion_1}`, `{completion_2}`), the
//!   pattern's two groups are the two individual scores, and a sample's
//!   reward is the mean of its scores over its comparisons. The pairs are
//!   order-balanced: every sample is shown first as often as second, so a
//!   judge's position bias adds the same to every sample.
//!
//! An answer without a match scores nothing (a counted failure), never 0.
//! Where several matches occur the last one counts: judges reason first and
//! conclude last.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use candle_core::{DType, Device};
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::config::{one, RewardTable};
use super::remote::{
    default_backoff, default_concurrency, default_max_failure_rate, default_retries, reach_of, CallStats,
    FailureBudget, Reach,
};
use super::{RewardSource, Sample};
use crate::data::Prompt;
use crate::error::{Error, Result};
use crate::service::{in_parallel, Client};

fn default_judge_timeout() -> f64 {
    300.0
}

fn default_max_tokens() -> u32 {
    1024
}

/// `type = "judge"`: an LLM judge (see `reward::judge`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeSpec {
    /// Metric name; default `judge`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// The API base, e.g. `http://127.0.0.1:8000/v1`; requests go to
    /// `<url>/chat/completions`.
    pub url: String,
    /// The model name the server expects.
    pub model: String,
    /// The environment variable holding the API key (sent as a bearer
    /// token; never written anywhere).
    pub api_key_env: Option<String>,
    /// A system message, sent before the rendered template.
    pub system: Option<String>,
    /// The user message, with `{prompt}`, `{completion}` (pointwise) or
    /// `{completion_1}`, `{completion_2}` (pairwise) and `{column}` fields;
    /// default: a 1-to-5 helpfulness rating in the GenRM convention.
    pub template: Option<String>,
    /// A regex whose first group (pointwise) or first two groups (pairwise)
    /// are the scores; default: `\boxed{s}` or `\boxed{s1, s2}`.
    pub score_pattern: Option<String>,
    /// `pointwise` (one completion per request) or `pairwise` (GenRM).
    #[serde(default)]
    pub mode: JudgeMode,
    /// Pairwise: `round_robin` (k comparisons per group) or `all`
    /// (k (k - 1)).
    #[serde(default)]
    pub pairs: Pairs,
    #[serde(default)]
    pub temperature: f64,
    /// The longest answer, in the judge's tokens.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
    /// Seconds per attempt.
    #[serde(default = "default_judge_timeout")]
    pub timeout_s: f64,
    /// Attempts after the first, on connection errors, timeouts, 429 and 5xx.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Seconds before the first retry; doubled for each next one, jittered.
    #[serde(default = "default_backoff")]
    pub backoff_s: f64,
    /// The share of a step's requests that may fail before the run stops.
    #[serde(default = "default_max_failure_rate")]
    pub max_failure_rate: f64,
}

impl RewardTable for JudgeSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        Ok(Box::new(JudgeSource::new(name, self.judge()?, self.pairs, self.max_failure_rate)))
    }
}

impl JudgeSpec {
    fn reach(&self) -> Reach<'_> {
        reach_of!(self)
    }

    /// The judge this table describes (also what `rloo eval --judge` asks).
    pub fn judge(&self) -> Result<Judge> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Invalid(format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if self.max_tokens == 0 {
            return Err(Error::Invalid("max_tokens must be at least 1".into()));
        }
        Judge::new(
            self.reach().client()?,
            JudgeSettings {
                url: self.url.clone(),
                model: self.model.clone(),
                system: self.system.clone(),
                template: self.template.clone(),
                score_pattern: self.score_pattern.clone(),
                temperature: self.temperature,
                max_tokens: self.max_tokens,
                max_concurrency: self.max_concurrency,
                mode: self.mode,
            },
        )
    }
}

/// The GenRM convention for two responses: the conversation, the two
/// responses, then individual helpfulness scores from 1 to 5.
pub const PAIRWISE_TEMPLATE: &str = "\
You are a judge of AI assistant responses. Read the conversation and the two candidate responses \
for the assistant's next turn, then rate the helpfulness of each response on a scale from 1 \
(unhelpful) to 5 (perfectly helpful).

[Conversation]
{prompt}

[Response 1]
{completion_1}

[Response 2]
{completion_2}

Explain your reasoning briefly, then give the two scores in the form \\boxed{{s1, s2}}.";

/// Two numbers in `\boxed{s1, s2}`.
pub const PAIRWISE_PATTERN: &str = r"\\boxed\{\s*(-?[0-9]+(?:\.[0-9]+)?)\s*,\s*(-?[0-9]+(?:\.[0-9]+)?)\s*\}";

/// One response rated from 1 to 5.
pub const POINTWISE_TEMPLATE: &str = "\
You are a judge of AI assistant responses. Read the conversation and the candidate response for \
the assistant's next turn, then rate its helpfulness on a scale from 1 (unhelpful) to 5 \
(perfectly helpful).

[Conversation]
{prompt}

[Response]
{completion}

Explain your reasoning briefly, then give the score in the form \\boxed{{s}}.";

/// One number in `\boxed{s}`.
pub const POINTWISE_PATTERN: &str = r"\\boxed\{\s*(-?[0-9]+(?:\.[0-9]+)?)\s*\}";

/// What the judge is shown at once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeMode {
    #[default]
    Pointwise,
    Pairwise,
}

/// Which pairs of a group a pairwise judge compares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pairs {
    /// Each sample against the next one in its group (the last against the
    /// first): `m` comparisons for `m` samples, each sample in two, once
    /// first and once second.
    #[default]
    RoundRobin,
    /// Every ordered pair: `m (m - 1)` comparisons, each sample in
    /// `2 (m - 1)`.
    All,
}

/// The comparisons `(first, second)` of a batch whose samples belong to the
/// prompt groups `groups` (sample `i` answers prompt `groups[i]`); groups of
/// one sample have none.
pub fn plan_pairs(groups: &[usize], pairs: Pairs) -> Vec<(usize, usize)> {
    let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &g) in groups.iter().enumerate() {
        members.entry(g).or_default().push(i);
    }
    let mut out = Vec::new();
    for m in members.values().filter(|m| m.len() >= 2) {
        match pairs {
            Pairs::RoundRobin if m.len() == 2 => out.extend([(m[0], m[1]), (m[1], m[0])]),
            Pairs::RoundRobin => out.extend((0..m.len()).map(|a| (m[a], m[(a + 1) % m.len()]))),
            Pairs::All => {
                for &a in m {
                    out.extend(m.iter().filter(|&&b| b != a).map(|&b| (a, b)));
                }
            }
        }
    }
    out
}

/// Each sample's mean score over the comparisons that were read
/// (`results[c]` holds the two scores of `comparisons[c]`); `None` for a
/// sample that no read comparison covers.
pub fn mean_pair_scores(n: usize, comparisons: &[(usize, usize)], results: &[Option<(f32, f32)>]) -> Vec<Option<f32>> {
    let mut sums = vec![(0.0f64, 0usize); n];
    for (&(a, b), r) in comparisons.iter().zip(results) {
        if let Some((sa, sb)) = r {
            sums[a].0 += *sa as f64;
            sums[a].1 += 1;
            sums[b].0 += *sb as f64;
            sums[b].1 += 1;
        }
    }
    sums.into_iter().map(|(s, c)| (c > 0).then(|| (s / c as f64) as f32)).collect()
}

/// A conversation as the judge reads it: `User: ...` paragraphs; text
/// prompts as they are.
pub fn transcript(prompt: &Prompt) -> String {
    match prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Messages(ms) => ms
            .iter()
            .map(|m| {
                let mut role = m.role.clone();
                if let Some(first) = role.get_mut(..1) {
                    first.make_ascii_uppercase();
                }
                format!("{role}: {}", m.content)
            })
            .collect::<Vec<_>>()
            .join("\n\n"),
    }
}

/// A prompt template with `{name}` fields; `{{` and `}}` are literal braces
/// (Python's `str.format` convention).
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    Field(String),
}

impl Template {
    pub fn parse(text: &str) -> Result<Template> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|p| p.1) == Some('{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek().map(|p| p.1) == Some('}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let rest = &text[at + 1..];
                    let end = rest.find('}').ok_or_else(|| {
                        Error::Invalid(format!(
                            "template: `{{` at byte {at} is never closed (write `{{{{` for a brace)"
                        ))
                    })?;
                    let name = &rest[..end];
                    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_' || c == '-' || c == '.')
                    {
                        return Err(Error::Invalid(format!(
                            "template: `{{{name}}}` at byte {at} is not a field name (write `{{{{` for a brace)"
                        )));
                    }
                    parts.push(Part::Text(std::mem::take(&mut literal)));
                    parts.push(Part::Field(name.to_string()));
                    for _ in 0..name.chars().count() + 1 {
                        chars.next();
                    }
                }
                '}' => return Err(Error::Invalid(format!("template: `}}` at byte {at} has no `{{` (write `}}}}`)"))),
                c => literal.push(c),
            }
        }
        parts.push(Part::Text(literal));
        Ok(Template { parts })
    }

    /// The field names, in order of first use.
    pub fn fields(&self) -> Vec<&str> {
        let mut seen = BTreeSet::new();
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Field(f) if seen.insert(f.as_str()) => Some(f.as_str()),
                _ => None,
            })
            .collect()
    }

    /// The text with each field's value; the error names a field `value`
    /// has no value for.
    pub fn render(&self, value: impl Fn(&str) -> Option<String>) -> std::result::Result<String, String> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Field(f) => out.push_str(&value(f).ok_or_else(|| format!("no value for `{{{f}}}`"))?),
            }
        }
        Ok(out)
    }
}

/// A dataset cell as template text: strings as they are, other JSON as JSON.
fn cell_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The fields every template may use besides columns.
const SAMPLE_FIELDS: &[&str] = &["prompt", "completion", "completion_1", "completion_2"];

/// The judge: where it is, what it is asked and how its answers are read.
pub struct Judge {
    client: Client,
    /// `<url>/chat/completions`.
    endpoint: String,
    model: String,
    system: Option<String>,
    template: Template,
    pattern: Regex,
    temperature: f64,
    max_tokens: u32,
    max_concurrency: usize,
    mode: JudgeMode,
}

/// One request's outcome.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// The judge's answer text, or why there is none.
    pub answer: std::result::Result<String, String>,
    /// The pattern's groups read from the answer.
    pub scores: Option<Vec<f32>>,
    pub secs: f64,
}

/// What the judge sees of one request: the prompt, the row, and one or
/// two completions.
pub struct Ask<'a> {
    pub prompt: &'a Prompt,
    pub row: &'a Map<String, Value>,
    pub completions: [&'a str; 2],
}

/// The settings of a [`Judge`] beside its client.
pub struct JudgeSettings {
    /// The API base, e.g. `http://127.0.0.1:8000/v1`.
    pub url: String,
    pub model: String,
    pub system: Option<String>,
    /// `None`: the mode's default template.
    pub template: Option<String>,
    /// `None`: the mode's default pattern.
    pub score_pattern: Option<String>,
    pub temperature: f64,
    pub max_tokens: u32,
    pub max_concurrency: usize,
    pub mode: JudgeMode,
}

impl Judge {
    pub fn new(client: Client, s: JudgeSettings) -> Result<Judge> {
        let (template, pattern, groups) = match s.mode {
            JudgeMode::Pointwise => (POINTWISE_TEMPLATE, POINTWISE_PATTERN, 1),
            JudgeMode::Pairwise => (PAIRWISE_TEMPLATE, PAIRWISE_PATTERN, 2),
        };
        let template = Template::parse(s.template.as_deref().unwrap_or(template))?;
        let pattern_text = s.score_pattern.as_deref().unwrap_or(pattern);
        let pattern = Regex::new(pattern_text)
            .map_err(|e| Error::Invalid(format!("score_pattern `{pattern_text}` is not a valid regex: {e}")))?;
        if pattern.captures_len() - 1 < groups {
            return Err(Error::Invalid(format!(
                "score_pattern `{pattern_text}` has {} capture groups; a {} judge reads {groups} score(s) from \
                 the first {groups} group(s)",
                pattern.captures_len() - 1,
                if groups == 1 { "pointwise" } else { "pairwise" },
            )));
        }
        let (wanted, unwanted): (&[&str], &[&str]) = match s.mode {
            JudgeMode::Pointwise => (&["completion"], &["completion_1", "completion_2"]),
            JudgeMode::Pairwise => (&["completion_1", "completion_2"], &["completion"]),
        };
        let fields = template.fields();
        if let Some(f) = fields.iter().find(|f| unwanted.contains(f)) {
            return Err(Error::Invalid(format!(
                "template uses `{{{f}}}`, which a {:?} judge does not fill; use {}",
                s.mode,
                wanted.iter().map(|w| format!("`{{{w}}}`")).collect::<Vec<_>>().join(" and ")
            )));
        }
        if let Some(w) = wanted.iter().find(|w| !fields.contains(w)) {
            return Err(Error::Invalid(format!("template never shows the judge `{{{w}}}`")));
        }
        Ok(Judge {
            client,
            endpoint: format!("{}/chat/completions", s.url.trim_end_matches('/')),
            model: s.model,
            system: s.system,
            template,
            pattern,
            temperature: s.temperature,
            max_tokens: s.max_tokens,
            max_concurrency: s.max_concurrency,
            mode: s.mode,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The dataset columns the template reads.
    pub fn columns(&self) -> Vec<&str> {
        self.template.fields().into_iter().filter(|f| !SAMPLE_FIELDS.contains(f)).collect()
    }

    /// The user message for one request.
    pub fn render(&self, ask: &Ask) -> std::result::Result<String, String> {
        self.template.render(|field| match field {
            "prompt" => Some(transcript(ask.prompt)),
            "completion" | "completion_1" => Some(ask.completions[0].to_string()),
            "completion_2" => Some(ask.completions[1].to_string()),
            column => ask.row.get(column).map(cell_text),
        })
    }

    /// The pattern's groups in the last match of `answer`.
    pub fn read(&self, answer: &str) -> Option<Vec<f32>> {
        let groups = if self.mode == JudgeMode::Pairwise { 2 } else { 1 };
        let caps = self.pattern.captures_iter(answer).last()?;
        (1..=groups).map(|g| caps.get(g)?.as_str().trim().parse::<f32>().ok().filter(|x| x.is_finite())).collect()
    }

    /// Asks every request, `max_concurrency` at a time.
    pub fn verdicts(&self, asks: &[Ask]) -> Vec<Verdict> {
        in_parallel(asks, self.max_concurrency, |ask| {
            let started = Instant::now();
            let answer = self.render(ask).and_then(|user| self.chat(&user));
            let scores = answer.as_ref().ok().and_then(|a| self.read(a));
            Verdict { answer, scores, secs: started.elapsed().as_secs_f64() }
        })
    }

    fn chat(&self, user: &str) -> std::result::Result<String, String> {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": user}));
        let body = json!({
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        });
        let answer = self.client.post_json(&self.endpoint, &body).map_err(|e| e.to_string())?;
        answer.pointer("/choices/0/message/content").and_then(Value::as_str).map(str::to_string).ok_or_else(|| {
            format!(
                "the answer has no choices[0].message.content: {}",
                crate::service::client::quote(&answer.to_string())
            )
        })
    }
}

/// A judge as a reward source.
pub struct JudgeSource {
    name: String,
    judge: Judge,
    pairs: Pairs,
    budget: FailureBudget,
}

impl JudgeSource {
    pub fn new(name: impl Into<String>, judge: Judge, pairs: Pairs, max_failure_rate: f64) -> JudgeSource {
        let name = name.into();
        JudgeSource { budget: FailureBudget::new(&name, judge.endpoint(), max_failure_rate), name, judge, pairs }
    }
}

impl RewardSource for JudgeSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        let pairwise = self.judge.mode == JudgeMode::Pairwise;
        let comparisons: Vec<(usize, usize)> = if pairwise {
            plan_pairs(&samples.iter().map(|s| s.group).collect::<Vec<_>>(), self.pairs)
        } else {
            (0..samples.len()).map(|i| (i, i)).collect()
        };
        let asks: Vec<Ask> = comparisons
            .iter()
            .map(|&(a, b)| Ask {
                prompt: samples[a].prompt,
                row: samples[a].row,
                completions: [samples[a].completion, samples[b].completion],
            })
            .collect();
        let verdicts = self.judge.verdicts(&asks);
        let mut stats = CallStats { items: asks.len(), ..CallStats::default() };
        let mut last_error = None;
        for v in &verdicts {
            stats.latencies.push(v.secs);
            if v.scores.is_none() {
                stats.failures += 1;
                last_error = Some(match &v.answer {
                    Ok(text) => {
                        format!("no match of score_pattern in the answer: {}", crate::service::client::quote(text))
                    }
                    Err(e) => e.clone(),
                });
            }
        }
        let unit = if pairwise { "comparisons" } else { "samples" };
        self.budget.settle(stats, unit, last_error.as_deref())?;
        Ok(if pairwise {
            let results: Vec<Option<(f32, f32)>> =
                verdicts.iter().map(|v| v.scores.as_ref().map(|s| (s[0], s[1]))).collect();
            mean_pair_scores(samples.len(), &comparisons, &results)
        } else {
            verdicts.iter().map(|v| v.scores.as_ref().map(|s| s[0])).collect()
        })
    }

    fn check_rows(&self, rows: &[&Map<String, Value>]) -> Result<()> {
        for column in self.judge.columns() {
            if !rows.is_empty() && rows.iter().all(|r| !r.contains_key(column)) {
                let keys: BTreeSet<&str> = rows.iter().flat_map(|r| r.keys().map(String::as_str)).collect();
                return Err(Error::Invalid(format!(
                    "reward `{}`: the template reads the column `{column}`, which no row has (columns: {})",
                    self.name,
                    keys.into_iter().collect::<Vec<_>>().join(", ")
                )));
            }
        }
        Ok(())
    }

    fn call_stats(&self) -> Option<CallStats> {
        self.budget.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Message;

    #[test]
    fn round_robin_pairs_show_each_sample_first_once_and_second_once() {
        // Two prompts of 3 and 2 samples, interleaved, and a lone sample.
        let groups = [0, 1, 0, 1, 0, 2];
        assert_eq!(plan_pairs(&groups, Pairs::RoundRobin), [(0, 2), (2, 4), (4, 0), (1, 3), (3, 1)]);
        let all = plan_pairs(&groups, Pairs::All);
        assert_eq!(all, [(0, 2), (0, 4), (2, 0), (2, 4), (4, 0), (4, 2), (1, 3), (3, 1)]);
        for plan in [plan_pairs(&groups, Pairs::RoundRobin), all] {
            for i in 0..5 {
                let first = plan.iter().filter(|p| p.0 == i).count();
                let second = plan.iter().filter(|p| p.1 == i).count();
                assert_eq!(first, second, "sample {i} in {plan:?}");
            }
        }
    }

    #[test]
    fn pair_scores_are_each_samples_mean_over_its_comparisons() {
        // One group of three, round robin: (0,1), (1,2), (2,0).
        // Sample 0: 4 (as first) and 2 (as second) -> 3.
        // Sample 1: 1 and 3 -> 2. Sample 2: the (1,2) comparison was not
        // read, so only 5 (as first of (2,0)) counts. Sample 3 is in no pair.
        let comparisons = [(0, 1), (1, 2), (2, 0)];
        let results = [Some((4.0, 1.0)), None, Some((5.0, 2.0))];
        let got = mean_pair_scores(4, &comparisons, &results);
        assert_eq!(got, [Some(3.0), Some(1.0), Some(5.0), None]);
        let results = [Some((4.0, 1.0)), Some((3.0, 2.0)), Some((5.0, 2.0))];
        assert_eq!(mean_pair_scores(3, &comparisons, &results), [Some(3.0), Some(2.0), Some(3.5)]);
    }

    #[test]
    fn templates_fill_fields_and_keep_escaped_braces() {
        let t = Template::parse("Q: {prompt}\nA: {completion} {{literal}} ({topic})").unwrap();
        assert_eq!(t.fields(), ["prompt", "completion", "topic"]);
        let text = t
            .render(|f| match f {
                "prompt" => Some("2+2?".into()),
                "completion" => Some("4".into()),
                _ => None,
            })
            .unwrap_err();
        assert_eq!(text, "no value for `{topic}`");
        let text = t.render(|f| Some(f.to_uppercase())).unwrap();
        assert_eq!(text, "Q: PROMPT\nA: COMPLETION {literal} (TOPIC)");
        for (bad, want) in [
            ("score {prompt", "template: `{` at byte 6 is never closed (write `{{` for a brace)"),
            ("a } b", "template: `}` at byte 2 has no `{` (write `}}`)"),
            ("a {b c}", "template: `{b c}` at byte 2 is not a field name (write `{{` for a brace)"),
        ] {
            assert_eq!(Template::parse(bad).unwrap_err().to_string(), want);
        }
        assert!(Template::parse(PAIRWISE_TEMPLATE).is_ok() && Template::parse(POINTWISE_TEMPLATE).is_ok());
    }

    fn judge(mode: JudgeMode, template: Option<&str>, pattern: Option<&str>) -> Result<Judge> {
        let client = Client::new(
            std::time::Duration::from_secs(1),
            &[],
            None,
            crate::service::Retry { retries: 0, backoff: std::time::Duration::ZERO },
        );
        Judge::new(
            client,
            JudgeSettings {
                url: "http://127.0.0.1:9/v1/".into(),
                model: "m".into(),
                system: None,
                template: template.map(str::to_string),
                score_pattern: pattern.map(str::to_string),
                temperature: 0.0,
                max_tokens: 16,
                max_concurrency: 1,
                mode,
            },
        )
    }

    #[test]
    fn the_last_match_of_the_pattern_is_the_score() {
        let j = judge(JudgeMode::Pairwise, None, None).unwrap();
        assert_eq!(j.endpoint(), "http://127.0.0.1:9/v1/chat/completions");
        assert_eq!(j.read("maybe \\boxed{1, 2}... no: \\boxed{ 4.5 ,3 }"), Some(vec![4.5, 3.0]));
        assert_eq!(j.read("both are fine"), None);
        let j = judge(JudgeMode::Pointwise, None, None).unwrap();
        assert_eq!(j.read("score: \\boxed{-2}"), Some(vec![-2.0]));
        assert_eq!(j.read("\\boxed{two}"), None);
    }

    #[test]
    fn templates_and_patterns_must_fit_the_mode() {
        let err = |r: Result<Judge>| r.err().unwrap().to_string();
        assert_eq!(
            err(judge(JudgeMode::Pairwise, Some("{prompt} {completion}"), None)),
            "template uses `{completion}`, which a Pairwise judge does not fill; use `{completion_1}` and `{completion_2}`"
        );
        assert_eq!(
            err(judge(JudgeMode::Pointwise, Some("{prompt}"), None)),
            "template never shows the judge `{completion}`"
        );
        assert_eq!(
            err(judge(JudgeMode::Pairwise, None, Some(r"score (\d)"))),
            "score_pattern `score (\\d)` has 1 capture groups; a pairwise judge reads 2 score(s) from the first 2 group(s)"
        );
        assert!(
            err(judge(JudgeMode::Pointwise, None, Some("(("))).starts_with("score_pattern `((` is not a valid regex")
        );
    }

    #[test]
    fn prompts_render_as_transcripts_and_columns_as_text() {
        let chat = Prompt::Messages(vec![Message::new("system", "Be brief."), Message::new("user", "Hi?")]);
        assert_eq!(transcript(&chat), "System: Be brief.\n\nUser: Hi?");
        let j = judge(JudgeMode::Pointwise, Some("{prompt}|{completion}|{answer}|{n}"), None).unwrap();
        assert_eq!(j.columns(), ["answer", "n"]);
        let row = json!({"answer": "42", "n": [1, 2]});
        let ask = Ask { prompt: &chat, row: row.as_object().unwrap(), completions: ["Hello.", ""] };
        assert_eq!(j.render(&ask).unwrap(), "System: Be brief.\n\nUser: Hi?|Hello.|42|[1,2]");
    }
}
