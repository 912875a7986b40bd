//! Where an engine keeps K and V of each slot: the layout of a device pool.
//!
//! Engines lay their paged KV out in their own way: vLLM per layer `[2, blocks, block_size,
//! heads, dim]` (a K plane and a V plane), SGLang one K buffer and one V buffer per layer
//! (`[slots × block_size, heads, dim]` each), kvtier's own pool `[layer][slot][K|V][token][head]
//! [dim]`. In all of them one slot's K (and its V) is `block_tokens × kv_heads × head_dim`
//! contiguous elements — half a block-layer — so a layout is, per layer, where slot 0's K and V
//! start (a buffer and a byte offset in it) and the stride from one slot to the next. Host pages
//! always keep kvtier's `[K|V]` order; the copy converts.

use std::fmt;
use std::str::FromStr;

use crate::KvGeometry;

/// Where K and V of one layer's slots are: slot `s`'s K is `k_offset + s × slot_stride` bytes
/// into buffer `k_buffer`, its V likewise from `v_offset` in `v_buffer`; each is half a
/// block-layer long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerLayout {
    /// The buffer holding the layer's K (a CPU pool has one buffer, index 0).
    pub k_buffer: u32,
    /// Bytes from that buffer's start to slot 0's K.
    pub k_offset: u64,
    /// The buffer holding the layer's V.
    pub v_buffer: u32,
    /// Bytes from that buffer's start to slot 0's V.
    pub v_offset: u64,
    /// Bytes from slot `s`'s K (and V) to slot `s + 1`'s.
    pub slot_stride: u64,
}

/// The engine layouts kvtier knows by name (for benchmarks, tests and clients that build a
/// [`PoolLayout`]); any other layout is given layer by layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKind {
    /// kvtier's own pool: per layer `num_slots` block-layers, each `[K|V][token][head][dim]`.
    Kvtier,
    /// vLLM's paged attention: per layer `[2, num_blocks, block_size, kv_heads, head_dim]`,
    /// layers one after another.
    Vllm,
    /// SGLang's MHA token pool: per layer a K buffer and a V buffer of
    /// `[slots × block_size, kv_heads, head_dim]`; in one allocation every layer's K buffer,
    /// then every layer's V buffer.
    Sglang,
}

impl LayoutKind {
    /// Every named layout, for help texts and tests.
    pub const ALL: [LayoutKind; 3] = [LayoutKind::Kvtier, LayoutKind::Vllm, LayoutKind::Sglang];

    /// The name on command lines and in output (`kvtier`, `vllm`, `sglang`).
    pub const fn name(self) -> &'static str {
        match self {
            LayoutKind::Kvtier => "kvtier",
            LayoutKind::Vllm => "vllm",
            LayoutKind::Sglang => "sglang",
        }
    }
}

impl fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LayoutKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LayoutKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown layout {s:?} (expected kvtier, vllm or sglang)"))
    }
}

/// A layout that does not fit its pool: `field` names the offending request field
/// (`layout.layers[3].slot_stride`), `reason` says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct LayoutError {
    /// The field, as the proto names it.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

/// One contiguous piece of a block-layer in its pool: `len` bytes at `offset` into buffer
/// `buffer`, holding bytes `at..at + len` of the block-layer in kvtier's `[K|V]` order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotPiece {
    /// The buffer.
    pub buffer: u32,
    /// Bytes from the buffer's start.
    pub offset: u64,
    /// Where the piece sits in the block-layer's `[K|V]` bytes.
    pub at: usize,
    /// Its length.
    pub len: usize,
}

/// A block-layer's pieces ([`PoolLayout::slot_pieces`]): one where V follows K, K then V
/// otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPieces {
    pieces: [SlotPiece; 2],
    n: usize,
}

impl SlotPieces {
    /// The pieces, in block-layer order.
    pub fn as_slice(&self) -> &[SlotPiece] {
        &self.pieces[..self.n]
    }

    /// The one piece of a block-layer whose V follows its K; `None` when K and V are apart.
    pub fn single(&self) -> Option<SlotPiece> {
        (self.n == 1).then_some(self.pieces[0])
    }
}

impl IntoIterator for SlotPieces {
    type Item = SlotPiece;
    type IntoIter = std::iter::Take<std::array::IntoIter<SlotPiece, 2>>;
    fn into_iter(self) -> Self::IntoIter {
        self.pieces.into_iter().take(self.n)
    }
}

/// Where K and V of every slot of every layer are (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolLayout {
    layers: Vec<LayerLayout>,
}

/// One K or V plane of one layer: `count` spans of `len` bytes, `stride` apart.
#[derive(Debug, Clone, Copy)]
struct Plane {
    buffer: u32,
    start: u64,
    stride: u64,
    count: u64,
    len: u64,
    layer: usize,
    v: bool,
}

impl Plane {
    fn end(&self) -> u64 {
        self.start + (self.count - 1) * self.stride + self.len
    }
    fn field(&self) -> String {
        format!(
            "layout.layers[{}].{}_offset",
            self.layer,
            if self.v { "v" } else { "k" }
        )
    }
    fn describe(&self) -> String {
        format!("layer {}'s {}", self.layer, if self.v { "V" } else { "K" })
    }
    /// The first slot pair `(i, j)` at which span `i` of `self` and span `j` of `other` share a
    /// byte, if any. Both have `stride >= len` (checked before).
    fn first_overlap(&self, other: &Plane) -> Option<(u64, u64)> {
        if self.buffer != other.buffer || self.end() <= other.start || other.end() <= self.start {
            return None;
        }
        let span_overlaps = |i: u64, j: u64| {
            let a = self.start + i * self.stride;
            let b = other.start + j * other.stride;
            a < b + other.len && b < a + self.len
        };
        if self.stride == other.stride {
            // Span i of self minus span j of other is d + k·s with k = i - j: the k nearest
            // -d/s within the pairs that exist decides, O(1).
            let s = i128::from(self.stride);
            let d = i128::from(self.start) - i128::from(other.start);
            let lo = (-d).div_euclid(s);
            for k in [lo, lo + 1] {
                let k = k.clamp(-(i128::from(other.count) - 1), i128::from(self.count) - 1);
                let (i, j) = if k >= 0 { (k, 0) } else { (0, -k) };
                if span_overlaps(i as u64, j as u64) {
                    return Some((i as u64, j as u64));
                }
            }
            return None;
        }
        // Different strides (rare: no engine does it): walk self's spans inside other's range.
        // Only spans q and q + 1 of `other` can meet a span of `self`, as other.stride >= len.
        for i in 0..self.count {
            let a = self.start + i * self.stride;
            if a + self.len <= other.start {
                continue;
            }
            if a >= other.end() {
                break;
            }
            let q = a.saturating_sub(other.start) / other.stride;
            for j in [q, q + 1] {
                if j < other.count && span_overlaps(i, j) {
                    return Some((i, j));
                }
            }
        }
        None
    }
}

impl PoolLayout {
    /// A layout from its layers, one per layer of the geometry (checked by
    /// [`PoolLayout::validate`]).
    pub fn new(layers: Vec<LayerLayout>) -> Self {
        Self { layers }
    }

    /// The named layout for `num_slots` slots of `geometry`, in one buffer starting `base`
    /// bytes in (kvtier's pool file puts its 4 KiB header there).
    pub fn of_kind(kind: LayoutKind, geometry: &KvGeometry, num_slots: u32, base: u64) -> Self {
        let half = geometry.bytes_per_block_layer() as u64 / 2;
        let n = u64::from(num_slots);
        let layers = geometry.layers();
        let layer = |k_offset: u64, v_offset: u64, slot_stride: u64| LayerLayout {
            k_buffer: 0,
            k_offset,
            v_buffer: 0,
            v_offset,
            slot_stride,
        };
        let layers = (0..layers)
            .map(|l| {
                let lu = u64::from(l);
                match kind {
                    LayoutKind::Kvtier => {
                        let k = base + lu * n * 2 * half;
                        layer(k, k + half, 2 * half)
                    }
                    LayoutKind::Vllm => {
                        let k = base + lu * 2 * n * half;
                        layer(k, k + n * half, half)
                    }
                    LayoutKind::Sglang => layer(
                        base + lu * n * half,
                        base + (u64::from(layers) + lu) * n * half,
                        half,
                    ),
                }
            })
            .collect();
        Self { layers }
    }

    /// Bytes one buffer must have for the named layout of [`PoolLayout::of_kind`] (all three
    /// hold exactly the KV: `layers × num_slots` block-layers after `base`).
    pub fn kind_bytes(geometry: &KvGeometry, num_slots: u32, base: u64) -> u64 {
        base + u64::from(geometry.layers()) * u64::from(num_slots) * geometry.bytes_per_block_layer() as u64
    }

    /// The layers, in order.
    pub fn layers(&self) -> &[LayerLayout] {
        &self.layers
    }

    /// One layer's layout. Panics if `layer` is out of range (callers check layers first).
    pub fn layer(&self, layer: u32) -> &LayerLayout {
        &self.layers[layer as usize]
    }

    /// Whether slot `s`'s V directly follows its K in `layer` (kvtier's own order): one copy of
    /// a whole block-layer then moves both.
    pub fn kv_adjacent(&self, layer: u32, geometry: &KvGeometry) -> bool {
        let l = self.layer(layer);
        l.k_buffer == l.v_buffer && l.v_offset == l.k_offset + geometry.bytes_per_block_layer() as u64 / 2
    }

    /// Byte offsets of (`slot`, `layer`)'s K and V in their buffers (the layout must have
    /// passed [`PoolLayout::validate`] for `slot`'s pool, so nothing overflows).
    pub fn kv_offsets(&self, layer: u32, slot: u32) -> (u64, u64) {
        let l = self.layer(layer);
        let s = u64::from(slot) * l.slot_stride;
        (l.k_offset + s, l.v_offset + s)
    }

    /// Where (`layer`, `slot`)'s block-layer is: one piece where V follows K, else its K and
    /// its V (the layout must have passed [`PoolLayout::validate`]; `layer` and `slot` exist).
    pub fn slot_pieces(&self, geometry: &KvGeometry, layer: u32, slot: u32) -> SlotPieces {
        let l = self.layer(layer);
        let (k, v) = self.kv_offsets(layer, slot);
        let bl = geometry.bytes_per_block_layer();
        let piece = |buffer, offset, at, len| SlotPiece {
            buffer,
            offset,
            at,
            len,
        };
        if self.kv_adjacent(layer, geometry) {
            SlotPieces {
                pieces: [piece(l.k_buffer, k, 0, bl), SlotPiece::default()],
                n: 1,
            }
        } else {
            SlotPieces {
                pieces: [
                    piece(l.k_buffer, k, 0, bl / 2),
                    piece(l.v_buffer, v, bl / 2, bl / 2),
                ],
                n: 2,
            }
        }
    }

    /// Checks that the layout fits `num_slots` slots of `geometry` in buffers of
    /// `buffer_bytes` bytes each: one entry per layer, buffers that exist, offsets and strides
    /// aligned to the dtype, slots that do not overlap each other, every K and V inside its
    /// buffer, and no two planes sharing a byte. Costs O(layers²) (O(slots) more for a pair of
    /// planes with different strides sharing a range).
    ///
    /// # Errors
    /// [`LayoutError`] naming the first field at fault.
    pub fn validate(
        &self,
        geometry: &KvGeometry,
        num_slots: u32,
        buffer_bytes: &[u64],
    ) -> Result<(), LayoutError> {
        let err = |field: String, reason: String| Err(LayoutError { field, reason });
        if self.layers.len() != geometry.layers() as usize {
            return err(
                "layout.layers".into(),
                format!(
                    "{} entries for a geometry of {} layers (give one per layer)",
                    self.layers.len(),
                    geometry.layers()
                ),
            );
        }
        let half = geometry.bytes_per_block_layer() as u64 / 2;
        let elem = geometry.dtype().size_bytes() as u64;
        let count = u64::from(num_slots.max(1));
        let mut planes = Vec::with_capacity(self.layers.len() * 2);
        for (i, l) in self.layers.iter().enumerate() {
            let at = |f: &str| format!("layout.layers[{i}].{f}");
            if l.slot_stride < half {
                return err(
                    at("slot_stride"),
                    format!(
                        "{} bytes, less than one slot's K (or V) of {half} bytes (block_tokens × kv_heads × head_dim × dtype bytes): slots would overlap",
                        l.slot_stride
                    ),
                );
            }
            for (name, value) in [
                ("slot_stride", l.slot_stride),
                ("k_offset", l.k_offset),
                ("v_offset", l.v_offset),
            ] {
                if !value.is_multiple_of(elem) {
                    return err(
                        at(name),
                        format!("{value} is not a multiple of the {elem}-byte dtype"),
                    );
                }
            }
            for (v, buffer, offset) in [(false, l.k_buffer, l.k_offset), (true, l.v_buffer, l.v_offset)] {
                let which = if v { "v" } else { "k" };
                let Some(&bytes) = buffer_bytes.get(buffer as usize) else {
                    return err(
                        at(&format!("{which}_buffer")),
                        format!(
                            "buffer {buffer}, but the pool has {} buffer(s)",
                            buffer_bytes.len()
                        ),
                    );
                };
                let end = (count - 1)
                    .checked_mul(l.slot_stride)
                    .and_then(|x| x.checked_add(offset))
                    .and_then(|x| x.checked_add(half));
                match end {
                    Some(end) if end <= bytes => {}
                    _ => {
                        return err(
                            at(&format!("{which}_offset")),
                            format!(
                                "slot {}'s {} ends at byte {}, past the end of buffer {buffer} ({bytes} bytes)",
                                count - 1,
                                which.to_uppercase(),
                                end.map_or_else(|| "beyond 2^64".to_string(), |e| e.to_string())
                            ),
                        );
                    }
                }
                planes.push(Plane {
                    buffer,
                    start: offset,
                    stride: l.slot_stride,
                    count,
                    len: half,
                    layer: i,
                    v,
                });
            }
        }
        for (a_index, a) in planes.iter().enumerate() {
            for b in &planes[..a_index] {
                if let Some((i, j)) = a.first_overlap(b) {
                    return err(
                        a.field(),
                        format!(
                            "{} of slot {i} overlaps {} of slot {j} in buffer {}",
                            a.describe(),
                            b.describe(),
                            a.buffer
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    fn geo() -> KvGeometry {
        KvGeometry::new(3, 2, 8, Dtype::F16, 4).unwrap() // block-layer 256 bytes, half 128
    }

    #[test]
    fn the_named_layouts_fill_their_buffer_exactly_without_overlap() {
        let g = geo();
        for kind in LayoutKind::ALL {
            for base in [0, 4096] {
                let layout = PoolLayout::of_kind(kind, &g, 5, base);
                let bytes = PoolLayout::kind_bytes(&g, 5, base);
                layout.validate(&g, 5, &[bytes]).unwrap();
                assert!(layout.validate(&g, 5, &[bytes - 1]).is_err(), "{kind}");
                // Every byte after base belongs to exactly one slot's K or V.
                let mut owner = vec![0u8; (bytes - base) as usize];
                for l in 0..3 {
                    for s in 0..5 {
                        let (k, v) = layout.kv_offsets(l, s);
                        for off in [k, v] {
                            for b in off..off + 128 {
                                owner[(b - base) as usize] += 1;
                            }
                        }
                    }
                }
                assert!(owner.iter().all(|&c| c == 1), "{kind}");
                assert_eq!(layout.kv_adjacent(1, &g), kind == LayoutKind::Kvtier);
            }
        }
        assert_eq!(
            PoolLayout::of_kind(LayoutKind::Vllm, &g, 5, 0).kv_offsets(1, 2),
            (1280 + 256, 1280 + 640 + 256)
        );
        assert_eq!("vllm".parse::<LayoutKind>(), Ok(LayoutKind::Vllm));
        assert!("paged".parse::<LayoutKind>().is_err());
    }

    fn expect_err(layout: &PoolLayout, buffers: &[u64], field: &str, words: &str) {
        let e = layout.validate(&geo(), 5, buffers).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.reason.contains(words), "{e}");
    }

    #[test]
    fn bad_layouts_name_the_field_at_fault() {
        let g = geo();
        let good = PoolLayout::of_kind(LayoutKind::Vllm, &g, 5, 0);
        let bytes = PoolLayout::kind_bytes(&g, 5, 0);
        let with = |i: usize, f: &dyn Fn(&mut LayerLayout)| {
            let mut layers = good.layers().to_vec();
            f(&mut layers[i]);
            PoolLayout::new(layers)
        };
        expect_err(
            &PoolLayout::new(good.layers()[..2].to_vec()),
            &[bytes],
            "layout.layers",
            "2 entries",
        );
        expect_err(
            &with(1, &|l| l.slot_stride = 64),
            &[bytes],
            "layout.layers[1].slot_stride",
            "slots would overlap",
        );
        expect_err(
            &with(2, &|l| l.v_offset += 1),
            &[bytes],
            "layout.layers[2].v_offset",
            "multiple of the 2-byte",
        );
        expect_err(
            &with(0, &|l| l.k_buffer = 1),
            &[bytes],
            "layout.layers[0].k_buffer",
            "has 1 buffer",
        );
        expect_err(
            &with(2, &|l| l.v_offset += 128),
            &[bytes],
            "layout.layers[2].v_offset",
            "past the end",
        );
        expect_err(
            &with(0, &|l| l.k_offset = u64::MAX - 1),
            &[bytes],
            "layout.layers[0].k_offset",
            "beyond 2^64",
        );
        // Layer 1's K moved onto layer 0's V (same stride).
        let v0 = good.layer(0).v_offset;
        expect_err(
            &with(1, &|l| l.k_offset = v0 + 256),
            &[bytes],
            "layout.layers[1].k_offset",
            "overlaps layer 0's V of slot 2",
        );
        // A stride that interleaves K and V of one layer, misaligned by half a span.
        let odd = with(0, &|l| {
            l.v_offset = l.k_offset + 64;
            l.slot_stride = 256;
        });
        expect_err(
            &odd,
            &[bytes],
            "layout.layers[0].v_offset",
            "overlaps layer 0's K of slot 0",
        );
        // Different strides sharing a range: layer 2's V spread at twice the stride over
        // layer 0's K plane.
        let spread = with(2, &|l| {
            l.v_offset = 0;
            l.slot_stride = 256;
        });
        expect_err(
            &spread,
            &[bytes],
            "layout.layers[2].v_offset",
            "overlaps layer 0's K of slot 0",
        );
        // Two buffers: the same offsets in different buffers are fine.
        let two = PoolLayout::new(
            (0..3)
                .map(|l| LayerLayout {
                    k_buffer: l,
                    k_offset: 0,
                    v_buffer: 3 + l,
                    v_offset: 0,
                    slot_stride: 128,
                })
                .collect(),
        );
        two.validate(&g, 5, &[640; 6]).unwrap();
        expect_err(&two, &[640; 5], "layout.layers[2].v_buffer", "has 5 buffer");
    }
}
