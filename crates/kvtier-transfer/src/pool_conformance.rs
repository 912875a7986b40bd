//! The device pool contract, checked once for every kind of pool and every layout (feature
//! `test-util`): the CPU pool in CI, the CUDA pool where a GPU is lent.
//!
//! Through [`DevicePool`] alone: a layer's batch lands bit-exact in kvtier's `[K|V]` host order
//! whichever way the pool lays K and V out, and comes back to other pages bit-exact; batches of
//! every layer may be in flight at once, loads and stores together; a batch naming a slot, a
//! layer or host bytes that do not exist is refused with an error and the pool keeps working.

use kvtier_store::{Prefault, ShmRegion};

use crate::conformance::CheckResult;
use crate::{CopyDirection, CopyTicket, DevicePool, SlotCopy};

/// A check of the pool contract.
pub type PoolCheck = fn(&dyn DevicePool) -> CheckResult;

/// Every check, by name.
pub const POOL_CHECKS: &[(&str, PoolCheck)] = &[
    ("round_trip_bit_exact", round_trip_bit_exact),
    (
        "loads_and_stores_in_flight_together",
        loads_and_stores_in_flight_together,
    ),
    ("bad_batches_are_refused", bad_batches_are_refused),
];

/// Runs every check on `pool`; the names and errors of those that failed.
pub fn run_pool_checks(pool: &dyn DevicePool) -> Vec<(&'static str, String)> {
    POOL_CHECKS
        .iter()
        .filter_map(|(name, check)| check(pool).err().map(|e| (*name, e)))
        .collect()
}

/// Up to 8 slots spread over the pool, in descending order (a batch need not be sorted).
fn spread_slots(pool: &dyn DevicePool) -> Vec<u32> {
    let n = pool.num_slots().min(8);
    let step = pool.num_slots() / n;
    (0..n).rev().map(|i| i * step).collect()
}

/// Host pages for `slots` × every layer, page (layer, i) at `(layer × n + i) × block-layer`.
fn host_for(pool: &dyn DevicePool, n: usize, name: &str) -> Result<ShmRegion, String> {
    let bl = pool.geometry().bytes_per_block_layer();
    let len = bl * n * pool.geometry().layers() as usize;
    ShmRegion::create_private(name, len, Prefault::Populate).map_err(|e| e.to_string())
}

/// Deterministic bytes for `region`, different for every `seed`.
fn pattern(region: &ShmRegion, seed: u64) -> Result<(), String> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let bytes: Vec<u8> = (0..region.len())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    region.write(0, &bytes).map_err(|e| e.to_string())
}

fn contents(region: &ShmRegion) -> Result<Vec<u8>, String> {
    let mut v = vec![0; region.len()];
    region.read(0, &mut v).map_err(|e| e.to_string())?;
    Ok(v)
}

/// Submits every layer's batch of `slots` ↔ `host` (pages as [`host_for`] lays them out) and
/// returns the tickets, all in flight.
fn submit_all(
    pool: &dyn DevicePool,
    direction: CopyDirection,
    host: &ShmRegion,
    slots: &[u32],
) -> Result<Vec<CopyTicket>, String> {
    let bl = pool.geometry().bytes_per_block_layer();
    (0..pool.geometry().layers())
        .map(|layer| {
            let copies: Vec<SlotCopy> = slots
                .iter()
                .enumerate()
                .map(|(i, &slot)| SlotCopy {
                    slot,
                    host_offset: (layer as usize * slots.len() + i) * bl,
                })
                .collect();
            pool.submit(direction, layer, host, &copies)
                .map_err(|e| format!("{direction:?} layer {layer}: {e}"))
        })
        .collect()
}

fn wait_all(tickets: Vec<CopyTicket>) -> CheckResult {
    for t in tickets {
        t.wait().map_err(|e| format!("waiting for a batch: {e}"))?;
    }
    Ok(())
}

/// Host pages → slots → other host pages: bit-exact, every layer's batch in flight at once.
pub fn round_trip_bit_exact(pool: &dyn DevicePool) -> CheckResult {
    let slots = spread_slots(pool);
    let src = host_for(pool, slots.len(), "pool-check-src")?;
    let dst = host_for(pool, slots.len(), "pool-check-dst")?;
    pattern(&src, 1)?;
    wait_all(submit_all(pool, CopyDirection::HostToDevice, &src, &slots)?)?;
    wait_all(submit_all(pool, CopyDirection::DeviceToHost, &dst, &slots)?)?;
    if contents(&src)? != contents(&dst)? {
        return Err("the pages stored from the slots differ from the pages loaded into them".into());
    }
    // The same slots again with other bytes: every copy rewrites, none is cached.
    pattern(&src, 2)?;
    wait_all(submit_all(pool, CopyDirection::HostToDevice, &src, &slots)?)?;
    wait_all(submit_all(pool, CopyDirection::DeviceToHost, &dst, &slots)?)?;
    if contents(&src)? != contents(&dst)? {
        return Err("a second round trip of the same slots did not carry the new bytes".into());
    }
    Ok(())
}

/// A store of some slots and a load of others, both in flight: each lands bit-exact.
pub fn loads_and_stores_in_flight_together(pool: &dyn DevicePool) -> CheckResult {
    let slots = spread_slots(pool);
    if slots.len() < 2 {
        return Ok(());
    }
    let (a, b) = slots.split_at(slots.len() / 2);
    let a_src = host_for(pool, a.len(), "pool-check-a")?;
    pattern(&a_src, 3)?;
    wait_all(submit_all(pool, CopyDirection::HostToDevice, &a_src, a)?)?;
    let b_src = host_for(pool, b.len(), "pool-check-b")?;
    pattern(&b_src, 4)?;
    let a_out = host_for(pool, a.len(), "pool-check-a-out")?;
    let mut tickets = submit_all(pool, CopyDirection::DeviceToHost, &a_out, a)?;
    tickets.extend(submit_all(pool, CopyDirection::HostToDevice, &b_src, b)?);
    wait_all(tickets)?;
    if contents(&a_out)? != contents(&a_src)? {
        return Err("a store running beside a load carried wrong bytes".into());
    }
    let b_out = host_for(pool, b.len(), "pool-check-b-out")?;
    wait_all(submit_all(pool, CopyDirection::DeviceToHost, &b_out, b)?)?;
    if contents(&b_out)? != contents(&b_src)? {
        return Err("a load running beside a store carried wrong bytes".into());
    }
    Ok(())
}

/// A slot, a layer or host bytes that do not exist: an error, not a crash; the pool works on.
pub fn bad_batches_are_refused(pool: &dyn DevicePool) -> CheckResult {
    let host = host_for(pool, 1, "pool-check-bad")?;
    let bl = pool.geometry().bytes_per_block_layer();
    let layers = pool.geometry().layers();
    let ok = SlotCopy {
        slot: 0,
        host_offset: 0,
    };
    let cases: [(&str, u32, SlotCopy); 3] = [
        (
            "a slot past the pool",
            0,
            SlotCopy {
                slot: pool.num_slots(),
                host_offset: 0,
            },
        ),
        ("a layer past the geometry", layers, ok),
        (
            "host bytes past the region",
            0,
            SlotCopy {
                slot: 0,
                host_offset: host.len() - bl + 1,
            },
        ),
    ];
    for direction in [CopyDirection::HostToDevice, CopyDirection::DeviceToHost] {
        for (what, layer, copy) in cases {
            if let Ok(t) = pool.submit(direction, layer, &host, &[copy]) {
                let _ = t.wait();
                return Err(format!("{direction:?} of {what} was accepted"));
            }
        }
        pool.submit(direction, 0, &host, &[])
            .and_then(CopyTicket::wait)
            .map_err(|e| format!("an empty batch: {e}"))?;
    }
    round_trip_bit_exact(pool).map_err(|e| format!("after refused batches: {e}"))
}
