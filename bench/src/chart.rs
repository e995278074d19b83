//! The PNG chart: engine-side prefix hit rate (with the oracle bound as a line) and TTFT
//! p50/p99 per policy, drawn with plotters' bitmap backend and the built-in 5×7 font.

use super::glyphs::{lit_cells, text_width};
use super::report::PolicyResult;
use plotters::prelude::*;
use std::path::Path;

const W: i32 = 1100;
const PANEL_H: i32 = 300;
const LEFT: i32 = 70;
const BAR_COLORS: [RGBColor; 2] = [RGBColor(66, 133, 244), RGBColor(219, 68, 55)];

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// Draws the chart for one workload into `path` (PNG). Failed policies get a labelled empty slot.
pub fn draw(
    path: &Path,
    title: &str,
    results: &[PolicyResult],
    oracle: Option<f64>,
) -> Result<(), String> {
    let h = 60 + 2 * (PANEL_H + 60);
    let root = BitMapBackend::new(path, (W as u32, h as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    text(&root, title, LEFT, 15, 3, &BLACK)?;
    let hits: Vec<Vec<f64>> = results
        .iter()
        .map(|r| vec![r.prefix_hit_rate.unwrap_or(0.0) * 100.0])
        .collect();
    let ttft: Vec<Vec<f64>> = results
        .iter()
        .map(|r| r.ttft_ms.map(|q| vec![q.p50, q.p99]).unwrap_or_default())
        .collect();
    let names: Vec<&str> = results.iter().map(|r| r.policy.as_str()).collect();
    panel(
        &root,
        60,
        "PREFIX HIT RATE % (LINE: ORACLE)",
        &names,
        &hits,
        Some(100.0),
        oracle.map(|o| o * 100.0),
    )?;
    panel(
        &root,
        60 + PANEL_H + 60,
        "TTFT MS (SIMULATED): P50 BLUE, P99 RED",
        &names,
        &ttft,
        None,
        None,
    )?;
    root.present().map_err(|e| e.to_string())
}

/// One bar panel with its top at `y0`; `max` fixes the scale (else the data maximum).
fn panel(
    root: &Area<'_>,
    y0: i32,
    label: &str,
    names: &[&str],
    series: &[Vec<f64>],
    max: Option<f64>,
    line: Option<f64>,
) -> Result<(), String> {
    text(root, label, LEFT, y0, 2, &BLACK)?;
    let (top, bottom) = (y0 + 25, y0 + PANEL_H - 20);
    let data_max = series.iter().flatten().copied().fold(0.0f64, f64::max);
    let scale_max = max.unwrap_or(data_max * 1.1).max(1e-9);
    let y_of = |v: f64| bottom - ((v / scale_max) * (bottom - top) as f64) as i32;
    rect(root, (LEFT, bottom), (W - 20, bottom + 1), &BLACK)?;
    text(root, &format!("{scale_max:.0}"), 5, top, 2, &BLACK)?;
    text(root, "0", 5, bottom - 10, 2, &BLACK)?;
    let slot = (W - 20 - LEFT) / names.len().max(1) as i32;
    for (i, (name, vals)) in names.iter().zip(series).enumerate() {
        let x0 = LEFT + i as i32 * slot + slot / 8;
        let bw = (slot * 3 / 4) / vals.len().max(1) as i32;
        for (j, v) in vals.iter().enumerate() {
            let x = x0 + j as i32 * bw;
            rect(
                root,
                (x, y_of(*v)),
                (x + bw - 2, bottom),
                &BAR_COLORS[j % 2],
            )?;
            let s = format!("{v:.0}");
            text(
                root,
                &s,
                x + (bw - text_width(&s, 2)) / 2,
                y_of(*v) - 18,
                2,
                &BLACK,
            )?;
        }
        let nx = LEFT + i as i32 * slot + (slot - text_width(name, 2)) / 2;
        text(root, name, nx.max(LEFT), bottom + 6, 2, &BLACK)?;
    }
    if let Some(l) = line {
        rect(
            root,
            (LEFT, y_of(l)),
            (W - 20, y_of(l) + 2),
            &RGBColor(15, 157, 88),
        )?;
    }
    Ok(())
}

fn rect(root: &Area<'_>, a: (i32, i32), b: (i32, i32), color: &RGBColor) -> Result<(), String> {
    root.draw(&Rectangle::new([a, b], color.filled()))
        .map_err(|e| e.to_string())
}

fn text(
    root: &Area<'_>,
    s: &str,
    x: i32,
    y: i32,
    scale: i32,
    color: &RGBColor,
) -> Result<(), String> {
    for (cx, cy) in lit_cells(s, scale) {
        rect(
            root,
            (x + cx, y + cy),
            (x + cx + scale - 1, y + cy + scale - 1),
            color,
        )?;
    }
    Ok(())
}
