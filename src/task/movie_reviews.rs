//! A built-in task that needs no downloaded data: short movie reviews whose
//! sentiment is controllable, in the spirit of the IMDb positive-review
//! task of the PPO-vs-RLOO studies. A deterministic generator writes every
//! split the pipeline needs: demonstrations for SFT (positive, negative and
//! mixed reviews), preference pairs for the reward model, and prompt sets
//! for RL and evaluation. The word lists double as a rule reward and as the
//! "share of positive reviews" measure.
//!
//! A review is positive when it praises and never criticises: one negative
//! sentence makes it mixed. The preference pairs teach exactly that, so a
//! reward model trained on them cannot be satisfied by a mixed review:
//! fully positive beats fully negative, fully positive beats the same
//! review with one sentence turned negative, and one negative sentence
//! beats two.

use serde_json::json;

use crate::rng::streams;
use crate::rng::Rng;

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

/// Words that describe without judging.
const NEUTRAL: &[&str] = &["long", "short", "quiet", "loud", "simple", "modern", "familiar", "colourful"];

/// How a sentence leans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sentiment {
    Positive,
    Neutral,
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

/// How many sentences come before the overall verdict.
fn body_length(rng: &mut Rng) -> usize {
    2 + (rng.next_u64() % 2) as usize
}

/// A review with one sentence per entry of `sentiments`, the last one the
/// overall verdict.
fn review_of(rng: &mut Rng, sentiments: &[Sentiment]) -> String {
    let words = |s: Sentiment| match s {
        Sentiment::Positive => POSITIVE,
        Sentiment::Neutral => NEUTRAL,
        Sentiment::Negative => NEGATIVE,
    };
    let (verdict, body) = sentiments.split_last().expect("a review has a verdict");
    let mut sentences: Vec<String> = body
        .iter()
        .map(|&s| {
            let (aspect, adj) = (pick(rng, ASPECTS), pick(rng, words(s)));
            match rng.next_u64() % 3 {
                0 => format!("The {aspect} was {adj}."),
                1 => format!("I found the {aspect} {adj}."),
                _ => format!(
                    "What {} {adj} {aspect}!",
                    if adj.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" }
                ),
            }
        })
        .collect();
    sentences.push(format!("Overall, a {} film.", pick(rng, words(*verdict))));
    format!(" {}", sentences.join(" "))
}

/// Sentiments of a review of `len` sentences with `n` of them (at random
/// places, the verdict included) `other` and the rest positive.
fn with_others(rng: &mut Rng, len: usize, n: usize, other: Sentiment) -> Vec<Sentiment> {
    let mut sentiments = vec![Sentiment::Positive; len];
    let mut placed = 0;
    while placed < n.min(len) {
        let i = (rng.next_u64() % len as u64) as usize;
        if sentiments[i] == Sentiment::Positive {
            sentiments[i] = other;
            placed += 1;
        }
    }
    sentiments
}

/// A preference pair `(chosen, rejected)` of reviews of equal length, so
/// that only their sentiment tells them apart (in tenths of the pairs):
/// fully positive against fully negative (2), against one negative
/// sentence (4) and against one neutral sentence (2, so that praise left
/// out costs too); one negative sentence against two (2).
fn preference_pair(rng: &mut Rng) -> (String, String) {
    use Sentiment::{Negative, Neutral};
    let len = body_length(rng) + 1;
    let (chosen, rejected) = match rng.next_u64() % 10 {
        0..=1 => (0, (len, Negative)),
        2..=5 => (0, (1, Negative)),
        6..=7 => (0, (1, Neutral)),
        _ => (1, (2, Negative)),
    };
    let chosen = with_others(rng, len, chosen, Negative);
    let rejected = with_others(rng, len, rejected.0, rejected.1);
    (review_of(rng, &chosen), review_of(rng, &rejected))
}

/// A demonstration: positive, negative or mixed (one sentence or more of
/// the other sentiment), a third each.
fn demonstration(rng: &mut Rng) -> String {
    let len = body_length(rng) + 1;
    let sentiments = match rng.next_u64() % 3 {
        0 => vec![Sentiment::Positive; len],
        1 => vec![Sentiment::Negative; len],
        _ => {
            let negative = 1 + (rng.next_u64() % (len as u64 - 1)) as usize;
            with_others(rng, len, negative, Sentiment::Negative)
        }
    };
    review_of(rng, &sentiments)
}

/// Every split of the task, as JSON rows.
pub struct TaskData {
    /// `{"prompt", "completion"}`: positive, negative and mixed reviews.
    pub sft: Vec<serde_json::Value>,
    /// `{"prompt", "chosen", "rejected"}`: chosen has fewer negative sentences.
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
    let sft = split(sft, &mut |rng, t| json!({"prompt": prompt(t), "completion": demonstration(rng)}));
    let preferences = split(preferences, &mut |rng, t| {
        let (chosen, rejected) = preference_pair(rng);
        json!({"prompt": prompt(t), "chosen": chosen, "rejected": rejected})
    });
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

    /// Praise and criticism: positive and negative words, split as the
    /// lexicon reward splits them.
    fn sentiment_words(text: &str) -> (usize, usize) {
        let words: Vec<String> = crate::reward::rules::words(text).collect();
        let count = |list: &[&str]| words.iter().filter(|w| list.contains(&w.as_str())).count();
        (count(POSITIVE), count(NEGATIVE))
    }

    /// Praise and no criticism, as the pipeline measures it.
    fn is_positive(text: &str) -> bool {
        let (praise, criticism) = sentiment_words(text);
        praise > 0 && criticism == 0
    }

    #[test]
    fn the_task_is_deterministic_and_its_pairs_prefer_praise_without_criticism() {
        let a = generate(3, 60, 200, 5, 5);
        let b = generate(3, 60, 200, 5, 5);
        assert_eq!((&a.sft, &a.preferences), (&b.sft, &b.preferences));
        assert_ne!(generate(4, 60, 200, 5, 5).sft, a.sft);
        let mut kinds = [0; 4];
        for p in &a.preferences {
            let (chosen, rejected) = (p["chosen"].as_str().unwrap(), p["rejected"].as_str().unwrap());
            let ((praise, criticism), (praise_r, criticism_r)) = (sentiment_words(chosen), sentiment_words(rejected));
            assert_eq!(chosen.matches(['.', '!']).count(), rejected.matches(['.', '!']).count());
            kinds[match (criticism, criticism_r, praise_r) {
                (0, _, 0) => 0,
                (0, 1, _) => 1,
                (0, 0, _) => 2,
                (1, 2, _) => 3,
                _ => panic!("not a kind of pair: {chosen} | {rejected}"),
            }] += 1;
            assert!(criticism < criticism_r || praise > praise_r, "{chosen} | {rejected}");
        }
        assert!(kinds.iter().all(|&k| k > 20), "every kind of pair: {kinds:?}");
        let positive = a.sft.iter().filter(|r| is_positive(r["completion"].as_str().unwrap())).count();
        let mixed =
            a.sft.iter().filter(|r| sentiment_words(r["completion"].as_str().unwrap()).0 > 0).count() - positive;
        assert!((10..=30).contains(&positive) && (10..=30).contains(&mixed), "{positive} positive, {mixed} mixed");
        let train_titles: Vec<&str> = a.prompts.iter().map(|r| r["prompt"].as_str().unwrap()).collect();
        assert!(a.eval_prompts.iter().all(|r| !train_titles.contains(&r["prompt"].as_str().unwrap())));
    }

    #[test]
    fn reviews_read_as_sentences_and_one_negative_sentence_makes_a_review_mixed() {
        let mut rng = Rng::new(1);
        let r = review_of(&mut rng, &[Sentiment::Positive; 3]);
        assert!(r.starts_with(' ') && r.ends_with("film.") && is_positive(&r), "{r}");
        let sentiments = with_others(&mut rng, 4, 1, Sentiment::Negative);
        let r = review_of(&mut rng, &sentiments);
        assert_eq!(sentiment_words(&r), (3, 1), "{r}");
        assert!(!is_positive(&r));
        assert!(!is_positive(" The plot was great. What a boring cast!"));
        assert!(!is_positive(" The plot was."), "no praise, not positive");
    }
}
