//! Eviction policies over host-arena pages.
//!
//! A policy only orders pages. Whether a page may actually go (not pinned, not being written,
//! not the prefix of another resident block) is decided by the tier through the `try_evict`
//! callback, so every policy obeys the same safety rules. Pages the callback refuses get a
//! second chance (they move to the young end), which keeps a victim search amortized O(1) even
//! when many pages at the old end are pinned by in-flight loads.
//!
//! All methods run under the tier's allocation lock and cost O(1), except `evict`, which walks
//! until it finds a victim.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;

use kvtier_core::BlockKey;
use serde::{Deserialize, Serialize};

use crate::host_arena::PageId;

const NIL: u32 = u32::MAX;

/// Orders resident pages for eviction.
pub trait EvictionPolicy: Send + fmt::Debug {
    /// Short name for logs and stats (`lru`, `s3fifo`).
    fn name(&self) -> &'static str;
    /// A page became resident (its block was committed).
    fn on_insert(&mut self, page: PageId, key: BlockKey);
    /// A resident page was used (matched or loaded).
    fn on_access(&mut self, page: PageId);
    /// A resident page left the tier by other means than [`EvictionPolicy::evict`].
    fn on_remove(&mut self, page: PageId);
    /// Walks candidates in eviction order and offers each to `try_evict`; the first one it
    /// accepts is forgotten by the policy and returned. `None` when no page was accepted.
    fn evict(&mut self, try_evict: &mut dyn FnMut(PageId) -> bool) -> Option<PageId>;
}

/// Which [`EvictionPolicy`] a host tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionKind {
    /// S3-FIFO (Yang et al., SOSP '23): a small probationary FIFO, a main FIFO with
    /// reinsertion, and a ghost list; resists one-shot scans. The default.
    #[default]
    S3fifo,
    /// Least recently used.
    Lru,
}

impl EvictionKind {
    /// Builds the policy for an arena of `pages` pages.
    pub fn build(self, pages: u32) -> Box<dyn EvictionPolicy> {
        match self {
            EvictionKind::S3fifo => Box::new(S3Fifo::new(pages)),
            EvictionKind::Lru => Box::new(Lru::new(pages)),
        }
    }
}

impl FromStr for EvictionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "s3fifo" | "s3-fifo" => Ok(EvictionKind::S3fifo),
            "lru" => Ok(EvictionKind::Lru),
            _ => Err(format!("unknown eviction policy {s:?} (expected s3fifo or lru)")),
        }
    }
}

/// An intrusive doubly-linked list of pages: `head` is the young end, `tail` the old end.
#[derive(Debug)]
struct PageList {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl PageList {
    fn new(pages: u32) -> Self {
        Self {
            prev: vec![NIL; pages as usize],
            next: vec![NIL; pages as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn push_head(&mut self, p: PageId) {
        let i = p as usize;
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = p;
        } else {
            self.tail = p;
        }
        self.head = p;
        self.len += 1;
    }

    fn unlink(&mut self, p: PageId) {
        let i = p as usize;
        let (pr, nx) = (self.prev[i], self.next[i]);
        if pr != NIL {
            self.next[pr as usize] = nx;
        } else {
            self.head = nx;
        }
        if nx != NIL {
            self.prev[nx as usize] = pr;
        } else {
            self.tail = pr;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.len -= 1;
    }

    fn move_to_head(&mut self, p: PageId) {
        if self.head != p {
            self.unlink(p);
            self.push_head(p);
        }
    }
}

/// Where a page is in a policy's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Absent,
    Small,
    Main,
}

/// Least-recently-used eviction.
#[derive(Debug)]
pub struct Lru {
    list: PageList,
    present: Vec<bool>,
}

impl Lru {
    /// A policy for `pages` pages.
    pub fn new(pages: u32) -> Self {
        Self {
            list: PageList::new(pages),
            present: vec![false; pages as usize],
        }
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_insert(&mut self, page: PageId, _key: BlockKey) {
        if !std::mem::replace(&mut self.present[page as usize], true) {
            self.list.push_head(page);
        }
    }
    fn on_access(&mut self, page: PageId) {
        if self.present[page as usize] {
            self.list.move_to_head(page);
        }
    }
    fn on_remove(&mut self, page: PageId) {
        if std::mem::replace(&mut self.present[page as usize], false) {
            self.list.unlink(page);
        }
    }
    fn evict(&mut self, try_evict: &mut dyn FnMut(PageId) -> bool) -> Option<PageId> {
        for _ in 0..self.list.len {
            let p = self.list.tail;
            if try_evict(p) {
                self.list.unlink(p);
                self.present[p as usize] = false;
                return Some(p);
            }
            self.list.move_to_head(p);
        }
        None
    }
}

/// S3-FIFO eviction: new pages enter a small FIFO (10% of the arena); a page used again before
/// it reaches the small FIFO's end moves to the main FIFO, others leave and are remembered in a
/// ghost list, so that their return goes straight to main. The main FIFO gives pages with a
/// non-zero use count another round (decrementing it) instead of evicting them.
#[derive(Debug)]
pub struct S3Fifo {
    small: PageList,
    main: PageList,
    place: Vec<Place>,
    freq: Vec<u8>,
    keys: Vec<BlockKey>,
    small_target: usize,
    ghost: HashSet<BlockKey>,
    ghost_order: VecDeque<BlockKey>,
    ghost_capacity: usize,
}

impl S3Fifo {
    /// A policy for `pages` pages.
    pub fn new(pages: u32) -> Self {
        let n = pages as usize;
        Self {
            small: PageList::new(pages),
            main: PageList::new(pages),
            place: vec![Place::Absent; n],
            freq: vec![0; n],
            keys: vec![BlockKey::default(); n],
            small_target: (n / 10).max(1),
            ghost: HashSet::new(),
            ghost_order: VecDeque::new(),
            ghost_capacity: n,
        }
    }

    fn remember_ghost(&mut self, key: BlockKey) {
        if self.ghost_capacity == 0 {
            return;
        }
        if self.ghost.insert(key) {
            self.ghost_order.push_back(key);
        }
        while self.ghost_order.len() > self.ghost_capacity {
            if let Some(old) = self.ghost_order.pop_front() {
                self.ghost.remove(&old);
            }
        }
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }
    fn on_insert(&mut self, page: PageId, key: BlockKey) {
        let i = page as usize;
        if self.place[i] != Place::Absent {
            return;
        }
        self.keys[i] = key;
        self.freq[i] = 0;
        if self.ghost.remove(&key) {
            self.main.push_head(page);
            self.place[i] = Place::Main;
        } else {
            self.small.push_head(page);
            self.place[i] = Place::Small;
        }
    }
    fn on_access(&mut self, page: PageId) {
        let f = &mut self.freq[page as usize];
        *f = (*f + 1).min(3);
    }
    fn on_remove(&mut self, page: PageId) {
        let i = page as usize;
        match std::mem::replace(&mut self.place[i], Place::Absent) {
            Place::Small => self.small.unlink(page),
            Place::Main => self.main.unlink(page),
            Place::Absent => {}
        }
    }
    fn evict(&mut self, try_evict: &mut dyn FnMut(PageId) -> bool) -> Option<PageId> {
        // First a walk that gives up on a list after a few refusals (pages pinned by loads or
        // holding prefixes of resident blocks can crowd the old end of main), then, only if
        // that found nothing, a walk that considers every page.
        self.walk(try_evict, REFUSALS_BEFORE_FALLBACK)
            .or_else(|| self.walk(try_evict, usize::MAX))
    }
}

/// Refusals a list may answer before the first walk moves on to the other list.
const REFUSALS_BEFORE_FALLBACK: usize = 64;

impl S3Fifo {
    fn walk(&mut self, try_evict: &mut dyn FnMut(PageId) -> bool, max_refusals: usize) -> Option<PageId> {
        // Each page moves from small to main at most once, is passed over at most 3 times for
        // its use count and is refused at most once per list before the walk gives up: the
        // budget only guards against a bug turning this into an endless loop.
        let budget = 8 * (self.small.len + self.main.len) + 8;
        let (mut small_refused, mut main_refused) = (0usize, 0usize);
        for _ in 0..budget {
            let small_done = small_refused >= self.small.len.min(max_refusals);
            let main_done = main_refused >= self.main.len.min(max_refusals);
            if small_done && main_done {
                return None;
            }
            // Main has pages and refused (enough of) them.
            let main_stuck = self.main.len > 0 && main_done;
            let from_small = !small_done && (self.small.len > self.small_target || main_done);
            let p = if from_small {
                self.small.tail
            } else {
                self.main.tail
            };
            let i = p as usize;
            if from_small {
                // When nothing in main can go, a used small page is evicted rather than
                // promoted: order only matters among pages that can actually leave.
                if self.freq[i] > 0 && !main_stuck {
                    self.small.unlink(p);
                    self.freq[i] = 0;
                    self.main.push_head(p);
                    self.place[i] = Place::Main;
                } else if try_evict(p) {
                    self.small.unlink(p);
                    self.place[i] = Place::Absent;
                    let key = self.keys[i];
                    self.remember_ghost(key);
                    return Some(p);
                } else {
                    small_refused += 1;
                    self.small.move_to_head(p);
                }
            } else if self.freq[i] > 0 {
                self.freq[i] -= 1;
                self.main.move_to_head(p);
            } else if try_evict(p) {
                self.main.unlink(p);
                self.place[i] = Place::Absent;
                return Some(p);
            } else {
                main_refused += 1;
                self.main.move_to_head(p);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BlockKey {
        BlockKey(u128::from(i) * 0x9e37_79b9_7f4a_7c15)
    }

    #[test]
    fn lru_evicts_least_recent_and_skips_refused() {
        let mut p = Lru::new(4);
        for i in 0..4 {
            p.on_insert(i, key(i));
        }
        p.on_access(0);
        assert_eq!(p.evict(&mut |_| true), Some(1));
        assert_eq!(
            p.evict(&mut |pg| pg != 2),
            Some(3),
            "refused page 2 is passed over"
        );
        assert_eq!(p.evict(&mut |_| false), None);
        p.on_remove(0);
        assert_eq!(p.evict(&mut |_| true), Some(2));
        assert_eq!(p.evict(&mut |_| true), None);
    }

    #[test]
    fn s3fifo_keeps_reused_pages_over_one_shot_scans() {
        let mut p = S3Fifo::new(20);
        // Ten hot pages, used twice each.
        for i in 0..10 {
            p.on_insert(i, key(i));
            p.on_access(i);
        }
        // A scan of one-shot pages fills the rest.
        for i in 10..20 {
            p.on_insert(i, key(i));
        }
        // A long scan of one-shot pages keeps arriving; each takes the victim's page.
        let mut victims = Vec::new();
        for i in 20..50 {
            let v = p.evict(&mut |_| true).unwrap();
            victims.push(v);
            p.on_insert(v, key(i));
        }
        assert!(victims.iter().all(|&v| v >= 10), "the hot set stays: {victims:?}");
    }

    #[test]
    fn s3fifo_ghost_hit_enters_main() {
        let mut p = S3Fifo::new(10);
        for i in 0..10 {
            p.on_insert(i, key(i));
        }
        let v = p.evict(&mut |_| true).unwrap();
        assert_eq!(v, 0);
        // Key 0 returns on another page: it goes to main, so small-FIFO victims come first.
        p.on_insert(0, key(0));
        assert_eq!(p.place[0], Place::Main);
    }

    #[test]
    fn s3fifo_terminates_when_everything_is_refused() {
        let mut p = S3Fifo::new(8);
        for i in 0..8 {
            p.on_insert(i, key(i));
            p.on_access(i);
            p.on_access(i);
        }
        assert_eq!(p.evict(&mut |_| false), None);
        assert_eq!(p.evict(&mut |pg| pg == 5), Some(5));
    }

    #[test]
    fn s3fifo_falls_back_to_main_when_small_is_all_refused() {
        let mut p = S3Fifo::new(10);
        for i in 0..5 {
            p.on_insert(i, key(i));
            p.on_access(i);
        }
        // Move the five used pages to main.
        assert_eq!(p.evict(&mut |_| false), None);
        for i in 5..10 {
            p.on_insert(i, key(i));
        }
        // Everything in small is refused (say, pinned): a main page must still be found.
        let v = p.evict(&mut |pg| pg < 5).unwrap();
        assert!(v < 5);
    }
}
