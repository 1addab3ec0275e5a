use super::*;

fn rows(cells: &[&[&str]]) -> Vec<Vec<String>> {
    cells.iter().map(|r| r.iter().map(|c| c.to_string()).collect()).collect()
}

#[test]
fn a_table_that_fits_keeps_natural_widths() {
    let got = render_table(&["prompt", "completion", "score"], &rows(&[&["Say hi", "hello there", "0.5000"]]), 120, 4);
    assert_eq!(
        got,
        "\
┏━━━━━━━━┳━━━━━━━━━━━━━┳━━━━━━━━┓
┃ prompt ┃ completion  ┃ score  ┃
┡━━━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━┩
│ Say hi │ hello there │ 0.5000 │
└────────┴─────────────┴────────┘
"
    );
}

#[test]
fn long_cells_wrap_at_words_within_the_width() {
    let table = rows(&[&["a b", "the quick brown fox jumps"]]);
    let got = render_table(&["prompt", "completion"], &table, 25, 0);
    assert_eq!(
        got,
        "\
┏━━━━━━━━┳━━━━━━━━━━━━━━┓
┃ prompt ┃ completion   ┃
┡━━━━━━━━╇━━━━━━━━━━━━━━┩
│ a b    │ the quick    │
│        │ brown fox    │
│        │ jumps        │
└────────┴──────────────┘
"
    );
    assert!(got.lines().all(|l| l.chars().count() == 25));
}

#[test]
fn cells_past_max_lines_end_in_an_ellipsis() {
    let table = rows(&[&["a b", "the quick brown fox jumps"]]);
    let got = render_table(&["prompt", "completion"], &table, 25, 2);
    assert_eq!(
        got,
        "\
┏━━━━━━━━┳━━━━━━━━━━━━━━┓
┃ prompt ┃ completion   ┃
┡━━━━━━━━╇━━━━━━━━━━━━━━┩
│ a b    │ the quick    │
│        │ brown fox…   │
└────────┴──────────────┘
"
    );
}

#[test]
fn multi_byte_text_is_measured_in_chars() {
    let table = rows(&[&["héllo", "naïve café über straße"]]);
    let got = render_table(&["prompt", "text"], &table, 20, 2);
    assert_eq!(
        got,
        "\
┏━━━━━━━━┳━━━━━━━━━┓
┃ prompt ┃ text    ┃
┡━━━━━━━━╇━━━━━━━━━┩
│ héllo  │ naïve   │
│        │ café…   │
└────────┴─────────┘
"
    );
    assert!(got.lines().all(|l| l.chars().count() == 20));
}

#[test]
fn rows_are_separated_and_newlines_tabs_and_missing_cells_are_handled() {
    let got = render_table(&["p", "s"], &rows(&[&["x\ty"], &["a\r\nb", "1"]]), 40, 4);
    assert_eq!(
        got,
        "\
┏━━━━━┳━━━┓
┃ p   ┃ s ┃
┡━━━━━╇━━━┩
│ x y │   │
├─────┼───┤
│ a   │ 1 │
│ b   │   │
└─────┴───┘
"
    );
}

#[test]
fn words_longer_than_the_column_are_split_and_a_full_last_line_loses_a_char() {
    assert_eq!(wrap("abcdefghij", 4, 0), ["abcd", "efgh", "ij"]);
    assert_eq!(wrap("abcdefghij", 4, 2), ["abcd", "efg…"]);
    assert_eq!(wrap("", 4, 2), [""]);
}

#[test]
fn narrow_columns_keep_their_width_and_wide_ones_share_the_rest() {
    assert_eq!(fit_widths(&[3, 50, 50], 60), [3, 29, 28]);
    assert_eq!(fit_widths(&[3, 5], 60), [3, 5]);
    assert_eq!(fit_widths(&[9, 9], 0), [1, 1], "at least one char each");
}

#[test]
fn terminal_width_comes_from_columns_or_defaults_to_120() {
    assert_eq!(width_from(Some("80")), 80);
    assert_eq!(width_from(Some("wide")), 120);
    assert_eq!(width_from(Some("0")), 120);
    assert_eq!(width_from(None), 120);
}

fn two_samples() -> SampleTable {
    let mut t = SampleTable::new();
    t.push(Sample {
        prompt: "2+2?".into(),
        completion: "4".into(),
        score: 1.0,
        extra_scores: vec![("rewards/math".into(), 1.0)],
    });
    t.push(Sample { prompt: "a|b".into(), completion: "*x*\ny".into(), score: -0.25, extra_scores: vec![] });
    t
}

#[test]
fn sample_table_has_a_column_per_score_and_blanks_for_missing_ones() {
    assert_eq!(
        two_samples().render(120, 8, 4),
        "\
┏━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━┓
┃ prompt ┃ completion ┃ score   ┃ rewards/math ┃
┡━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━┩
│ 2+2?   │ 4          │ 1.0000  │ 1.0000       │
├────────┼────────────┼─────────┼──────────────┤
│ a|b    │ *x*        │ -0.2500 │              │
│        │ y          │         │              │
└────────┴────────────┴─────────┴──────────────┘
"
    );
    assert_eq!(two_samples().render(120, 1, 4).lines().count(), 5, "one row under the header");
}

#[test]
fn sample_table_markdown_escapes_what_markdown_would_format() {
    assert_eq!(
        two_samples().to_markdown(),
        "\
| prompt | completion | score | rewards/math |
| --- | --- | --- | --- |
| 2+2? | 4 | 1.0000 | 1.0000 |
| a\\|b | \\*x\\*<br>y | -0.2500 |  |
"
    );
}
