//! `--plot`: extra charges against loss rate, without and with keys, drawn with plotters.
//!
//! plotters measures text with a font it is given (its `ab_glyph` backend; the system-font
//! backend needs fontconfig headers this project does not build with). No font is shipped:
//! the chart uses DejaVu Sans or Liberation Sans where the system has it (Debian's
//! `fonts-dejavu-core`, which `fontconfig` pulls in, is on this project's machines), and
//! without either it is drawn without any text, with a warning.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Context as _;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::FontStyle;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::report::{RateReport, Report};

/// Where common distributions install a plain sans-serif TrueType font.
const FONT_CANDIDATES: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// The family name the font is registered under; SVG viewers render it with their own.
const FAMILY: &str = "sans-serif";

/// Registers a system font with plotters once per process; whether one was found.
fn font_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        FONT_CANDIDATES.iter().any(|path| {
            let Ok(bytes) = std::fs::read(path) else {
                return false;
            };
            // plotters keeps fonts for the life of the process and takes only `'static`
            // bytes; this happens once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).is_ok()
        })
    })
}

/// Draws `report` to `path`: PNG when the name ends in `.png`, SVG otherwise.
pub(super) fn draw(path: &Path, report: &Report) -> anyhow::Result<()> {
    let labels = font_available();
    if !labels {
        eprintln!(
            "idem simulate: no TrueType font found (looked for DejaVu Sans, Liberation Sans); \
             the chart has no text"
        );
    }
    let size = (900, 560);
    let is_png = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    let drawn = if is_png {
        let root = BitMapBackend::new(path, size).into_drawing_area();
        chart(&root, report, labels).and_then(|()| root.present().map_err(plot_error))
    } else {
        let root = SVGBackend::new(path, size).into_drawing_area();
        chart(&root, report, labels).and_then(|()| root.present().map_err(plot_error))
    };
    drawn.with_context(|| format!("cannot draw the chart to {}", path.display()))
}

fn plot_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

const WITHOUT_KEYS: RGBColor = RGBColor(200, 40, 40);
const WITH_KEYS: RGBColor = RGBColor(30, 110, 200);
const THEORY: RGBColor = RGBColor(150, 150, 150);

/// The chart's coordinates: loss in percent across, extra charges up.
type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// One variant's measured points, (loss %, extra charges), and how its line is drawn.
struct Measured {
    name: &'static str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

/// The rates in order of loss, and how far the axes reach.
struct Extent<'a> {
    rates: Vec<&'a RateReport>,
    /// Intents per rate.
    n: u64,
    x_max: f64,
    y_max: f64,
}

impl<'a> Extent<'a> {
    fn of(report: &'a Report) -> Self {
        let mut rates: Vec<_> = report.rates.iter().collect();
        rates.sort_by(|a, b| a.loss.total_cmp(&b.loss));
        let n = rates.first().map_or(0, |r| r.requests);
        let max_loss = rates.last().map_or(0.0, |r| r.loss);
        let max_extra = rates
            .iter()
            .map(|r| {
                (r.without_keys.extra_charges.max(r.with_keys.extra_charges) as f64)
                    .max(r.expected.extra_charges)
            })
            .fold(0.0, f64::max);
        let x_max = if max_loss > 0.0 {
            max_loss * 110.0
        } else {
            1.0
        };
        let y_max = if max_extra > 0.0 {
            max_extra * 1.15
        } else {
            1.0
        };
        Self {
            rates,
            n,
            x_max,
            y_max,
        }
    }

    /// The measured points of each variant.
    fn measured(&self) -> [Measured; 2] {
        let without: Vec<(f64, f64)> = self
            .rates
            .iter()
            .map(|r| (r.loss * 100.0, r.without_keys.extra_charges as f64))
            .collect();
        let with: Vec<(f64, f64)> = self
            .rates
            .iter()
            .map(|r| (r.loss * 100.0, r.with_keys.extra_charges as f64))
            .collect();
        [
            Measured {
                name: "without keys (measured)",
                color: WITHOUT_KEYS,
                points: without,
            },
            Measured {
                name: "with keys (measured)",
                color: WITH_KEYS,
                points: with,
            },
        ]
    }
}

fn chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    report: &Report,
    labels: bool,
) -> anyhow::Result<()> {
    let extent = Extent::of(report);
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = axes(root, report.seed, &extent, labels)?;
    theory(&mut chart, &extent, labels)?;
    for variant in extent.measured() {
        measured(&mut chart, &variant, labels)?;
    }
    if labels {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FAMILY, 15))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(plot_error)?;
        // What was measured, small in the bottom margin: a URL may be long.
        let (_, height) = root.dim_in_pixel();
        let height = i32::try_from(height).unwrap_or(i32::MAX);
        root.draw_text(
            &format!("Measured: {}", report.target.label()),
            &(FAMILY, 13).into_font().color(&BLACK.mix(0.6)),
            (24, height - 20),
        )
        .map_err(plot_error)?;
    }
    Ok(())
}

/// The caption and the labelled axes, or without labels only the frame.
fn axes<'a, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    seed: u64,
    extent: &Extent<'_>,
    labels: bool,
) -> anyhow::Result<Chart<'a, DB>> {
    let (x_max, y_max) = (extent.x_max, extent.y_max);
    let mut builder = ChartBuilder::on(root);
    builder.margin(24);
    if labels {
        builder
            .caption(
                format!(
                    "Extra charges when answers are lost after commit (N = {}, seed {seed})",
                    extent.n
                ),
                (FAMILY, 22),
            )
            .x_label_area_size(50)
            .y_label_area_size(70);
    }
    let mut chart = builder
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(plot_error)?;
    if labels {
        chart
            .configure_mesh()
            .x_desc("ACK loss rate (%)")
            .y_desc("extra charges")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style((FAMILY, 15))
            .axis_desc_style((FAMILY, 16))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(plot_error)?;
    } else {
        // The frame only: mesh lines without their labels would be a puzzle.
        chart
            .plotting_area()
            .draw(&Rectangle::new(
                [(0.0, 0.0), (x_max, y_max)],
                BLACK.stroke_width(1),
            ))
            .map_err(plot_error)?;
    }
    Ok(chart)
}

/// The statistics' curve, N·p/(1−p), sampled finely under the measured points.
fn theory<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    extent: &Extent<'_>,
    labels: bool,
) -> anyhow::Result<()> {
    let (n, x_max) = (extent.n, extent.x_max);
    let theory = (0..=100).map(|i| {
        let p = x_max / 100.0 * f64::from(i) / 100.0;
        (p * 100.0, n as f64 * p / (1.0 - p))
    });
    let series = chart
        .draw_series(LineSeries::new(theory, THEORY.stroke_width(1)))
        .map_err(plot_error)?;
    if labels {
        series
            .label("expected without keys, N·p/(1−p)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], THEORY.stroke_width(1)));
    }
    Ok(())
}

/// One variant's measured points: a line, a dot on each, and with labels each value.
fn measured<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    variant: &Measured,
    labels: bool,
) -> anyhow::Result<()> {
    let Measured {
        name,
        color,
        ref points,
    } = *variant;
    let series = chart
        .draw_series(LineSeries::new(points.to_vec(), color.stroke_width(3)))
        .map_err(plot_error)?;
    if labels {
        series.label(name).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
        });
    }
    chart
        .draw_series(points.iter().map(|p| Circle::new(*p, 5, color.filled())))
        .map_err(plot_error)?;
    if labels {
        // Each measured value above and to the left of its point, clear of the rising
        // line.
        let style = (FAMILY, 15)
            .into_font()
            .color(&color)
            .pos(Pos::new(HPos::Right, VPos::Bottom));
        chart
            .draw_series(points.iter().map(|&(x, y)| {
                EmptyElement::at((x, y)) + Text::new(format!("{y:.0}"), (-6, -6), style.clone())
            }))
            .map_err(plot_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::report::{Expected, RunFacts, Target, WithKeys, WithoutKeys};

    fn report() -> Report {
        let facts = RunFacts {
            run_id: "a".into(),
            account: "a".into(),
            intents_charged: 1000,
            resources_seen: 1000,
            resources_listed: None,
            listed_not_seen: None,
            attempts: 0,
            answers_lost: 0,
            answers_without_id: 0,
            unanswered: 0,
            refused: 0,
        };
        let rate = |loss: f64, extra: u64| RateReport {
            loss,
            requests: 1000,
            without_keys: WithoutKeys {
                double_charge_incidents: extra,
                extra_charges: extra,
                charges_in_db: 1000 + extra,
                run: facts.clone(),
            },
            with_keys: WithKeys {
                double_charges: 0,
                extra_charges: 0,
                duplicates_prevented: extra,
                charges_in_db: 1000,
                run: facts.clone(),
            },
            expected: Expected {
                double_charge_incidents: 1000.0 * loss,
                extra_charges: 1000.0 * loss / (1.0 - loss),
            },
        };
        Report {
            target: Target::InProcess { database: None },
            seed: 42,
            max_attempts: 21,
            rates: vec![rate(0.01, 9), rate(0.05, 55), rate(0.10, 108)],
        }
    }

    #[test]
    fn draws_an_svg_with_and_without_text() {
        let dir = tempfile::tempdir().unwrap();
        for labels in [false, true] {
            if labels && !font_available() {
                continue;
            }
            let path = dir.path().join(format!("chart-{labels}.svg"));
            {
                let root = SVGBackend::new(&path, (900, 560)).into_drawing_area();
                chart(&root, &report(), labels).unwrap();
                root.present().unwrap();
            }
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.starts_with("<svg"), "{svg:.80}");
            assert!(svg.contains("<polyline"), "the series are drawn");
            assert_eq!(svg.contains("<text"), labels);
        }
    }
}
