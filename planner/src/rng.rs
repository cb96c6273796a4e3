//! Deterministic pseudo-random numbers: [`SplitMix64`], the planner's one generator (the
//! general checkpoint search's kicks, the random model generators). No dependency, the same
//! sequence on every machine.

/// Vigna's SplitMix64: a tiny, fast, well-mixed 64-bit generator. Deterministic from its seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n >= 1`), by Lemire's multiply-shift.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A uniform element of a non-empty slice.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }

    /// An element drawn with the given integer weights.
    pub fn weighted<T: Copy>(&mut self, xs: &[(u32, T)]) -> T {
        let total: u32 = xs.iter().map(|x| x.0).sum();
        let mut r = self.below(total as usize) as u32;
        for &(w, x) in xs {
            if r < w {
                return x;
            }
            r -= w;
        }
        xs[xs.len() - 1].1
    }
}
