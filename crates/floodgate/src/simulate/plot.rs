//! `simulate --plot FILE.svg|FILE.html`: a picture of what each algorithm
//! admits over time on the trace's busiest key. One panel per algorithm,
//! sharing the time axis:
//!
//! * a line of what it has admitted in the trailing window (a shaped
//!   request counts from when it is released), against the limit (dashed)
//!   and the exact `sliding_log`'s own line (grey): the fixed window's
//!   burst at a window edge shows as a peak at twice the limit;
//! * a strip of ticks below: admitted (green) and denied (red) requests.
//!
//! Plain SVG (or the same SVG in a bare HTML page): no scripts, no styles
//! from elsewhere. Traces longer than the picture is wide are drawn as one
//! column per pixel, each the maximum of its span, so no peak is lost.

use std::collections::HashMap;
use std::fmt::Write;

use floodgate::trace::for_each_event;
use floodgate_core::{HumanDuration, Limit};

use super::{SimStore, decide, store};
use crate::exit::Failure;

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 170.0;
const RIGHT: f64 = 20.0;
const PANEL: f64 = 90.0;
const STRIP: f64 = 14.0;
const GAP: f64 = 26.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 40.0;

/// One algorithm's decisions on the plotted key: (when, hits) admitted
/// (at release, for a shaper) and denied, in microseconds.
struct Run {
    name: String,
    admitted: Vec<(u64, u64)>,
    denied: Vec<(u64, u64)>,
}

/// The trace's busiest key (most events; the first seen when tied) and its
/// events as (at_ms, hits).
fn busiest(trace: &[u8]) -> Result<(String, Vec<(u64, u64)>), Failure> {
    let mut counts: HashMap<String, (usize, usize)> = HashMap::new();
    for_each_event(trace, |ev| {
        let n = counts.len();
        counts.entry(ev.key.to_string()).or_insert((0, n)).0 += 1;
        Ok::<(), Failure>(())
    })?;
    let Some((key, _)) = counts.into_iter().max_by(|a, b| a.1.0.cmp(&b.1.0).then(b.1.1.cmp(&a.1.1))) else {
        return Err(Failure::usage("--plot: the trace has no events to draw"));
    };
    let mut events = Vec::new();
    for_each_event(trace, |ev| {
        if ev.key == key {
            events.push((ev.at_ms, ev.hits));
        }
        Ok::<(), Failure>(())
    })?;
    Ok((key, events))
}

/// Draw `limits` (the first is the exact reference) on `trace`'s busiest
/// key; SVG, or an HTML page holding it when `html`.
pub(super) fn plot(trace: &[u8], limits: &[(String, Limit)], html: bool) -> Result<String, Failure> {
    let (key, events) = busiest(trace)?;
    let mut runs = Vec::with_capacity(limits.len());
    for (name, limit) in limits {
        let s: SimStore = store();
        let mut run = Run { name: name.clone(), admitted: Vec::new(), denied: Vec::new() };
        for &(at_ms, hits) in &events {
            let ev = floodgate::trace::Event { at_ms, key: key.as_str().into(), hits };
            let d = decide(&s, limit, &ev)?;
            let at = at_ms * 1_000;
            if d.allowed {
                run.admitted.push((at + u64::try_from(d.delay.as_micros()).unwrap_or(u64::MAX), hits));
            } else {
                run.denied.push((at, hits));
            }
        }
        run.admitted.sort_unstable();
        runs.push(run);
    }
    let svg = draw(&key, events.len(), &limits[0].1, &runs);
    Ok(if html {
        format!(
            "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>floodgate simulate: {}</title></head>\n<body>\n{svg}</body></html>\n",
            escape(&key)
        )
    } else {
        svg
    })
}

/// The trailing-window count of `admitted` (sorted), as steps: (time, count
/// from then on), at every admission and every expiry.
fn trailing(admitted: &[(u64, u64)], window_us: u64) -> Vec<(u64, u64)> {
    let mut steps = Vec::with_capacity(admitted.len() * 2);
    let (mut i, mut j, mut count) = (0, 0, 0u64);
    while i < admitted.len() || j < i {
        let next_in = admitted.get(i).map(|a| a.0);
        let next_out = (j < i).then(|| admitted[j].0.saturating_add(window_us));
        let t = match (next_in, next_out) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => break,
        };
        while j < i && admitted[j].0.saturating_add(window_us) <= t {
            count -= admitted[j].1;
            j += 1;
        }
        while i < admitted.len() && admitted[i].0 == t {
            count += admitted[i].1;
            i += 1;
        }
        steps.push((t, count));
    }
    steps
}

/// The largest value of `steps` in each of `columns` spans of [t0, t1).
fn columns(steps: &[(u64, u64)], t0: u64, t1: u64, columns: usize) -> Vec<u64> {
    let mut out = vec![0u64; columns];
    let span = (t1 - t0).max(1) as f64 / columns as f64;
    let col = |t: u64| (((t.saturating_sub(t0)) as f64 / span) as usize).min(columns - 1);
    for (k, &(t, v)) in steps.iter().enumerate() {
        let end = steps.get(k + 1).map_or(t1, |n| n.0);
        for o in &mut out[col(t)..=col(end.saturating_sub(1).max(t))] {
            *o = (*o).max(v);
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn draw(key: &str, events: usize, reference: &Limit, runs: &[Run]) -> String {
    let window_us = u64::try_from(reference.window().as_micros()).unwrap_or(u64::MAX);
    let limit = reference.limit();
    let last = runs.iter().flat_map(|r| r.admitted.iter().chain(&r.denied)).map(|e| e.0).max().unwrap_or(0);
    let first = runs.iter().flat_map(|r| r.admitted.iter().chain(&r.denied)).map(|e| e.0).min().unwrap_or(0);
    let (t0, t1) = (first, last.max(first + 1) + window_us / 10);
    let plot_w = WIDTH - LEFT - RIGHT;
    let cols = plot_w as usize;
    let trails: Vec<Vec<u64>> = runs.iter().map(|r| columns(&trailing(&r.admitted, window_us), t0, t1, cols)).collect();
    let peak = trails.iter().flatten().copied().max().unwrap_or(0).max(limit).max(1);
    let y_max = (peak as f64 * 1.1).ceil();
    let height = TOP + runs.len() as f64 * (PANEL + STRIP + GAP) + BOTTOM;
    let x = |t: u64| LEFT + (t.saturating_sub(t0)) as f64 / (t1 - t0) as f64 * plot_w;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{LEFT}\" y=\"20\" font-size=\"15\" font-weight=\"bold\">Admitted in the trailing {} window, key \u{201c}{}\u{201d} ({events} requests)</text>",
        HumanDuration(reference.window()),
        escape(key)
    );
    let _ = writeln!(
        s,
        "<text x=\"{LEFT}\" y=\"38\" fill=\"#555\">limit {limit} per {} (dashed) \u{b7} grey: sliding_log, the exact answer \u{b7} ticks: admitted (green), denied (red)</text>",
        HumanDuration(reference.window())
    );
    for (p, (run, trail)) in runs.iter().zip(&trails).enumerate() {
        let top = TOP + p as f64 * (PANEL + STRIP + GAP);
        let base = top + PANEL;
        let y = |v: u64| base - v as f64 / y_max * PANEL;
        let over = trail.iter().copied().max().unwrap_or(0);
        let _ = writeln!(s, "<g>");
        let _ = writeln!(
            s,
            "<rect x=\"{LEFT}\" y=\"{top}\" width=\"{plot_w}\" height=\"{PANEL}\" fill=\"#fafafa\" stroke=\"#ddd\"/>"
        );
        let _ = writeln!(s, "<text x=\"8\" y=\"{}\" font-weight=\"bold\">{}</text>", top + 16.0, escape(&run.name));
        let colour = if over > limit { "#c62828" } else { "#555" };
        let _ = writeln!(s, "<text x=\"8\" y=\"{}\" fill=\"{colour}\">most in a window: {over}</text>", top + 34.0);
        let _ = writeln!(
            s,
            "<text x=\"8\" y=\"{}\" fill=\"#555\">admitted {}, denied {}</text>",
            top + 52.0,
            run.admitted.iter().map(|a| a.1).sum::<u64>(),
            run.denied.iter().map(|a| a.1).sum::<u64>()
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"#999\" text-anchor=\"end\" font-size=\"10\">{}</text>",
            LEFT - 4.0,
            top + 10.0,
            y_max as u64
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{base}\" fill=\"#999\" text-anchor=\"end\" font-size=\"10\">0</text>",
            LEFT - 4.0
        );
        // The limit.
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"#1565c0\" stroke-dasharray=\"5 4\"/>",
            LEFT + plot_w,
            ly = y(limit)
        );
        // The exact answer beside each other algorithm, then this one.
        if p > 0 {
            let _ = writeln!(s, "{}", polyline(&trails[0], &y, "#9e9e9e", 1.2));
        }
        let _ = writeln!(s, "{}", polyline(trail, &y, if p == 0 { "#424242" } else { "#2e7d32" }, 1.6));
        // Ticks: admitted above, denied below.
        let strip = base + 3.0;
        let mut ticks = |events: &[(u64, u64)], y0: f64, colour: &str| {
            let mut seen = vec![false; cols + 1];
            let mut d = String::new();
            for &(t, _) in events {
                let c = (x(t) - LEFT) as usize;
                if c <= cols && !std::mem::replace(&mut seen[c], true) {
                    let _ = write!(d, "M{:.1} {y0:.1}v5", x(t));
                }
            }
            if !d.is_empty() {
                let _ = writeln!(s, "<path stroke=\"{colour}\" d=\"{d}\"/>");
            }
        };
        ticks(&run.admitted, strip, "#2e7d32");
        ticks(&run.denied, strip + 6.0, "#c62828");
        let _ = writeln!(s, "</g>");
    }
    // The time axis, in seconds from the first request.
    let axis = height - BOTTOM + 4.0;
    let span_s = (t1 - t0) as f64 / 1e6;
    let step =
        [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 3600.0]
            .into_iter()
            .find(|st| span_s / st <= 10.0)
            .unwrap_or(86_400.0);
    let mut t = 0.0;
    while t <= span_s {
        let px = LEFT + t / span_s * plot_w;
        let _ = writeln!(s, "<line x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{TOP}\" y2=\"{axis}\" stroke=\"#eee\"/>");
        let _ = writeln!(
            s,
            "<text x=\"{px:.1}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">{}s</text>",
            axis + 14.0,
            trim(t)
        );
        t += step;
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" fill=\"#555\">time from the first request</text>",
        WIDTH - RIGHT,
        axis + 30.0
    );
    s.push_str("</svg>\n");
    s
}

fn trim(t: f64) -> String {
    let s = format!("{t:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// A step line through one value per pixel column.
fn polyline(values: &[u64], y: &impl Fn(u64) -> f64, colour: &str, width: f64) -> String {
    let mut pts = String::with_capacity(values.len() * 16);
    let mut prev: Option<u64> = None;
    for (c, &v) in values.iter().enumerate() {
        let px = LEFT + c as f64;
        if let Some(p) = prev
            && p != v
        {
            let _ = write!(pts, "{px:.1},{:.1} ", y(p));
        }
        if prev != Some(v) || c + 1 == values.len() {
            let _ = write!(pts, "{px:.1},{:.1} ", y(v));
        }
        prev = Some(v);
    }
    format!("<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"{width}\" points=\"{}\"/>", pts.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trailing_count_rises_and_expires() {
        // Two at 0, one at 500 ms; a 1 s window.
        let steps = trailing(&[(0, 1), (0, 1), (500_000, 1)], 1_000_000);
        assert_eq!(steps, [(0, 2), (500_000, 3), (1_000_000, 1), (1_500_000, 0)]);
    }

    #[test]
    fn columns_keep_each_span_s_peak() {
        let steps = [(0, 1), (10, 5), (11, 0), (50, 2)];
        assert_eq!(columns(&steps, 0, 100, 4), [5, 0, 2, 2]);
    }
}
