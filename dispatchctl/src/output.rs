//! Rendering: aligned text tables, JSON and YAML, and the small formatters
//! the tables use (ages, durations, sizes, CPU lists, UTC times, shell
//! quoting).
//!
//! Tables are plain text in the kubectl style: upper-case headers, columns
//! separated by three spaces, widths computed from the widest cell
//! (counted in terminal columns, so wide characters line up), numbers
//! right-aligned, no trailing spaces, and long cells cut at a per-column
//! limit with `…`.

use serde::Serialize;
use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};

/// `-o` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// Human-readable table.
    #[default]
    Table,
    /// Table without truncation of long cells.
    Wide,
    /// JSON (one document; `watch` prints one object per line).
    Json,
    /// YAML.
    Yaml,
}

/// Output could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("cannot encode JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot encode YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// Pretty JSON with a final newline.
pub fn to_json<T: Serialize>(value: &T) -> Result<String, OutputError> {
    let mut s = serde_json::to_string_pretty(value)?;
    s.push('\n');
    Ok(s)
}

/// YAML (serde_yaml ends it with a newline).
pub fn to_yaml<T: Serialize>(value: &T) -> Result<String, OutputError> {
    Ok(serde_yaml::to_string(value)?)
}

/// Column alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// One column: header, alignment, and an optional width limit (in
/// terminal columns) beyond which cells are cut with `…`.
#[derive(Debug, Clone)]
pub struct Column {
    pub header: String,
    pub align: Align,
    pub max_width: Option<usize>,
}

impl Column {
    /// A left-aligned column without limit.
    pub fn left(header: &str) -> Self {
        Column {
            header: header.to_string(),
            align: Align::Left,
            max_width: None,
        }
    }

    /// A right-aligned (numeric) column.
    pub fn right(header: &str) -> Self {
        Column {
            align: Align::Right,
            ..Column::left(header)
        }
    }

    /// Cut cells longer than `w` columns.
    pub fn max(mut self, w: usize) -> Self {
        self.max_width = Some(w);
        self
    }
}

/// A text table.
#[derive(Debug, Clone)]
pub struct Table {
    columns: Vec<Column>,
    rows: Vec<Vec<String>>,
    /// Ignore `max_width` (`-o wide`).
    pub wide: bool,
}

/// Separator between columns.
const GAP: &str = "   ";

impl Table {
    pub fn new(columns: Vec<Column>) -> Self {
        Table {
            columns,
            rows: Vec::new(),
            wide: false,
        }
    }

    /// Adds a row; missing cells are empty, extra cells are dropped.
    pub fn row(&mut self, mut cells: Vec<String>) {
        cells.resize(self.columns.len(), String::new());
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rendered table, one line per row after the header, each ending
    /// in a newline.
    pub fn render(&self) -> String {
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                r.iter()
                    .zip(&self.columns)
                    .map(|(c, col)| match col.max_width {
                        Some(w) if !self.wide => truncate(c, w),
                        _ => sanitize(c),
                    })
                    .collect()
            })
            .collect();
        let widths: Vec<usize> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, col)| {
                cells
                    .iter()
                    .map(|r| r[i].width())
                    .chain(std::iter::once(col.header.width()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let header: Vec<String> = self.columns.iter().map(|c| c.header.clone()).collect();
        for row in std::iter::once(&header).chain(cells.iter()) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str(GAP);
                }
                let pad = widths[i].saturating_sub(cell.width());
                match self.columns[i].align {
                    Align::Left => {
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        line.extend(std::iter::repeat_n(' ', pad));
                        line.push_str(cell);
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Replaces control characters (newlines, tabs, escapes) with spaces so
/// that one cell stays on one line and cannot drive the terminal.
pub fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Cuts `s` to at most `max` terminal columns, ending with `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    let s = sanitize(s);
    if s.width() <= max {
        return s;
    }
    if max == 0 {
        return String::new();
    }
    let mut out = String::new();
    let mut w = 0;
    for c in s.chars() {
        let cw = c.width().unwrap_or(0);
        if w + cw > max - 1 {
            break;
        }
        out.push(c);
        w += cw;
    }
    out.push('…');
    out
}

/// A compact duration: `850ms`, `42s`, `5m12s`, `3h4m`, `2d5h`.
pub fn human_duration_ms(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = ms / 1000;
    let (d, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        if h > 0 {
            format!("{d}d{h}h")
        } else {
            format!("{d}d")
        }
    } else if h > 0 {
        if m > 0 {
            format!("{h}h{m}m")
        } else {
            format!("{h}h")
        }
    } else if m > 0 {
        if sec > 0 {
            format!("{m}m{sec}s")
        } else {
            format!("{m}m")
        }
    } else {
        format!("{sec}s")
    }
}

/// An age: like [`human_duration_ms`] but in whole seconds (`0s` under a
/// second), as ages are read at a glance.
pub fn human_age_ms(ms: i64) -> String {
    if ms < 1000 {
        "0s".to_string()
    } else {
        human_duration_ms(ms)
    }
}

/// A size in bytes with a binary unit: `512MiB`, `1.5GiB`, `100B`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut v = bytes as f64;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else if (v - v.round()).abs() < 0.05 {
        format!("{:.0}{}", v.round(), UNITS[unit])
    } else {
        format!("{v:.1}{}", UNITS[unit])
    }
}

/// CPU ids as ranges: `0-3,8,10-11`. Sorts and removes duplicates.
pub fn cpu_list(cpus: &[u32]) -> String {
    let mut v = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let start = v[i];
        let mut end = start;
        while i + 1 < v.len() && v[i + 1] == end + 1 {
            i += 1;
            end = v[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// Unix milliseconds as `YYYY-MM-DD HH:MM:SSZ` (UTC; no time-zone
/// database needed).
pub fn utc_time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    format!(
        "{y:04}-{mo:02}-{d:02} {:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Joins a command line for display, single-quoting words a shell would
/// split or interpret.
pub fn shell_join(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            let plain = !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c));
            if plain {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns_and_trims() {
        let mut t = Table::new(vec![
            Column::left("ID"),
            Column::right("CPUS"),
            Column::left("REASON").max(10),
        ]);
        t.row(vec!["j-1".into(), "4".into(), "short".into()]);
        t.row(vec![
            "j-1000".into(),
            "128".into(),
            "a rather long reason".into(),
        ]);
        t.row(vec!["j-2".into(), "1".into(), String::new()]);
        let out = t.render();
        let expected = "\
ID       CPUS   REASON
j-1         4   short
j-1000    128   a rather …
j-2         1
";
        assert_eq!(out, expected);
        t.wide = true;
        assert!(t.render().contains("a rather long reason"));
    }

    #[test]
    fn truncation_counts_terminal_columns() {
        assert_eq!(truncate("abcdef", 6), "abcdef");
        assert_eq!(truncate("abcdefg", 6), "abcde…");
        assert_eq!(truncate("abc", 0), "");
        assert_eq!(truncate("line1\nline2", 20), "line1 line2");
        // CJK characters are two columns wide.
        assert_eq!(truncate("日本語テキスト", 7), "日本語…");
        let mut t = Table::new(vec![Column::left("NAME"), Column::left("X")]);
        t.row(vec!["日本".into(), "a".into()]);
        t.row(vec!["abcdef".into(), "b".into()]);
        assert_eq!(t.render(), "NAME     X\n日本     a\nabcdef   b\n");
    }

    #[test]
    fn durations_sizes_and_lists() {
        assert_eq!(human_duration_ms(-5), "0ms");
        assert_eq!(human_duration_ms(850), "850ms");
        assert_eq!(human_age_ms(850), "0s");
        assert_eq!(human_age_ms(61_000), "1m1s");
        assert_eq!(human_duration_ms(42_000), "42s");
        assert_eq!(human_duration_ms(312_000), "5m12s");
        assert_eq!(human_duration_ms(300_000), "5m");
        assert_eq!(
            human_duration_ms(3 * 3_600_000 + 4 * 60_000 + 5_000),
            "3h4m"
        );
        assert_eq!(human_duration_ms(2 * 86_400_000 + 5 * 3_600_000), "2d5h");
        assert_eq!(human_size(100), "100B");
        assert_eq!(human_size(512 << 20), "512MiB");
        assert_eq!(human_size(3 << 29), "1.5GiB");
        assert_eq!(cpu_list(&[]), "");
        assert_eq!(cpu_list(&[3, 0, 1, 2, 8, 11, 10]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[5]), "5");
    }

    #[test]
    fn utc_times() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00Z");
        assert_eq!(utc_time(951_782_400_000), "2000-02-29 00:00:00Z");
        assert_eq!(utc_time(1_767_225_599_999), "2025-12-31 23:59:59Z");
        assert_eq!(utc_time(-1000), "1969-12-31 23:59:59Z");
    }

    #[test]
    fn shell_quoting() {
        let w = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(shell_join(&w(&["echo", "hi"])), "echo hi");
        assert_eq!(
            shell_join(&w(&["sh", "-c", "echo $X; it's"])),
            r"sh -c 'echo $X; it'\''s'"
        );
        assert_eq!(shell_join(&w(&["a", ""])), "a ''");
    }
}
