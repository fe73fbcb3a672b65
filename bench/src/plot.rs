//! SVG plots in the manner of the paper's figures (plotters, SVG backend only: no fonts or
//! system libraries needed; the viewer renders the text).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::ext2::{Ext2Report, Stack};
use crate::sweep::SweepReport;

const WRITE: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const READ: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
const LINES: [RGBColor; 3] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e}")
}

/// Two panels, MB/s and MB per CPU-second, each with a write and a read bar per stack.
pub(crate) fn ext2(r: &Ext2Report, path: &Path) -> Result<()> {
    let stacks: Vec<&str> = Stack::ALL
        .iter()
        .map(|s| s.name())
        .filter(|n| r.stacks.contains_key(*n))
        .collect();
    let root = SVGBackend::new(path, (1100, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (title, body) = root.split_vertically(40);
    title
        .titled(
            &format!(
                "ext2 on NBD: {} MiB written + sync, read back cold (median of {})",
                r.params.file_size_bytes >> 20,
                r.params.repeat
            ),
            ("sans-serif", 20),
        )
        .map_err(err)?;
    let panels = body.split_evenly((1, 2));
    for (panel, (measure, label)) in panels.iter().zip([
        ("MBps", "throughput, MB/s"),
        (
            "MB_per_cpu_s",
            "MB per CPU-second (machine, other processes excluded)",
        ),
    ]) {
        let value = |stack: &str, dir: &str| r.stacks[stack][&format!("{dir}_{measure}")].median;
        let top = stacks
            .iter()
            .flat_map(|s| [value(s, "write"), value(s, "read")])
            .fold(0.0f64, f64::max)
            * 1.15;
        let n = stacks.len() as f64;
        let mut chart = ChartBuilder::on(panel)
            .caption(label, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..n, 0.0..top.max(1.0))
            .map_err(err)?;
        let names = stacks.clone();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_label_formatter(&|y| format!("{y:.0}"))
            .x_labels(stacks.len() * 2 + 1)
            .x_label_formatter(&move |x| {
                let i = (x - 0.5).round();
                if (x - 0.5 - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
                    names[i as usize].to_string()
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(err)?;
        for (dir, color, x0) in [("write", WRITE, 0.12), ("read", READ, 0.5)] {
            chart
                .draw_series(stacks.iter().enumerate().map(|(i, s)| {
                    let x = i as f64 + x0;
                    Rectangle::new([(x, 0.0), (x + 0.38, value(s, dir))], color.filled())
                }))
                .map_err(err)?
                .label(dir)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
            chart
                .draw_series(stacks.iter().enumerate().map(|(i, s)| {
                    let v = value(s, dir);
                    Text::new(
                        format!("{v:.0}"),
                        (i as f64 + x0 + 0.04, v + top * 0.01),
                        ("sans-serif", 11).into_font().color(&BLACK),
                    )
                }))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

fn size_label(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else {
        format!("{}k", b >> 10)
    }
}

/// MB/s against request size, one line per stack, one panel per queue depth.
pub(crate) fn sweep(r: &SweepReport, dir: &str, path: &Path) -> Result<()> {
    let sizes = r.params.sizes.clone();
    let depths = &r.params.depths;
    let root = SVGBackend::new(path, (420 * depths.len() as u32 + 20, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (title, body) = root.split_vertically(40);
    title
        .titled(
            &format!("raw NBD sequential {dir}: throughput vs request size"),
            ("sans-serif", 20),
        )
        .map_err(err)?;
    let panels = body.split_evenly((1, depths.len()));
    let top = r
        .points
        .iter()
        .filter(|p| p.dir == dir)
        .map(|p| p.MBps.median)
        .fold(0.0f64, f64::max)
        * 1.1;
    let stacks = ["qpip", "fio-nbdkit", "fio-qemu-nbd"];
    for (panel, &depth) in panels.iter().zip(depths) {
        let n = sizes.len() as f64;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("queue depth {depth}"), ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(-0.3..n - 0.7, 0.0..top.max(1.0))
            .map_err(err)?;
        let labels = sizes.clone();
        chart
            .configure_mesh()
            .x_labels(sizes.len() * 2)
            .x_desc("request size")
            .y_desc("MB/s")
            .y_label_formatter(&|y| format!("{y:.0}"))
            .x_label_formatter(&move |x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                    size_label(labels[i as usize])
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(err)?;
        for (k, stack) in stacks.iter().enumerate() {
            let color = LINES[k];
            let pts: Vec<(f64, f64)> = sizes
                .iter()
                .enumerate()
                .filter_map(|(i, &s)| {
                    r.points
                        .iter()
                        .find(|p| {
                            p.stack == *stack && p.dir == dir && p.size == s && p.depth == depth
                        })
                        .map(|p| (i as f64, p.MBps.median))
                })
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(*stack)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
