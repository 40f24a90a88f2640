//! The persistent decode's schedule, mirrored from `kernels/include/schedule.cuh` (read its
//! header comment first): which KV tiles each CTA streams for given lengths. The kernel works
//! this out on the device at every call; this model is what the tests compare the kernel's
//! record with, and what the CPU reference uses to check the merge rule.

/// The longest aligned range (`aligned_limit`) taken over balanced shares of `share` tiles:
/// 1/32 more, plus four tiles (what a unit's cut and merge cost at least).
pub fn aligned_limit(share: u64) -> u64 {
    share + share / 32 + 4
}

/// The sequence of `total` tiles cut over `ctas` working CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Tiles in the sequence.
    pub total: u64,
    /// Working CTAs (0 when there are no tiles).
    pub ctas: usize,
    /// Aligned ranges: the tiles of each CTA (k whole units of U tiles) or of each part of a
    /// unit (q); 0: balanced shares.
    pub per: u64,
    /// Units in parts: U, the tiles of every unit; 0: whole units or balanced shares.
    pub unit: u64,
    /// Units in parts: f = ceil(U / q) parts a unit; 1 otherwise.
    pub parts: u64,
}

impl Schedule {
    /// `make_schedule`: at most `grid` CTAs, each with at least `min_tiles` tiles where there
    /// are enough, in balanced shares; or aligned ranges where all `units` units have the same
    /// tiles (`unit_min == unit_max`) and the longest range is at most [`aligned_limit`] of the
    /// balanced share: k whole units a CTA where there are as many units as CTAs, else each
    /// unit in equal parts.
    pub fn new(
        total: u64,
        grid: usize,
        min_tiles: usize,
        units: u64,
        unit_min: u64,
        unit_max: u64,
    ) -> Self {
        let ctas = total.div_ceil(min_tiles as u64).min(grid as u64);
        if total > 0 && unit_min == unit_max {
            let limit = aligned_limit(total.div_ceil(ctas));
            if units >= ctas {
                let k = units.div_ceil(grid as u64);
                if k * unit_min <= limit {
                    return Schedule {
                        total,
                        ctas: units.div_ceil(k) as usize,
                        per: k * unit_min,
                        unit: 0,
                        parts: 1,
                    };
                }
            } else {
                let q = unit_min.div_ceil(ctas / units);
                let f = unit_min.div_ceil(q);
                if q <= limit {
                    return Schedule {
                        total,
                        ctas: (units * f) as usize,
                        per: q,
                        unit: if f > 1 { unit_min } else { 0 },
                        parts: f,
                    };
                }
            }
        }
        Schedule {
            total,
            ctas: ctas as usize,
            per: 0,
            unit: 0,
            parts: 1,
        }
    }

    /// B(c): the first tile of CTA c.
    pub fn begin(&self, c: usize) -> u64 {
        if self.unit > 0 {
            let c = c as u64;
            (c / self.parts) * self.unit + (c % self.parts) * self.per
        } else if self.per > 0 {
            (c as u64 * self.per).min(self.total)
        } else {
            c as u64 * self.total / self.ctas as u64
        }
    }

    /// The CTA whose range holds tile `t`.
    pub fn cta_of(&self, t: u64) -> usize {
        if let Some(u) = t.checked_div(self.unit) {
            (u * self.parts + (t - u * self.unit) / self.per) as usize // units in parts
        } else if let Some(c) = t.checked_div(self.per) {
            c as usize // whole units
        } else {
            (((t + 1) * self.ctas as u64 - 1) / self.total) as usize
        }
    }

    /// Workspace slot of CTA c's cut piece that starts at tile `start`.
    pub fn slot(&self, c: usize, start: u64) -> usize {
        2 * c + usize::from(start != self.begin(c))
    }
}

/// Tiles of a request of `len` positions.
pub fn tiles_of(len: usize, tile_tokens: usize) -> usize {
    len.div_ceil(tile_tokens)
}

/// The first position a request of `len` positions streams (`first_position`): 0, or with a
/// window of `window_left` positions the first position its first of `q_len` new tokens sees,
/// rounded down to a multiple of `granularity` ([`tile_granularity`]).
pub fn first_position(
    len: usize,
    q_len: usize,
    window_left: Option<usize>,
    granularity: usize,
) -> usize {
    match window_left {
        None => 0,
        Some(left) => len.saturating_sub(q_len + left) / granularity * granularity,
    }
}

/// Where a unit's tiles may start: anywhere in a contiguous cache, on a page run
/// (`min(page_size, tile_tokens)`) in a paged one.
pub fn tile_granularity(page_size: Option<usize>, tile_tokens: usize) -> usize {
    page_size.map_or(1, |p| p.min(tile_tokens))
}

/// A request's window as the schedule sees it: new tokens per request, the window's left side,
/// and where tiles may start ([`tile_granularity`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileWindow {
    /// New tokens per request.
    pub q_len: usize,
    /// Positions before a query's own it sees (`None`: all).
    pub left: Option<usize>,
    /// [`tile_granularity`].
    pub granularity: usize,
}

impl TileWindow {
    /// No window: every unit streams its request from position 0.
    pub const NONE: TileWindow = TileWindow {
        q_len: 1,
        left: None,
        granularity: 1,
    };
}

/// One unit's part of one CTA's range (`Piece` in schedule.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Request.
    pub batch: usize,
    /// Unit within the request: `kv_head * col_blocks + col_block`.
    pub unit: usize,
    /// First tile of the unit in this piece (tile k holds positions from origin + k x
    /// tile_tokens).
    pub first: usize,
    /// One past its last tile.
    pub end: usize,
    /// Tiles of the unit.
    pub tiles: usize,
    /// Global index of the unit's first tile.
    pub start: u64,
    /// The position of the unit's tile 0 ([`first_position`]).
    pub origin: usize,
}

impl Piece {
    /// Whether the piece is the whole unit (written out directly, no merge).
    pub fn whole(&self) -> bool {
        self.first == 0 && self.end == self.tiles
    }
}

/// The whole schedule of one call: per working CTA, its pieces in order.
///
/// `lens` are the clamped lengths, `units` the units per request (hkv x column blocks).
pub fn pieces(
    lens: &[usize],
    units: usize,
    tile_tokens: usize,
    grid: usize,
    min_tiles: usize,
) -> (Schedule, Vec<Vec<Piece>>) {
    pieces_in_window(lens, TileWindow::NONE, units, tile_tokens, grid, min_tiles)
}

/// [`pieces`] with a sliding window: each unit streams only the tiles from its request's
/// [`first_position`] on.
pub fn pieces_in_window(
    lens: &[usize],
    window: TileWindow,
    units: usize,
    tile_tokens: usize,
    grid: usize,
    min_tiles: usize,
) -> (Schedule, Vec<Vec<Piece>>) {
    let origins: Vec<usize> = lens
        .iter()
        .map(|&l| first_position(l, window.q_len, window.left, window.granularity))
        .collect();
    let tiles: Vec<usize> = lens
        .iter()
        .zip(&origins)
        .map(|(&l, &o)| tiles_of(l - o, tile_tokens))
        .collect();
    let total: u64 = tiles.iter().map(|&t| (t * units) as u64).sum();
    let busy = tiles.iter().filter(|&&t| t > 0);
    let (lo, hi) = (busy.clone().min(), busy.clone().max());
    let s = Schedule::new(
        total,
        grid,
        min_tiles,
        (busy.count() * units) as u64,
        lo.map_or(0, |&t| t as u64),
        hi.map_or(0, |&t| t as u64),
    );
    let mut out = vec![Vec::new(); s.ctas];
    let mut start = 0u64;
    for (b, &t) in tiles.iter().enumerate() {
        for unit in 0..units {
            if t == 0 {
                continue;
            }
            let end = start + t as u64;
            let (c0, c1) = (s.cta_of(start), s.cta_of(end - 1));
            for (c, list) in out.iter_mut().enumerate().take(c1 + 1).skip(c0) {
                let lo = s.begin(c).max(start);
                let hi = s.begin(c + 1).min(end);
                list.push(Piece {
                    batch: b,
                    unit,
                    first: (lo - start) as usize,
                    end: (hi - start) as usize,
                    tiles: t,
                    start,
                    origin: origins[b],
                });
            }
            start = end;
        }
    }
    (s, out)
}

/// Workspace slot of a cut piece of lane `lane` (of `lanes`) whose in-lane slot is `slot`
/// (`lane_slot` in schedule.cuh).
pub fn lane_slot(slot: usize, lanes: usize, lane: usize) -> usize {
    slot * lanes + lane
}

/// The whole schedule of one call with column lanes (schedule.cuh): the grid's CTAs dealt into
/// `lanes` lanes (CTA i in lane i % lanes, at place i / lanes), each lane scheduled as
/// [`pieces`] over `grid / lanes` CTAs and the units of its column block. `units` are the units
/// per request of all lanes (hkv x column blocks, a multiple of `lanes`); the result is indexed
/// by CTA, `lanes` x the schedule's working CTAs of them.
pub fn pieces_in_lanes(
    lens: &[usize],
    window: TileWindow,
    units: usize,
    lanes: usize,
    tile_tokens: usize,
    grid: usize,
    min_tiles: usize,
) -> (Schedule, Vec<Vec<Piece>>) {
    assert!(lanes >= 1 && units % lanes == 0 && grid >= lanes);
    let (s, per_place) = pieces_in_window(
        lens,
        window,
        units / lanes,
        tile_tokens,
        grid / lanes,
        min_tiles,
    );
    let mut out = Vec::with_capacity(per_place.len() * lanes);
    for list in &per_place {
        for lane in 0..lanes {
            out.push(
                list.iter()
                    .map(|p| Piece {
                        unit: p.unit * lanes + lane,
                        ..*p
                    })
                    .collect(),
            );
        }
    }
    (s, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_streams_only_its_own_tiles() {
        let tile = 64;
        for (granularity, left, q_len) in [(1, 128, 1), (16, 100, 4), (64, 0, 2), (1, 5000, 1)] {
            let window = TileWindow {
                q_len,
                left: Some(left),
                granularity,
            };
            let lens = [0, 1, 100, 129, 4096, 32_768];
            let (s, per_cta) = pieces_in_window(&lens, window, 3, tile, 16, 2);
            for (b, &len) in lens.iter().enumerate() {
                let origin = first_position(len, q_len, Some(left), granularity);
                // the first position the first new token sees is streamed, from a granule start
                let seen_from = len.saturating_sub(q_len + left);
                assert!(origin <= seen_from && seen_from - origin < granularity.max(1));
                assert_eq!(origin % granularity, 0);
                // every unit of the request: its tiles once each, from the origin to the length
                for unit in 0..3 {
                    let mut got: Vec<usize> = per_cta
                        .iter()
                        .flatten()
                        .filter(|p| p.batch == b && p.unit == unit)
                        .inspect(|p| assert_eq!(p.origin, origin))
                        .flat_map(|p| p.first..p.end)
                        .collect();
                    got.sort_unstable();
                    let want: Vec<usize> = (0..tiles_of(len - origin, tile)).collect();
                    assert_eq!(got, want, "len {len} unit {unit}");
                }
            }
            let total: u64 = lens
                .iter()
                .map(|&l| {
                    3 * tiles_of(l - first_position(l, q_len, Some(left), granularity), tile) as u64
                })
                .sum();
            assert_eq!(s.total, total);
        }
        // no window: the plain schedule
        assert_eq!(
            pieces_in_window(&[4096, 7], TileWindow::NONE, 2, 64, 8, 2),
            pieces(&[4096, 7], 2, 64, 8, 2)
        );
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
            z ^ (z >> 31)
        }
    }

    /// Every tile of every unit is streamed exactly once, by CTAs in order, in shares that
    /// differ by at most one tile; cut pieces are only first or last of their CTA and their
    /// slots are distinct.
    #[test]
    fn pieces_cover_every_tile_once_in_balanced_shares() {
        let mut rng = Rng(7);
        for case in 0..400 {
            let batch = 1 + (rng.next() % 40) as usize;
            let units = 1 + (rng.next() % 8) as usize;
            let grid = 1 + (rng.next() % 140) as usize;
            let min_tiles = 1 + (rng.next() % 4) as usize;
            let uniform = (rng.next() % 200) as usize;
            let lens: Vec<usize> = (0..batch)
                .map(|_| match rng.next() % 4 {
                    // one case in three has uniform lengths (whole units where they fit)
                    _ if case % 3 == 0 => uniform,
                    0 => 0,
                    1 => (rng.next() % 200) as usize,
                    _ => (rng.next() % 20000) as usize,
                })
                .collect();
            let (s, per_cta) = pieces(&lens, units, 64, grid, min_tiles);
            let total: u64 = lens.iter().map(|&l| (tiles_of(l, 64) * units) as u64).sum();
            assert_eq!(s.total, total);
            if total == 0 {
                assert_eq!(s.ctas, 0);
                continue;
            }
            assert!(s.ctas >= 1 && s.ctas <= grid);
            let mut seen = std::collections::HashMap::new();
            let mut slots = std::collections::HashSet::new();
            for (c, list) in per_cta.iter().enumerate() {
                let share: u64 = list.iter().map(|p| (p.end - p.first) as u64).sum();
                assert_eq!(share, s.begin(c + 1) - s.begin(c), "case {case} cta {c}");
                let floor = total / s.ctas as u64;
                let balanced = total.div_ceil(total.div_ceil(min_tiles as u64).min(grid as u64));
                if s.unit > 0 {
                    // units in parts: one piece a CTA, every part q tiles but a unit's last,
                    // at most the limit over the balanced share
                    assert_eq!(list.len(), 1, "case {case}: two pieces in one part");
                    assert!(share == s.per || (list[0].end == list[0].tiles && share < s.per));
                    assert!(s.per <= aligned_limit(balanced), "case {case}");
                } else if s.per > 0 {
                    // whole units: k of them a CTA (the last CTA the rest), none cut, at most
                    // the limit over the balanced share of the CTAs the grid would have had
                    assert!(share == s.per || (c + 1 == s.ctas && share <= s.per));
                    assert!(
                        list.iter().all(|p| p.whole()),
                        "case {case}: a cut whole unit"
                    );
                    assert!(s.per <= aligned_limit(balanced), "case {case}");
                } else {
                    assert!(
                        share == floor || share == floor + 1,
                        "case {case}: share {share}"
                    );
                }
                for (i, p) in list.iter().enumerate() {
                    assert!(p.first < p.end && p.end <= p.tiles);
                    if !p.whole() {
                        assert!(i == 0 || i == list.len() - 1, "cut piece in the middle");
                        assert!(slots.insert(s.slot(c, p.start + p.first as u64)));
                    }
                    *seen.entry((p.batch, p.unit)).or_insert(0usize) += p.end - p.first;
                }
            }
            for (b, &l) in lens.iter().enumerate() {
                for u in 0..units {
                    let want = tiles_of(l, 64);
                    assert_eq!(seen.get(&(b, u)).copied().unwrap_or(0), want);
                }
            }
        }
    }

    /// With lanes, every tile of every unit is streamed once, by the CTAs of its lane (units
    /// per request a multiple of the lanes: column lanes, several per lane; head lanes, one),
    /// the lanes in step (the same tiles at the same places), and the cut pieces' slots are
    /// distinct across all lanes and within twice the grid.
    #[test]
    fn lanes_stream_every_unit_once_in_step() {
        let mut rng = Rng(5);
        for case in 0..200 {
            let batch = 1 + (rng.next() % 20) as usize;
            let lanes = 1 + (rng.next() % 16) as usize;
            let units = lanes * (1 + (rng.next() % 3) as usize);
            let grid = lanes + (rng.next() % 140) as usize;
            let lens: Vec<usize> = (0..batch).map(|_| (rng.next() % 9000) as usize).collect();
            let (s, per_cta) = pieces_in_lanes(&lens, TileWindow::NONE, units, lanes, 64, grid, 2);
            assert_eq!(per_cta.len(), s.ctas * lanes);
            let mut seen = std::collections::HashMap::new();
            let mut slots = std::collections::HashSet::new();
            for (i, list) in per_cta.iter().enumerate() {
                let (place, lane) = (i / lanes, i % lanes);
                let first = &per_cta[place * lanes];
                assert_eq!(list.len(), first.len(), "case {case}: lanes out of step");
                for (p, q) in list.iter().zip(first) {
                    assert_eq!((p.batch, p.first, p.end), (q.batch, q.first, q.end));
                    assert_eq!(p.unit % lanes, lane, "case {case}: a unit of another lane");
                    if !p.whole() {
                        let slot = lane_slot(s.slot(place, p.start + p.first as u64), lanes, lane);
                        assert!(
                            slot < 2 * grid && slots.insert(slot),
                            "case {case}: slot {slot}"
                        );
                    }
                    *seen.entry((p.batch, p.unit)).or_insert(0usize) += p.end - p.first;
                }
            }
            for (b, &l) in lens.iter().enumerate() {
                for u in 0..units {
                    let got = seen.get(&(b, u)).copied().unwrap_or(0);
                    assert_eq!(got, tiles_of(l, 64), "case {case}");
                }
            }
        }
    }

    /// The pieces of every unit, each a partial over its tiles' positions and merged in CTA
    /// order as the merging CTA does, give the f64 reference output and LSE of every row.
    #[test]
    fn pieces_merged_in_cta_order_give_the_reference() {
        use crate::reference::{
            combine_partials, decode_reference, random_bf16, relative_error, split_partial,
            RefShape, SplitMix64,
        };
        let tile = 16;
        let mut rng = Rng(11);
        for case in 0..12 {
            let (hq, hkv, d) = [(4, 2, 16), (8, 1, 32), (6, 3, 16)][case % 3];
            let batch = 1 + (rng.next() % 5) as usize;
            let lens: Vec<usize> = (0..batch)
                .map(|_| match rng.next() % 4 {
                    0 => 0,
                    _ => (rng.next() % 300) as usize,
                })
                .collect();
            let max_len = lens.iter().copied().max().unwrap_or(0) + 5;
            let shape = RefShape {
                batch,
                q_len: 1,
                hq,
                hkv,
                d,
                max_len,
                softmax_scale: 1.0 / (d as f64).sqrt(),
            };
            let mut data = SplitMix64::new(case as u64);
            let (_, q) = random_bf16(&mut data, batch * hq * d, 2.0);
            let (_, k) = random_bf16(&mut data, batch * max_len * hkv * d, 1.0);
            let (_, v) = random_bf16(&mut data, batch * max_len * hkv * d, 1.0);
            let want = decode_reference(&shape, &q, &k, &v, &lens);
            let grid = 1 + (rng.next() % 40) as usize;
            let (_, per_cta) = pieces(&lens, hkv, tile, grid, 1 + case % 3);
            // each unit's pieces in CTA order
            let mut by_unit: std::collections::BTreeMap<(usize, usize), Vec<Piece>> =
                Default::default();
            for list in &per_cta {
                for p in list {
                    by_unit.entry((p.batch, p.unit)).or_default().push(*p);
                }
            }
            for (b, &len) in lens.iter().enumerate() {
                for h in 0..hq {
                    let row = b * hq + h;
                    let got = match by_unit.get(&(b, h / (hq / hkv))) {
                        None => (vec![0.0; d], f64::NEG_INFINITY), // zero-length request
                        Some(list) => {
                            let partials: Vec<_> = list
                                .iter()
                                .map(|p| {
                                    let r = p.first * tile..(p.end * tile).min(len);
                                    split_partial(&shape, &q, &k, &v, b, 0, h, r)
                                })
                                .collect();
                            combine_partials(&partials, d)
                        }
                    };
                    let o = &want.out[row * d..(row + 1) * d];
                    assert!(relative_error(&got.0, o) < 1e-12, "case {case} row {row}");
                    let (a, e) = (got.1, want.lse[row]);
                    assert!(
                        a == e || (a - e).abs() < 1e-9,
                        "case {case} row {row}: {a} {e}"
                    );
                }
            }
        }
    }

    /// The closed forms agree with their definitions: cta_of(t) is the largest c with
    /// B(c) <= t, in both kinds of schedule.
    #[test]
    fn cta_of_inverts_begin() {
        for total in 1..300u64 {
            for ctas in 1..=total.min(140) as usize {
                let balanced = Schedule {
                    total,
                    ctas,
                    per: 0,
                    unit: 0,
                    parts: 1,
                };
                let per = total.div_ceil(ctas as u64);
                let whole = Schedule {
                    total,
                    ctas: total.div_ceil(per) as usize,
                    per,
                    unit: 0,
                    parts: 1,
                };
                let mut schedules = vec![balanced, whole];
                if ctas == 1 && total <= 120 {
                    // units in parts: `units` units of U tiles, each in f parts of q
                    for units in (1..total).filter(|u| total % u == 0) {
                        let unit = total / units;
                        for q in 1..unit {
                            schedules.push(Schedule {
                                total,
                                ctas: (units * unit.div_ceil(q)) as usize,
                                per: q,
                                unit,
                                parts: unit.div_ceil(q),
                            });
                        }
                    }
                }
                for s in schedules {
                    for t in 0..total {
                        let c = s.cta_of(t);
                        assert!(c < s.ctas, "{s:?} {t}");
                        assert!(s.begin(c) <= t && (c + 1 == s.ctas || s.begin(c + 1) > t));
                    }
                }
            }
        }
    }

    /// Aligned ranges where uniform units fit the limit, balanced shares elsewhere (32/8 heads,
    /// d 128: 8 units a request, 64-position tiles, 132 SMs, 2 tiles at least).
    #[test]
    fn uniform_batches_take_aligned_ranges_where_they_fit() {
        let plan = |batch: usize, len: usize| {
            let (s, per_cta) = pieces(&vec![len; batch], 8, 64, 132, 2);
            let most = per_cta.iter().map(Vec::len).max().unwrap_or(0);
            (s.ctas, s.per, s.unit, most)
        };
        // whole units: one or more a CTA, four SMs idle
        assert_eq!(plan(16, 4096), (128, 64, 0, 1)); // share 63
        assert_eq!(plan(32, 4096), (128, 128, 0, 2)); // share 125
        assert_eq!(plan(64, 4096), (128, 256, 0, 4)); // share 249, limit 260
        assert_eq!(plan(16, 32768), (128, 512, 0, 1)); // share 497, limit 516

        // units in parts: one piece a CTA
        assert_eq!(plan(1, 4096), (128, 4, 64, 1)); // 16 parts of 4
        assert_eq!(plan(4, 4096), (128, 16, 64, 1)); // 4 parts of 16
        assert_eq!(plan(8, 4096), (128, 32, 64, 1)); // 2 parts of 32
        assert_eq!(plan(3, 4096), (120, 13, 64, 1)); // 5 parts of 13 (the last 12), share 12

        // 48 units in two parts of 32 against a share of 24: balanced
        assert_eq!(plan(6, 4096).1, 0);
        // a zero-length request leaves the others uniform
        let (s, per_cta) = pieces(&[4096, 0, 4096], 8, 64, 16, 2);
        assert_eq!((s.ctas, s.per, s.unit), (16, 64, 0));
        assert!(per_cta.iter().flatten().all(|p| p.whole()));
        // one different length: balanced
        assert_eq!(pieces(&[4096, 4032], 8, 64, 16, 2).0.per, 0);
    }
}
