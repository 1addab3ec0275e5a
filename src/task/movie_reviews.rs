//! A built-in task that needs no downloaded data: short movie reviews whose
//! sentiment is controllable, in the spirit of the IMDb positive-review
//! task of the PPO-vs-RLOO studies. A deterministic generator writes every
//! split the pipeline needs: demonstrations for SFT (both sentiments),
//! preference pairs for the reward model (the more positive review is
//! chosen), and prompt sets for RL and evaluation. The word lists double as
//! a rule reward and as the "share of positive reviews" measure.

use serde_json::json;

use crate::generate::rng::streams;
use crate::generate::Rng;

pub const POSITIVE: &[&str] = &[
    "wonderful",
    "brilliant",
    "moving",
    "beautiful",
    "superb",
    "delightful",
    "gripping",
    "charming",
    "funny",
    "great",
];
pub const NEGATIVE: &[&str] =
    &["boring", "awful", "dull", "clumsy", "tedious", "weak", "predictable", "bland", "silly", "bad"];
const ASPECTS: &[&str] =
    &["acting", "plot", "music", "ending", "dialogue", "camera work", "pacing", "story", "script", "cast"];
const SUBJECTS: &[&str] =
    &["Night", "River", "Garden", "Storm", "Letter", "Island", "Winter", "Mirror", "Road", "Song"];
const PLACES: &[&str] = &["Paris", "the North", "Avalon", "the Sea", "Tomorrow", "the Valley", "Rome", "the Moon"];

/// How a review leans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sentiment {
    Positive,
    Negative,
}

fn pick<'a>(rng: &mut Rng, xs: &[&'a str]) -> &'a str {
    xs[(rng.next_u64() % xs.len() as u64) as usize]
}

/// A film title, e.g. "The Garden of Rome".
pub fn title(rng: &mut Rng) -> String {
    format!("The {} of {}", pick(rng, SUBJECTS), pick(rng, PLACES))
}

/// The prompt every split uses for a title.
pub fn prompt(title: &str) -> String {
    format!("Review of \"{title}\":")
}

/// A review of two or three sentences with the given sentiment.
pub fn review(rng: &mut Rng, sentiment: Sentiment) -> String {
    let words = match sentiment {
        Sentiment::Positive => POSITIVE,
        Sentiment::Negative => NEGATIVE,
    };
    let mut sentences = Vec::new();
    let n = 2 + (rng.next_u64() % 2) as usize;
    for _ in 0..n {
        let (aspect, adj) = (pick(rng, ASPECTS), pick(rng, words));
        sentences.push(match rng.next_u64() % 3 {
            0 => format!("The {aspect} was {adj}."),
            1 => format!("I found the {aspect} {adj}."),
            _ => {
                format!("What {} {adj} {aspect}!", if adj.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" })
            }
        });
    }
    sentences.push(format!("Overall, a {} film.", pick(rng, words)));
    format!(" {}", sentences.join(" "))
}

/// Positive minus negative words of a text (lower-cased words).
pub fn sentiment_score(text: &str) -> i64 {
    let words = text.split(|c: char| !c.is_alphanumeric()).map(str::to_lowercase);
    words.map(|w| i64::from(POSITIVE.contains(&w.as_str())) - i64::from(NEGATIVE.contains(&w.as_str()))).sum()
}

/// Every split of the task, as JSON rows.
pub struct TaskData {
    /// `{"prompt", "completion"}`, half positive, half negative.
    pub sft: Vec<serde_json::Value>,
    /// `{"prompt", "chosen", "rejected"}`: chosen is the positive review.
    pub preferences: Vec<serde_json::Value>,
    /// `{"prompt"}` for RL.
    pub prompts: Vec<serde_json::Value>,
    /// `{"prompt"}` on titles never seen in training.
    pub eval_prompts: Vec<serde_json::Value>,
}

/// Generates the task deterministically from `seed`.
pub fn generate(seed: u64, sft: usize, preferences: usize, prompts: usize, eval_prompts: usize) -> TaskData {
    let mut rng = Rng::stream(seed, &[streams::TASK_DATA]);
    let mut seen = std::collections::BTreeSet::new();
    let mut split = |n: usize, make: &mut dyn FnMut(&mut Rng, &str) -> serde_json::Value| -> Vec<serde_json::Value> {
        (0..n)
            .map(|_| {
                let t = title(&mut rng);
                seen.insert(t.clone());
                make(&mut rng, &t)
            })
            .collect()
    };
    let sft = split(sft, &mut |rng, t| {
        let s = if rng.next_u64() % 2 == 0 { Sentiment::Positive } else { Sentiment::Negative };
        json!({"prompt": prompt(t), "completion": review(rng, s)})
    });
    let preferences = split(
        preferences,
        &mut |rng, t| json!({"prompt": prompt(t), "chosen": review(rng, Sentiment::Positive), "rejected": review(rng, Sentiment::Negative)}),
    );
    let prompts = split(prompts, &mut |_, t| json!({"prompt": prompt(t)}));
    // Held-out titles: a second word order no training title uses.
    let mut eval_rng = Rng::stream(seed, &[streams::TASK_EVAL]);
    let eval_prompts = (0..eval_prompts)
        .map(|_| {
            let t = format!("{} in {}", pick(&mut eval_rng, SUBJECTS), pick(&mut eval_rng, PLACES));
            json!({"prompt": prompt(&t)})
        })
        .collect();
    TaskData { sft, preferences, prompts, eval_prompts }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_is_deterministic_and_labelled_by_its_word_lists() {
        let a = generate(3, 20, 10, 5, 5);
        let b = generate(3, 20, 10, 5, 5);
        assert_eq!(a.sft, b.sft);
        assert_ne!(generate(4, 20, 10, 5, 5).sft, a.sft);
        for p in &a.preferences {
            assert!(sentiment_score(p["chosen"].as_str().unwrap()) > 0);
            assert!(sentiment_score(p["rejected"].as_str().unwrap()) < 0);
        }
        let positive = a.sft.iter().filter(|r| sentiment_score(r["completion"].as_str().unwrap()) > 0).count();
        assert!((5..=15).contains(&positive), "both sentiments in the demonstrations: {positive}/20");
        let train_titles: Vec<&str> = a.prompts.iter().map(|r| r["prompt"].as_str().unwrap()).collect();
        assert!(a.eval_prompts.iter().all(|r| !train_titles.contains(&r["prompt"].as_str().unwrap())));
    }

    #[test]
    fn reviews_read_as_sentences() {
        let mut rng = Rng::new(1);
        let r = review(&mut rng, Sentiment::Positive);
        assert!(r.starts_with(' ') && r.ends_with("film."), "{r}");
        assert_eq!(sentiment_score(" The plot was boring. What a great cast!"), 0);
    }
}
