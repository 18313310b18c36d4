//! The benchmarks' charts: the routing benchmark's hit rate and TTFT p50 per mode, the load
//! ladder's TTFT p90 against rate.

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

/// The load ladder's chart ([`crate::bench_load`]'s document): per workload, TTFT p90 against
/// the offered rate, one line per mode (log scale), and the target as a dashed line.
pub fn load_png(path: &Path, doc: &serde_json::Value) -> Result<()> {
    let _ = register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    let workloads: Vec<(&String, &serde_json::Value)> = doc["workloads"]
        .as_object()
        .map(|m| m.iter().collect())
        .unwrap_or_default();
    let root =
        BitMapBackend::new(path, (900, 420 * workloads.len().max(1) as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let areas = root.split_evenly((workloads.len().max(1), 1));
    for ((name, w), area) in workloads.iter().zip(&areas) {
        let modes: Vec<(&String, Vec<(f64, f64)>)> = w["modes"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(mode, m)| {
                let points = m["points"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| Some((p["rate"].as_f64()?, p["ttft_p90_ms"].as_f64()?)))
                    .filter(|(_, t)| *t > 0.0)
                    .collect();
                (mode, points)
            })
            .collect();
        let all = modes.iter().flat_map(|(_, ps)| ps.iter());
        let max_rate = all.clone().map(|p| p.0).fold(1.0, f64::max) * 1.05;
        let target = w["target_ttft_ms"].as_f64().unwrap_or(1.0);
        let dynamo_target = w["dynamo_target_ttft_ms"].as_f64();
        let targets = [target, dynamo_target.unwrap_or(target)];
        let max_ttft = all
            .clone()
            .map(|p| p.1)
            .chain(targets)
            .fold(target, f64::max)
            * 1.5;
        let min_ttft = all.map(|p| p.1).chain(targets).fold(target, f64::min) * 0.7;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{name}: TTFT p90 against offered load"),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_rate, (min_ttft..max_ttft).log_scale())
            .map_err(|e| anyhow!("{e:?}"))?;
        chart
            .configure_mesh()
            .x_desc("requests/s")
            .y_desc("TTFT p90 (ms)")
            .draw()
            .map_err(|e| anyhow!("{e:?}"))?;
        // Colours that read on white (the palette's third is yellow).
        const COLOURS: [RGBColor; 6] = [
            RGBColor(214, 39, 40),
            RGBColor(44, 160, 44),
            RGBColor(31, 119, 180),
            RGBColor(148, 103, 189),
            RGBColor(255, 127, 14),
            RGBColor(23, 190, 207),
        ];
        for (k, (mode, points)) in modes.iter().enumerate() {
            let colour = COLOURS[k % COLOURS.len()];
            let color = colour.stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color))
                .map_err(|e| anyhow!("{e:?}"))?
                .label(mode.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(|e| anyhow!("{e:?}"))?;
        }
        // The simulated fleet's target in long dashes, the Dynamo mockers' in short ones.
        let lines = [
            (Some(target), 6, "target"),
            (dynamo_target, 2, "target (Dynamo's mockers)"),
        ];
        for (t, dash, label) in lines {
            let Some(t) = t else { continue };
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, t), (max_rate, t)],
                    dash,
                    4,
                    BLACK.stroke_width(1),
                ))
                .map_err(|e| anyhow!("{e:?}"))?
                .label(label)
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow!("{e:?}"))?;
    }
    root.present().map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}
