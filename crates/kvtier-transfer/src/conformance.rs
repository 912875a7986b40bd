//! The tier contract, checked once for every tier configuration (feature `test-util`).
//!
//! What every configuration of tiers must do, whatever its tiers are (host memory with either
//! eviction policy, host memory over disk under either write policy, and the remote tier and
//! the CUDA pools when they come): a block is visible only once its insert committed; it reads
//! back bit-exact; a block of another namespace is a miss; a clear by namespace holds, across a
//! reopen where the tier persists; a pinned block is never evicted; a block damaged at rest is a
//! miss and is counted, never served; and a reopen keeps every acknowledged block where the
//! tier persists.
//!
//! Each check is a function over a [`TierSubject`] (how to open the configuration, and again
//! over the same state) and returns `Err` with what broke, so the suite's own tests can show
//! that each check fails on a subject that breaks its rule. Checks use the real queues and a
//! shared-memory device pool, as the sidecar does.

use std::fmt;
use std::path::PathBuf;

use kvtier_core::{BlockKey, Dtype, KvGeometry, NamespaceFingerprint};
use kvtier_store::{
    DiskTier, DiskTierConfig, EvictionKind, HostTier, PinnedPage, RemoteTier, RemoteTierConfig, Reservation,
    TieredStore, WritePolicy,
};

use crate::TransferConfig;
use crate::test_util::{Rig, chain_blocks, host_config, keys_in, kv};

/// The result of one check: `Err` says what broke the contract.
pub type CheckResult = Result<(), String>;

/// A check of the contract.
pub type Check = fn(&dyn TierSubject) -> CheckResult;

/// Every check, by name.
pub const CHECKS: &[(&str, Check)] = &[
    ("two_phase_insert", two_phase_insert),
    ("read_back_bit_exact", read_back_bit_exact),
    ("other_namespace_is_a_miss", other_namespace_is_a_miss),
    ("clear_by_namespace_holds", clear_by_namespace_holds),
    ("pinned_is_never_evicted", pinned_is_never_evicted),
    (
        "damaged_at_rest_is_a_miss_and_counted",
        damaged_at_rest_is_a_miss_and_counted,
    ),
    ("reopen_keeps_acknowledged", reopen_keeps_acknowledged),
];

/// Runs every check, each on a fresh subject from `make` (a persistent subject must start
/// empty); the names and errors of those that failed.
pub fn run_all<S: TierSubject>(make: impl Fn() -> S) -> Vec<(&'static str, String)> {
    CHECKS
        .iter()
        .filter_map(|(name, check)| check(&make()).err().map(|e| (*name, e)))
        .collect()
}

/// Host pages every subject gets: small enough for the eviction checks to flood.
pub const HOST_BLOCKS: u64 = 64;
const SLOTS: u32 = 512;
const A: NamespaceFingerprint = NamespaceFingerprint(0xa11ce);
const B: NamespaceFingerprint = NamespaceFingerprint(0xb0b);

/// One configuration of tiers, and how to open it again over the same state.
pub trait TierSubject: fmt::Debug {
    /// Opens the tiers: host memory starts empty every time; a persistent tier is reopened over
    /// what the previous opening left (which must have been dropped first).
    fn open(&self) -> TieredStore;
    /// Whether blocks survive a reopen.
    fn persistent(&self) -> bool;
    /// Damages the payload of every block at rest in the persistent tier (the store is open).
    /// `false` when there is nothing at rest to damage (host memory only).
    fn damage_at_rest(&self) -> bool;
    /// Holds the pins a check took until the check ends (a faulty subject may drop them).
    fn hold(&self, pins: Vec<PinnedPage>) -> Vec<PinnedPage> {
        pins
    }
    /// Called right after blocks were stored and before they are read back (a faulty subject
    /// may damage them).
    fn after_store(&self, _store: &TieredStore, _ns: NamespaceFingerprint, _keys: &[BlockKey]) {}
}

/// The geometry every subject uses: 2 layers of 8 KiB block-layers.
pub fn geometry() -> KvGeometry {
    KvGeometry::new(2, 2, 64, Dtype::Bf16, 16).unwrap_or_else(|e| panic!("test geometry: {e}"))
}

/// Host memory only, with `eviction`.
#[derive(Debug)]
pub struct HostOnly {
    /// The eviction policy.
    pub eviction: EvictionKind,
}

impl TierSubject for HostOnly {
    fn open(&self) -> TieredStore {
        let host = HostTier::new(geometry(), &host_config(geometry(), HOST_BLOCKS, self.eviction))
            .unwrap_or_else(|e| panic!("host tier: {e}"));
        TieredStore::host_only(host)
    }
    fn persistent(&self) -> bool {
        false
    }
    fn damage_at_rest(&self) -> bool {
        false
    }
}

/// Host memory (S3-FIFO) over a disk tier in `dir`, under `policy`.
#[derive(Debug)]
pub struct HostOverDisk {
    /// Directory of the disk tier (empty at the start of each check).
    pub dir: PathBuf,
    /// The write policy.
    pub policy: WritePolicy,
}

impl HostOverDisk {
    fn disk_config(&self) -> DiskTierConfig {
        DiskTierConfig {
            dir: self.dir.clone(),
            capacity: kvtier_core::ByteSize::mib(64),
            region_size: kvtier_core::ByteSize::mib(2),
            ..Default::default()
        }
    }

    /// The region files, oldest first.
    pub fn region_files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .map(|d| d.filter_map(|e| Some(e.ok()?.path())).collect())
            .unwrap_or_default();
        files.retain(|p| p.extension().is_some_and(|e| e == "kvt"));
        files.sort();
        files
    }
}

impl TierSubject for HostOverDisk {
    fn open(&self) -> TieredStore {
        let g = geometry();
        let host = HostTier::new(g, &host_config(g, HOST_BLOCKS, EvictionKind::S3fifo))
            .unwrap_or_else(|e| panic!("host tier: {e}"));
        let (disk, _) = DiskTier::open(g, &self.disk_config()).unwrap_or_else(|e| panic!("disk tier: {e}"));
        TieredStore::new(host, Some(disk), self.policy, 2)
    }
    fn persistent(&self) -> bool {
        true
    }
    fn damage_at_rest(&self) -> bool {
        use std::os::unix::fs::FileExt;
        // The on-disk format: a 4 KiB region header, then entries of a 4 KiB header and one
        // 4 KiB-aligned page each. One byte in each entry's payload is flipped.
        let stride = 4096 + geometry().bytes_per_block().next_multiple_of(4096) as u64;
        for path in self.region_files() {
            let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).open(&path) else {
                continue;
            };
            let len = f.metadata().map_or(0, |m| m.len());
            let mut at = 4096 + 4096 + 1000;
            while at < len {
                let mut b = [0u8; 1];
                if f.read_exact_at(&mut b, at).is_ok() {
                    b[0] ^= 0x40;
                    let _ = f.write_all_at(&b, at);
                }
                at += stride;
            }
        }
        true
    }
}

/// Host memory (S3-FIFO) over the remote tier on the cluster at `nodes`, under `policy`, with
/// its keys under `key_prefix` (one of its own per subject, so each starts empty).
#[derive(Debug)]
pub struct HostOverRemote {
    /// The cluster's nodes.
    pub nodes: Vec<String>,
    /// This subject's key prefix.
    pub key_prefix: String,
    /// The remote tier's write policy.
    pub policy: WritePolicy,
}

impl HostOverRemote {
    fn remote(&self) -> RemoteTier {
        RemoteTier::open(
            geometry(),
            &RemoteTierConfig {
                nodes: self.nodes.clone(),
                key_prefix: self.key_prefix.clone(),
                write_policy: self.policy,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("remote tier: {e}"))
    }
}

impl TierSubject for HostOverRemote {
    fn open(&self) -> TieredStore {
        let g = geometry();
        let host = HostTier::new(g, &host_config(g, HOST_BLOCKS, EvictionKind::S3fifo))
            .unwrap_or_else(|e| panic!("host tier: {e}"));
        TieredStore::host_only(host).with_remote(Some(self.remote()))
    }
    fn persistent(&self) -> bool {
        true
    }
    fn damage_at_rest(&self) -> bool {
        self.remote().damage_all().is_ok_and(|n| n > 0)
    }
}

/// Whether the store has a tier that outlives host memory (disk or remote).
fn has_persistent(store: &TieredStore) -> bool {
    store.disk().is_some() || store.remote().is_some()
}

/// Blocks found corrupt so far in the persistent tiers.
fn corrupt_total(store: &TieredStore) -> u64 {
    store.disk().map_or(0, |d| d.stats().corrupt_total)
        + store.remote().map_or(0, |r| r.stats().corrupt_total)
}

/// Clears `ns` in every tier, the shared remote tier included (which a store's own clear
/// leaves alone: there it is asked by name).
fn clear_everywhere(store: &TieredStore, ns: NamespaceFingerprint) -> Result<(), String> {
    store.clear(Some(ns)).map_err(|e| format!("clear: {e}"))?;
    if let Some(r) = store.remote() {
        r.clear(Some(ns)).map_err(|e| format!("remote clear: {e}"))?;
    }
    Ok(())
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> CheckResult {
    if ok { Ok(()) } else { Err(what()) }
}

fn rig(subject: &dyn TierSubject) -> Rig {
    Rig::new(subject.open(), SLOTS, &TransferConfig::default())
}

/// Stores `keys` of `ns` from slots `first_slot..` through the store queue and waits until
/// they are where the write policy puts them (write-through: after the matches that admit them).
fn store(r: &Rig, ns: NamespaceFingerprint, keys: &[BlockKey], first_slot: u32) -> CheckResult {
    r.write_slots(keys, first_slot);
    let (copied, _) = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, ns, &chain_blocks(keys, first_slot))
        .and_then(|t| t.wait_persisted())
        .map_err(|e| format!("store: {e}"))?;
    ensure(copied.stored_blocks == keys.len(), || {
        format!("stored {} of {} blocks", copied.stored_blocks, keys.len())
    })?;
    let remote_write_through = r
        .store
        .remote()
        .is_some_and(|t| t.config().write_policy == WritePolicy::WriteThrough);
    if r.store.write_policy() == WritePolicy::WriteThrough || remote_write_through {
        for _ in 0..2 {
            r.queues.match_prefix(&r.store, ns, keys);
        }
    }
    // Every job (and the tiers it holds) is gone once the queue is idle: the tiers may be
    // reopened after the rig drops.
    r.queues.store.wait_idle();
    // Writes behind to the remote tier are acknowledged once queued: wait for them.
    if let Some(remote) = r.store.remote() {
        ensure(remote.flush(std::time::Duration::from_secs(60)), || {
            "remote writes did not finish".into()
        })?;
    }
    Ok(())
}

/// Loads `keys` into slots `first_slot..`: (loaded, from the persistent tier (disk or remote),
/// missing).
fn load(
    r: &Rig,
    ns: NamespaceFingerprint,
    keys: &[BlockKey],
    first_slot: u32,
) -> Result<(usize, usize, usize), String> {
    r.scrub(first_slot, keys.len());
    let report = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, ns, &Rig::load_blocks(keys, first_slot))
        .and_then(|t| t.wait())
        .map_err(|e| format!("load: {e}"))?;
    r.queues.load.wait_idle();
    Ok((
        report.loaded_blocks,
        report.disk_blocks + report.remote_blocks,
        report.missing.len(),
    ))
}

fn matched(r: &Rig, ns: NamespaceFingerprint, keys: &[BlockKey]) -> usize {
    r.store.match_prefix(ns, keys).tiers.len()
}

/// A block is invisible until its insert commits; an abandoned insert frees its page and
/// publishes nothing; a committed one reads back what was written.
pub fn two_phase_insert(subject: &dyn TierSubject) -> CheckResult {
    let r = rig(subject);
    let k = keys_in(A, 1, 1, 16)[0];
    let bl = r.geometry.bytes_per_block_layer();
    let reserve = || r.host.reserve(A, k, None).map_err(|e| format!("reserve: {e}"));
    let Reservation::Writer(w) = reserve()? else {
        return Err("a fresh key was not reservable".into());
    };
    for layer in 0..r.geometry.layers() {
        w.write_layer(layer, &kv(k, layer, bl))
            .map_err(|e| e.to_string())?;
    }
    ensure(matched(&r, A, &[k]) == 0 && !r.host.contains(A, k), || {
        "a block was visible before its insert committed".into()
    })?;
    ensure(matches!(reserve()?, Reservation::InFlight), || {
        "a second insert of a block being written was not refused".into()
    })?;
    let used = r.host.stats().used_pages;
    drop(w);
    ensure(matched(&r, A, &[k]) == 0, || {
        "an abandoned insert was published".into()
    })?;
    ensure(r.host.stats().used_pages + 1 == used, || {
        "an abandoned insert kept its page".into()
    })?;
    let Reservation::Writer(w) = reserve()? else {
        return Err("the key of an abandoned insert was not reservable again".into());
    };
    for layer in 0..r.geometry.layers() {
        w.write_layer(layer, &kv(k, layer, bl))
            .map_err(|e| e.to_string())?;
    }
    w.commit();
    ensure(matched(&r, A, &[k]) == 1, || {
        "a committed block was not found".into()
    })?;
    ensure(matches!(reserve()?, Reservation::AlreadyStored), || {
        "a committed block was reservable again".into()
    })?;
    let pin = r.host.pin(A, k).ok_or("a committed block could not be pinned")?;
    let mut buf = vec![0u8; bl];
    for layer in 0..r.geometry.layers() {
        pin.read_layer(layer, &mut buf).map_err(|e| e.to_string())?;
        ensure(buf == kv(k, layer, bl), || {
            format!("layer {layer} read back differs")
        })?;
    }
    Ok(())
}

/// Stored blocks load back bit-exact: from host memory, and from the persistent tier alone
/// once host memory has forgotten them.
pub fn read_back_bit_exact(subject: &dyn TierSubject) -> CheckResult {
    let r = rig(subject);
    let ks = keys_in(A, 24, 2, 16);
    store(&r, A, &ks, 0)?;
    subject.after_store(&r.store, A, &ks);
    let (loaded, _, missing) = load(&r, A, &ks, 100)?;
    ensure((loaded, missing) == (24, 0), || {
        format!("loaded {loaded}, missing {missing} of 24")
    })?;
    if let Some((slot, layer)) = r.first_wrong_slot(&ks, 100) {
        return Err(format!(
            "slot {slot} layer {layer} differs after a load from host memory"
        ));
    }
    if has_persistent(&r.store) {
        r.host.clear(None);
        let (loaded, disk, _) = load(&r, A, &ks, 200)?;
        ensure((loaded, disk) == (24, 24), || {
            format!("{loaded} loaded, {disk} from the persistent tier, of 24")
        })?;
        if let Some((slot, layer)) = r.first_wrong_slot(&ks, 200) {
            return Err(format!(
                "slot {slot} layer {layer} differs after a load from the persistent tier"
            ));
        }
    }
    Ok(())
}

/// Blocks of one namespace are misses in another, in every tier.
pub fn other_namespace_is_a_miss(subject: &dyn TierSubject) -> CheckResult {
    let r = rig(subject);
    let ks = keys_in(A, 8, 3, 16);
    store(&r, A, &ks, 0)?;
    for pass in ["host memory", "the persistent tier"] {
        ensure(matched(&r, B, &ks) == 0, || {
            format!("another namespace matched in {pass}")
        })?;
        let (loaded, _, missing) = load(&r, B, &ks, 100)?;
        ensure((loaded, missing) == (0, 8), || {
            format!("another namespace loaded {loaded} blocks from {pass}")
        })?;
        if !has_persistent(&r.store) {
            break;
        }
        r.host.clear(None);
    }
    ensure(matched(&r, A, &ks) == 8, || {
        "the owning namespace lost its blocks".into()
    })
}

/// A clear of one namespace removes its blocks from every tier and leaves the others; where the
/// tier persists, a reopen does not bring them back.
pub fn clear_by_namespace_holds(subject: &dyn TierSubject) -> CheckResult {
    let (ka, kb) = (keys_in(A, 8, 4, 16), keys_in(B, 8, 4, 16));
    {
        let r = rig(subject);
        store(&r, A, &ka, 0)?;
        store(&r, B, &kb, 8)?;
        clear_everywhere(&r.store, A)?;
        ensure(matched(&r, A, &ka) == 0, || {
            "a cleared namespace still matched".into()
        })?;
        ensure(matched(&r, B, &kb) == 8, || {
            "a clear removed another namespace's blocks".into()
        })?;
    }
    if subject.persistent() {
        let r = rig(subject);
        ensure(matched(&r, A, &ka) == 0, || {
            "a reopen brought cleared blocks back".into()
        })?;
        ensure(matched(&r, B, &kb) == 8, || {
            "a reopen lost another namespace's blocks".into()
        })?;
    }
    Ok(())
}

/// Pinned blocks stay resident and intact while far more blocks than the tier holds go
/// through it.
pub fn pinned_is_never_evicted(subject: &dyn TierSubject) -> CheckResult {
    let r = rig(subject);
    let ks = keys_in(A, 8, 5, 16);
    store(&r, A, &ks, 0)?;
    let pins: Vec<PinnedPage> = ks.iter().filter_map(|&k| r.host.pin(A, k)).collect();
    ensure(pins.len() == 8, || {
        format!("pinned {} of 8 stored blocks", pins.len())
    })?;
    let held = subject.hold(pins);
    for wave in 0..4u32 {
        let flood = keys_in(B, 64, 100 + wave, 16);
        r.write_slots(&flood, 100);
        // Some may not fit around the pins: that is the tier saying no, not an error here.
        let _ = r
            .queues
            .store
            .submit(&r.dyn_pool, &r.store, B, &chain_blocks(&flood, 100))
            .and_then(|t| t.wait());
    }
    let resident = ks.iter().filter(|&&k| r.host.contains(A, k)).count();
    ensure(resident == 8, || {
        format!("{} of 8 pinned blocks were evicted", 8 - resident)
    })?;
    let (loaded, disk, _) = load(&r, A, &ks, 300)?;
    ensure((loaded, disk) == (8, 0), || {
        format!("pinned blocks: {loaded} loaded, {disk} from the persistent tier")
    })?;
    if let Some((slot, layer)) = r.first_wrong_slot(&ks, 300) {
        return Err(format!("pinned block in slot {slot} layer {layer} changed"));
    }
    drop(held);
    Ok(())
}

/// A block damaged at rest is never served: it is a miss, and it is counted.
pub fn damaged_at_rest_is_a_miss_and_counted(subject: &dyn TierSubject) -> CheckResult {
    if !subject.persistent() {
        return Ok(()); // nothing at rest: host memory only
    }
    let r = rig(subject);
    let ks = keys_in(A, 16, 6, 16);
    store(&r, A, &ks, 0)?;
    r.host.clear(None);
    ensure(subject.damage_at_rest(), || {
        "a persistent subject damaged nothing".into()
    })?;
    let before = corrupt_total(&r.store);
    let (loaded, _, missing) = load(&r, A, &ks, 100)?;
    ensure((loaded, missing) == (0, 16), || {
        format!("{loaded} damaged blocks were served, {missing} reported missing")
    })?;
    let counted = corrupt_total(&r.store) - before;
    ensure(counted == 16, || {
        format!("{counted} of 16 damaged blocks counted as corrupt")
    })
}

/// Where the tier persists, every acknowledged block is there after a reopen, bit-exact.
pub fn reopen_keeps_acknowledged(subject: &dyn TierSubject) -> CheckResult {
    if !subject.persistent() {
        return Ok(());
    }
    let ks = keys_in(A, 40, 7, 16);
    {
        let r = rig(subject);
        store(&r, A, &ks, 0)?;
    }
    let r = rig(subject);
    let (loaded, disk, missing) = load(&r, A, &ks, 100)?;
    ensure((loaded, disk, missing) == (40, 40, 0), || {
        format!("after a reopen: {loaded} loaded, {disk} from the persistent tier, {missing} missing of 40")
    })?;
    match r.first_wrong_slot(&ks, 100) {
        Some((slot, layer)) => Err(format!("slot {slot} layer {layer} differs after a reopen")),
        None => Ok(()),
    }
}
