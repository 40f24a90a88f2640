//! Plots of a results file: one chart per shape group (mqa, gqa, mha, batch, custom), shapes
//! equally spaced on x (labelled by L, or by batch for the batch group), effective TB/s on y, one
//! line per implementation and one for the byte floor (and the read ceiling when measured).
//!
//! SVG and PNG through plotters without its system-font features (DESIGN.md): text needs a TTF
//! that ab_glyph can read, found at run time ([`find_system_font`]; none is shipped). Without
//! one the charts are drawn without text, and [`plot_results`] says so once on stderr.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::results::{BenchResults, Row};

/// Chart size in pixels.
const SIZE: (u32, u32) = (1100, 650);
/// Font family the charts use (the found TTF is registered under it).
const FAMILY: &str = "sans-serif";
/// Environment variable: a TTF to use for chart text, or `none` for charts without text.
pub const FONT_ENV: &str = "KVSTREAM_PLOT_FONT";

/// Places to look for a TTF, in order, before any *.ttf under the font directories.
const PREFERRED_FONTS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];
const FONT_DIRS: [&str; 2] = ["/usr/share/fonts", "/usr/local/share/fonts"];

/// Files the plotter wrote, and whether they have text.
#[derive(Debug, Default)]
pub struct Written {
    /// SVG and PNG paths.
    pub files: Vec<PathBuf>,
    /// Whether a font was available (the charts have titles, labels and legends).
    pub with_text: bool,
}

/// Candidate TTFs on this machine: `$KVSTREAM_PLOT_FONT`, the preferred paths, then every
/// *.ttf under the usual font directories (regular sans faces first).
pub fn font_candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var(FONT_ENV) {
        if p == "none" {
            return out;
        }
        out.push(PathBuf::from(p));
    }
    out.extend(PREFERRED_FONTS.iter().map(PathBuf::from));
    let mut found = Vec::new();
    for dir in FONT_DIRS {
        collect_ttf(Path::new(dir), 6, &mut found);
    }
    // regular sans faces before bold/italic/mono/serif ones
    let penalty = |p: &PathBuf| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        [
            "bold", "italic", "oblique", "mono", "serif", "light", "math",
        ]
        .iter()
        .filter(|w| name.contains(*w))
        .count()
            + usize::from(!name.contains("sans"))
    };
    found.sort_by_key(|p| (penalty(p), p.clone()));
    out.extend(found);
    // GPU images often ship no system fonts but do ship matplotlib, which bundles DejaVu Sans.
    out.extend(matplotlib_font());
    out.into_iter().filter(|p| p.is_file()).collect()
}

/// DejaVu Sans as bundled with the matplotlib of `python3`, if there is one.
fn matplotlib_font() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import matplotlib, os; print(os.path.join(matplotlib.get_data_path(), 'fonts', 'ttf', 'DejaVuSans.ttf'))",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn collect_ttf(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() && depth > 0 {
            collect_ttf(&p, depth - 1, out);
        } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
            out.push(p);
        }
    }
}

/// The first candidate TTF that ab_glyph accepts, registered as the charts' font; `None`
/// when there is none (or `$KVSTREAM_PLOT_FONT=none`). Looked up once per process.
pub fn find_system_font() -> Option<&'static Path> {
    static FONT: OnceLock<Option<PathBuf>> = OnceLock::new();
    FONT.get_or_init(|| {
        font_candidates().into_iter().find(|path| {
            let Ok(bytes) = std::fs::read(path) else {
                return false;
            };
            // plotters keeps the font for the life of the process
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).is_ok()
        })
    })
    .as_deref()
}

/// Writes `{prefix}-{group}.svg` and `.png` into `dir` for every group of `results`; text
/// when a system font was found (else a note on stderr, once per process).
pub fn plot_results(results: &BenchResults, dir: &Path, prefix: &str) -> Result<Written, String> {
    let with_text = find_system_font().is_some();
    if !with_text {
        static SAID: OnceLock<()> = OnceLock::new();
        SAID.get_or_init(|| {
            eprintln!(
                "note: no TTF font found (looked in {} and ${FONT_ENV}); the plots have no text",
                FONT_DIRS.join(", ")
            )
        });
    }
    plot_results_with(results, dir, prefix, with_text)
}

/// [`plot_results`] with the text choice made by the caller (`with_text` needs a registered
/// font, see [`find_system_font`]).
pub fn plot_results_with(
    results: &BenchResults,
    dir: &Path,
    prefix: &str,
    with_text: bool,
) -> Result<Written, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut written = Written {
        files: Vec::new(),
        with_text,
    };
    for (group, rows) in groups(&results.rows) {
        let chart = Chart::new(results, &group, &rows, with_text);
        let svg = dir.join(format!("{prefix}-{group}.svg"));
        {
            let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
            chart
                .draw(&root)
                .map_err(|e| format!("{}: {e}", svg.display()))?;
            root.present()
                .map_err(|e| format!("{}: {e}", svg.display()))?;
        }
        written.files.push(svg);
        let png = dir.join(format!("{prefix}-{group}.png"));
        {
            let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
            chart
                .draw(&root)
                .map_err(|e| format!("{}: {e}", png.display()))?;
            root.present()
                .map_err(|e| format!("{}: {e}", png.display()))?;
        }
        written.files.push(png);
    }
    Ok(written)
}

/// Rows by group, groups in order of first appearance.
fn groups(rows: &[Row]) -> Vec<(String, Vec<&Row>)> {
    let mut out: Vec<(String, Vec<&Row>)> = Vec::new();
    for r in rows {
        let g = r.group_name();
        match out.iter_mut().find(|(name, _)| *name == g) {
            Some((_, v)) => v.push(r),
            None => out.push((g, vec![r])),
        }
    }
    out
}

/// "4K" for 4096, "1000" for 1000.
fn short_len(l: usize) -> String {
    if l >= 1024 && l % 1024 == 0 {
        format!("{}K", l / 1024)
    } else {
        l.to_string()
    }
}

/// One line of a chart: its name and a value per x position (None: no point; the line breaks).
struct Series {
    name: String,
    values: Vec<Option<f64>>,
    color: RGBColor,
    dashed: bool,
}

/// Everything a chart shows, independent of the backend.
struct Chart {
    title: String,
    x_desc: &'static str,
    labels: Vec<String>,
    /// Adjacent x positions with different keys are not joined by lines.
    segment: Vec<String>,
    series: Vec<Series>,
    ceiling_tbps: Option<f64>,
    with_text: bool,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

impl Chart {
    fn new(results: &BenchResults, group: &str, rows: &[&Row], with_text: bool) -> Self {
        let by_batch = group == "batch";
        let custom = group == crate::results::CUSTOM_GROUP;
        let distinct = |f: &dyn Fn(&Row) -> usize| {
            rows.iter().map(|r| f(r)).collect::<BTreeSet<_>>().len() > 1
        };
        let several_d = distinct(&|r| r.d);
        let several_len = distinct(&|r| r.len);
        let labels = rows
            .iter()
            .map(|r| {
                if custom {
                    r.id.trim_start_matches("custom-").to_string()
                } else if by_batch {
                    let mut s = format!("b{}", r.batch);
                    if several_len {
                        s += &format!(" L{}", short_len(r.len));
                    }
                    s
                } else {
                    let mut s = short_len(r.len);
                    if several_d {
                        s += &format!(" d{}", r.d);
                    }
                    s
                }
            })
            .collect();
        // a line joins shapes that differ only in the x variable
        let segment = rows
            .iter()
            .map(|r| {
                if by_batch {
                    format!("{} {} {} {}", r.hq, r.hkv, r.d, r.len)
                } else if custom {
                    r.id.clone()
                } else {
                    format!("{} {} {} {}", r.batch, r.hq, r.hkv, r.d)
                }
            })
            .collect();
        let mut names: Vec<String> = rows
            .iter()
            .flat_map(|r| r.results.keys().cloned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        // kvstream first, its variants next, peers after
        names.sort_by_key(|n| (n != "kvstream", !n.starts_with("kvstream"), n.clone()));
        let mut series: Vec<Series> = names
            .iter()
            .enumerate()
            .map(|(i, name)| Series {
                name: name.clone(),
                values: rows
                    .iter()
                    .map(|r| r.results.get(name).and_then(|x| x.tbps(r.io_bytes)))
                    .collect(),
                color: PALETTE[i % PALETTE.len()],
                dashed: false,
            })
            .collect();
        series.push(Series {
            name: "byte floor (streaming read)".into(),
            values: rows.iter().map(|r| r.floor_tbps()).collect(),
            color: RGBColor(0, 0, 0),
            dashed: true,
        });
        Chart {
            title: format!(
                "{group}: effective bandwidth, {} ({} {})",
                results.gpu, results.commit, results.date
            ),
            x_desc: if by_batch {
                "batch"
            } else if custom {
                "shape"
            } else {
                "L (cache length)"
            },
            labels,
            segment,
            series,
            ceiling_tbps: results
                .read_ceiling_gbps
                .filter(|g| g.is_finite() && *g > 0.0)
                .map(|g| g / 1e3),
            with_text,
        }
    }

    /// Runs of consecutive x positions that one line may join, with their values.
    fn runs(&self, values: &[Option<f64>]) -> Vec<Vec<(u32, f64)>> {
        let mut runs: Vec<Vec<(u32, f64)>> = Vec::new();
        let mut current: Vec<(u32, f64)> = Vec::new();
        for (i, v) in values.iter().enumerate() {
            let joins = i > 0 && self.segment[i] == self.segment[i - 1];
            if !joins && !current.is_empty() {
                runs.push(std::mem::take(&mut current));
            }
            match v {
                Some(y) => current.push((i as u32, *y)),
                None => {
                    if !current.is_empty() {
                        runs.push(std::mem::take(&mut current));
                    }
                }
            }
        }
        if !current.is_empty() {
            runs.push(current);
        }
        runs
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let n = self.labels.len().max(1) as u32;
        let top = self
            .series
            .iter()
            .flat_map(|s| s.values.iter().flatten().copied())
            .chain(self.ceiling_tbps)
            .filter(|y| y.is_finite())
            .fold(0.0f64, f64::max);
        let y_max = if top > 0.0 { top * 1.12 } else { 1.0 };
        let mut builder = ChartBuilder::on(root);
        builder.margin(16);
        if self.with_text {
            builder
                .caption(&self.title, (FAMILY, 22))
                .x_label_area_size(48)
                .y_label_area_size(64);
        }
        let mut chart = builder
            // a discrete u32 range includes its end: 0..n-1 is n segments
            .build_cartesian_2d((0u32..n - 1).into_segmented(), 0f64..y_max)
            .map_err(e)?;
        let labels = &self.labels;
        let fmt_x = |v: &SegmentValue<u32>| match v {
            SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(RGBColor(235, 235, 235));
        if self.with_text {
            mesh.x_labels(n as usize)
                .x_label_formatter(&fmt_x)
                .x_desc(self.x_desc)
                .y_desc("effective TB/s (Q+K+V+O bytes / latency)")
                .label_style((FAMILY, 12));
        }
        // without text there are no label areas, so the mesh draws lines only
        mesh.draw().map_err(e)?;

        if let Some(c) = self.ceiling_tbps {
            let line = vec![(SegmentValue::Exact(0), c), (SegmentValue::Last, c)];
            let s = chart
                .draw_series(DashedLineSeries::new(
                    line,
                    4,
                    6,
                    RGBColor(120, 120, 120).stroke_width(1),
                ))
                .map_err(e)?;
            if self.with_text {
                s.label(format!("read ceiling ({c:.2} TB/s)"))
                    .legend(|(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], RGBColor(120, 120, 120))
                    });
            }
        }
        for s in &self.series {
            let color = s.color;
            let style = color.stroke_width(if s.dashed { 2 } else { 3 });
            let mut first = true;
            for run in self.runs(&s.values) {
                let pts: Vec<(SegmentValue<u32>, f64)> = run
                    .iter()
                    .map(|&(i, y)| (SegmentValue::CenterOf(i), y))
                    .collect();
                let drawn = if s.dashed {
                    chart
                        .draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))
                        .map_err(e)?
                } else {
                    chart
                        .draw_series(LineSeries::new(pts.clone(), style))
                        .map_err(e)?
                };
                if first && self.with_text {
                    drawn.label(s.name.clone()).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                    });
                }
                first = false;
                chart
                    .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                    .map_err(e)?;
            }
        }
        if self.with_text {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(160, 160, 160))
                .label_font((FAMILY, 14))
                .draw()
                .map_err(e)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::tests::fake_results;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvstream-plot-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn check_written(w: &Written, groups: &[&str], prefix: &str) {
        for g in groups {
            for ext in ["svg", "png"] {
                let p = w
                    .files
                    .iter()
                    .find(|p| {
                        p.file_name().unwrap().to_string_lossy() == format!("{prefix}-{g}.{ext}")
                    })
                    .unwrap_or_else(|| panic!("no {g}.{ext} in {:?}", w.files));
                let len = std::fs::metadata(p).unwrap().len();
                assert!(len > 1000, "{}: {len} bytes", p.display());
            }
        }
        let svg = std::fs::read_to_string(
            w.files
                .iter()
                .find(|p| p.extension().unwrap() == "svg")
                .unwrap(),
        )
        .unwrap();
        assert!(
            svg.contains("<svg") && svg.contains("polyline"),
            "no lines in the SVG"
        );
    }

    #[test]
    fn plots_fake_results_with_the_system_font_when_there_is_one() {
        let r = fake_results();
        let dir = temp_dir("font");
        let w = plot_results(&r, &dir, "fake").unwrap();
        assert_eq!(w.files.len(), 2 * 5, "{:?}", w.files);
        check_written(&w, &["gqa", "mqa", "mha", "batch", "custom"], "fake");
        if w.with_text {
            let svg = std::fs::read_to_string(dir.join("fake-gqa.svg")).unwrap();
            assert!(svg.contains("byte floor"), "legend missing");
            assert!(svg.contains("128K"), "L labels missing");
            let svg = std::fs::read_to_string(dir.join("fake-batch.svg")).unwrap();
            assert!(svg.contains("b128"), "batch labels missing");
        } else {
            println!("no system font: the charts were drawn without text");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn plots_without_text_need_no_font() {
        let r = fake_results();
        let dir = temp_dir("plain");
        let w = plot_results_with(&r, &dir, "plain", false).unwrap();
        check_written(&w, &["gqa", "mqa", "mha", "batch", "custom"], "plain");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lines_break_between_sub_series_and_at_missing_points() {
        let r = fake_results();
        let rows: Vec<&Row> = r
            .rows
            .iter()
            .filter(|x| x.group_name() == "batch")
            .collect();
        let c = Chart::new(&r, "batch", &rows, true);
        assert_eq!(c.labels.len(), 12);
        assert_eq!(c.labels[0], "b1 L4K");
        let floor = c.series.last().unwrap();
        assert_eq!(
            c.runs(&floor.values).len(),
            2,
            "two cache lengths, two lines"
        );
        let mut values = floor.values.clone();
        values[2] = None;
        assert_eq!(c.runs(&values).len(), 3);
        assert_eq!(c.series[0].name, "kvstream");
        assert_eq!(c.series[1].name, "kvstream/g2");
    }
}
