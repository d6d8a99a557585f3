//! Seeded randomness and hashing that every crate shares: splitmix64 for
//! initialisation, shuffling and test inputs (reproducible across platforms
//! and runs), and 64-bit FNV-1a for fingerprints of names and program text.

/// splitmix64: small, fast and reproducible; not for cryptography.
///
/// ```
/// use hlo_ir::rng::Rng;
/// let (mut a, mut b) = (Rng::new(7), Rng::new(7));
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!((0.0..1.0).contains(&a.next_f64()));
/// ```
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (mixed with a constant, so seed 0 is not the
    /// all-zero state).
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// A generator whose state is exactly `state`.
    pub fn from_state(state: u64) -> Rng {
        Rng(state)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.next_f64().max(f64::MIN_POSITIVE);
        let v = self.next_f64();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// 64-bit FNV-1a fed piece by piece (a file read in chunks, say).
///
/// ```
/// use hlo_ir::rng::{fnv1a, Fnv1a};
/// let mut h = Fnv1a::new();
/// h.update(b"foo");
/// h.update(b"bar");
/// assert_eq!(h.finish(), fnv1a(b"foobar"));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(FNV_OFFSET)
    }
}

impl Fnv1a {
    pub fn new() -> Fnv1a {
        Fnv1a::default()
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0 = bytes
            .iter()
            .fold(self.0, |h, &b| (h ^ b as u64).wrapping_mul(FNV_PRIME));
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// 64-bit FNV-1a of `bytes`.
///
/// ```
/// assert_eq!(hlo_ir::rng::fnv1a(b""), 0xcbf2_9ce4_8422_2325);
/// assert_eq!(hlo_ir::rng::fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
/// ```
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::new();
    h.update(bytes);
    h.finish()
}

/// FNV-1a over several parts with a separator after each, so `("ab", "c")`
/// and `("a", "bc")` differ: the key of compile caches.
///
/// ```
/// use hlo_ir::rng::fingerprint;
/// assert_ne!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"a", b"bc"]));
/// ```
pub fn fingerprint(parts: &[&[u8]]) -> u64 {
    parts.iter().fold(FNV_OFFSET, |mut h, p| {
        for &b in *p {
            h = (h ^ b as u64).wrapping_mul(FNV_PRIME);
        }
        (h ^ 0xff).wrapping_mul(FNV_PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // splitmix64 from state 0 (Vigna's reference implementation).
        let mut r = Rng::from_state(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn fnv1a_matches_published_vectors() {
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fingerprint(&[]), FNV_OFFSET);
    }
}
