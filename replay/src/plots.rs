//! The replay's SVG plots (plotters' SVG backend; text is laid out without font files):
//! hit rate over time per policy, the TTFT CDF per policy, and per-worker load over time.

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use plotters::prelude::*;

use super::sim::PolicyRun;

const SIZE: (u32, u32) = (900, 480);
/// Points of a CDF curve at most (keeps the SVGs small).
const CDF_POINTS: usize = 200;

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    COLORS[i % COLORS.len()]
}

fn label(run: &PolicyRun) -> &'static str {
    run.policy.map_or("?", |p| p.as_label())
}

/// A series as points, skipping empty buckets.
fn points(xs: &[f64], ys: &[Option<f64>]) -> Vec<(f64, f64)> {
    xs.iter()
        .zip(ys)
        .filter_map(|(x, y)| y.map(|y| (*x, y)))
        .collect()
}

fn x_end(runs: &[PolicyRun]) -> f64 {
    runs.iter()
        .filter_map(|r| {
            let step = r.bucket_starts_s.get(1).copied().unwrap_or(1.0);
            r.bucket_starts_s.last().map(|last| last + step)
        })
        .fold(1e-3, f64::max)
}

fn hit_rate(runs: &[PolicyRun], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Prefix hit rate over time", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..x_end(runs), 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc("simulated time (s)")
        .y_desc("cached blocks / prompt blocks")
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(
                points(&run.bucket_starts_s, &run.hit_rate_series),
                c.stroke_width(2),
            ))?
            .label(label(run))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// `(ttft ms, fraction ≤)` at up to [`CDF_POINTS`] quantiles.
fn cdf(ttft_us: &[u64]) -> Vec<(f64, f64)> {
    let mut sorted = ttft_us.to_vec();
    sorted.sort_unstable();
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    (1..=CDF_POINTS.min(n))
        .map(|k| {
            let rank = (k * n).div_ceil(CDF_POINTS.min(n));
            let v = sorted[rank.clamp(1, n) - 1] as f64 / 1000.0;
            (v.max(0.1), rank as f64 / n as f64)
        })
        .collect()
}

fn ttft_cdf(runs: &[PolicyRun], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let curves: Vec<Vec<(f64, f64)>> = runs.iter().map(|r| cdf(&r.ttft_us)).collect();
    let lo = curves
        .iter()
        .flatten()
        .map(|p| p.0)
        .fold(f64::INFINITY, f64::min);
    let hi = curves.iter().flatten().map(|p| p.0).fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi * 1.1)
    } else {
        (0.1, 1000.0)
    };
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF (latency model)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc("modelled TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()?;
    for (i, (run, curve)) in runs.iter().zip(curves).enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(curve, c.stroke_width(2)))?
            .label(label(run))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn worker_load(runs: &[PolicyRun], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let height = 260 * runs.len().max(1) as u32;
    let root = SVGBackend::new(path, (SIZE.0, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((runs.len().max(1), 1));
    let y_max = runs
        .iter()
        .flat_map(|r| r.worker_load_series.iter().flatten().flatten())
        .fold(1.0f64, |a, b| a.max(*b))
        * 1.05;
    for (run, panel) in runs.iter().zip(panels) {
        let mut chart = ChartBuilder::on(&panel)
            .caption(
                format!("Active blocks per worker: {}", label(run)),
                ("sans-serif", 16),
            )
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_end(runs), 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_desc("simulated time (s)")
            .y_desc("active blocks")
            .draw()?;
        for (w, series) in run.worker_load_series.iter().enumerate() {
            chart.draw_series(LineSeries::new(
                points(&run.bucket_starts_s, series),
                color(w).mix(0.8).stroke_width(1),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Writes the three plots into `dir`; returns their paths.
pub fn write_all(runs: &[PolicyRun], dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let plots: [(&str, PlotFn); 3] = [
        ("hit_rate.svg", hit_rate),
        ("ttft_cdf.svg", ttft_cdf),
        ("worker_load.svg", worker_load),
    ];
    let mut written = Vec::new();
    for (name, draw) in plots {
        let path = dir.join(name);
        draw(runs, &path).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

type PlotFn = fn(&[PolicyRun], &Path) -> Result<(), Box<dyn std::error::Error>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_reaches_one_at_the_maximum() {
        let values: Vec<u64> = (1..=1000).map(|v| v * 1000).collect();
        let curve = cdf(&values);
        assert_eq!(curve.len(), CDF_POINTS);
        assert_eq!(curve.last(), Some(&(1000.0, 1.0)));
        assert_eq!(curve[0], (5.0, 0.005));
        assert!(cdf(&[]).is_empty());
    }
}
