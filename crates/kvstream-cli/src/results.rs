//! What `kvstream bench` reads and writes: the shape matrix (bench/matrix.json) and the results
//! file in the format of docs/benchmarking.md. Plain data, no GPU: `kvstream plot` and the tests use it too.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Group of shapes given with `--shape` rather than taken from the matrix.
pub const CUSTOM_GROUP: &str = "custom";

/// One decode shape of the benchmark.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    /// Unique name, e.g. `gqa-d128-L131072`.
    pub id: String,
    /// Plot group: mqa, gqa, mha, batch (matrix) or custom (command line).
    pub group: String,
    /// Requests.
    pub batch: usize,
    /// New tokens per request (the kernels decode one).
    pub q_len: usize,
    /// Query heads.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
    /// Cache length of every request.
    #[serde(rename = "L")]
    pub len: usize,
    /// Element type name.
    pub dtype: String,
    /// Paged cache with pages of this many positions (shuffled pages); contiguous when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<usize>,
    /// Skewed batch: one request has this many positions and the others `L`; which request is
    /// long changes from set to set (every call of a replay sees other lengths). Needs pages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_len: Option<usize>,
    /// Paged cache whose pages are handed out in pool order (each request's pages consecutive
    /// in memory) instead of shuffled: separates the cost of scattered pages from the cost of
    /// paging itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pages_in_order: bool,
    /// Ragged batch: request b of set 0 has `lens[b]` positions (each at most `L`, the
    /// capacity); set s rotates them by s requests, so every call of a replayed graph sees
    /// other lengths with the same total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lens: Option<Vec<usize>>,
    /// Element type of the K and V caches when it is not `dtype` (`fp8_e4m3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_dtype: Option<String>,
    /// Score modifiers of a model row (bench/matrix-models.json, timed by bench/compare.py): a
    /// left window, a softcap, attention sinks. `kvstream bench` refuses rows that carry any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub softcap: Option<f64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sinks: bool,
}

impl Shape {
    /// Cache positions of each request in pool set `set`.
    pub fn lens(&self, set: usize) -> Vec<usize> {
        if let Some(lens) = &self.lens {
            return (0..self.batch)
                .map(|b| lens[(b + set) % self.batch])
                .collect();
        }
        (0..self.batch)
            .map(|b| match self.long_len {
                Some(long) if b == set % self.batch => long,
                _ => self.len,
            })
            .collect()
    }

    /// Whether the lengths change from set to set (skewed and ragged batches): one captured
    /// graph then replays calls with other lengths.
    pub fn varies_lengths(&self) -> bool {
        self.long_len.is_some() || self.lens.is_some()
    }

    /// Cache capacity per request: the longest length any set gives a request.
    pub fn max_len(&self) -> usize {
        self.long_len.unwrap_or(0).max(self.len)
    }

    /// A bf16 shape from `batch,hq,hkv,d,L` (the `--shape` syntax).
    pub fn parse_cli(spec: &str) -> Result<Self, String> {
        let nums: Vec<usize> = spec
            .split(',')
            .map(|t| t.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("--shape {spec:?}: {e} (expected batch,hq,hkv,d,L)"))?;
        let [batch, hq, hkv, d, len] = nums[..] else {
            return Err(format!(
                "--shape {spec:?}: expected 5 numbers batch,hq,hkv,d,L, got {}",
                nums.len()
            ));
        };
        Ok(Shape {
            id: format!("{CUSTOM_GROUP}-b{batch}-h{hq}-{hkv}-d{d}-L{len}"),
            group: CUSTOM_GROUP.into(),
            batch,
            q_len: 1,
            hq,
            hkv,
            d,
            len,
            dtype: "bf16".into(),
            page_size: None,
            long_len: None,
            pages_in_order: false,
            lens: None,
            kv_dtype: None,
            window: None,
            softcap: None,
            sinks: false,
        })
    }
}

/// bench/matrix.json.
#[derive(Clone, Debug, Deserialize)]
pub struct Matrix {
    /// The shapes, in plot order.
    pub shapes: Vec<Shape>,
}

impl Matrix {
    /// Parses a matrix file's text; ids must be unique.
    pub fn parse(text: &str) -> Result<Self, String> {
        let m: Matrix = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut ids: Vec<&str> = m.shapes.iter().map(|s| s.id.as_str()).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("shape id {:?} appears twice", w[0]));
        }
        Ok(m)
    }

    /// Reads and parses a matrix file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The shapes whose ids are listed, in the matrix's order; an unknown id is an error.
    pub fn select(&self, ids: &[String]) -> Result<Vec<Shape>, String> {
        if let Some(bad) = ids
            .iter()
            .find(|id| !self.shapes.iter().any(|s| &s.id == *id))
        {
            return Err(format!("--ids: no shape {bad:?} in the matrix"));
        }
        Ok(self
            .shapes
            .iter()
            .filter(|s| ids.contains(&s.id))
            .cloned()
            .collect())
    }
}

/// One implementation's result on one shape: numbers, or `error`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ImplResult {
    /// Median latency per call, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub us: Option<f64>,
    /// io_bytes / us, decimal GB/s.
    #[serde(rename = "GBps", default, skip_serializing_if = "Option::is_none")]
    pub gbps: Option<f64>,
    /// ||o - ref|| / ||ref|| on set 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rel_err: Option<f64>,
    /// `kernel+pdl` (split-KV with combine) or `single`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// KV splits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub splits: Option<usize>,
    /// Minimum latency per call over the rounds, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_us: Option<f64>,
    /// Why there are no (valid) numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Keys other tools wrote (kept on a round trip).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl ImplResult {
    /// A failed result.
    pub fn failed(error: impl Into<String>) -> Self {
        ImplResult {
            error: Some(error.into()),
            ..Default::default()
        }
    }

    /// Effective bandwidth in TB/s when the result is valid: GBps, else io_bytes / us.
    pub fn tbps(&self, io_bytes: u64) -> Option<f64> {
        if self.error.is_some() {
            return None;
        }
        let gbps = self.gbps.or_else(|| {
            self.us
                .filter(|&us| us > 0.0)
                .map(|us| io_bytes as f64 / us / 1e3)
        })?;
        gbps.is_finite().then_some(gbps / 1e3)
    }
}

/// One shape's row of the results file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Shape id.
    pub id: String,
    /// Plot group (an extra key; inferred from the id when a file lacks it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Requests.
    pub batch: usize,
    /// New tokens per request.
    pub q_len: usize,
    /// Query heads.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
    /// Cache length.
    #[serde(rename = "L")]
    pub len: usize,
    /// Element type.
    pub dtype: String,
    /// Q + K + V + O bytes, each counted once.
    pub io_bytes: u64,
    /// Streaming read of io_bytes, same timer (best grid), microseconds.
    pub floor_us: Option<f64>,
    /// By implementation: `kvstream`, `kvstream/g2`, peers.
    pub results: BTreeMap<String, ImplResult>,
    /// Keys other tools wrote (kept on a round trip).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Row {
    /// The row of `shape` before anything is measured.
    pub fn for_shape(shape: &Shape, io_bytes: u64) -> Self {
        // the shape's optional keys (page_size, long_len, ...: whatever it serialises beyond
        // the row's own fields) travel as extra keys of the row
        const ROW_KEYS: [&str; 9] = [
            "id", "group", "batch", "q_len", "hq", "hkv", "d", "L", "dtype",
        ];
        let extra = match serde_json::to_value(shape) {
            Ok(serde_json::Value::Object(keys)) => keys
                .into_iter()
                .filter(|(k, _)| !ROW_KEYS.contains(&k.as_str()))
                .collect(),
            _ => unreachable!("a Shape serialises to a JSON object"),
        };
        Row {
            id: shape.id.clone(),
            group: Some(shape.group.clone()),
            batch: shape.batch,
            q_len: shape.q_len,
            hq: shape.hq,
            hkv: shape.hkv,
            d: shape.d,
            len: shape.len,
            dtype: shape.dtype.clone(),
            io_bytes,
            floor_us: None,
            results: BTreeMap::new(),
            extra,
        }
    }

    /// The plot group: the `group` key, else the id's prefix for matrix ids, else custom.
    pub fn group_name(&self) -> String {
        if let Some(g) = &self.group {
            return g.clone();
        }
        let prefix = self.id.split('-').next().unwrap_or("");
        match prefix {
            "mqa" | "gqa" | "mha" | "batch" => prefix.to_string(),
            _ => CUSTOM_GROUP.to_string(),
        }
    }

    /// Byte floor as TB/s.
    pub fn floor_tbps(&self) -> Option<f64> {
        self.floor_us
            .filter(|&us| us > 0.0 && us.is_finite())
            .map(|us| self.io_bytes as f64 / us / 1e6)
    }
}

/// A results file (docs/benchmarking.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchResults {
    /// YYYY-MM-DD (UTC).
    pub date: String,
    /// Short sha of the measured code.
    pub commit: String,
    /// GPU name.
    pub gpu: String,
    /// Streaming read over >= 4 GiB, best grid, decimal GB/s.
    #[serde(rename = "read_ceiling_GBps")]
    pub read_ceiling_gbps: Option<f64>,
    /// One per shape.
    pub rows: Vec<Row>,
    /// Keys other tools wrote (kept on a round trip).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl BenchResults {
    /// Reads a results file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes it (pretty-printed), creating the directory.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

/// The commit being measured: `$KVSTREAM_COMMIT` when set (a copy of the tree measured
/// elsewhere may carry another checkout's git metadata), else `git rev-parse --short HEAD`,
/// else "unknown".
pub fn current_commit() -> String {
    let env = std::env::var("KVSTREAM_COMMIT")
        .ok()
        .filter(|s| !s.is_empty());
    env.or_else(|| {
        std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
    .unwrap_or_else(|| "unknown".into())
}

/// Today's date (UTC) as YYYY-MM-DD.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// (year, month, day) of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The shared matrix the repository carries.
    const MATRIX: &str = include_str!("../../../bench/matrix.json");

    #[test]
    fn the_repository_matrix_has_60_valid_shapes() {
        let m = Matrix::parse(MATRIX).unwrap();
        assert_eq!(m.shapes.len(), 60);
        for group in ["mqa", "gqa", "mha", "batch"] {
            assert!(m.shapes.iter().any(|s| s.group == group), "{group}");
        }
        for s in &m.shapes {
            assert_eq!(s.dtype, "bf16", "{}", s.id);
            assert_eq!(s.q_len, 1, "{}", s.id);
            kvstream::DecodeProblem::new(s.batch, s.hq, s.hkv, s.d, s.len, kvstream::DType::Bf16)
                .unwrap_or_else(|e| panic!("{}: {e}", s.id));
        }
        let picked = m
            .select(&["gqa-d128-L131072".into(), "mqa-d64-L1024".into()])
            .unwrap();
        assert_eq!(picked.len(), 2);
        assert_eq!(picked[0].id, "mqa-d64-L1024"); // matrix order
        assert_eq!(
            (picked[1].hq, picked[1].hkv, picked[1].len),
            (16, 2, 131072)
        );
        assert!(m.select(&["nope".into()]).is_err());
    }

    #[test]
    fn matrix_rejects_duplicates_and_cli_shapes_parse() {
        let dup = r#"{"shapes": [
            {"id": "a", "group": "g", "batch": 1, "q_len": 1, "hq": 8, "hkv": 1, "d": 64, "L": 8, "dtype": "bf16"},
            {"id": "a", "group": "g", "batch": 1, "q_len": 1, "hq": 8, "hkv": 1, "d": 64, "L": 8, "dtype": "bf16"}]}"#;
        assert!(Matrix::parse(dup).is_err());
        let s = Shape::parse_cli("4, 32,8,128,4096").unwrap();
        assert_eq!(
            (s.batch, s.hq, s.hkv, s.d, s.len, s.group.as_str()),
            (4, 32, 8, 128, 4096, CUSTOM_GROUP)
        );
        assert_eq!(s.dtype, "bf16");
        assert!(Shape::parse_cli("1,16,2,128").is_err());
        assert!(Shape::parse_cli("1,16,2,128,x").is_err());
    }

    /// Fake results over a few matrix shapes (also used by the plot tests).
    pub(crate) fn fake_results() -> BenchResults {
        let m = Matrix::parse(MATRIX).unwrap();
        let mut rows = Vec::new();
        let mut shapes: Vec<Shape> = m
            .shapes
            .iter()
            .filter(|s| s.id.contains("d128") || s.group == "batch")
            .cloned()
            .collect();
        shapes.push(Shape::parse_cli("2,16,2,128,1000").unwrap());
        for (i, s) in shapes.iter().enumerate() {
            let io = (2 * s.batch * s.hq * s.d * 2 + 2 * s.batch * s.len * s.hkv * s.d * 2) as u64;
            let mut row = Row::for_shape(s, io);
            let floor = 1.5 + io as f64 / 4.4e6;
            row.floor_us = Some(floor);
            let us = floor * 1.3;
            row.results.insert(
                "kvstream".into(),
                ImplResult {
                    us: Some(us),
                    gbps: Some(io as f64 / us / 1e3),
                    rel_err: Some(2.1e-3),
                    mode: Some("kernel+pdl".into()),
                    splits: Some(32),
                    min_us: Some(us * 0.98),
                    ..Default::default()
                },
            );
            let g2 = if i % 5 == 3 {
                ImplResult::failed("rel err 3.0e-1 > 1e-2")
            } else {
                ImplResult {
                    us: Some(us * 1.1),
                    gbps: Some(io as f64 / us / 1.1e3),
                    rel_err: Some(2.0e-3),
                    mode: Some("single".into()),
                    splits: Some(1),
                    min_us: Some(us),
                    ..Default::default()
                }
            };
            row.results.insert("kvstream/g2".into(), g2);
            rows.push(row);
        }
        BenchResults {
            date: today(),
            commit: "abc1234".into(),
            gpu: "NVIDIA H200".into(),
            read_ceiling_gbps: Some(4550.0),
            rows,
            extra: BTreeMap::new(),
        }
    }

    #[test]
    fn results_round_trip_with_the_method_keys() {
        let r = fake_results();
        let text = serde_json::to_string_pretty(&r).unwrap();
        let back: BenchResults = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        for key in ["date", "commit", "gpu", "read_ceiling_GBps", "rows"] {
            assert!(v.get(key).is_some(), "top-level {key}");
        }
        let row = &v["rows"][0];
        for key in [
            "id", "batch", "q_len", "hq", "hkv", "d", "L", "dtype", "io_bytes", "floor_us",
            "results",
        ] {
            assert!(row.get(key).is_some(), "row {key}");
        }
        let k = &row["results"]["kvstream"];
        for key in ["us", "GBps", "rel_err", "mode", "splits", "min_us"] {
            assert!(k.get(key).is_some(), "kvstream {key}");
        }
        assert!(k.get("error").is_none());
        assert!(row["results"].get("kvstream/g2").is_some());
        // a failed result is {"error": ...} only
        let failed = serde_json::to_value(ImplResult::failed("boom")).unwrap();
        assert_eq!(failed, serde_json::json!({"error": "boom"}));
    }

    #[test]
    fn method_example_and_peer_keys_parse() {
        let text = r#"{ "date": "2026-12-01", "commit": "x", "gpu": "NVIDIA H200",
          "read_ceiling_GBps": 4550.0,
          "rows": [
            { "id": "gqa-d128-L131072", "batch": 1, "q_len": 1, "hq": 16, "hkv": 2, "d": 128,
              "L": 131072, "dtype": "bf16", "io_bytes": 134221824, "floor_us": 32.1,
              "results": {
                "kvstream":   {"us": 31.2, "GBps": 4301.0, "rel_err": 0.0021, "mode": "kernel+pdl", "splits": 32},
                "cudnn":      {"us": 38.9, "GBps": 3450.0, "rel_err": 0.0022, "backend": "cudnn"},
                "fa3":        {"error": "not installed"} } } ] }"#;
        let r: BenchResults = serde_json::from_str(text).unwrap();
        let row = &r.rows[0];
        assert_eq!(row.group_name(), "gqa");
        assert!(row.results["fa3"].tbps(row.io_bytes).is_none());
        assert!((row.results["kvstream"].tbps(row.io_bytes).unwrap() - 4.301).abs() < 1e-9);
        assert_eq!(row.results["cudnn"].extra["backend"], "cudnn");
        let again: BenchResults =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn rows_keep_the_shapes_optional_keys() {
        let serving: Matrix = Matrix::parse(include_str!("../../../bench/serving.json")).unwrap();
        let by_id = |id: &str| serving.shapes.iter().find(|s| s.id == id).unwrap();
        let row = Row::for_shape(by_id("inorder64-b16-L2048-long1048576"), 0);
        let keys: Vec<&str> = row.extra.keys().map(String::as_str).collect();
        assert_eq!(keys, ["long_len", "page_size", "pages_in_order"]);
        assert_eq!(row.extra["long_len"], 1_048_576);
        assert!(Row::for_shape(by_id("contig-d128-b8-L32768"), 0)
            .extra
            .is_empty());
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_788), (2026, 12, 1));
        assert_eq!(today().len(), 10);
    }
}
