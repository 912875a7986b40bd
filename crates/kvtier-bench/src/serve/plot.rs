//! The serving report as a figure (SVG, by plotters): mean TTFT and total throughput per
//! batch size, one bar per scenario, with axes, ticks, units and a legend.

use plotters::coord::ranged1d::{IntoSegmentedCoord, SegmentValue};
use plotters::prelude::*;

use super::{Scenario, ServeReport, ServeRun};

/// One panel: its y-axis label (with the unit) and the figure it draws per run.
struct Panel {
    y_desc: &'static str,
    value: fn(&ServeRun) -> f64,
}

const PANELS: [Panel; 2] = [
    Panel {
        y_desc: "mean TTFT (ms)",
        value: |r| r.ttft_ms.mean,
    },
    Panel {
        y_desc: "total throughput (tok/s)",
        value: |r| r.input_tok_s() + r.output_tok_s(),
    },
];

/// Bar colours by scenario: recompute red, host blue, disk orange, HBM green, remote purple.
fn color(s: Scenario) -> RGBColor {
    match s {
        Scenario::Recompute => RGBColor(0xd6, 0x27, 0x28),
        Scenario::Host => RGBColor(0x1f, 0x77, 0xb4),
        Scenario::Disk => RGBColor(0xff, 0x7f, 0x0e),
        Scenario::Hbm => RGBColor(0x2c, 0xa0, 0x2c),
        Scenario::Remote => RGBColor(0x94, 0x67, 0xbd),
    }
}

impl ServeReport {
    /// TTFT and throughput per scenario and batch size, as an SVG document (760 × 640).
    pub fn svg(&self) -> String {
        let mut out = String::new();
        if let Err(e) = self.draw(&mut out) {
            // Drawing into a string fails only on a plotters bug; say so in the figure's place.
            return format!(
                "<svg xmlns=\"http://www.w3.org/2000/svg\"><text x=\"10\" y=\"20\">plot failed: {e}</text></svg>\n"
            );
        }
        out
    }

    fn draw(&self, out: &mut String) -> Result<(), Box<dyn std::error::Error + '_>> {
        let mut batches: Vec<usize> = self.runs.iter().map(|r| r.batch).collect();
        batches.sort_unstable();
        batches.dedup();
        let mut scenarios: Vec<Scenario> = Vec::new();
        for r in &self.runs {
            if !scenarios.contains(&r.scenario) {
                scenarios.push(r.scenario);
            }
        }
        let root = SVGBackend::with_string(out, (760, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let panels = root.split_evenly((PANELS.len(), 1));
        let bars = scenarios.len().max(1) as f64;
        for (area, panel) in panels.iter().zip(&PANELS) {
            let max = self.runs.iter().map(panel.value).fold(0.0, f64::max).max(1e-9);
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!(
                        "{} — {} prompt / {} output tokens",
                        panel.y_desc, self.input_len, self.output_len
                    ),
                    ("sans-serif", 15),
                )
                .margin(12)
                .margin_right(110)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(
                    (0..batches.len().saturating_sub(1)).into_segmented(),
                    0.0..max * 1.15,
                )?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_desc("batch size (concurrent requests)")
                .y_desc(panel.y_desc)
                .x_label_formatter(&|x| match x {
                    SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                        batches.get(*i).map_or_else(String::new, |b| b.to_string())
                    }
                    SegmentValue::Last => String::new(),
                })
                .y_label_formatter(&|y| format!("{y:.0}"))
                .draw()?;
            // Bars sit on the pixel grid of each batch's segment (absolute pixels, on `root`).
            let plot = chart.plotting_area();
            let (xs, _) = plot.get_pixel_range();
            let edge = |bi: usize| f64::from(plot.map_coordinate(&(SegmentValue::Exact(bi), 0.0)).0);
            let base = plot.map_coordinate(&(SegmentValue::Exact(0), 0.0)).1;
            let legend_y = plot.map_coordinate(&(SegmentValue::Exact(0), max * 1.15)).1 + 6;
            for (si, &scenario) in scenarios.iter().enumerate() {
                let c = color(scenario);
                for (bi, b) in batches.iter().enumerate() {
                    let Some(r) = self.runs.iter().find(|r| r.batch == *b && r.scenario == scenario) else {
                        continue;
                    };
                    let v = (panel.value)(r);
                    let (start, end) = (edge(bi), edge(bi + 1));
                    let seg_px = end - start;
                    let left = start + seg_px * (si as f64 + 0.5) / (bars + 1.0);
                    let width = seg_px / (bars + 1.0) * 0.9;
                    let top = plot.map_coordinate(&(SegmentValue::Exact(bi), v)).1;
                    let (l, r) = (left as i32, (left + width) as i32);
                    root.draw(&Rectangle::new([(l, top), (r, base)], c.filled()))?;
                    root.draw(&Text::new(
                        format!("{v:.0}"),
                        (l, top - 13),
                        ("sans-serif", 11).into_font(),
                    ))?;
                }
                // The legend: a swatch and the scenario's name, right of the plot.
                let (lx, ly) = (xs.end + 14, legend_y + 16 * si as i32);
                root.draw(&Rectangle::new([(lx, ly), (lx + 10, ly + 10)], c.filled()))?;
                root.draw(&Text::new(
                    scenario.name(),
                    (lx + 14, ly),
                    ("sans-serif", 12).into_font(),
                ))?;
            }
        }
        root.present()?;
        Ok(())
    }
}
