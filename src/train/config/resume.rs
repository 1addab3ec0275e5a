//! What a resumed run may change from the configuration its checkpoint was
//! saved with.

use serde::Serialize;

use super::TrainConfig;

/// The resolved configuration, saved in the output directory and in each checkpoint.
pub const CONFIG_FILE: &str = "rloo_config.toml";

/// Keys a resumed run may change: where and how often it reports and
/// saves, and how it uses the machine. Any other change would make the
/// resumed run a different run than the one its checkpoint belongs to.
pub const CHANGEABLE_ON_RESUME: &[&str] = &[
    "eval.split",
    "eval.dataset",
    "eval.take",
    "eval.strategy",
    "eval.steps",
    "model.device",
    "generation.local_rollout_forward_batch_size",
    "train.output_dir",
    "train.logging_steps",
    "train.save_steps",
    "train.save_total_limit",
    "train.num_sample_generations",
    "train.num_completions_to_print",
    "train.resume_from_checkpoint",
    "train.stop_after",
    "train.overwrite_output_dir",
    "train.max_skipped_steps",
    "train.zero_stage",
];

impl TrainConfig {
    /// The differences from the configuration a checkpoint was saved with
    /// (see [`changes_since`]).
    pub fn changes_since(&self, saved: &TrainConfig) -> std::result::Result<Vec<String>, Vec<String>> {
        changes_since(saved, self, CHANGEABLE_ON_RESUME)
    }
}

/// The differences between the configuration a checkpoint was saved with
/// and the run's, as `key: saved -> now`: `Ok` with the changes a resume
/// may make (those `changeable` names; to log), or `Err` with those it may not.
pub fn changes_since<T: Serialize>(
    saved: &T,
    now: &T,
    changeable: &[&str],
) -> std::result::Result<Vec<String>, Vec<String>> {
    let (old, new) = (flat_keys(saved), flat_keys(now));
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    let (mut allowed, mut refused) = (Vec::new(), Vec::new());
    for key in keys {
        let (was, is) = (old.get(key), new.get(key));
        if was == is {
            continue;
        }
        let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "unset".into());
        let line = format!("{key}: {} -> {}", show(was), show(is));
        if changeable.contains(&key.as_str()) {
            allowed.push(line);
        } else {
            refused.push(line);
        }
    }
    if refused.is_empty() {
        Ok(allowed)
    } else {
        Err(refused)
    }
}

/// `section.key -> value` for every set key; `[[reward]]` is one key.
fn flat_keys<T: Serialize>(cfg: &T) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    if let Ok(toml::Value::Table(top)) = toml::Value::try_from(cfg) {
        for (section, value) in top {
            match value {
                toml::Value::Table(keys) => {
                    for (key, v) in keys {
                        out.insert(format!("{section}.{key}"), v.to_string());
                    }
                }
                other => {
                    out.insert(section, other.to_string());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests::with;

    #[test]
    fn resume_accepts_reporting_changes_and_refuses_the_rest() {
        let saved = with(&["rloo.k=4", "data.path=a.jsonl", "train.save_steps=10"]).unwrap();
        let now = with(&["rloo.k=4", "data.path=a.jsonl", "train.save_steps=5", "train.resume_from_checkpoint=latest"])
            .unwrap();
        assert_eq!(
            now.changes_since(&saved).unwrap(),
            ["train.resume_from_checkpoint: unset -> \"latest\"", "train.save_steps: 10 -> 5"]
        );
        let now = with(&["rloo.k=2", "data.path=b.jsonl", "train.seed=7", "train.learning_rate=1e-3"]).unwrap();
        let refused = now.changes_since(&saved).unwrap_err();
        assert_eq!(
            refused,
            [
                "data.path: \"a.jsonl\" -> \"b.jsonl\"",
                "rloo.k: 4 -> 2",
                "train.learning_rate: 0.000003 -> 0.001",
                "train.seed: 42 -> 7"
            ]
        );
    }
}
