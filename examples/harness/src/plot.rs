//! The routing benchmark's chart: hit rate and TTFT p50 per mode, one panel per workload.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// One bar group: (mode, hit rate 0..1, TTFT p50 ms).
pub type Bars = Vec<(String, f64, f64)>;

/// Draw `panels` (workload name, bars) into a PNG at `path`.
pub fn routing_png(path: &Path, panels: &[(String, Bars)]) -> Result<()> {
    // An embedded font: the chart must render on a machine without system fonts.
    let _ = register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    let rows = panels.len().max(1);
    let root = BitMapBackend::new(path, (1200, 320 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let areas = root.split_evenly((rows, 2));
    for (i, (workload, bars)) in panels.iter().enumerate() {
        let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
        let max_ttft = bars.iter().map(|b| b.2).fold(1.0, f64::max) * 1.1;
        for (j, (title, max, value)) in [
            (
                "hit rate (%)",
                100.0,
                Box::new(|b: &(String, f64, f64)| b.1 * 100.0)
                    as Box<dyn Fn(&(String, f64, f64)) -> f64>,
            ),
            (
                "TTFT p50 (ms)",
                max_ttft,
                Box::new(|b: &(String, f64, f64)| b.2),
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let area = &areas[i * 2 + j];
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{workload}: {title}"), ("sans-serif", 18))
                .margin(8)
                .x_label_area_size(60)
                .y_label_area_size(50)
                .build_cartesian_2d((0..bars.len().max(1)).into_segmented(), 0.0..max)
                .map_err(|e| anyhow!("{e:?}"))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(bars.len().max(1))
                .x_label_formatter(&|x| match x {
                    SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                    _ => String::new(),
                })
                .x_label_style(("sans-serif", 11))
                .draw()
                .map_err(|e| anyhow!("{e:?}"))?;
            chart
                .draw_series(bars.iter().enumerate().map(|(k, b)| {
                    let color = Palette99::pick(k).filled();
                    let mut bar = Rectangle::new(
                        [
                            (SegmentValue::Exact(k), 0.0),
                            (SegmentValue::Exact(k + 1), value(b)),
                        ],
                        color,
                    );
                    bar.set_margin(0, 0, 6, 6);
                    bar
                }))
                .map_err(|e| anyhow!("{e:?}"))?;
        }
    }
    root.present().map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}
