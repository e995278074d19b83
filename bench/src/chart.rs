//! The shareable chart of one workload (`chart.png`, [`WIDTH`] × [`HEIGHT`] px): per policy, the
//! engine-side prefix hit rate with the oracle bound as a labelled dashed line, and TTFT p50/p99
//! (the engines' simulated TTFT plus the real latency the gateway path added) as horizontal bars,
//! with labelled, ticked axes, one legend and the `kv` verdict as headline.
//!
//! Text is DejaVu Sans (Debian's `fonts-dejavu-core`), found through fontconfig (`fc-match`) or
//! `$LOXI_BENCH_FONT`, and rasterised by `ab_glyph` through plotters. Without a usable font the
//! chart is refused with [`ChartError::FontMissing`] or [`ChartError::BadFont`], never drawn
//! without its text; `bench-routing` checks this before it runs anything ([`locate_font`]).

use super::report::{PolicyResult, verdict};
use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Chart width, px.
pub const WIDTH: u32 = 1600;
/// Chart height, px.
pub const HEIGHT: u32 = 900;
/// The legend strip `(x0, y0, x1, y1)`, px: one row of swatches under the headline.
pub const LEGEND: (i32, i32, i32, i32) = (40, 112, 1560, 146);
/// Environment variable naming a TrueType/OpenType file to use instead of DejaVu Sans.
pub const FONT_ENV: &str = "LOXI_BENCH_FONT";
/// Where Debian's `fonts-dejavu-core` puts DejaVu Sans (used when `fc-match` is absent).
pub const DEBIAN_DEJAVU: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

const HIT: RGBColor = RGBColor(0, 137, 123);
const ORACLE: RGBColor = RGBColor(216, 67, 21);
const P50: RGBColor = RGBColor(144, 185, 238);
const P99: RGBColor = RGBColor(21, 76, 154);
const GRID: RGBColor = RGBColor(225, 225, 225);
const MUTED: RGBColor = RGBColor(90, 90, 90);

/// Why the chart was not drawn.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// No font file found; the text says where it was looked for.
    #[error(
        "chart: no font ({0}); install Debian's fonts-dejavu-core (scripts/setup.sh does) or set {FONT_ENV}=/path/to/font.ttf"
    )]
    FontMissing(String),
    /// The file exists but is not a font ab_glyph can read.
    #[error("chart: {}: {reason}", path.display())]
    BadFont {
        /// The font file.
        path: PathBuf,
        /// Read error, or "not a TrueType/OpenType font".
        reason: String,
    },
    /// Drawing or writing the PNG failed.
    #[error("chart: {}: {msg}", path.display())]
    Draw {
        /// The PNG (or `<buffer>`).
        path: PathBuf,
        /// The backend's error.
        msg: String,
    },
}

/// The font file for the chart: `$LOXI_BENCH_FONT` when set (it must be a file), else the file
/// fontconfig resolves for "DejaVu Sans" (`fc-match`; a substitute family is not accepted), else
/// [`DEBIAN_DEJAVU`]. Errors with [`ChartError::FontMissing`] naming what was tried.
pub fn locate_font() -> Result<PathBuf, ChartError> {
    locate(
        std::env::var_os(FONT_ENV).map(PathBuf::from),
        fc_match,
        Path::new(DEBIAN_DEJAVU),
    )
}

/// [`locate_font`] with its inputs: the override, the fontconfig lookup and the fixed path.
fn locate(
    env: Option<PathBuf>,
    fc: fn(&str) -> Option<PathBuf>,
    debian: &Path,
) -> Result<PathBuf, ChartError> {
    if let Some(p) = env {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(ChartError::FontMissing(format!(
                "{FONT_ENV}={} is not a file",
                p.display()
            )))
        };
    }
    if let Some(p) = fc("DejaVu Sans") {
        return Ok(p);
    }
    if debian.is_file() {
        return Ok(debian.to_path_buf());
    }
    Err(ChartError::FontMissing(format!(
        "fc-match has no \"DejaVu Sans\" and {} is missing",
        debian.display()
    )))
}

/// fontconfig's file for `family`, when fontconfig knows that family itself (not a substitute).
fn fc_match(family: &str) -> Option<PathBuf> {
    let out = std::process::Command::new("fc-match")
        .arg("--format=%{family}\n%{file}")
        .arg(family)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let (families, file) = text.split_once('\n')?;
    let known = families.split(',').any(|f| f.trim() == family);
    let file = PathBuf::from(file.trim());
    (out.status.success() && known && file.is_file()).then_some(file)
}

/// Registers the font at `path` with plotters (once per path per process; the bytes stay
/// loaded for the life of the process) and returns its family name.
fn register(path: &Path) -> Result<&'static str, ChartError> {
    static FAMILIES: Mutex<Option<HashMap<PathBuf, &'static str>>> = Mutex::new(None);
    let mut map = FAMILIES.lock().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(f) = map.get(path) {
        return Ok(f);
    }
    let bytes = std::fs::read(path).map_err(|e| ChartError::BadFont {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let family: &'static str = Box::leak(format!("loxi-chart-{}", map.len()).into_boxed_str());
    plotters::style::register_font(
        family,
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| ChartError::BadFont {
        path: path.to_path_buf(),
        reason: "not a TrueType/OpenType font".into(),
    })?;
    map.insert(path.to_path_buf(), family);
    Ok(family)
}

/// Draws the chart for one workload into `path` (PNG, [`WIDTH`] × [`HEIGHT`]) with the font
/// from [`locate_font`]. `title` names the workload; `oracle` is the bound (0..1). Failed
/// policies keep their row, marked "failed".
pub fn draw(
    path: &Path,
    title: &str,
    results: &[PolicyResult],
    oracle: Option<f64>,
) -> Result<(), ChartError> {
    draw_with_font(path, &locate_font()?, title, results, oracle)
}

/// [`draw`] with an explicit font file.
pub fn draw_with_font(
    path: &Path,
    font: &Path,
    title: &str,
    results: &[PolicyResult],
    oracle: Option<f64>,
) -> Result<(), ChartError> {
    let family = register(font)?;
    let err = |msg: String| ChartError::Draw {
        path: path.to_path_buf(),
        msg,
    };
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    paint(&root, family, title, results, oracle).map_err(err)?;
    root.present().map_err(|e| err(e.to_string()))
}

/// Draws the chart into an RGB buffer of `WIDTH × HEIGHT × 3` bytes (what [`draw`] encodes).
pub fn render_rgb(
    buf: &mut [u8],
    font: &Path,
    title: &str,
    results: &[PolicyResult],
    oracle: Option<f64>,
) -> Result<(), ChartError> {
    let family = register(font)?;
    let err = |msg: String| ChartError::Draw {
        path: PathBuf::from("<buffer>"),
        msg,
    };
    let root = BitMapBackend::with_buffer(buf, (WIDTH, HEIGHT)).into_drawing_area();
    paint(&root, family, title, results, oracle).map_err(err)?;
    root.present().map_err(|e| err(e.to_string()))
}

type Res = Result<(), String>;

fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

fn paint<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    family: &'static str,
    title: &str,
    results: &[PolicyResult],
    oracle: Option<f64>,
) -> Res {
    let font = |size: i32| (family, size).into_font();
    root.fill(&WHITE).map_err(e)?;
    let workers = results
        .iter()
        .map(|r| r.requests_per_worker.len())
        .max()
        .unwrap_or(0);
    let requests = results.iter().map(|r| r.requests).max().unwrap_or(0);
    let heading = format!(
        "{title}: {} requests over {workers} workers, per routing policy",
        thousands(requests as f64)
    );
    root.draw(&Text::new(heading, (40, 22), font(32).color(&BLACK)))
        .map_err(e)?;
    let baseline = results
        .iter()
        .find(|r| r.policy == "rr" && r.error.is_none());
    let headline = results
        .iter()
        .find(|r| r.policy == "kv")
        .map(|kv| verdict(kv, baseline, oracle))
        .unwrap_or_else(|| "no kv policy in this run".into());
    root.draw(&Text::new(headline, (40, 70), font(22).color(&P99)))
        .map_err(e)?;
    legend(root, &font)?;
    let body = root.margin(160, 70, 20, 30);
    let (left, right) = body.split_horizontally(700);
    hit_panel(root, &left, &font, results, oracle)?;
    ttft_panel(&right, &font, results)?;
    let foot = [
        "TTFT = the engine's simulated time to first token (queueing + prefill of the uncached tokens) + the real latency the gateway path added (vllm-sim's x-sim-* timestamps).",
        "Hit rate = engine-side Δprefix_cache_hits / Δprefix_cache_queries (tokens). Oracle = one LRU cache with the whole fleet's capacity and ideal placement (the bound for LRU engines).",
    ];
    for (i, line) in foot.iter().enumerate() {
        root.draw(&Text::new(
            *line,
            (40, HEIGHT as i32 - 56 + 24 * i as i32),
            font(15).color(&MUTED),
        ))
        .map_err(e)?;
    }
    Ok(())
}

/// One row of swatches inside [`LEGEND`].
fn legend<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    font: &dyn Fn(i32) -> FontDesc<'static>,
) -> Res {
    let (x0, y0, _, y1) = LEGEND;
    let mid = (y0 + y1) / 2;
    let style = font(18)
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let mut x = x0;
    let items: [(&str, Option<RGBColor>); 4] = [
        ("prefix hit rate (engine-side)", Some(HIT)),
        ("oracle bound", None),
        ("TTFT p50", Some(P50)),
        ("TTFT p99", Some(P99)),
    ];
    for (label, fill) in items {
        match fill {
            Some(c) => root
                .draw(&Rectangle::new(
                    [(x, mid - 9), (x + 28, mid + 9)],
                    c.filled(),
                ))
                .map_err(e)?,
            None => dashed(root, (x, mid), (x + 28, mid), ORACLE.stroke_width(3))?,
        }
        root.draw(&Text::new(label, (x + 38, mid), style.clone()))
            .map_err(e)?;
        let (w, _) = root.estimate_text_size(label, &style).map_err(e)?;
        x += 38 + w as i32 + 48;
    }
    Ok(())
}

/// A dashed straight line from `a` to `b` in pixels (8 px dashes, 6 px gaps).
fn dashed<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    a: (i32, i32),
    b: (i32, i32),
    style: ShapeStyle,
) -> Res {
    let (dx, dy) = ((b.0 - a.0) as f64, (b.1 - a.1) as f64);
    let len = dx.hypot(dy).max(1.0);
    let mut t = 0.0;
    while t < len {
        let t1 = (t + 8.0).min(len);
        let p = |t: f64| {
            (
                a.0 + (dx * t / len).round() as i32,
                a.1 + (dy * t / len).round() as i32,
            )
        };
        area.draw(&PathElement::new(vec![p(t), p(t1)], style))
            .map_err(e)?;
        t += 14.0;
    }
    Ok(())
}

/// A linear axis from `lo` to `hi` with ticks exactly at `ticks` (plotters' own f64 axis picks
/// its ticks and has no default label formatting).
#[derive(Debug, Clone)]
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let t = (v - self.lo) / (self.hi - self.lo).max(f64::MIN_POSITIVE);
        limit.0 + (t * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

/// The policy axis for `n` rows: row `i` centred at `i`, with 0.7 rows of headroom on top.
fn rows_axis(n: usize) -> Axis {
    Axis {
        lo: -0.5,
        hi: n as f64 - 0.5 + 0.7,
        ticks: (0..n).map(|i| i as f64).collect(),
    }
}

/// Row centre of policy `i` of `n` (first policy on top).
/// The label of a policy row with no value to draw.
fn unmeasured(r: &PolicyResult) -> &'static str {
    if r.error.is_some() {
        "failed (see results.md)"
    } else {
        "not measured"
    }
}

/// Draws a panel's grid, its x-axis description and ticks (`fmt_x`) and the policy names on
/// the rows (`names`, top to bottom).
fn mesh<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<Axis, Axis>>,
    desc: &str,
    fmt_x: &dyn Fn(&f64) -> String,
    names: &[String],
    tick: &TextStyle,
    font: &dyn Fn(i32) -> FontDesc<'static>,
) -> Res {
    let n = names.len().max(1);
    let label = |y: &f64| {
        let i = n as i64 - 1 - y.round() as i64;
        names.get(i as usize).cloned().unwrap_or_default()
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .x_desc(desc)
        .x_label_formatter(fmt_x)
        .y_label_formatter(&label)
        .label_style(tick.clone())
        .axis_desc_style(font(18))
        .draw()
        .map_err(e)
}

fn row(i: usize, n: usize) -> f64 {
    (n - 1 - i) as f64
}

fn names(results: &[PolicyResult]) -> Vec<String> {
    results.iter().map(|r| r.policy.clone()).collect()
}

/// Width of the policy-name axis: the longest name plus room for the tick.
fn name_axis_px<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    style: &TextStyle<'_>,
    names: &[String],
) -> Result<u32, String> {
    let mut w = 0;
    for n in names {
        w = w.max(area.estimate_text_size(n, style).map_err(e)?.0);
    }
    Ok(w + 16)
}

/// The hit-rate panel in `area`; `root` (the whole canvas, absolute pixels) takes the oracle
/// line, which is placed from the chart's absolute coordinates.
fn hit_panel<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    area: &DrawingArea<DB, Shift>,
    font: &dyn Fn(i32) -> FontDesc<'static>,
    results: &[PolicyResult],
    oracle: Option<f64>,
) -> Res {
    let n = results.len().max(1);
    let names = names(results);
    let tick = font(16).color(&BLACK);
    let name_px = name_axis_px(area, &tick, &names)?;
    let mut chart = ChartBuilder::on(area)
        .caption("Prefix cache hit rate", font(24))
        .margin_right(30)
        .x_label_area_size(60)
        .y_label_area_size(name_px)
        .build_cartesian_2d(
            Axis {
                lo: 0.0,
                hi: 100.0,
                ticks: (0..=10).map(|k| f64::from(k) * 10.0).collect(),
            },
            rows_axis(n),
        )
        .map_err(e)?;
    mesh(
        &mut chart,
        "hit rate, % of prompt tokens served from cache",
        &|v| format!("{v:.0}"),
        &names,
        &tick,
        font,
    )?;
    let inside = font(16)
        .color(&WHITE)
        .pos(Pos::new(HPos::Right, VPos::Center));
    let outside = font(16)
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (i, r) in results.iter().enumerate() {
        let y = row(i, n);
        let Some(h) = r.prefix_hit_rate.filter(|_| r.error.is_none()) else {
            let why = unmeasured(r);
            chart
                .draw_series([EmptyElement::at((0.0, y)) + Text::new(why, (8, 0), outside.clone())])
                .map_err(e)?;
            continue;
        };
        let v = h * 100.0;
        chart
            .draw_series([Rectangle::new(
                [(0.0, y - 0.32), (v, y + 0.32)],
                HIT.filled(),
            )])
            .map_err(e)?;
        let text = format!("{v:.1} %");
        let bar_px = chart.backend_coord(&(v, y)).0 - chart.backend_coord(&(0.0, y)).0;
        let text_px = area.estimate_text_size(&text, &inside).map_err(e)?.0 as i32;
        let element = if bar_px > text_px + 16 {
            EmptyElement::at((v, y)) + Text::new(text, (-8, 0), inside.clone())
        } else {
            EmptyElement::at((v, y)) + Text::new(text, (8, 0), outside.clone())
        };
        chart.draw_series([element]).map_err(e)?;
    }
    if let Some(o) = oracle {
        let v = o * 100.0;
        let top = chart.backend_coord(&(v, n as f64 - 0.5 + 0.7));
        let bottom = chart.backend_coord(&(v, -0.5));
        dashed(root, top, bottom, ORACLE.stroke_width(3))?;
        let style = font(17)
            .color(&ORACLE)
            .pos(Pos::new(HPos::Right, VPos::Top));
        root.draw(&Text::new(
            format!("oracle bound {v:.1} %"),
            (top.0 - 8, top.1 + 4),
            style,
        ))
        .map_err(e)?;
    }
    Ok(())
}

/// How TTFT values map to the panel's x axis: `log10(ms)` when they span more than 20×, else ms.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Scale {
    log: bool,
    /// Axis range in axis units.
    lo: f64,
    hi: f64,
}

impl Scale {
    /// The scale for values between `min` and `max` ms (both > 0), with room on the right for
    /// the value labels.
    fn fit(min: f64, max: f64) -> Self {
        let (min, max) = (min.max(0.1), max.max(min.max(0.1)));
        if max / min > 20.0 {
            let lo = min.log10().floor();
            let hi = max.log10() + 0.12 * (max.log10() - lo).max(1.0);
            Self { log: true, lo, hi }
        } else {
            Self {
                log: false,
                lo: 0.0,
                hi: max * 1.18,
            }
        }
    }

    fn x(&self, ms: f64) -> f64 {
        if self.log { ms.max(1e-3).log10() } else { ms }
    }

    fn ms(&self, x: f64) -> f64 {
        if self.log { 10f64.powf(x) } else { x }
    }

    /// Tick positions (axis units): decades, with 2× and 5× when the axis spans at most three
    /// decades; on a linear axis, steps of 1, 2 or 5 × 10^k, about six of them.
    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let span = self.hi - self.lo;
            let mut out = Vec::new();
            let mut d = self.lo.floor() as i32;
            while (d as f64) <= self.hi {
                for m in [1.0, 2.0, 5.0] {
                    if m > 1.0 && span > 3.2 {
                        continue;
                    }
                    let x = d as f64 + f64::log10(m);
                    if x >= self.lo - 1e-9 && x <= self.hi + 1e-9 {
                        out.push(x);
                    }
                }
                d += 1;
            }
            out
        } else {
            let raw = self.hi / 6.0;
            let mag = 10f64.powf(raw.log10().floor());
            let step = [1.0, 2.0, 5.0, 10.0]
                .iter()
                .map(|m| m * mag)
                .find(|s| *s >= raw)
                .unwrap_or(10.0 * mag);
            (0..)
                .map(|k| k as f64 * step)
                .take_while(|x| *x <= self.hi + 1e-9)
                .collect()
        }
    }
}

/// `ms` for a value label: thousands separators, one decimal below 10.
fn fmt_ms(ms: f64) -> String {
    if ms < 10.0 {
        return format!("{ms:.1}");
    }
    thousands(ms)
}

/// `x` rounded to an integer, with thousands separators.
fn thousands(x: f64) -> String {
    let digits = format!("{x:.0}");
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ttft_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    font: &dyn Fn(i32) -> FontDesc<'static>,
    results: &[PolicyResult],
) -> Res {
    let n = results.len().max(1);
    let names = names(results);
    let ok: Vec<_> = results
        .iter()
        .filter(|r| r.error.is_none())
        .filter_map(|r| r.ttft_ms)
        .collect();
    let min = ok.iter().map(|q| q.p50).fold(f64::INFINITY, f64::min);
    let max = ok.iter().map(|q| q.p99).fold(0.0, f64::max);
    let scale = if ok.is_empty() {
        Scale::fit(1.0, 100.0)
    } else {
        Scale::fit(min, max)
    };
    let tick = font(16).color(&BLACK);
    let name_px = name_axis_px(area, &tick, &names)?;
    let mut chart = ChartBuilder::on(area)
        .caption("Time to first token", font(24))
        .margin_left(30)
        .margin_right(20)
        .x_label_area_size(60)
        .y_label_area_size(name_px)
        .build_cartesian_2d(
            Axis {
                lo: scale.lo,
                hi: scale.hi,
                ticks: scale.ticks(),
            },
            rows_axis(n),
        )
        .map_err(e)?;
    let fmt_tick = |x: &f64| fmt_ms(scale.ms(*x));
    let desc = if scale.log {
        "TTFT, ms (log scale), including the gateway's added latency"
    } else {
        "TTFT, ms, including the gateway's added latency"
    };
    mesh(&mut chart, desc, &fmt_tick, &names, &tick, font)?;
    let value = font(15)
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (i, r) in results.iter().enumerate() {
        let y = row(i, n);
        let Some(q) = r.ttft_ms.filter(|_| r.error.is_none()) else {
            let why = unmeasured(r);
            chart
                .draw_series([
                    EmptyElement::at((scale.lo, y)) + Text::new(why, (8, 0), value.clone())
                ])
                .map_err(e)?;
            continue;
        };
        for (v, color, dy) in [(q.p50, P50, 0.17), (q.p99, P99, -0.17)] {
            let x = scale.x(v).clamp(scale.lo, scale.hi);
            chart
                .draw_series([Rectangle::new(
                    [(scale.lo, y + dy - 0.15), (x, y + dy + 0.15)],
                    color.filled(),
                )])
                .map_err(e)?;
            chart
                .draw_series([
                    EmptyElement::at((x, y + dy)) + Text::new(fmt_ms(v), (6, 0), value.clone())
                ])
                .map_err(e)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Quantiles;

    fn font() -> PathBuf {
        locate_font().expect("DejaVu Sans (fonts-dejavu-core, installed by scripts/setup.sh)")
    }

    fn result(policy: &str, hit: f64, p50: f64, p99: f64) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            requests: 1200,
            ok: 1200,
            prefix_hit_rate: Some(hit),
            ttft_ms: Some(Quantiles { p50, p90: p99, p99 }),
            requests_per_worker: vec![300; 4],
            ..PolicyResult::default()
        }
    }

    fn demo_results() -> Vec<PolicyResult> {
        vec![
            result("rr", 0.449, 98.0, 765.2),
            result("chwbl", 0.919, 31.5, 98.4),
            result("kv", 0.947, 32.4, 104.9),
            PolicyResult::failed("sglang-router-cache_aware", "pip install failed".into()),
        ]
    }

    fn pixel(buf: &[u8], x: i32, y: i32) -> (u8, u8, u8) {
        let i = 3 * (y as usize * WIDTH as usize + x as usize);
        (buf[i], buf[i + 1], buf[i + 2])
    }

    /// Pixels of exactly `c` inside `(x0, y0, x1, y1)`.
    fn count(buf: &[u8], (x0, y0, x1, y1): (i32, i32, i32, i32), c: RGBColor) -> usize {
        let mut n = 0;
        for y in y0..y1 {
            for x in x0..x1 {
                if pixel(buf, x, y) == (c.0, c.1, c.2) {
                    n += 1;
                }
            }
        }
        n
    }

    fn render(results: &[PolicyResult], oracle: Option<f64>) -> Vec<u8> {
        let mut buf = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
        render_rgb(&mut buf, &font(), "Workload shared_prefix", results, oracle).expect("render");
        buf
    }

    #[test]
    fn png_file_has_the_chart_dimensions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("chart.png");
        draw_with_font(
            &path,
            &font(),
            "Workload shared_prefix",
            &demo_results(),
            Some(0.954),
        )
        .expect("draw");
        let bytes = std::fs::read(&path).expect("read png");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be =
            |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        assert_eq!((be(16), be(20)), (WIDTH, HEIGHT));
    }

    #[test]
    fn legend_has_swatches_and_text_and_the_oracle_line_is_drawn() {
        let buf = render(&demo_results(), Some(0.954));
        // Swatches: the hit-rate, p50 and p99 colours, 28 × 18 px each, plus the oracle dash.
        for c in [HIT, P50, P99] {
            assert!(count(&buf, LEGEND, c) >= 28 * 18, "swatch {c:?}");
        }
        assert!(count(&buf, LEGEND, ORACLE) > 0, "oracle dash in the legend");
        // Text: dark anti-aliased glyph pixels beyond the swatches.
        let dark = (LEGEND.1..LEGEND.3)
            .flat_map(|y| (LEGEND.0..LEGEND.2).map(move |x| (x, y)))
            .filter(|&(x, y)| {
                let (r, g, b) = pixel(&buf, x, y);
                r < 100 && g < 100 && b < 100
            })
            .count();
        assert!(dark > 500, "legend text pixels: {dark}");
        // Background outside the legend's swatch row is white, and the top-left corner too.
        assert_eq!(pixel(&buf, 5, 5), (255, 255, 255));
        // The oracle line runs down the hit-rate panel: far more than the legend's dash.
        let panel = (0, LEGEND.3 + 1, 760, HEIGHT as i32 - 70);
        assert!(count(&buf, panel, ORACLE) > 200, "oracle line");
        let without = render(&demo_results(), None);
        assert_eq!(count(&without, panel, ORACLE), 0, "no oracle, no line");
    }

    #[test]
    fn bar_lengths_follow_the_values() {
        let panel = (0, LEGEND.3 + 1, 760, HEIGHT as i32 - 70);
        let full = render(&[result("kv", 0.90, 30.0, 40.0)], None);
        let half = render(&[result("kv", 0.45, 30.0, 40.0)], None);
        let (f, h) = (count(&full, panel, HIT), count(&half, panel, HIT));
        let ratio = f as f64 / h as f64;
        assert!((ratio - 2.0).abs() < 0.1, "hit bars {f} vs {h}");
        // TTFT on a linear axis: p99 40 ms vs p50 30 ms.
        let right = (760, LEGEND.3 + 1, WIDTH as i32, HEIGHT as i32 - 70);
        let ratio = count(&full, right, P99) as f64 / count(&full, right, P50) as f64;
        assert!((ratio - 4.0 / 3.0).abs() < 0.08, "ttft bars {ratio}");
    }

    #[test]
    fn missing_or_bad_font_is_refused_with_a_clear_error() {
        let no_fc = |_: &str| None;
        let gone = Path::new("/nonexistent/DejaVuSans.ttf");
        let err = locate(None, no_fc, gone).expect_err("no font anywhere");
        assert!(matches!(err, ChartError::FontMissing(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("fonts-dejavu-core") && msg.contains(FONT_ENV),
            "{msg}"
        );
        let err = locate(Some(gone.to_path_buf()), no_fc, gone).expect_err("env file missing");
        assert!(err.to_string().contains("is not a file"), "{err}");
        let real = font();
        assert_eq!(locate(Some(real.clone()), no_fc, gone).expect("env"), real);
        assert_eq!(locate(None, no_fc, &real).expect("debian path"), real);

        let dir = tempfile::tempdir().expect("tempdir");
        let junk = dir.path().join("junk.ttf");
        std::fs::write(&junk, b"not a font").expect("write");
        let png = dir.path().join("chart.png");
        let err = draw_with_font(&png, &junk, "t", &demo_results(), None).expect_err("junk font");
        assert!(
            matches!(&err, ChartError::BadFont { reason, .. } if reason.contains("not a TrueType")),
            "{err}"
        );
        assert!(!png.exists(), "nothing drawn without a font");
    }

    #[test]
    fn fontconfig_resolves_dejavu_and_rejects_a_substitute() {
        // scripts/setup.sh installs fontconfig and fonts-dejavu-core.
        let p = fc_match("DejaVu Sans").expect("fc-match knows DejaVu Sans");
        assert_eq!(
            p.file_name().and_then(|f| f.to_str()),
            Some("DejaVuSans.ttf")
        );
        assert_eq!(
            fc_match("No Such Family 4711"),
            None,
            "substitutes are not accepted"
        );
    }

    #[test]
    fn ttft_axis_goes_logarithmic_over_a_wide_range() {
        let wide = Scale::fit(31.5, 5518.0);
        assert!(wide.log);
        assert_eq!(wide.lo, 1.0);
        let ticks: Vec<String> = wide.ticks().iter().map(|x| fmt_ms(wide.ms(*x))).collect();
        assert_eq!(
            ticks,
            [
                "10", "20", "50", "100", "200", "500", "1,000", "2,000", "5,000", "10,000"
            ]
        );
        let huge = Scale::fit(31.5, 60_000.0);
        let ticks: Vec<String> = huge.ticks().iter().map(|x| fmt_ms(huge.ms(*x))).collect();
        assert_eq!(ticks, ["10", "100", "1,000", "10,000", "100,000"]);
        let narrow = Scale::fit(30.0, 110.0);
        assert!(!narrow.log);
        assert_eq!(narrow.ticks(), [0.0, 50.0, 100.0]);
        let two_decades = Scale::fit(30.0, 765.0);
        let ticks: Vec<String> = two_decades
            .ticks()
            .iter()
            .map(|x| fmt_ms(two_decades.ms(*x)))
            .collect();
        assert_eq!(ticks, ["10", "20", "50", "100", "200", "500", "1,000"]);
        assert_eq!(fmt_ms(1_234_567.0), "1,234,567");
        assert_eq!(fmt_ms(9.87), "9.9");
    }
}
