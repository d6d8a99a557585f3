//! A run's loss curves as one self-contained SVG file: train loss per
//! step and eval loss at each evaluation, read back from the metrics file
//! so the chart shows what was logged, including the steps before a
//! resume. The SVG is written as text; no plotting library is needed to
//! make it or to view it.

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{ReportError, Result};
use crate::metrics::LossCurves;

/// Writes the loss chart of the metrics file `metrics` to `out`, through a
/// temporary file renamed over `out` so no reader sees half a chart.
pub fn write_loss_svg(metrics: &Path, out: &Path, title: &str) -> Result<()> {
    let curves = LossCurves::read_metrics(metrics)?;
    if curves.is_empty() {
        return Err(ReportError::NoLossValues {
            path: metrics.to_path_buf(),
        });
    }
    curves.write_svg(out, title)
}

impl LossCurves {
    /// Writes these curves' chart to `out` through a temporary file
    /// renamed over it.
    pub fn write_svg(&self, out: &Path, title: &str) -> Result<()> {
        crate::fs::write_atomic(out, loss_svg(self, title).as_bytes())
    }

    /// [`LossCurves::write_svg`] with the axis and curves named by
    /// `labels` ([`chart_svg`]).
    pub fn write_chart(&self, out: &Path, title: &str, labels: Labels) -> Result<()> {
        crate::fs::write_atomic(out, chart_svg(self, title, labels).as_bytes())
    }
}

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 56.0;
const TRAIN_COLOR: &str = "#1f77b4";
const EVAL_COLOR: &str = "#d62728";

/// One axis: data values `lo..hi` drawn at pixels `px_lo..px_hi` (for the
/// y axis `px_lo` is the bottom, so larger values are higher).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub px_lo: f64,
    pub px_hi: f64,
}

impl Axis {
    /// The pixel coordinate of data value `v`.
    pub fn px(&self, v: f64) -> f64 {
        self.px_lo + (v - self.lo) / (self.hi - self.lo) * (self.px_hi - self.px_lo)
    }

    /// The data value at pixel coordinate `p` (the inverse of `px`).
    #[cfg(test)]
    pub(crate) fn value_at(&self, p: f64) -> f64 {
        self.lo + (p - self.px_lo) / (self.px_hi - self.px_lo) * (self.hi - self.lo)
    }
}

/// Evenly spaced tick values, `step` apart.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Ticks {
    pub step: f64,
    pub values: Vec<f64>,
}

/// Ticks `1`, `2` or `5` times a power of ten apart, about `target` of
/// them, from a multiple of the step at or below `lo` to one at or above
/// `hi`, so the axis can end on labelled ticks. `integer` keeps the step at
/// 1 or more (steps are counted in whole numbers). Needs `lo < hi`, both
/// finite.
pub(crate) fn nice_ticks(lo: f64, hi: f64, target: usize, integer: bool) -> Ticks {
    let mut raw = (hi - lo) / target.max(1) as f64;
    if integer {
        raw = raw.max(1.0);
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let norm = raw / magnitude;
    let mantissa = if norm <= 1.0 + 1e-9 {
        1.0
    } else if norm <= 2.0 + 1e-9 {
        2.0
    } else if norm <= 5.0 + 1e-9 {
        5.0
    } else {
        10.0
    };
    let step = mantissa * magnitude;
    // The slack keeps a bound that is a multiple of the step up to rounding
    // (0.3 / 0.1 = 2.9999999999999996) from gaining a tick beyond it.
    let first = (lo / step + 1e-9).floor() as i64;
    let last = (hi / step - 1e-9).ceil() as i64;
    Ticks {
        step,
        values: (first..=last).map(|k| k as f64 * step).collect(),
    }
}

/// `lo..hi` widened where it is empty, so a single point or a flat line
/// still has a range to be drawn in.
fn padded(lo: f64, hi: f64, integer: bool) -> (f64, f64) {
    if hi > lo {
        (lo, hi)
    } else if integer {
        (lo - 1.0, hi + 1.0)
    } else {
        let pad = (lo.abs() * 0.05).max(1e-3);
        (lo - pad, hi + pad)
    }
}

/// The chart's axes, each ending on its first and last tick.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Frame {
    pub x: Axis,
    pub y: Axis,
    pub x_ticks: Ticks,
    pub y_ticks: Ticks,
}

/// The frame for `curves`' finite points (`0..1` both ways when there are
/// none); `loss_svg` draws through it, and tests map pixels back with it.
pub(crate) fn frame(curves: &LossCurves) -> Frame {
    let points = || finite(&curves.train).chain(finite(&curves.eval));
    let (mut x_lo, mut x_hi, mut y_lo, mut y_hi) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (s, v) in points() {
        x_lo = x_lo.min(s as f64);
        x_hi = x_hi.max(s as f64);
        y_lo = y_lo.min(v);
        y_hi = y_hi.max(v);
    }
    if points().next().is_none() {
        (x_lo, x_hi, y_lo, y_hi) = (0.0, 1.0, 0.0, 1.0);
    }
    let (x_lo, x_hi) = padded(x_lo, x_hi, true);
    let (y_lo, y_hi) = padded(y_lo, y_hi, false);
    let x_ticks = nice_ticks(x_lo, x_hi, 8, true);
    let y_ticks = nice_ticks(y_lo, y_hi, 6, false);
    let ends = |t: &Ticks| (t.values[0], t.values[t.values.len() - 1]);
    let (x0, x1) = ends(&x_ticks);
    let (y0, y1) = ends(&y_ticks);
    Frame {
        x: Axis {
            lo: x0,
            hi: x1,
            px_lo: LEFT,
            px_hi: WIDTH - RIGHT,
        },
        y: Axis {
            lo: y0,
            hi: y1,
            px_lo: HEIGHT - BOTTOM,
            px_hi: TOP,
        },
        x_ticks,
        y_ticks,
    }
}

/// The points of a curve that can be drawn.
fn finite(points: &[(i64, f64)]) -> impl Iterator<Item = (i64, f64)> + '_ {
    points.iter().copied().filter(|(_, v)| v.is_finite())
}

/// A tick label with as many decimals as the tick step needs.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()).max(0.0) as usize
    };
    // `-0.0` prints as "-0".
    let v = if v.abs() < step * 1e-6 { 0.0 } else { v };
    format!("{v:.decimals$}")
}

/// Text made safe for XML content and attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 allows no other control characters.
            c if c.is_control() && !matches!(c, '\t' | '\n' | '\r') => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// What a chart's axis and two curves are called.
#[derive(Clone, Copy, Debug)]
pub struct Labels<'a> {
    /// The y axis.
    pub y: &'a str,
    /// The first curve (`train`) and the second (`eval`).
    pub train: &'a str,
    pub eval: &'a str,
    /// A dot at each point of the second curve (evaluations are few).
    pub eval_markers: bool,
}

/// The loss chart's labels.
pub(crate) const LOSS: Labels<'static> = Labels {
    y: "loss",
    train: "train loss",
    eval: "eval loss",
    eval_markers: true,
};

/// The loss chart: an 800x480 SVG with ticked axes, the train loss as a
/// line (`<polyline class="train">`), the eval loss as a line with a dot at
/// each evaluation (`<polyline class="eval">`), a legend and `title`.
/// Non-finite values are left out.
pub fn loss_svg(curves: &LossCurves, title: &str) -> String {
    chart_svg(curves, title, LOSS)
}

/// [`loss_svg`]'s chart of any two curves, as `labels` names them (GRPO's
/// reward per step and its moving mean: `reward.svg`).
pub fn chart_svg(curves: &LossCurves, title: &str, labels: Labels) -> String {
    let f = frame(curves);
    let mut s = String::new();
    // Written in painting order: each part is drawn over the ones before.
    write_header(&mut s, &f, title);
    write_grid(&mut s, &f);
    write_tick_labels(&mut s, &f);
    write_axes(&mut s, &f, labels.y);
    let has_train = finite(&curves.train).next().is_some();
    let has_eval = finite(&curves.eval).next().is_some();
    if has_train {
        write_train_curve(&mut s, &f, &curves.train);
    }
    if has_eval {
        write_eval_curve(&mut s, &f, &curves.eval, labels.eval_markers);
    }
    if !has_train && !has_eval {
        write_no_values(&mut s, &f);
    }
    write_legend(&mut s, &f, &legend_entries(labels, has_train, has_eval));
    s.push_str("</svg>\n");
    s
}

// `write!` to a String cannot fail, so the helpers below drop its result.

/// The `<svg>` element's opening, a white background (viewers differ in
/// what they show through a transparent one) and the title above the plot.
fn write_header(s: &mut String, f: &Frame, title: &str) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.2}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
        (f.x.px_lo + f.x.px_hi) / 2.0,
        escape(title)
    );
}

/// A light line across the plot at every tick, so values can be read off
/// the middle of the chart, drawn first so the curves cover it.
fn write_grid(s: &mut String, f: &Frame) {
    let (left, right) = (f.x.px_lo, f.x.px_hi);
    let (bottom, top) = (f.y.px_lo, f.y.px_hi);
    let _ = writeln!(s, r##"<g class="grid" stroke="#e4e4e4" stroke-width="1">"##);
    for &v in &f.x_ticks.values {
        let x = f.x.px(v);
        let _ = writeln!(
            s,
            r#"<line x1="{x:.2}" y1="{top:.2}" x2="{x:.2}" y2="{bottom:.2}"/>"#
        );
    }
    for &v in &f.y_ticks.values {
        let y = f.y.px(v);
        let _ = writeln!(
            s,
            r#"<line x1="{left:.2}" y1="{y:.2}" x2="{right:.2}" y2="{y:.2}"/>"#
        );
    }
    let _ = writeln!(s, "</g>");
}

/// Each tick's value: the steps below the x axis, the values left of the
/// y axis, with only as many decimals as the tick step needs.
fn write_tick_labels(s: &mut String, f: &Frame) {
    let _ = writeln!(s, r##"<g class="ticks" fill="#333">"##);
    for &v in &f.x_ticks.values {
        let _ = writeln!(
            s,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
            f.x.px(v),
            f.y.px_lo + 18.0,
            tick_label(v, f.x_ticks.step)
        );
    }
    for &v in &f.y_ticks.values {
        let _ = writeln!(
            s,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"#,
            f.x.px_lo - 8.0,
            f.y.px(v) + 4.0,
            tick_label(v, f.y_ticks.step)
        );
    }
    let _ = writeln!(s, "</g>");
}

/// The two axes as one path along the plot's left and bottom edges, and
/// their names: `step` below, `y_label` turned upright on the left.
fn write_axes(s: &mut String, f: &Frame, y_label: &str) {
    let (left, right) = (f.x.px_lo, f.x.px_hi);
    let (bottom, top) = (f.y.px_lo, f.y.px_hi);
    let _ = writeln!(
        s,
        r##"<path class="axes" d="M{left:.2},{top:.2} V{bottom:.2} H{right:.2}" fill="none" stroke="#333" stroke-width="1"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.2}" y="{:.2}" text-anchor="middle">step</text>"#,
        (left + right) / 2.0,
        HEIGHT - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {:.2}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (top + bottom) / 2.0,
        escape(y_label)
    );
}

/// A curve's finite points in pixels, as a `<polyline>`'s `points` value.
fn polyline_points(f: &Frame, points: &[(i64, f64)]) -> String {
    finite(points)
        .map(|(x, y)| format!("{:.2},{:.2}", f.x.px(x as f64), f.y.px(y)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The first curve as a line, with a dot when it has a single point.
fn write_train_curve(s: &mut String, f: &Frame, train: &[(i64, f64)]) {
    let _ = writeln!(
        s,
        r#"<polyline class="train" points="{}" fill="none" stroke="{TRAIN_COLOR}" stroke-width="1.5" stroke-linejoin="round"/>"#,
        polyline_points(f, train)
    );
    // A line through one point draws nothing.
    if let [(x, y)] = finite(train).collect::<Vec<_>>()[..] {
        let _ = writeln!(
            s,
            r#"<circle class="train-marker" cx="{:.2}" cy="{:.2}" r="3" fill="{TRAIN_COLOR}"/>"#,
            f.x.px(x as f64),
            f.y.px(y)
        );
    }
}

/// The second curve as a line and, when `markers`, a dot at each point
/// (evaluations are few enough to mark; the dots' group is written
/// either way).
fn write_eval_curve(s: &mut String, f: &Frame, eval: &[(i64, f64)], markers: bool) {
    let _ = writeln!(
        s,
        r#"<polyline class="eval" points="{}" fill="none" stroke="{EVAL_COLOR}" stroke-width="1.5" stroke-linejoin="round"/>"#,
        polyline_points(f, eval)
    );
    let _ = writeln!(s, r#"<g class="eval-markers" fill="{EVAL_COLOR}">"#);
    for (x, y) in finite(eval).filter(|_| markers) {
        let _ = writeln!(
            s,
            r#"<circle cx="{:.2}" cy="{:.2}" r="3"/>"#,
            f.x.px(x as f64),
            f.y.px(y)
        );
    }
    let _ = writeln!(s, "</g>");
}

/// A note in the middle of the plot, so an empty chart does not look like
/// a broken one.
fn write_no_values(s: &mut String, f: &Frame) {
    let _ = writeln!(
        s,
        r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#888">no finite loss values</text>"##,
        (f.x.px_lo + f.x.px_hi) / 2.0,
        (f.y.px_lo + f.y.px_hi) / 2.0
    );
}

/// One line of the legend: a curve's name, its color and whether its
/// points are marked with dots.
struct LegendEntry<'a> {
    name: &'a str,
    color: &'a str,
    marker: bool,
}

/// The legend's lines: only the curves that were drawn.
fn legend_entries<'a>(labels: Labels<'a>, has_train: bool, has_eval: bool) -> Vec<LegendEntry<'a>> {
    let train = LegendEntry {
        name: labels.train,
        color: TRAIN_COLOR,
        marker: false,
    };
    let eval = LegendEntry {
        name: labels.eval,
        color: EVAL_COLOR,
        marker: labels.eval_markers,
    };
    [(train, has_train), (eval, has_eval)]
        .into_iter()
        .filter_map(|(entry, shown)| shown.then_some(entry))
        .collect()
}

/// The legend, in the top right corner where falling losses leave room,
/// sized to its longest name; nothing when no curve was drawn.
fn write_legend(s: &mut String, f: &Frame, entries: &[LegendEntry]) {
    if entries.is_empty() {
        return;
    }
    let longest = entries
        .iter()
        .map(|e| e.name.chars().count())
        .max()
        .unwrap_or(0);
    let w = (48.0 + 7.0 * longest as f64).max(110.0);
    let h = 8.0 + 18.0 * entries.len() as f64;
    let (x0, y0) = (f.x.px_hi - w - 8.0, f.y.px_hi + 8.0);
    let _ = writeln!(s, r#"<g class="legend">"#);
    let _ = writeln!(
        s,
        r##"<rect x="{x0:.2}" y="{y0:.2}" width="{w}" height="{h}" fill="white" fill-opacity="0.85" stroke="#ccc"/>"##
    );
    for (i, e) in entries.iter().enumerate() {
        let y = y0 + 13.0 + 18.0 * i as f64;
        let color = e.color;
        let _ = writeln!(
            s,
            r#"<line x1="{:.2}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}" stroke="{color}" stroke-width="1.5"/>"#,
            x0 + 8.0,
            x0 + 32.0
        );
        if e.marker {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.2}" cy="{y:.2}" r="3" fill="{color}"/>"#,
                x0 + 20.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.2}" y="{:.2}">{}</text>"#,
            x0 + 40.0,
            y + 4.0,
            escape(e.name)
        );
    }
    let _ = writeln!(s, "</g>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_metrics_file_is_an_error_and_no_file_is_written() {
        let dir = crate::temp_dir("empty");
        let metrics = dir.join("empty.jsonl");
        std::fs::write(&metrics, "{\"step\":1,\"lr\":0.1}\n").unwrap();
        let out = dir.join("empty.svg");
        let err = write_loss_svg(&metrics, &out, "t").unwrap_err();
        assert!(
            matches!(&err, ReportError::NoLossValues { path } if *path == metrics),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with(&format!("{} holds no loss values", metrics.display())),
            "{err}"
        );
        assert!(!out.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ticks_are_one_two_five_steps_covering_the_range() {
        let t = nice_ticks(0.0, 1.0, 5, false);
        assert_eq!(t.step, 0.2);
        assert_eq!(t.values.len(), 6);
        assert!((t.values[5] - 1.0).abs() < 1e-12);
        let t = nice_ticks(1.83, 3.41, 6, false);
        assert_eq!(t.step, 0.5);
        assert_eq!(t.values, vec![1.5, 2.0, 2.5, 3.0, 3.5]);
        let t = nice_ticks(1.0, 30.0, 8, true);
        assert_eq!(t.step, 5.0);
        assert_eq!(t.values, vec![0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0]);
        assert_eq!(nice_ticks(3.0, 5.0, 8, true).values, vec![3.0, 4.0, 5.0]);
        assert_eq!(nice_ticks(0.3, 0.7, 4, false).values.len(), 5);
        for (lo, hi) in [
            (0.0, 7.3),
            (2.31, 2.32),
            (-4.0, 1e-3),
            (1e-7, 3e-7),
            (12.0, 99_999.0),
            (0.93, 11.2),
        ] {
            for target in [3, 6, 8] {
                let t = nice_ticks(lo, hi, target, false);
                let mantissa = t.step / 10f64.powf(t.step.log10().floor());
                assert!(
                    [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
                    "{lo}..{hi}: step {}",
                    t.step
                );
                let eps = t.step * 1e-6;
                assert!(t.values[0] <= lo + eps && *t.values.last().unwrap() >= hi - eps);
                assert!(t.values[0] > lo - t.step - eps, "{lo}..{hi}: {t:?}");
                assert!(t.values.len() >= 2 && t.values.len() <= target + 2, "{t:?}");
                for w in t.values.windows(2) {
                    assert!((w[1] - w[0] - t.step).abs() < eps);
                }
            }
        }
    }

    /// The `points` of the polyline with `class`.
    fn polyline_points(svg: &str, class: &str) -> Vec<(f64, f64)> {
        let start = svg
            .find(&format!(r#"<polyline class="{class}" points=""#))
            .unwrap_or_else(|| panic!("no {class} polyline"));
        let rest = &svg[start..];
        let rest = &rest[rest.find("points=\"").unwrap() + 8..];
        rest[..rest.find('"').unwrap()]
            .split(' ')
            .map(|p| {
                let (x, y) = p.split_once(',').unwrap();
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect()
    }

    /// Checks that every element is closed in order, the way an XML parser
    /// would, and that `&` only starts an entity.
    fn assert_well_formed(svg: &str) {
        let mut open = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find('<') {
            let text = &rest[..i];
            for (j, _) in text.match_indices('&') {
                let entity = &text[j..];
                assert!(
                    ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                        .iter()
                        .any(|e| entity.starts_with(e)),
                    "bare & in {text:?}"
                );
            }
            let end = rest[i..].find('>').unwrap() + i;
            let tag = &rest[i + 1..end];
            assert!(!tag.contains('<'), "{tag}");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name.trim().to_string()));
            } else if !tag.ends_with('/') {
                let name = tag.split_whitespace().next().unwrap().to_string();
                open.push(name);
            }
            if open.is_empty() {
                assert!(rest[end + 1..].trim().is_empty(), "content after the root");
            }
            rest = &rest[end + 1..];
        }
        assert!(open.is_empty(), "unclosed {open:?}");
    }

    #[test]
    fn svg_draws_the_points_where_the_axes_say() {
        let curves = LossCurves {
            train: vec![(1, 4.0), (2, f64::NAN), (3, 3.1), (10, 2.2), (30, 1.9)],
            eval: vec![(10, 2.6), (20, f64::INFINITY), (30, 2.1)],
        };
        let svg = loss_svg(&curves, "tiny <lora> & \"demo\"");
        assert_well_formed(&svg);
        assert!(svg.contains("tiny &lt;lora&gt; &amp; &quot;demo&quot;"));
        assert!(svg.contains(">train loss<") && svg.contains(">eval loss<"));
        assert!(svg.contains(">step<") && svg.contains(">loss<"));
        let f = frame(&curves);
        // Steps 0..30 in fives; losses 1.9..4.0 in halves, to 1.5..4.0.
        assert_eq!((f.x.lo, f.x.hi, f.x_ticks.step), (0.0, 30.0, 5.0));
        assert_eq!((f.y.lo, f.y.hi, f.y_ticks.step), (1.5, 4.0, 0.5));
        assert_eq!((f.x.px_lo, f.x.px_hi), (LEFT, WIDTH - RIGHT));
        // Step 1 is 1/30 of the way along 704 pixels; loss 4.0 is the top.
        let train = polyline_points(&svg, "train");
        assert_eq!(train.len(), 4);
        assert_eq!(train[0], (95.47, TOP));
        assert_eq!(train[3], (WIDTH - RIGHT, 363.84));
        let eval = polyline_points(&svg, "eval");
        assert_eq!(eval.len(), 2);
        // Two decimals of a pixel are well within 0.01 of a step or loss.
        for ((px, py), (step, loss)) in [
            (train[0], (1.0, 4.0)),
            (train[1], (3.0, 3.1)),
            (train[3], (30.0, 1.9)),
            (eval[0], (10.0, 2.6)),
            (eval[1], (30.0, 2.1)),
        ] {
            assert!((f.x.value_at(px) - step).abs() < 1e-3, "{px} {step}");
            assert!((f.y.value_at(py) - loss).abs() < 1e-3, "{py} {loss}");
        }
        assert_eq!(svg.matches("<circle ").count(), 2 + 1); // + the legend's
    }

    #[test]
    fn one_point_or_a_flat_line_has_a_range() {
        let one = LossCurves {
            train: vec![(5, 2.0)],
            eval: vec![],
        };
        let f = frame(&one);
        assert!(f.x.lo < 5.0 && f.x.hi > 5.0, "{f:?}");
        assert!(f.y.lo < 2.0 && f.y.hi > 2.0, "{f:?}");
        let svg = loss_svg(&one, "one");
        assert_well_formed(&svg);
        let p = polyline_points(&svg, "train");
        assert_eq!(p.len(), 1);
        let marker = format!(
            r#"<circle class="train-marker" cx="{:.2}" cy="{:.2}""#,
            p[0].0, p[0].1
        );
        assert!(svg.contains(&marker), "{svg}");
        assert!((f.x.value_at(p[0].0) - 5.0).abs() < 1e-3);
        assert!(!svg.contains("class=\"eval\"") && !svg.contains("eval loss"));

        let flat = LossCurves {
            train: vec![(0, 0.0), (100, 0.0)],
            eval: vec![],
        };
        let f = frame(&flat);
        assert!(
            f.y.lo < 0.0 && f.y.hi > 0.0 && f.y.hi - f.y.lo < 0.01,
            "{f:?}"
        );
        let svg = loss_svg(&flat, "flat");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));

        let none = LossCurves {
            train: vec![(1, f64::NAN)],
            eval: vec![],
        };
        let svg = loss_svg(&none, "none");
        assert_well_formed(&svg);
        assert!(svg.contains("no finite loss values") && !svg.contains("<polyline"));
    }

    #[test]
    fn write_loss_svg_writes_the_chart() {
        let dir = crate::temp_dir("write");
        let metrics = dir.join("run.jsonl");
        std::fs::write(
            &metrics,
            "{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"loss\":1.0}\n{\"step\":2,\"eval_loss\":1.5}\n",
        )
        .unwrap();
        let out = dir.join("run.svg");
        write_loss_svg(&metrics, &out, "run").unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert_eq!(
            svg,
            loss_svg(&LossCurves::read_metrics(&metrics).unwrap(), "run")
        );
        assert_eq!(polyline_points(&svg, "train").len(), 2);
        assert_eq!(polyline_points(&svg, "eval").len(), 1);
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        // No temporary file is left beside the chart.
        assert_eq!(names, ["run.jsonl", "run.svg"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
