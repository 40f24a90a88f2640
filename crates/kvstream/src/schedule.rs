//! The persistent decode's schedule, mirrored from `kernels/include/schedule.cuh` (read its
//! header comment first): which KV tiles each CTA streams for given lengths. The kernel works
//! this out on the device at every call; this model is what the tests compare the kernel's
//! record with, and what the CPU reference uses to check the merge rule.

/// The sequence of `total` tiles cut over `ctas` working CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Tiles in the sequence.
    pub total: u64,
    /// Working CTAs (0 when there are no tiles).
    pub ctas: usize,
}

impl Schedule {
    /// `make_schedule`: at most `grid` CTAs, each with at least `min_tiles` tiles where there
    /// are enough.
    pub fn new(total: u64, grid: usize, min_tiles: usize) -> Self {
        let wanted = total.div_ceil(min_tiles as u64);
        Schedule {
            total,
            ctas: wanted.min(grid as u64) as usize,
        }
    }

    /// B(c): the first tile of CTA c.
    pub fn begin(&self, c: usize) -> u64 {
        c as u64 * self.total / self.ctas as u64
    }

    /// The CTA whose range holds tile `t`.
    pub fn cta_of(&self, t: u64) -> usize {
        (((t + 1) * self.ctas as u64 - 1) / self.total) as usize
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

/// One unit's part of one CTA's range (`Piece` in schedule.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Request.
    pub batch: usize,
    /// Unit within the request: `kv_head * col_blocks + col_block`.
    pub unit: usize,
    /// First tile of the unit in this piece.
    pub first: usize,
    /// One past its last tile.
    pub end: usize,
    /// Tiles of the unit.
    pub tiles: usize,
    /// Global index of the unit's first tile.
    pub start: u64,
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
    let tiles: Vec<usize> = lens.iter().map(|&l| tiles_of(l, tile_tokens)).collect();
    let total: u64 = tiles.iter().map(|&t| (t * units) as u64).sum();
    let s = Schedule::new(total, grid, min_tiles);
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
                });
            }
            start = end;
        }
    }
    (s, out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let lens: Vec<usize> = (0..batch)
                .map(|_| match rng.next() % 4 {
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
                assert!(
                    share == floor || share == floor + 1,
                    "case {case}: share {share}"
                );
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
    /// B(c) <= t.
    #[test]
    fn cta_of_inverts_begin() {
        for total in 1..300u64 {
            for ctas in 1..=total.min(140) as usize {
                let s = Schedule { total, ctas };
                for t in 0..total {
                    let c = s.cta_of(t);
                    assert!(s.begin(c) <= t && (c + 1 == ctas || s.begin(c + 1) > t));
                }
            }
        }
    }
}
