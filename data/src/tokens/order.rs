//! A seeded permutation of `0..n` computed one index at a time, in
//! constant memory: the global shuffle of prepared token shards, whatever
//! their size.
//!
//! A balanced Feistel network over the smallest even number of bits
//! covering `n` is a bijection of `0..2^bits`; walking the cycle from an
//! index until it lands below `n` ("cycle walking") restricts it to a
//! bijection of `0..n`. The domain is under `4n`, so a walk takes fewer
//! than four rounds on average. Six rounds of a 64-bit mixing function
//! make the order look random (a Luby–Rackoff construction needs four).

/// A permutation of `0..n`, by seed.
///
/// ```
/// use hlo_data::tokens::order::Permutation;
/// let p = Permutation::new(10, 7);
/// let mut seen: Vec<u64> = (0..10).map(|i| p.at(i)).collect();
/// seen.sort();
/// assert_eq!(seen, (0..10).collect::<Vec<u64>>());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permutation {
    n: u64,
    /// Bits of each half of the Feistel network's domain.
    half: u32,
    keys: [u64; ROUNDS],
}

const ROUNDS: usize = 6;

/// SplitMix64's finaliser: a bijective 64-bit mix.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Permutation {
    /// The permutation of `0..n` seeded by `seed`.
    pub fn new(n: u64, seed: u64) -> Permutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half = bits.div_ceil(2).max(1);
        let mut keys = [0u64; ROUNDS];
        let mut state = seed;
        for k in &mut keys {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            *k = mix(state);
        }
        Permutation { n, half, keys }
    }

    pub fn len(&self) -> u64 {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// One pass of the Feistel network over `0..4^half`.
    fn encrypt(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half) - 1;
        let (mut l, mut r) = (x >> self.half, x & mask);
        for k in self.keys {
            let f = mix(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half) | r
    }

    /// The index at position `i` of the order (`i < n`).
    pub fn at(&self, i: u64) -> u64 {
        debug_assert!(i < self.n, "{i} is outside 0..{}", self.n);
        let mut x = i;
        loop {
            x = self.encrypt(x);
            if x < self.n {
                return x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_is_a_permutation_and_seeds_differ() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            let p = Permutation::new(n, 3);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.at(i) as usize;
                assert!(!seen[j], "n {n}: {j} twice");
                seen[j] = true;
            }
        }
        let order = |seed| {
            (0..1000)
                .map(|i| Permutation::new(1000, seed).at(i))
                .collect::<Vec<_>>()
        };
        assert_ne!(order(1), order(2));
        assert_eq!(order(1), order(1));
    }

    #[test]
    fn the_order_looks_shuffled() {
        // Neighbours in the order are far apart in the data, and each
        // tenth of the data is spread over the whole order.
        let n = 10_000u64;
        let p = Permutation::new(n, 9);
        let near = (1..n)
            .filter(|&i| p.at(i).abs_diff(p.at(i - 1)) < 10)
            .count();
        assert!(near < 50, "{near} neighbours within 10");
        let first_tenth_in_first_half = (0..n / 2).filter(|&i| p.at(i) < n / 10).count();
        assert!(
            (400..600).contains(&first_tenth_in_first_half),
            "{first_tenth_in_first_half}"
        );
    }
}
