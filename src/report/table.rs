//! The sample table printed during training, like the `rich` table of TRL's
//! `print_rich_table`: prompts, completions and scores in a box-drawn grid,
//! each cell word-wrapped to its column and cut to a few lines.
//!
//! Widths count `char`s: right for most text; East Asian wide characters
//! and emoji take two terminal cells each and push their row's border out.

use crate::report::samples::Sample;

/// The width used when neither the caller nor `COLUMNS` gives one.
pub const DEFAULT_WIDTH: usize = 120;

/// The width to render tables at: `COLUMNS` when it holds a number (shells
/// export it only on request), else [`DEFAULT_WIDTH`].
pub fn terminal_width() -> usize {
    width_from(std::env::var("COLUMNS").ok().as_deref())
}

fn width_from(columns: Option<&str>) -> usize {
    columns.and_then(|c| c.trim().parse().ok()).filter(|&w: &usize| w > 0).unwrap_or(DEFAULT_WIDTH)
}

/// Renders `rows` under `headers` in at most `width` columns (more only when
/// `width` cannot fit one character per column), each cell wrapped at word
/// boundaries and cut to `max_lines` lines ending in `…` (0: no limit).
/// Missing cells are blank; cells past the headers are ignored.
pub fn render_table(headers: &[&str], rows: &[Vec<String>], width: usize, max_lines: usize) -> String {
    if headers.is_empty() {
        return String::new();
    }
    let natural: Vec<usize> = (0..headers.len())
        .map(|i| {
            let cells = rows.iter().map(|r| cell(r, i));
            std::iter::once(headers[i]).chain(cells).map(longest_line).max().unwrap_or(0).max(1)
        })
        .collect();
    // Each column costs its text, one space either side and one border.
    let widths = fit_widths(&natural, width.saturating_sub(3 * headers.len() + 1));

    let mut out = rule(&widths, "┏", "━", "┳", "┓");
    push_row(&mut out, headers, &widths, max_lines, '┃');
    out += &rule(&widths, "┡", "━", "╇", "┩");
    for (n, row) in rows.iter().enumerate() {
        if n > 0 {
            out += &rule(&widths, "├", "─", "┼", "┤");
        }
        let cells: Vec<&str> = (0..headers.len()).map(|i| cell(row, i)).collect();
        push_row(&mut out, &cells, &widths, max_lines, '│');
    }
    out + &rule(&widths, "└", "─", "┴", "┘")
}

fn cell(row: &[String], i: usize) -> &str {
    row.get(i).map_or("", String::as_str)
}

/// Column widths that sum to at most `available`: columns narrower than an
/// even share keep their natural width, the rest split what is left.
fn fit_widths(natural: &[usize], available: usize) -> Vec<usize> {
    if natural.iter().sum::<usize>() <= available {
        return natural.to_vec();
    }
    let mut widths = vec![0; natural.len()];
    let mut open: Vec<usize> = (0..natural.len()).collect();
    let mut left = available;
    loop {
        let share = left / open.len();
        let (fits, wide): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| natural[i] <= share);
        if fits.is_empty() {
            for (n, &i) in wide.iter().enumerate() {
                let extra = usize::from(n < left % wide.len());
                widths[i] = (share + extra).max(1);
            }
            return widths;
        }
        for &i in &fits {
            widths[i] = natural[i];
            left -= natural[i];
        }
        open = wide;
    }
}

fn rule(widths: &[usize], left: &str, fill: &str, join: &str, right: &str) -> String {
    let parts: Vec<String> = widths.iter().map(|&w| fill.repeat(w + 2)).collect();
    format!("{left}{}{right}\n", parts.join(join))
}

fn push_row(out: &mut String, cells: &[&str], widths: &[usize], max_lines: usize, border: char) {
    let wrapped: Vec<Vec<String>> = cells.iter().zip(widths).map(|(c, &w)| wrap(c, w, max_lines)).collect();
    let height = wrapped.iter().map(Vec::len).max().unwrap_or(1);
    for line in 0..height {
        out.push(border);
        for (lines, &w) in wrapped.iter().zip(widths) {
            let text = lines.get(line).map_or("", String::as_str);
            let pad = w.saturating_sub(text.chars().count());
            out.push_str(&format!(" {text}{} {border}", " ".repeat(pad)));
        }
        out.push('\n');
    }
}

fn longest_line(text: &str) -> usize {
    clean(text).lines().map(|l| l.chars().count()).max().unwrap_or(0)
}

/// Tabs and other control characters would break the box: each becomes a
/// space, except newlines, which break lines.
fn clean(text: &str) -> String {
    text.replace("\r\n", "\n").chars().map(|c| if c.is_control() && c != '\n' { ' ' } else { c }).collect()
}

/// Greedy word wrap to `width` chars; words longer than a line are split.
/// More than `max_lines` lines (when not 0) are cut, the last ending in `…`.
fn wrap(text: &str, width: usize, max_lines: usize) -> Vec<String> {
    let mut lines = Vec::new();
    for paragraph in clean(text).split('\n') {
        let mut line = String::new();
        for word in paragraph.split_whitespace() {
            let (line_len, word_len) = (line.chars().count(), word.chars().count());
            if line_len > 0 && line_len + 1 + word_len <= width {
                line.push(' ');
                line.push_str(word);
                continue;
            }
            if line_len > 0 {
                lines.push(std::mem::take(&mut line));
            }
            let chars: Vec<char> = word.chars().collect();
            let mut chunks = chars.chunks(width.max(1)).peekable();
            while let Some(chunk) = chunks.next() {
                let chunk: String = chunk.iter().collect();
                match chunks.peek() {
                    Some(_) => lines.push(chunk),
                    None => line = chunk,
                }
            }
        }
        lines.push(line);
    }
    if max_lines > 0 && lines.len() > max_lines {
        lines.truncate(max_lines);
        let last = lines.last_mut().expect("max_lines > 0");
        if last.chars().count() >= width {
            last.pop();
        }
        last.push('…');
    }
    lines
}

/// The same table as Markdown, for TensorBoard's Text tab; newlines become
/// `<br>` and characters that Markdown or HTML would act on are escaped.
pub fn render_markdown(headers: &[&str], rows: &[Vec<String>]) -> String {
    let line = |cells: Vec<String>| format!("| {} |\n", cells.join(" | "));
    let mut out = line(headers.iter().map(|h| escape_markdown(h)).collect());
    out += &line(headers.iter().map(|_| "---".to_string()).collect());
    for row in rows {
        let cells = (0..headers.len()).map(|i| escape_markdown(row.get(i).map_or("", String::as_str)));
        out += &line(cells.collect());
    }
    out
}

fn escape_markdown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.replace("\r\n", "\n").chars() {
        match c {
            '\n' => out.push_str("<br>"),
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '|' | '#' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Samples gathered during a step, shown as a table with a column per score
/// (`score`, then each extra score in order of first appearance).
#[derive(Debug, Clone, Default)]
pub struct SampleTable {
    samples: Vec<Sample>,
}

impl SampleTable {
    pub fn new() -> SampleTable {
        SampleTable::default()
    }

    pub fn push(&mut self, sample: Sample) {
        self.samples.push(sample);
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    pub fn clear(&mut self) {
        self.samples.clear();
    }

    /// The box-drawn table of the first `max_rows` samples for the console,
    /// each cell cut to `max_lines` lines.
    pub fn render(&self, width: usize, max_rows: usize, max_lines: usize) -> String {
        let (headers, mut rows) = self.cells();
        rows.truncate(max_rows);
        let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
        render_table(&headers, &rows, width, max_lines)
    }

    /// The table as Markdown, for [`crate::report::TensorBoardWriter::add_text`].
    pub fn to_markdown(&self) -> String {
        let (headers, rows) = self.cells();
        let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
        render_markdown(&headers, &rows)
    }

    fn cells(&self) -> (Vec<String>, Vec<Vec<String>>) {
        let mut extra: Vec<&str> = Vec::new();
        for (name, _) in self.samples.iter().flat_map(|s| &s.extra_scores) {
            if !extra.contains(&name.as_str()) {
                extra.push(name);
            }
        }
        let mut headers: Vec<String> = ["prompt", "completion", "score"].map(String::from).to_vec();
        headers.extend(extra.iter().map(|n| n.to_string()));
        let rows = self
            .samples
            .iter()
            .map(|s| {
                let mut row = vec![s.prompt.clone(), s.completion.clone(), format_score(s.score)];
                row.extend(extra.iter().map(|name| {
                    s.extra_scores.iter().find(|(n, _)| n == name).map_or(String::new(), |&(_, v)| format_score(v))
                }));
                row
            })
            .collect();
        (headers, rows)
    }
}

fn format_score(v: f64) -> String {
    format!("{v:.4}")
}

#[cfg(test)]
mod tests;
