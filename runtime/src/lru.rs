//! A small least-recently-used map: the compile caches' bound, so a
//! long-running process (a server compiling per shape bucket, eager mode
//! over many programs) does not grow without limit; also the server's
//! host cache of parsed adapters.

use std::collections::HashMap;
use std::hash::Hash;

/// At most `capacity` entries; inserting into a full map drops the entry
/// used longest ago.
pub struct Lru<K, V> {
    capacity: usize,
    tick: u64,
    entries: HashMap<K, (V, u64)>,
}

impl<K: Hash + Eq + Clone, V> Lru<K, V> {
    pub fn new(capacity: usize) -> Self {
        Lru {
            capacity: capacity.max(1),
            tick: 0,
            entries: HashMap::new(),
        }
    }

    pub fn get(&mut self, key: &K) -> Option<&mut V> {
        self.tick += 1;
        let tick = self.tick;
        self.entries.get_mut(key).map(|(v, used)| {
            *used = tick;
            v
        })
    }

    /// Inserts `value` (replacing one under `key`), evicting the least
    /// recently used entry when full.
    pub fn insert(&mut self, key: K, value: V) {
        self.tick += 1;
        if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
            if let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(key, (value, self.tick));
    }

    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.entries.remove(key).map(|(v, _)| v)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.values().map(|(v, _)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::Lru;

    #[test]
    fn evicts_the_least_recently_used() {
        let mut lru = Lru::new(2);
        lru.insert("a", 1);
        lru.insert("b", 2);
        assert_eq!(lru.get(&"a"), Some(&mut 1)); // "b" is now the oldest
        lru.insert("c", 3);
        assert!(lru.get(&"b").is_none());
        assert_eq!(lru.get(&"a"), Some(&mut 1));
        assert_eq!(lru.get(&"c"), Some(&mut 3));
        assert_eq!(lru.len(), 2);
    }
}
