//! Context parallelism: how one request's cache positions are spread over the ranks of a group,
//! and what each rank decodes so that the merged partial states ([`crate::merge`]) equal the
//! whole decode. The Python package's `kvstream.distributed` runs the same rule on the device
//! (its tests check that the two agree).
//!
//! Query row i of a request of `len` positions and `q_len` new tokens sees positions up to
//! `len - q_len + i`. On a rank those are a prefix of its local positions (local order is the
//! global one). Positions before the last `q_len - 1` are seen by every row; the rank's positions
//! among those last ones form one run `[a, e)` (pages of at least `q_len - 1` positions keep it
//! so). A local decode of all the rank's positions with the window's right side `len - e` shows
//! each row that sees position `a - 1` or later exactly its prefix; the rows before that see the
//! positions ahead of the run only: an unbounded decode of that length. So a rank runs one
//! unbounded decode and one per right side, each request in the ones its [`RankShare`] names
//! (length 0 in the others), masks the rows the other decode serves (LSE `-inf`) and merges.
//!
//! ```
//! use kvstream::context::Sharding;
//! // pages of 64 dealt over 4 ranks; a request of 1000 positions, 4 new tokens
//! let share = Sharding::Pages(64).share(2, 4, 1000, 4).unwrap();
//! assert_eq!(share.held, 256); // pages 2, 6, 10, 14
//! ```

use crate::error::{Error, Result};

/// How a request's positions are spread over `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Rank r holds positions `[r C, (r + 1) C)`.
    Chunks(usize),
    /// Page j (positions `[j P, (j + 1) P)`) is on rank `j % world`; a rank's pages in order.
    Pages(usize),
}

/// A rank's last held run among a request's last `q_len - 1` positions (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailShare {
    /// The right window side of the rank's decode of all its positions of the request.
    pub right: usize,
    /// The first query row that decode serves; the rows before come from the unbounded one.
    pub first_row: usize,
    /// Positions in the run (`e - a`).
    pub run: usize,
}

/// What one rank decodes of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankShare {
    /// The request's positions the rank holds.
    pub held: usize,
    /// Positions the rank's unbounded decode reads of the request (0: the request is not in it).
    pub all_len: usize,
    /// Where the rank holds some of the request's last `q_len - 1` positions.
    pub tail: Option<TailShare>,
}

impl Sharding {
    /// The chunk length or page size.
    pub fn unit(self) -> usize {
        match self {
            Sharding::Chunks(u) | Sharding::Pages(u) => u,
        }
    }

    /// Whether the rule holds for `world` ranks and `q_len` new tokens: a unit of at least 1;
    /// pages over several ranks of at least `q_len - 1` positions (the new tokens' mask spans
    /// at most two pages).
    pub fn validate(self, world: usize, q_len: usize) -> Result<()> {
        if self.unit() == 0 {
            return Err(Error::invalid("sharding unit", 0, "at least 1 position"));
        }
        if world == 0 {
            return Err(Error::invalid("world", 0, "at least 1 rank"));
        }
        if let Sharding::Pages(p) = self {
            if world > 1 && q_len > 1 && p + 1 < q_len {
                return Err(Error::invalid(
                    "page size",
                    p,
                    format!("at least q_len - 1 = {} with {world} ranks", q_len - 1),
                ));
            }
        }
        Ok(())
    }

    /// Whether `rank` of `world` holds position `pos`.
    pub fn holds(self, rank: usize, world: usize, pos: usize) -> bool {
        match self {
            Sharding::Chunks(c) => pos / c == rank,
            Sharding::Pages(p) => (pos / p) % world == rank,
        }
    }

    /// What `rank` of `world` decodes of a request of `len` positions and `q_len` new tokens.
    pub fn share(self, rank: usize, world: usize, len: usize, q_len: usize) -> Result<RankShare> {
        self.validate(world, q_len)?;
        if rank >= world {
            return Err(Error::invalid("rank", rank, format!("0..{world}")));
        }
        let unit = self.unit();
        // held positions and the end of the last one; the run's lowest possible start
        let (held, end, run_floor) = match self {
            Sharding::Chunks(c) => {
                let start = rank * c;
                let held = len.saturating_sub(start).min(c);
                (held, start + held, start)
            }
            Sharding::Pages(p) => {
                let (full, rem) = (len / p, len % p);
                let full_here = (full + world - 1).saturating_sub(rank) / world;
                let partial_here = rem > 0 && full % world == rank;
                let held = full_here * p + if partial_here { rem } else { 0 };
                let end = if partial_here {
                    len
                } else if full_here > 0 {
                    (rank + (full_here - 1) * world + 1) * p
                } else {
                    0
                };
                let floor = if world == 1 {
                    0
                } else {
                    end.saturating_sub(1) / unit * unit
                };
                (held, end, floor)
            }
        };
        let a = (len + 1).saturating_sub(q_len).max(run_floor);
        if held == 0 || q_len == 1 || end <= a {
            return Ok(RankShare {
                held,
                all_len: held,
                tail: None,
            });
        }
        let first_row = (a + q_len).saturating_sub(len + 1);
        let before = held - (end - a);
        Ok(RankShare {
            held,
            all_len: if first_row > 0 { before } else { 0 },
            tail: Some(TailShare {
                right: len - end,
                first_row,
                run: end - a,
            }),
        })
    }

    /// Positions query row `row` sees of what `rank` holds (the held positions up to global
    /// `len - q_len + row`): what a per-token decode of the rank reads.
    pub fn visible(
        self,
        rank: usize,
        world: usize,
        len: usize,
        q_len: usize,
        row: usize,
    ) -> Result<usize> {
        let share = self.share(rank, world, len, q_len)?;
        Ok(match share.tail {
            None => share.held,
            Some(t) => {
                let e = len - t.right;
                let a = e - t.run;
                let first_hidden = (len + 1 + row).saturating_sub(q_len).max(a);
                share.held - e.saturating_sub(first_hidden)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::SplitMix64;

    /// The rule from the held positions themselves (the module docs, position by position).
    fn model(sharding: Sharding, rank: usize, world: usize, len: usize, q_len: usize) -> RankShare {
        let held: Vec<usize> = (0..len)
            .filter(|&g| sharding.holds(rank, world, g))
            .collect();
        let tail: Vec<usize> = held.iter().copied().filter(|&g| g + q_len > len).collect();
        let Some(&last) = tail.last() else {
            return RankShare {
                held: held.len(),
                all_len: held.len(),
                tail: None,
            };
        };
        assert!(tail.windows(2).all(|w| w[1] == w[0] + 1), "a run: {tail:?}");
        let (a, e) = (tail[0], last + 1);
        let first_row = (a + q_len).saturating_sub(len + 1);
        RankShare {
            held: held.len(),
            all_len: if first_row > 0 {
                held.len() - tail.len()
            } else {
                0
            },
            tail: Some(TailShare {
                right: len - e,
                first_row,
                run: e - a,
            }),
        }
    }

    #[test]
    fn closed_form_equals_the_positions_rule() {
        let mut rng = SplitMix64::new(41);
        for _ in 0..3000 {
            let world = 1 + rng.below(8);
            let q_len = 1 + rng.below(8);
            let unit = q_len.saturating_sub(1).max(1) + rng.below(20);
            let sharding = if rng.below(2) == 0 {
                Sharding::Chunks(unit)
            } else {
                Sharding::Pages(unit)
            };
            let cap = if let Sharding::Chunks(c) = sharding {
                world * c
            } else {
                300
            };
            let len = rng.below(cap + 1);
            let rank = rng.below(world);
            let what = format!("{sharding:?} rank {rank}/{world} len {len} q_len {q_len}");
            let got = sharding.share(rank, world, len, q_len).unwrap();
            assert_eq!(got, model(sharding, rank, world, len, q_len), "{what}");
            for row in 0..q_len {
                let want = (0..len)
                    .filter(|&g| sharding.holds(rank, world, g) && g + q_len <= len + row)
                    .count();
                let v = sharding.visible(rank, world, len, q_len, row).unwrap();
                assert_eq!(v, want, "{what} row {row}");
            }
        }
    }

    #[test]
    fn every_position_is_held_once() {
        for sharding in [Sharding::Chunks(7), Sharding::Pages(3)] {
            let world = 5;
            let len = if let Sharding::Chunks(c) = sharding {
                world * c
            } else {
                101
            };
            let total: usize = (0..world)
                .map(|r| sharding.share(r, world, len, 1).unwrap().held)
                .sum();
            assert_eq!(total, len, "{sharding:?}");
        }
    }

    #[test]
    fn bad_arguments_are_named() {
        let err = |r: Result<RankShare>| r.unwrap_err().to_string();
        assert!(err(Sharding::Pages(2).share(0, 2, 10, 4)).contains("page size"));
        assert!(err(Sharding::Chunks(0).share(0, 2, 10, 1)).contains("unit"));
        assert!(err(Sharding::Chunks(4).share(2, 2, 10, 1)).contains("rank"));
        // one rank holds every page: any page size serves
        assert!(Sharding::Pages(1).share(0, 1, 10, 8).is_ok());
    }
}
