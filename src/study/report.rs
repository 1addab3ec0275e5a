//! The study's report: a table per arm (final reward and its spread over
//! seeds, KL, the `[eval]` measures on held-out prompts, wall time, peak
//! memory, completions/s), which arm won, and overlaid curves
//! with the seeds' spread: reward and KL against episodes, and the
//! reward-KL frontier. Written as `study.md` with PNGs.

use std::path::{Path, PathBuf};

use super::eval::Measure;
use super::{RunRecord, Study};
use crate::error::Result;
use crate::io::write_atomic;
use crate::report::chart::{Chart, Series};
use crate::report::table::render_markdown;
use crate::stats::{mean, mean_std, Deviation};

/// One arm over its seeds.
#[derive(Debug, Clone, Default)]
pub struct ArmSummary {
    pub name: String,
    /// Per seed: the mean score of the run's last tenth of steps.
    pub final_reward: Vec<f64>,
    pub final_kl: Vec<f64>,
    pub wall_seconds: Vec<f64>,
    pub peak_rss_mb: Vec<f64>,
    pub completions_per_second: Vec<f64>,
    /// Each `[eval]` measure, per seed (NaN: nothing scored).
    pub eval: Vec<(Measure, Vec<f64>)>,
    /// Per step, over seeds: (episode, [value of each seed]).
    pub reward_curve: Vec<(f64, Vec<f64>)>,
    pub kl_curve: Vec<(f64, Vec<f64>)>,
}

/// Reads each run's metrics and gathers them by arm.
pub fn summarise(study: &Study, records: &[RunRecord]) -> Result<Vec<ArmSummary>> {
    let mut out = Vec::new();
    let measures = study.measures()?;
    for arm in &study.arms {
        let mut s = ArmSummary { name: arm.name.clone(), ..ArmSummary::default() };
        s.eval = measures.iter().map(|m| (m.clone(), vec![])).collect();
        for record in records.iter().filter(|r| r.arm == arm.name) {
            let rows = crate::data::read_rows(study.run_dir(arm, record.seed).join("metrics.jsonl"))?;
            let get = |key: &str| -> Vec<f64> {
                rows.iter().map(|r| r.fields.get(key).and_then(|v| v.as_f64()).unwrap_or(f64::NAN)).collect()
            };
            let (episodes, rewards, kls, secs) =
                (get("episode"), get("objective/scores"), get("objective/kl"), get("time/step"));
            let tail = (rows.len() / 10).max(1);
            let last = |xs: &[f64]| mean(&xs[xs.len().saturating_sub(tail)..]).unwrap_or(f64::NAN);
            s.final_reward.push(last(&rewards));
            s.final_kl.push(last(&kls));
            s.wall_seconds.push(record.wall_seconds);
            s.peak_rss_mb.push(record.peak_rss_mb);
            let step_secs: f64 = secs.iter().filter(|x| x.is_finite()).sum();
            s.completions_per_second.push(episodes.last().copied().unwrap_or(0.0) / step_secs.max(1e-9));
            for (measure, values) in &mut s.eval {
                values.push(record.eval.get(measure.name()).copied().flatten().unwrap_or(f64::NAN));
            }
            add_curve(&mut s.reward_curve, &episodes, &rewards);
            add_curve(&mut s.kl_curve, &episodes, &kls);
        }
        out.push(s);
    }
    Ok(out)
}

/// Adds one seed's values to a curve, step by step.
fn add_curve(curve: &mut Vec<(f64, Vec<f64>)>, episodes: &[f64], values: &[f64]) {
    for (i, (&e, &v)) in episodes.iter().zip(values).enumerate() {
        match curve.get_mut(i) {
            Some((_, seeds)) => seeds.push(v),
            None => curve.push((e, vec![v])),
        }
    }
}

impl ArmSummary {
    /// The per-seed values of `measure`, or of the final training reward.
    fn values(&self, measure: Option<&Measure>) -> &[f64] {
        match measure {
            Some(m) => self.eval.iter().find(|(e, _)| e == m).map_or(&[], |(_, v)| v.as_slice()),
            None => &self.final_reward,
        }
    }

    /// Mean and sample standard deviation over seeds of `measure`.
    fn spread(&self, measure: Option<&Measure>) -> (f64, f64) {
        let finite: Vec<f64> = self.values(measure).iter().copied().filter(|x| x.is_finite()).collect();
        mean_std(&finite, Deviation::Sample).unwrap_or((f64::NAN, f64::NAN))
    }
}

/// `mean ± sd`, shares in percent.
fn show(measure: Option<&Measure>, (m, sd): (f64, f64)) -> String {
    match measure {
        Some(Measure::Share(_)) => format!("{:.1}% ± {:.1}%", 100.0 * m, 100.0 * sd),
        _ => format!("{m:.3} ± {sd:.3}"),
    }
}

/// A written report, and its parts for quoting elsewhere.
pub struct StudyReport {
    pub path: PathBuf,
    /// The markdown table, a row per arm.
    pub table: String,
    /// Which arm won, in a sentence.
    pub verdict: String,
}

/// Writes `study.md` and its charts into the study's output directory.
pub fn write_report(study: &Study, arms: &[ArmSummary]) -> Result<StudyReport> {
    let dir = &study.output_dir;
    let measures = study.measures()?;
    let mut headers = vec!["arm".to_string(), "final reward".into(), "KL".into()];
    headers.extend(measures.iter().map(|m| format!("{} (held-out)", m.name())));
    headers.extend(["wall time s".into(), "peak memory MB".into(), "completions/s".into()]);
    let avg = |xs: &[f64]| mean(xs).unwrap_or(f64::NAN);
    let rows: Vec<Vec<String>> = arms
        .iter()
        .map(|a| {
            let mut row = vec![a.name.clone(), show(None, a.spread(None)), format!("{:.3}", avg(&a.final_kl))];
            row.extend(measures.iter().map(|m| show(Some(m), a.spread(Some(m)))));
            row.extend([
                format!("{:.1}", avg(&a.wall_seconds)),
                format!("{:.0}", a.peak_rss_mb.iter().copied().fold(0.0, f64::max)),
                format!("{:.1}", avg(&a.completions_per_second)),
            ]);
            row
        })
        .collect();
    let charts = write_charts(dir, arms)?;
    let held_out = match &study.eval {
        Some(e) => format!(
            " Held-out measures: {} samples per prompt of {}, scored after training.",
            e.samples_per_prompt, e.prompts
        ),
        None => String::new(),
    };
    let mut md = format!(
        "# Study\n\n{} arms x {} seeds ({:?}), {} episodes per run. Final values are the mean over the \
         last tenth of each run's steps, then over seeds (± the sample standard deviation over seeds); wall \
         time and completions/s are means over seeds, peak memory the largest.{held_out}\n\n",
        arms.len(),
        study.seeds.len(),
        study.seeds,
        arms.iter().flat_map(|a| a.reward_curve.last()).map(|(e, _)| *e).fold(0.0, f64::max)
    );
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    let table = render_markdown(&headers, &rows);
    let rank_by = study.eval.as_ref().and_then(|e| e.rank_by.as_deref());
    let verdict = verdict(arms, measures.iter().find(|m| Some(m.name()) == rank_by));
    md.push_str(&format!("{table}\n{verdict}"));
    for (title, file) in charts {
        md.push_str(&format!("\n## {title}\n\n![{title}]({file})\n"));
    }
    let path = dir.join("study.md");
    write_atomic(&path, md.as_bytes())?;
    Ok(StudyReport { path, table, verdict })
}

/// Which arm won on `measure` (default: the final training reward), and
/// by how much against the seeds' spread.
fn verdict(arms: &[ArmSummary], measure: Option<&Measure>) -> String {
    let what = measure.map_or("final reward".to_string(), |m| format!("{} on held-out prompts", m.name()));
    let mut ranked: Vec<&ArmSummary> = arms.iter().filter(|a| a.spread(measure).0.is_finite()).collect();
    ranked.sort_by(|a, b| b.spread(measure).0.total_cmp(&a.spread(measure).0));
    let Some(best) = ranked.first() else { return format!("No arm finished with a finite {what}.\n") };
    let (m, sd) = best.spread(measure);
    let mut text = format!("**{}** reached the highest {what}, {}", best.name, show(measure, (m, sd)));
    if let Some(second) = ranked.get(1) {
        let (m2, sd2) = second.spread(measure);
        let clear = m - sd > m2 + sd2;
        text.push_str(&format!(
            ", ahead of {} ({}){}",
            second.name,
            show(measure, (m2, sd2)),
            if clear {
                "; the seeds' spreads do not overlap"
            } else {
                "; the seeds' spreads overlap, so the lead is not clear"
            }
        ));
    }
    text.push_str(&format!(", at a final KL of {:.3}.\n", mean(&best.final_kl).unwrap_or(f64::NAN)));
    text
}

/// A curve's (x, mean) points and its (x, low, high) band over the seeds.
type Banded = (Vec<(f64, f64)>, Vec<(f64, f64, f64)>);

/// The curves, smoothed over a few steps, with the seeds' min-max band.
fn write_charts(dir: &Path, arms: &[ArmSummary]) -> Result<Vec<(String, String)>> {
    let band = |curve: &[(f64, Vec<f64>)]| -> Banded {
        let xs: Vec<f64> = curve.iter().map(|(e, _)| *e).collect();
        let over_seeds = |f: fn(&[f64]) -> f64| smooth(&curve.iter().map(|(_, seeds)| f(seeds)).collect::<Vec<_>>());
        let means = over_seeds(|s| mean(s).unwrap_or(f64::NAN));
        let lows = over_seeds(|s| s.iter().copied().fold(f64::INFINITY, f64::min));
        let highs = over_seeds(|s| s.iter().copied().fold(f64::NEG_INFINITY, f64::max));
        let points = xs.iter().copied().zip(means).collect();
        let band = xs.iter().zip(lows).zip(highs).map(|((&x, lo), hi)| (x, lo, hi)).collect();
        (points, band)
    };
    let chart = |title: &str, x: &str, y: &str, series: Vec<Series>| Chart {
        title: title.into(),
        x_label: x.into(),
        y_label: y.into(),
        series,
    };
    let mut reward = vec![];
    let mut kl = vec![];
    let mut frontier = vec![];
    for a in arms {
        let (points, spread) = band(&a.reward_curve);
        reward.push(Series { label: a.name.clone(), points: points.clone(), band: spread, traces: vec![] });
        let (kl_points, kl_spread) = band(&a.kl_curve);
        kl.push(Series { label: a.name.clone(), points: kl_points.clone(), band: kl_spread, traces: vec![] });
        // Reward against KL, step by step; each seed's path behind the mean's.
        let traces = (0..a.reward_curve.first().map_or(0, |(_, s)| s.len()))
            .map(|seed| {
                let of = |curve: &[(f64, Vec<f64>)]| smooth(&curve.iter().map(|(_, s)| s[seed]).collect::<Vec<_>>());
                of(&a.kl_curve).into_iter().zip(of(&a.reward_curve)).collect()
            })
            .collect();
        let at_kl = kl_points.iter().map(|p| p.1);
        frontier.push(Series {
            label: a.name.clone(),
            points: at_kl.zip(&points).map(|(k, p)| (k, p.1)).collect(),
            band: vec![],
            traces,
        });
    }
    let made = [
        ("reward against episodes", "reward.png", chart("Reward against episodes", "episodes", "mean score", reward)),
        (
            "KL against episodes",
            "kl.png",
            chart("KL to the reference against episodes", "episodes", "KL (nats per completion)", kl),
        ),
        (
            "reward-KL frontier",
            "frontier.png",
            chart("Reward against KL", "KL (nats per completion)", "mean score", frontier),
        ),
    ];
    let mut out = vec![];
    for (title, file, chart) in made {
        chart.write_png(&dir.join(file))?;
        out.push((title.to_string(), file.to_string()));
    }
    Ok(out)
}

/// A centred moving average over about a twentieth of the points.
fn smooth(xs: &[f64]) -> Vec<f64> {
    let half = xs.len() / 40;
    (0..xs.len())
        .map(|i| {
            let window = &xs[i.saturating_sub(half)..(i + half + 1).min(xs.len())];
            mean(&window.iter().copied().filter(|x| x.is_finite()).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(name: &str, rewards: &[f64]) -> ArmSummary {
        ArmSummary {
            name: name.into(),
            final_reward: rewards.to_vec(),
            final_kl: vec![0.5; rewards.len()],
            ..ArmSummary::default()
        }
    }

    #[test]
    fn the_verdict_names_the_winner_and_whether_the_spreads_overlap() {
        let text = verdict(&[arm("a", &[1.0, 1.2]), arm("b", &[2.0, 2.2]), arm("c", &[1.9, 2.5])], None);
        assert!(text.starts_with("**c** reached the highest final reward, 2.200"), "{text}");
        assert!(text.contains("ahead of b") && text.contains("overlap, so the lead is not clear"), "{text}");
        let text = verdict(&[arm("a", &[1.0, 1.1]), arm("b", &[2.0, 2.1])], None);
        assert!(text.contains("**b**") && text.contains("do not overlap"), "{text}");
    }

    #[test]
    fn the_verdict_can_rank_by_a_held_out_share() {
        let positive = Measure::Share("positive".into());
        let with_share = |name: &str, rewards: &[f64], shares: &[f64]| ArmSummary {
            eval: vec![(positive.clone(), shares.to_vec())],
            ..arm(name, rewards)
        };
        let arms = [with_share("a", &[3.0, 3.0], &[0.80, 0.84]), with_share("b", &[2.0, 2.0], &[0.95, f64::NAN])];
        let text = verdict(&arms, Some(&positive));
        assert!(text.starts_with("**b** reached the highest positive on held-out prompts, 95.0% ± "), "{text}");
        assert!(text.contains("ahead of a (82.0% ± 2.8%)"), "{text}");
        assert!(verdict(&arms, None).starts_with("**a**"));
    }

    #[test]
    fn smoothing_keeps_the_length_and_averages_neighbours() {
        let xs: Vec<f64> = (0..80).map(|i| if i % 2 == 0 { 0.0 } else { 2.0 }).collect();
        let s = smooth(&xs);
        assert_eq!(s.len(), 80);
        assert!(s[40..42].iter().all(|v| (v - 1.0).abs() < 0.3), "{:?}", &s[38..44]);
    }
}
