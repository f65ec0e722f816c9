//! Hand-written SVG plots (no plotting crate): line charts (active nodes
//! over time, response-time CDFs on a log axis) and bar charts (one value
//! per policy). Output is a self-contained SVG document string.

use std::fmt::Write;

const W: f64 = 760.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;

const COLORS: [&str; 12] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939",
];

/// A named line.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// About five round tick values covering [lo, hi].
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    if hi <= lo || !hi.is_finite() || !lo.is_finite() {
        return vec![lo];
    }
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

fn label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e4).contains(&a) {
        format!("{v:.0e}")
    } else if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn head(out: &mut String, title: &str) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        esc(title)
    );
}

fn axes(out: &mut String, xlabel: &str, ylabel: &str) {
    let (x0, x1, y0, y1) = (LEFT, W - RIGHT, H - BOTTOM, TOP);
    let _ = writeln!(
        out,
        r#"<path d="M{x0} {y1} L{x0} {y0} L{x1} {y0}" stroke="black" fill="none"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (x0 + x1) / 2.0,
        H - 15.0,
        esc(xlabel)
    );
    let _ = writeln!(
        out,
        r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">{}</text>"#,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0,
        esc(ylabel)
    );
}

/// Keep at most `max` points, evenly spaced (first and last kept).
fn thin(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 2 {
        return points.to_vec();
    }
    let step = (points.len() - 1) as f64 / (max - 1) as f64;
    (0..max)
        .map(|i| points[((i as f64 * step).round() as usize).min(points.len() - 1)])
        .collect()
}

/// A line chart; with `log_x`, x values must be > 0 (others are dropped).
pub fn line_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[Series],
    log_x: bool,
) -> String {
    let fx = |x: f64| if log_x { x.log10() } else { x };
    let pts: Vec<Vec<(f64, f64)>> = series
        .iter()
        .map(|s| {
            let p: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!log_x || *x > 0.0))
                .map(|&(x, y)| (fx(x), y))
                .collect();
            thin(&p, 400)
        })
        .collect();
    let all = pts.iter().flatten();
    let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::MAX, f64::MIN, 0f64, f64::MIN);
    for &(x, y) in all {
        xmin = xmin.min(x);
        xmax = xmax.max(x);
        ymin = ymin.min(y);
        ymax = ymax.max(y);
    }
    if xmin > xmax {
        (xmin, xmax, ymax) = (0.0, 1.0, 1.0);
    }
    if xmax <= xmin {
        xmax = xmin + 1.0;
    }
    if ymax <= ymin {
        ymax = ymin + 1.0;
    }
    let (x0, x1, y0, y1) = (LEFT, W - RIGHT, H - BOTTOM, TOP);
    let sx = |x: f64| x0 + (x - xmin) / (xmax - xmin) * (x1 - x0);
    let sy = |y: f64| y0 - (y - ymin) / (ymax - ymin) * (y0 - y1);
    let mut out = String::new();
    head(&mut out, title);
    axes(&mut out, xlabel, ylabel);
    let xt = if log_x {
        (xmin.floor() as i32..=xmax.ceil() as i32)
            .map(f64::from)
            .filter(|t| *t >= xmin - 1e-9 && *t <= xmax + 1e-9)
            .collect()
    } else {
        ticks(xmin, xmax)
    };
    for t in xt {
        let x = sx(t);
        let text = if log_x {
            label(10f64.powf(t))
        } else {
            label(t)
        };
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{y1}" stroke="#e0e0e0"/><text x="{x:.1}" y="{}" text-anchor="middle">{text}</text>"##,
            y0 + 16.0
        );
    }
    for t in ticks(ymin, ymax) {
        let y = sy(t);
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            label(t)
        );
    }
    for (i, (s, p)) in series.iter().zip(&pts).enumerate() {
        let color = COLORS[i % COLORS.len()];
        if !p.is_empty() {
            let mut d = String::new();
            for (k, &(x, y)) in p.iter().enumerate() {
                let _ = write!(
                    d,
                    "{}{:.1} {:.1} ",
                    if k == 0 { 'M' } else { 'L' },
                    sx(x),
                    sy(y)
                );
            }
            let _ = writeln!(
                out,
                r#"<path d="{}" stroke="{color}" stroke-width="1.5" fill="none"/>"#,
                d.trim_end()
            );
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x1 + 12.0,
            x1 + 32.0,
            x1 + 38.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// A bar chart, one bar per label.
pub fn bar_chart(title: &str, ylabel: &str, bars: &[(String, f64)]) -> String {
    let ymax = bars
        .iter()
        .map(|b| b.1)
        .filter(|v| v.is_finite())
        .fold(0f64, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let (x0, x1, y0, y1) = (LEFT, W - RIGHT, H - BOTTOM, TOP);
    let sy = |y: f64| y0 - y / ymax * (y0 - y1);
    let mut out = String::new();
    head(&mut out, title);
    axes(&mut out, "", ylabel);
    for t in ticks(0.0, ymax) {
        let y = sy(t);
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            label(t)
        );
    }
    let n = bars.len().max(1) as f64;
    let slot = (x1 - x0) / n;
    for (i, (name, v)) in bars.iter().enumerate() {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        let x = x0 + slot * i as f64 + slot * 0.15;
        let y = sy(v);
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(
            out,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{color}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
            slot * 0.7,
            (y0 - y).max(0.0),
            x + slot * 0.35,
            y - 4.0,
            label(v)
        );
        let lx = x + slot * 0.35;
        let _ = writeln!(
            out,
            r#"<text x="{lx:.1}" y="{}" text-anchor="end" font-size="10" transform="rotate(-30 {lx:.1} {})">{}</text>"#,
            y0 + 14.0,
            y0 + 14.0,
            esc(name)
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed() {
        let s = vec![
            Series {
                name: "a<b".into(),
                points: (1..100).map(|i| (i as f64, (i * i) as f64)).collect(),
            },
            Series {
                name: "empty".into(),
                points: vec![],
            },
        ];
        for log in [false, true] {
            let svg = line_chart("t", "x", "y", &s, log);
            assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
            assert!(svg.contains("a&lt;b"));
            assert_eq!(svg.matches("<path").count(), 2, "axes + one line");
        }
        let bars = bar_chart("b", "y", &[("x".into(), 3.0), ("y".into(), f64::NAN)]);
        assert_eq!(bars.matches("<rect").count(), 3, "background + 2 bars");
    }

    #[test]
    fn round_ticks() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(thin(&[(0.0, 0.0); 10], 3).len(), 3);
    }
}
