//! Output helpers for experiments: aligned text tables (from `texttable`,
//! which `rebound box` shares), bar-chart PNGs and progress bars.

use std::path::Path;

use anyhow::Context;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
pub use texttable::{Table, thousands};

/// Register a TrueType font for plot text (plotters' `ab_glyph` backend
/// needs one; Debian's `fonts-dejavu-core` provides it).
pub fn register_font() -> anyhow::Result<()> {
    use std::sync::OnceLock;
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let result = DONE.get_or_init(|| {
        let candidates = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        ];
        let path = candidates
            .iter()
            .find(|p| Path::new(p).exists())
            .ok_or_else(|| {
                "no DejaVuSans.ttf found for plot labels; install it with `apt-get install -y fonts-dejavu-core`"
                    .to_owned()
            })?;
        let bytes: &'static [u8] = Box::leak(
            std::fs::read(path)
                .map_err(|e| format!("reading {path}: {e}"))?
                .into_boxed_slice(),
        );
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a usable TrueType font"))?;
        Ok(())
    });
    result.clone().map_err(|e| anyhow::anyhow!(e))
}

/// Series colours of every plot, in order.
const PALETTE: [RGBColor; 7] = [
    RGBColor(54, 110, 180),
    RGBColor(214, 96, 77),
    RGBColor(90, 160, 90),
    RGBColor(150, 110, 190),
    RGBColor(200, 150, 40),
    RGBColor(60, 60, 60),
    RGBColor(80, 180, 200),
];

/// One panel of a grouped bar chart: for each category, one bar per series.
#[derive(Debug)]
pub struct BarPanel {
    /// Panel title.
    pub title: String,
    /// Y axis label.
    pub y_label: String,
    /// Category names (x axis).
    pub categories: Vec<String>,
    /// `(series name, value per category)`.
    pub series: Vec<(String, Vec<f64>)>,
}

/// How a panel's series share a category.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bars {
    /// One bar per series, side by side.
    Grouped,
    /// One bar per category, the series stacked bottom to top (the
    /// smart-storage paper's Figures 8 to 11).
    Stacked,
}

/// Draw panels side by side into a PNG, one bar per series and category.
pub fn bar_chart_png(path: &Path, title: &str, panels: &[BarPanel]) -> anyhow::Result<()> {
    draw_bars(path, title, panels, Bars::Grouped)
}

/// Draw panels side by side into a PNG, one bar per category with the
/// series stacked (e.g. I/O, compute, communication).
pub fn stacked_bar_png(path: &Path, title: &str, panels: &[BarPanel]) -> anyhow::Result<()> {
    draw_bars(path, title, panels, Bars::Stacked)
}

fn draw_bars(path: &Path, title: &str, panels: &[BarPanel], bars: Bars) -> anyhow::Result<()> {
    register_font()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let width = 700 * panels.len() as u32;
    let root = BitMapBackend::new(path, (width, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (head, body) = root.split_vertically(40);
    head.titled(title, ("sans-serif", title_size(&head, title, width)?))?;
    let areas = body.split_evenly((1, panels.len()));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel, bars)?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The title's font size: 24 points, smaller for a title that would not
/// fit the image's width (down to 12), so no title is cut at its ends.
fn title_size<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    width: u32,
) -> anyhow::Result<f64> {
    let room = width.saturating_sub(24);
    let mut size = 24.0;
    while size > 12.0 {
        let (w, _) = area
            .estimate_text_size(title, &("sans-serif", size).into_text_style(area))
            .map_err(|e| anyhow::anyhow!("measuring the title: {e}"))?;
        if w <= room {
            break;
        }
        size -= 1.0;
    }
    Ok(size)
}

/// The highest bar of a panel: the largest value, or the largest stack.
fn tallest(panel: &BarPanel, bars: Bars) -> f64 {
    match bars {
        Bars::Grouped => panel
            .series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .fold(0.0f64, f64::max),
        Bars::Stacked => (0..panel.categories.len())
            .map(|c| panel.series.iter().map(|(_, v)| v[c]).sum::<f64>())
            .fold(0.0f64, f64::max),
    }
}

/// A y-axis label: thousands separators from 1,000, fewer decimals the
/// larger the axis.
fn axis_value(v: f64, max: f64) -> String {
    if v >= 1000.0 {
        thousands(v.round())
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if max < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

/// One panel: axes, a category label under each group of bars, the bars
/// and the legend.
fn draw_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    panel: &BarPanel,
    bars: Bars,
) -> anyhow::Result<()> {
    let n_cat = panel.categories.len();
    let n_ser = panel.series.len().max(1);
    // Headroom for the legend in the upper right.
    let max = tallest(panel, bars) * 1.35;
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..n_cat as f64, 0f64..max.max(1e-9))?;
    let cats = panel.categories.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n_cat * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 && i < cats.len() {
                cats[i].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| axis_value(*v, max))
        .y_desc(panel.y_label.as_str())
        .label_style(("sans-serif", 14))
        .draw()?;
    let bar_w = 0.8 / n_ser as f64;
    let mut base = vec![0.0; n_cat];
    for (s, (name, values)) in panel.series.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        let rects: Vec<_> = values
            .iter()
            .enumerate()
            .map(|(c, &v)| match bars {
                Bars::Grouped => {
                    let x0 = c as f64 + 0.1 + s as f64 * bar_w;
                    Rectangle::new([(x0, 0.0), (x0 + bar_w * 0.95, v)], color.filled())
                }
                Bars::Stacked => {
                    let r = Rectangle::new(
                        [(c as f64 + 0.15, base[c]), (c as f64 + 0.85, base[c] + v)],
                        color.filled(),
                    );
                    base[c] += v;
                    r
                }
            })
            .collect();
        chart
            .draw_series(rects)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
    }
    draw_legend(&mut chart)?;
    Ok(())
}

/// The legend of a plot: a box in the upper right.
fn draw_legend<'a: 'b, 'b>(
    chart: &mut ChartContext<'b, BitMapBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

/// A progress bar on stderr for `total` steps (hidden when stderr is not a
/// terminal).
pub fn progress(total: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_prefix(what.to_owned());
    bar
}

/// Draw line series `(name, [(x, y)])` into a PNG with one panel.
pub fn line_chart_png(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<()> {
    register_font()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let points = || series.iter().flat_map(|(_, v)| v.iter().copied());
    let x_min = points().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let x_max = points().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let y_max = points().map(|p| p.1).fold(0.0f64, f64::max) * 1.3;
    let (x_min, x_max) = if x_min.is_finite() && x_max > x_min {
        (x_min, x_max)
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(x_min..x_max, 0f64..y_max.max(1e-9))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .y_label_formatter(&|v| thousands(v.round()))
        .label_style(("sans-serif", 14))
        .draw()?;
    let palette = PALETTE;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = palette[i % palette.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One panel of [`two_panel_line_png`]: its y label and its named series.
pub type LinePanel<'a> = (&'a str, &'a [(String, Vec<(f64, f64)>)]);

/// A number for an axis label: integers as such, others to 3 significant
/// digits.
fn axis_number(v: f64) -> String {
    if v >= 1.0 && (v - v.round()).abs() < 1e-6 {
        thousands(v.round())
    } else if v.abs() < 0.01 && v != 0.0 {
        format!("{v:.1e}")
    } else {
        format!("{v:.2}")
    }
}

/// Two line charts side by side sharing the x axis (optionally log-scaled:
/// the x values are plotted by their base-2 logarithm and labelled with
/// their value). Series whose name contains "bad" are drawn thick with markers.
pub fn two_panel_line_png(
    path: &Path,
    title: &str,
    x_label: &str,
    log_x: bool,
    left: LinePanel<'_>,
    right: LinePanel<'_>,
) -> anyhow::Result<()> {
    register_font()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let root = BitMapBackend::new(path, (1500, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let panels = root.split_evenly((1, 2));
    let tx = |x: f64| if log_x { x.log2() } else { x };
    for (area, (y_label, series)) in panels.iter().zip([left, right]) {
        let xs = || series.iter().flat_map(|(_, v)| v.iter().map(|p| tx(p.0)));
        let x_min = xs().fold(f64::INFINITY, f64::min);
        let x_max = xs().fold(f64::NEG_INFINITY, f64::max);
        let (x_min, x_max) = if x_min.is_finite() && x_max > x_min {
            (x_min, x_max)
        } else {
            (0.0, 1.0)
        };
        let y_max = series
            .iter()
            .flat_map(|(_, v)| v.iter().map(|p| p.1))
            .fold(0.0f64, f64::max)
            * 1.35;
        let mut chart = ChartBuilder::on(area)
            .margin(14)
            .x_label_area_size(45)
            .y_label_area_size(85)
            .build_cartesian_2d(x_min..x_max, 0f64..y_max.max(1e-9))?;
        let x_fmt = |v: &f64| {
            if log_x {
                axis_number(2f64.powf(*v))
            } else {
                axis_number(*v)
            }
        };
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&|v| thousands(v.round()))
            .label_style(("sans-serif", 14))
            .draw()?;
        let mut kinds: Vec<&str> = Vec::new();
        for (name, pts) in series {
            // One colour per policy (the name's first word), whatever the path.
            let kind = name.split_whitespace().next().unwrap_or("");
            let k = kinds.iter().position(|&n| n == kind).unwrap_or_else(|| {
                kinds.push(kind);
                kinds.len() - 1
            });
            let color = PALETTE[k % PALETTE.len()];
            let bad = name.contains("bad");
            let width = if bad { 3 } else { 1 };
            let pts: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (tx(x), y)).collect();
            chart
                .draw_series(LineSeries::new(
                    pts.iter().copied(),
                    color.stroke_width(width),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(width))
                });
            if bad {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
        }
        draw_legend(&mut chart)?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
