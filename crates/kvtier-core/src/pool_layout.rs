//! Where an engine keeps K and V of each slot: the layout of a device pool.
//!
//! Engines lay their paged KV out in their own way: vLLM per layer `[2, blocks, block_size,
//! heads, dim]` (a K plane and a V plane) or, from 0.34, `[blocks, heads, block_size, K‖V]` in
//! one of several physical orders (K and V interleaved per token and head), SGLang one K buffer
//! and one V buffer per layer (`[slots × block_size, heads, dim]` each), kvtier's own pool
//! `[layer][slot][K|V][token][head][dim]`. A layout says, per layer, where slot 0's K and V start
//! (a buffer and a byte offset in it), the stride from one slot to the next and, inside a slot,
//! the strides from one token and from one head to the next (0: packed, so that a slot's K is
//! one `[token][head][dim]` run). A head's `head_dim` elements are always contiguous. Host
//! pages always keep kvtier's `[K|V][token][head][dim]` order; the copy converts.

use std::fmt;
use std::str::FromStr;

use crate::KvGeometry;

/// Where K and V of one layer's slots are: element `(token t, head h)` of slot `s`'s K starts
/// `k_offset + s × slot_stride + t × token_stride + h × head_stride` bytes into buffer
/// `k_buffer` (`head_dim` contiguous elements), its V likewise from `v_offset` in `v_buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
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
    /// Bytes from token `t`'s K (and V) to token `t + 1`'s within a slot; 0: packed
    /// (`kv_heads × head_dim × dtype bytes`).
    pub token_stride: u64,
    /// Bytes from head `h`'s K (and V) to head `h + 1`'s within a token; 0: packed
    /// (`head_dim × dtype bytes`).
    pub head_stride: u64,
    /// The KV cache group the layer belongs to (0 for an engine with one): layers of one
    /// group share a block table, so a request names one slot per block per group (vLLM's
    /// hybrid KV cache manager keeps sliding-window and full-attention layers in groups of
    /// their own). Layers of different groups may share memory: the engine hands a block to
    /// one group at a time.
    pub group: u32,
}

impl LayerLayout {
    /// `(token_stride, head_stride)` in bytes, 0 read as packed.
    pub fn strides(&self, geometry: &KvGeometry) -> (u64, u64) {
        let unit = head_bytes(geometry);
        let hs = if self.head_stride == 0 {
            unit
        } else {
            self.head_stride
        };
        let ts = if self.token_stride == 0 {
            unit * u64::from(geometry.kv_heads())
        } else {
            self.token_stride
        };
        (ts, hs)
    }

    /// Whether a slot's K (and its V) is one `[token][head][dim]` run.
    pub fn packed(&self, geometry: &KvGeometry) -> bool {
        self.runs(geometry).count == 1
    }

    /// How a slot's K (and V) splits into contiguous runs.
    pub fn runs(&self, geometry: &KvGeometry) -> LayerRuns {
        let unit = head_bytes(geometry);
        let (heads, tokens) = (geometry.kv_heads(), geometry.block_tokens());
        let (ts, hs) = self.strides(geometry);
        let heads_packed = heads == 1 || hs == unit;
        let tokens_packed = heads_packed && (tokens == 1 || ts == unit * u64::from(heads));
        let (len, per_token, count) = if tokens_packed {
            (unit * u64::from(heads) * u64::from(tokens), 1, 1)
        } else if heads_packed {
            (unit * u64::from(heads), 1, tokens)
        } else {
            (unit, heads, tokens * heads)
        };
        LayerRuns {
            len,
            per_token,
            count,
            token_stride: ts,
            head_stride: hs,
        }
    }
}

/// Bytes of one head of one token (`head_dim` elements): the smallest contiguous run.
fn head_bytes(geometry: &KvGeometry) -> u64 {
    u64::from(geometry.head_dim()) * geometry.dtype().size_bytes() as u64
}

/// A slot's K (or V) as `count` contiguous runs of `len` bytes, in kvtier's `[token][head]`
/// order ([`LayerLayout::runs`]): run `r` is token `r / per_token`, head `r % per_token`, at
/// `r / per_token × token_stride + r % per_token × head_stride` bytes from the slot's K (or
/// V) in the pool and at `r × len` in the host page's K (or V) half. Heads that follow each
/// other are one run (`per_token` 1), and so are tokens when heads are packed too (`count` 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRuns {
    /// Bytes per run.
    pub len: u64,
    /// Runs per token: 1, or `kv_heads`.
    pub per_token: u32,
    /// Runs per slot's K (or V).
    pub count: u32,
    /// Bytes from one token to the next in the pool.
    pub token_stride: u64,
    /// Bytes from one head to the next in the pool.
    pub head_stride: u64,
}

impl LayerRuns {
    /// Bytes from the slot's K (or V) to run `r` in the pool.
    pub fn offset(&self, r: u32) -> u64 {
        u64::from(r / self.per_token) * self.token_stride + u64::from(r % self.per_token) * self.head_stride
    }
}

/// The engine layouts kvtier knows by name (for benchmarks, tests and clients that build a
/// [`PoolLayout`]); any other layout is given layer by layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayoutKind {
    /// kvtier's own pool: per layer `num_slots` block-layers, each `[K|V][token][head][dim]`.
    Kvtier,
    /// vLLM's paged attention before 0.34 (FlashAttention): per layer `[2, num_blocks,
    /// block_size, kv_heads, head_dim]`, layers one after another.
    Vllm,
    /// vLLM ≥ 0.34's default `LBNHC`: per layer `[num_blocks, block_size, kv_heads, K‖V]`, K and
    /// V interleaved per token and head.
    VllmLbnhc,
    /// vLLM ≥ 0.34's `LBHNC` (FlashInfer's `HND`): per layer `[num_blocks, kv_heads,
    /// block_size, K‖V]`.
    VllmLbhnc,
    /// SGLang's MHA token pool: per layer a K buffer and a V buffer of
    /// `[slots × block_size, kv_heads, head_dim]`; in one allocation every layer's K buffer,
    /// then every layer's V buffer.
    Sglang,
}

impl LayoutKind {
    /// Every named layout, for help texts and tests.
    pub const ALL: [LayoutKind; 5] = [
        LayoutKind::Kvtier,
        LayoutKind::Vllm,
        LayoutKind::VllmLbnhc,
        LayoutKind::VllmLbhnc,
        LayoutKind::Sglang,
    ];

    /// The name on command lines and in output (`kvtier`, `vllm`, `vllm-lbnhc`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            LayoutKind::Kvtier => "kvtier",
            LayoutKind::Vllm => "vllm",
            LayoutKind::VllmLbnhc => "vllm-lbnhc",
            LayoutKind::VllmLbhnc => "vllm-lbhnc",
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
            .ok_or_else(|| {
                let names: Vec<&str> = LayoutKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown layout {s:?} (expected one of {})", names.join(", "))
            })
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

/// A block-layer's pieces ([`PoolLayout::slot_pieces`]): one where V follows a packed K, K
/// then V where they are packed but apart, and where the layout splits them per token (or per
/// token and head) each run of K followed by the same run of V.
#[derive(Debug, Clone)]
pub struct SlotPieces {
    k: (u32, u64),
    v: (u32, u64),
    half: usize,
    runs: LayerRuns,
    single: bool,
    next: u32,
}

impl SlotPieces {
    /// The one piece of a block-layer whose V follows its packed K; `None` otherwise.
    pub fn single(&self) -> Option<SlotPiece> {
        self.single.then_some(SlotPiece {
            buffer: self.k.0,
            offset: self.k.1,
            at: 0,
            len: 2 * self.half,
        })
    }

    fn total(&self) -> u32 {
        if self.single { 1 } else { 2 * self.runs.count }
    }
}

impl Iterator for SlotPieces {
    type Item = SlotPiece;
    fn next(&mut self) -> Option<SlotPiece> {
        if self.next >= self.total() {
            return None;
        }
        let i = self.next;
        self.next += 1;
        if self.single {
            return self.single();
        }
        // Run r of K, then run r of V: where the engine interleaves them (K‖V rows) the device
        // side is walked in address order and each host half as one stream.
        let (v, r) = (i % 2, i / 2);
        let ((buffer, base), at) = if v == 0 { (self.k, 0) } else { (self.v, self.half) };
        Some(SlotPiece {
            buffer,
            offset: base + self.runs.offset(r),
            at: at + r as usize * self.runs.len as usize,
            len: self.runs.len as usize,
        })
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.total() - self.next.min(self.total())) as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for SlotPieces {}

/// KV cache groups a pool's layout may have: a Load or Store names a slot per block in each,
/// and the gRPC message limit is sized for this many (vLLM splits a hybrid model's layers into
/// groups of equal size: gpt-oss makes 2, Llama 4 4, Gemma 3's 5:1 sliding-to-full layers
/// about 7).
pub const MAX_KV_CACHE_GROUPS: u32 = 8;

/// Where K and V of every slot of every layer are (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolLayout {
    layers: Vec<LayerLayout>,
}

/// One K or V plane of one layer, for the overlap checks: runs of `unit` bytes at
/// `start + Σ iᵈ × strideᵈ` over the slot, token and head dimensions; every byte it touches lies
/// in `start..start + hull`.
#[derive(Debug, Clone, Copy)]
struct Plane {
    buffer: u32,
    start: u64,
    /// (stride, count) of slots, tokens, heads.
    dims: [(u64, u64); 3],
    unit: u64,
    hull: u64,
    /// Bytes one slot's K (or V) spans, first byte to last.
    slot_extent: u64,
    layer: usize,
    group: u32,
    v: bool,
}

impl Plane {
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

    /// Whether every run of `self` and of `other` starts at the same residue modulo the gcd
    /// `g` of both planes' strides, with the two residue ranges apart: then no byte is in
    /// both (how K and V interleaved per token and head are told apart in O(1)).
    fn residues_apart(&self, other: &Plane) -> bool {
        let g = self
            .dims
            .iter()
            .chain(&other.dims)
            .filter(|&&(_, count)| count > 1)
            .fold(0u64, |g, &(stride, _)| gcd(g, stride));
        if g == 0 {
            return false;
        }
        let r = (i128::from(other.start) - i128::from(self.start)).rem_euclid(i128::from(g)) as u64;
        r >= self.unit && r + other.unit <= g
    }

    /// Where `self` and `other` share a byte: `Some(Some((i, j)))` names slot `i` of `self`
    /// and slot `j` of `other`, `Some(None)` a sharing that is not pinned to one slot pair (a
    /// layout whose slot is not its outermost dimension).
    fn overlap(&self, other: &Plane) -> Option<Option<(u64, u64)>> {
        if self.buffer != other.buffer
            || self.start + self.hull <= other.start
            || other.start + other.hull <= self.start
        {
            return None;
        }
        if self.dims == other.dims {
            return self.same_strides_overlap(other).map(Some);
        }
        if self.residues_apart(other) {
            return None;
        }
        let spans = |p: &Plane| (p.dims[0].1 == 1 || p.dims[0].0 >= p.slot_extent).then(|| p.slot_spans());
        match (spans(self), spans(other)) {
            (Some(a), Some(b)) => a.first_overlap(&b).map(Some),
            _ => Some(None),
        }
    }

    /// For planes with the same strides and counts: the first slot pair `(i, j)` at which a
    /// run of `self`'s slot `i` shares a byte with a run of `other`'s slot `j`. Exact, and
    /// O(1): the strides are nested (each clears everything inside it, checked before), so
    /// the start difference splits into per-dimension steps with at most two candidates each.
    fn same_strides_overlap(&self, other: &Plane) -> Option<(u64, u64)> {
        // (dimension, stride, count) of the dimensions that repeat, innermost first.
        let mut dims: Vec<(usize, i128, i128)> = (0..3)
            .filter(|&d| self.dims[d].1 > 1)
            .map(|d| (d, i128::from(self.dims[d].0), i128::from(self.dims[d].1)))
            .collect();
        dims.sort_by_key(|&(_, stride, _)| stride);
        let unit = i128::from(self.unit);
        // A run of self's index vector i meets one of other's j when
        // |other.start - self.start - Σ (i - j)·stride| < unit.
        fn search(d: i128, dims: &[(usize, i128, i128)], unit: i128, slot_step: i128) -> Option<i128> {
            let Some((&(dim, stride, count), inner)) = dims.split_last() else {
                return (d.abs() < unit).then_some(slot_step);
            };
            let reach = inner.iter().map(|&(_, s, n)| (n - 1) * s).sum::<i128>() + unit;
            let lo = (d - reach).div_euclid(stride);
            (lo..=lo + 2)
                .filter(|m| m.abs() < count && (d - m * stride).abs() < reach)
                .find_map(|m| search(d - m * stride, inner, unit, if dim == 0 { m } else { slot_step }))
        }
        let d = i128::from(other.start) - i128::from(self.start);
        search(d, &dims, unit, 0).map(|m| (m.max(0) as u64, (-m).max(0) as u64))
    }

    /// Each slot's K (or V) as one span of `slot_extent` bytes (the slot must be the outermost
    /// dimension).
    fn slot_spans(&self) -> Spans {
        Spans {
            start: self.start,
            stride: self.dims[0].0.max(self.slot_extent),
            count: self.dims[0].1,
            len: self.slot_extent,
        }
    }
}

/// `count` spans of `len` bytes, `stride >= len` apart.
#[derive(Debug, Clone, Copy)]
struct Spans {
    start: u64,
    stride: u64,
    count: u64,
    len: u64,
}

impl Spans {
    fn end(&self) -> u64 {
        self.start + (self.count - 1) * self.stride + self.len
    }

    /// The first pair `(i, j)` at which span `i` of `self` and span `j` of `other` share a
    /// byte, if any.
    fn first_overlap(&self, other: &Spans) -> Option<(u64, u64)> {
        if self.end() <= other.start || other.end() <= self.start {
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

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
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
        let unit = head_bytes(geometry);
        let (heads, tokens) = (u64::from(geometry.kv_heads()), u64::from(geometry.block_tokens()));
        let n = u64::from(num_slots);
        let layers = geometry.layers();
        let packed = |k_offset: u64, v_offset: u64, slot_stride: u64| LayerLayout {
            k_offset,
            v_offset,
            slot_stride,
            ..LayerLayout::default()
        };
        let layers = (0..layers)
            .map(|l| {
                let lu = u64::from(l);
                // Where layer l starts when every layer holds n block-layers in turn.
                let at = base + lu * n * 2 * half;
                match kind {
                    LayoutKind::Kvtier => packed(at, at + half, 2 * half),
                    LayoutKind::Vllm => packed(at, at + n * half, half),
                    LayoutKind::VllmLbnhc => LayerLayout {
                        token_stride: heads * 2 * unit,
                        head_stride: 2 * unit,
                        ..packed(at, at + unit, 2 * half)
                    },
                    LayoutKind::VllmLbhnc => LayerLayout {
                        token_stride: 2 * unit,
                        head_stride: tokens * 2 * unit,
                        ..packed(at, at + unit, 2 * half)
                    },
                    LayoutKind::Sglang => packed(
                        base + lu * n * half,
                        base + (u64::from(layers) + lu) * n * half,
                        half,
                    ),
                }
            })
            .collect();
        Self { layers }
    }

    /// Bytes one buffer must have for the named layout of [`PoolLayout::of_kind`] (all of
    /// them hold exactly the KV: `layers × num_slots` block-layers after `base`).
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

    /// Whether slot `s`'s V directly follows its packed K in `layer` (kvtier's own order): one
    /// copy of a whole block-layer then moves both.
    pub fn kv_adjacent(&self, layer: u32, geometry: &KvGeometry) -> bool {
        let l = self.layer(layer);
        l.k_buffer == l.v_buffer
            && l.v_offset == l.k_offset + geometry.bytes_per_block_layer() as u64 / 2
            && l.packed(geometry)
    }

    /// Byte offsets of (`slot`, `layer`)'s K and V in their buffers (where token 0, head 0 of
    /// each starts; the layout must have passed [`PoolLayout::validate`] for `slot`'s pool, so
    /// nothing overflows).
    pub fn kv_offsets(&self, layer: u32, slot: u32) -> (u64, u64) {
        let l = self.layer(layer);
        let s = u64::from(slot) * l.slot_stride;
        (l.k_offset + s, l.v_offset + s)
    }

    /// Where (`layer`, `slot`)'s block-layer is, piece by piece (the layout must have passed
    /// [`PoolLayout::validate`]; `layer` and `slot` exist).
    pub fn slot_pieces(&self, geometry: &KvGeometry, layer: u32, slot: u32) -> SlotPieces {
        let l = self.layer(layer);
        let (k, v) = self.kv_offsets(layer, slot);
        SlotPieces {
            k: (l.k_buffer, k),
            v: (l.v_buffer, v),
            half: geometry.bytes_per_block_layer() / 2,
            runs: l.runs(geometry),
            single: self.kv_adjacent(layer, geometry),
            next: 0,
        }
    }

    /// Checks that the layout fits `num_slots` slots of `geometry` in buffers of
    /// `buffer_bytes` bytes each: one entry per layer, buffers that exist, offsets and strides
    /// aligned to the dtype, slots, tokens and heads that do not overlap each other, every K
    /// and V inside its buffer, and no two planes sharing a byte. Planes that share a range are
    /// told apart when their runs fall in different residues of their strides' gcd (K and V
    /// interleaved per token and head) or, slot by slot, when the slot is their outermost
    /// dimension; any other sharing is refused. Costs O(layers²) (O(slots) more for a pair of
    /// planes with different slot strides sharing a range).
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
        let elem = geometry.dtype().size_bytes() as u64;
        let unit = head_bytes(geometry);
        let count = u64::from(num_slots.max(1));
        let mut planes = Vec::with_capacity(self.layers.len() * 2);
        for (i, l) in self.layers.iter().enumerate() {
            let at = |f: &str| format!("layout.layers[{i}].{f}");
            for (name, value) in [
                ("slot_stride", l.slot_stride),
                ("token_stride", l.token_stride),
                ("head_stride", l.head_stride),
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
            let (ts, hs) = l.strides(geometry);
            let dims = [
                (l.slot_stride, count),
                (ts, u64::from(geometry.block_tokens())),
                (hs, u64::from(geometry.kv_heads())),
            ];
            let hull = nested_extent(&dims, unit).map_err(|(d, extent)| {
                let (name, what, one) = [
                    ("slot_stride", "slots", "slot's"),
                    ("token_stride", "tokens", "token's"),
                    ("head_stride", "heads", "head's"),
                ][d];
                LayoutError {
                    field: at(name),
                    reason: format!(
                        "{} bytes, less than the {extent} bytes each {one} K (or V) spans{}: {what} would overlap",
                        dims[d].0,
                        if d == 0 { " (block_tokens × kv_heads × head_dim × dtype bytes when packed)" } else { "" }
                    ),
                }
            })?;
            // One slot's K (or V), from its first byte to its last.
            let slot_extent = nested_extent(&[(0, 1), dims[1], dims[2]], unit).unwrap_or(hull);
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
                match offset.checked_add(hull) {
                    Some(end) if end <= bytes => {}
                    end => {
                        return err(
                            at(&format!("{which}_offset")),
                            format!(
                                "the last slot's {} ends at byte {}, past the end of buffer {buffer} ({bytes} bytes)",
                                which.to_uppercase(),
                                end.map_or_else(|| "beyond 2^64".to_string(), |e| e.to_string())
                            ),
                        );
                    }
                }
                planes.push(Plane {
                    buffer,
                    start: offset,
                    dims,
                    unit,
                    hull,
                    slot_extent,
                    layer: i,
                    group: l.group,
                    v,
                });
            }
        }
        self.validate_groups()?;
        for (a_index, a) in planes.iter().enumerate() {
            // Layers of different groups may share bytes: the engine gives a block to one
            // group at a time (vLLM's hybrid KV cache manager lays them over one tensor).
            for b in planes[..a_index].iter().filter(|b| b.group == a.group) {
                if let Some(slots) = a.overlap(b) {
                    let reason = match slots {
                        Some((i, j)) => format!(
                            "{} of slot {i} overlaps {} of slot {j} in buffer {}",
                            a.describe(),
                            b.describe(),
                            a.buffer
                        ),
                        None => format!(
                            "{} shares bytes of buffer {} with {} (or their strides do not keep them apart)",
                            a.describe(),
                            a.buffer,
                            b.describe()
                        ),
                    };
                    return err(a.field(), reason);
                }
            }
        }
        Ok(())
    }

    /// Checks that the groups are numbered 0, 1, 2, ... with no number left out.
    fn validate_groups(&self) -> Result<(), LayoutError> {
        let n = self.layers.len();
        if let Some(i) = self.layers.iter().position(|l| l.group as usize >= n) {
            return Err(LayoutError {
                field: format!("layout.layers[{i}].group"),
                reason: format!(
                    "group {}, but {n} layers make at most {n} groups (numbered from 0)",
                    self.layers[i].group
                ),
            });
        }
        if let Some(i) = self.layers.iter().position(|l| l.group >= MAX_KV_CACHE_GROUPS) {
            return Err(LayoutError {
                field: format!("layout.layers[{i}].group"),
                reason: format!(
                    "group {}: at most {MAX_KV_CACHE_GROUPS} KV cache groups (numbered 0 to {}), what a \
                     request's slots for every group fit in the message limit for",
                    self.layers[i].group,
                    MAX_KV_CACHE_GROUPS - 1
                ),
            });
        }
        let groups = self.groups();
        let mut used = vec![false; groups as usize];
        for l in &self.layers {
            used[l.group as usize] = true;
        }
        match used.iter().position(|&u| !u) {
            None => Ok(()),
            Some(missing) => {
                let i = self
                    .layers
                    .iter()
                    .position(|l| l.group == groups - 1)
                    .unwrap_or(0);
                Err(LayoutError {
                    field: format!("layout.layers[{i}].group"),
                    reason: format!(
                        "group {}, but no layer is in group {missing}: number the KV cache groups 0, 1, 2, ... \
                         with none left out",
                        groups - 1
                    ),
                })
            }
        }
    }

    /// How many KV cache groups the layers form (1 for an engine with one block table).
    pub fn groups(&self) -> u32 {
        self.layers
            .iter()
            .map(|l| l.group)
            .max()
            .map_or(1, |g| g.saturating_add(1))
    }

    /// The KV cache group of each layer, in layer order.
    pub fn layer_groups(&self) -> Vec<u32> {
        self.layers.iter().map(|l| l.group).collect()
    }
}

/// For a plane's (stride, count) dimensions (slots, tokens, heads) with runs of `unit` bytes:
/// checks, innermost stride first, that each dimension's stride clears everything inside it,
/// and gives the bytes the whole plane spans (saturating at 2^64, which no buffer has).
/// `Err((dimension, bytes the inside spans))` names the first that does not.
fn nested_extent(dims: &[(u64, u64); 3], unit: u64) -> Result<u64, (usize, u64)> {
    let mut order = [0usize, 1, 2];
    order.sort_by_key(|&d| dims[d].0);
    let mut extent = unit;
    for d in order {
        let (stride, count) = dims[d];
        if count <= 1 {
            continue;
        }
        if stride < extent {
            return Err((d, extent));
        }
        extent = (count - 1).saturating_mul(stride).saturating_add(extent);
    }
    Ok(extent)
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
                // Every byte after base belongs to exactly one slot's K or V, and each
                // block-layer's pieces cover its 256 bytes once, in order.
                let mut owner = vec![0u8; (bytes - base) as usize];
                for l in 0..3 {
                    for s in 0..5 {
                        let pieces = layout.slot_pieces(&g, l, s);
                        assert_eq!(pieces.len(), pieces.clone().count());
                        let mut covered = vec![0u8; 256];
                        for p in pieces {
                            covered[p.at..p.at + p.len].iter_mut().for_each(|c| *c += 1);
                            for b in p.offset..p.offset + p.len as u64 {
                                owner[(b - base) as usize] += 1;
                            }
                        }
                        assert!(covered.iter().all(|&c| c == 1), "{kind}");
                    }
                }
                assert!(owner.iter().all(|&c| c == 1), "{kind}");
                assert_eq!(layout.kv_adjacent(1, &g), kind == LayoutKind::Kvtier);
                let pieces_per_block_layer = match kind {
                    LayoutKind::Kvtier => 1,
                    LayoutKind::Vllm | LayoutKind::Sglang => 2,
                    // 4 tokens × 2 heads of 16 bytes, K then V.
                    LayoutKind::VllmLbnhc | LayoutKind::VllmLbhnc => 16,
                };
                assert_eq!(
                    layout.slot_pieces(&g, 2, 4).len(),
                    pieces_per_block_layer,
                    "{kind}"
                );
            }
        }
        assert_eq!(
            PoolLayout::of_kind(LayoutKind::Vllm, &g, 5, 0).kv_offsets(1, 2),
            (1280 + 256, 1280 + 640 + 256)
        );
        // vllm-lbnhc, layer 1 slot 2: [blocks, token, head, K‖V] rows of 32 bytes; token 1,
        // head 0 of V is the block-layer's byte 128 + 32.
        let lbnhc = PoolLayout::of_kind(LayoutKind::VllmLbnhc, &g, 5, 0);
        let p: Vec<SlotPiece> = lbnhc.slot_pieces(&g, 1, 2).collect();
        assert_eq!(
            p[2 * 2 + 1],
            SlotPiece {
                buffer: 0,
                offset: 1280 + 2 * 256 + 64 + 16,
                at: 128 + 32,
                len: 16
            }
        );
        assert_eq!("vllm".parse::<LayoutKind>(), Ok(LayoutKind::Vllm));
        assert_eq!("vllm-lbhnc".parse::<LayoutKind>(), Ok(LayoutKind::VllmLbhnc));
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
                    v_buffer: 3 + l,
                    slot_stride: 128,
                    ..LayerLayout::default()
                })
                .collect(),
        );
        two.validate(&g, 5, &[640; 6]).unwrap();
        expect_err(&two, &[640; 5], "layout.layers[2].v_buffer", "has 5 buffer");
        let lbnhc = PoolLayout::of_kind(LayoutKind::VllmLbnhc, &g, 5, 0);
        let with = |i: usize, f: &dyn Fn(&mut LayerLayout)| {
            let mut layers = lbnhc.layers().to_vec();
            f(&mut layers[i]);
            PoolLayout::new(layers)
        };
        expect_err(
            &with(1, &|l| l.token_stride = 40),
            &[bytes],
            "layout.layers[1].token_stride",
            "tokens would overlap",
        );
        expect_err(
            &with(1, &|l| l.head_stride = 8),
            &[bytes],
            "layout.layers[1].head_stride",
            "heads would overlap",
        );
        expect_err(
            &with(0, &|l| l.head_stride = 33),
            &[bytes],
            "layout.layers[0].head_stride",
            "multiple of the 2-byte",
        );
        // V moved half a head into K's runs: the interleaved runs now share bytes.
        expect_err(
            &with(2, &|l| l.v_offset -= 8),
            &[bytes],
            "layout.layers[2].v_offset",
            "overlaps layer 2's K of slot 0",
        );
        // The slot stride is one token too short: slot 0's last token is slot 1's first.
        expect_err(
            &with(0, &|l| l.slot_stride -= 64),
            &[bytes],
            "layout.layers[0].slot_stride",
            "slots would overlap",
        );
    }

    /// vLLM ≥ 0.34's `LHBNC` (heads outermost, then blocks): the slot is not a plane's
    /// outermost dimension, so K and V interleave across slots too.
    #[test]
    fn layers_of_different_groups_may_share_memory_and_groups_are_numbered_without_gaps() {
        let g = geo();
        let bytes = PoolLayout::kind_bytes(&g, 5, 0);
        // vLLM's hybrid KV cache manager: layers 0 and 2 (group 0) and layer 1 (group 1) over
        // the same blocks; layer 1 lies on layer 0's memory.
        let mut layers = PoolLayout::of_kind(LayoutKind::Vllm, &g, 5, 0).layers().to_vec();
        layers[1] = LayerLayout {
            group: 1,
            ..layers[0]
        };
        let hybrid = PoolLayout::new(layers.clone());
        hybrid.validate(&g, 5, &[bytes]).unwrap();
        assert_eq!((hybrid.groups(), hybrid.layer_groups()), (2, vec![0, 1, 0]));
        assert_eq!(PoolLayout::of_kind(LayoutKind::Vllm, &g, 5, 0).groups(), 1);
        // Within a group, the same sharing is refused.
        layers[1].group = 0;
        expect_err(
            &PoolLayout::new(layers.clone()),
            &[bytes],
            "layout.layers[1].k_offset",
            "overlaps layer 0's K",
        );
        // Group 2 with no group 1, and a group past what the layers can make.
        layers[1].group = 2;
        layers[2].group = 2;
        expect_err(
            &PoolLayout::new(layers.clone()),
            &[bytes],
            "layout.layers[1].group",
            "no layer is in group 1",
        );
        layers[1].group = u32::MAX;
        expect_err(
            &PoolLayout::new(layers),
            &[bytes],
            "layout.layers[1].group",
            "at most 3 groups",
        );
        // Ten layers, each its own group: the request limit is sized for eight.
        let g10 = KvGeometry::new(10, 2, 8, Dtype::F16, 4).unwrap();
        let bytes10 = PoolLayout::kind_bytes(&g10, 5, 0);
        let mut layers = PoolLayout::of_kind(LayoutKind::Vllm, &g10, 5, 0)
            .layers()
            .to_vec();
        for (i, l) in layers.iter_mut().enumerate() {
            l.group = (i as u32).min(MAX_KV_CACHE_GROUPS - 1);
        }
        PoolLayout::new(layers.clone())
            .validate(&g10, 5, &[bytes10])
            .unwrap();
        layers[9].group = 9;
        layers[8].group = 8;
        let e = PoolLayout::new(layers).validate(&g10, 5, &[bytes10]).unwrap_err();
        assert_eq!(e.field, "layout.layers[8].group", "{e}");
        assert!(e.reason.contains("at most 8 KV cache groups"), "{e}");
    }

    #[test]
    fn layouts_with_the_slot_inside_the_head_validate_and_copy_every_byte_once() {
        let g = geo(); // 4 tokens, 2 heads of 16 bytes
        let n = 5u64;
        let row = 32; // K‖V of one head of one token
        let layer_bytes = 2 * n * 4 * row;
        let lhbnc = |l: u64| LayerLayout {
            k_offset: l * layer_bytes,
            v_offset: l * layer_bytes + 16,
            slot_stride: 4 * row,
            token_stride: row,
            head_stride: n * 4 * row,
            ..LayerLayout::default()
        };
        let layout = PoolLayout::new((0..3).map(lhbnc).collect());
        layout.validate(&g, 5, &[3 * layer_bytes]).unwrap();
        let mut owner = vec![0u8; (3 * layer_bytes) as usize];
        for l in 0..3 {
            for s in 0..5 {
                for p in layout.slot_pieces(&g, l, s) {
                    for b in p.offset..p.offset + p.len as u64 {
                        owner[b as usize] += 1;
                    }
                }
            }
        }
        assert!(owner.iter().all(|&c| c == 1));
        // Layer 1 moved up by one row: its runs land on layer 0's (same residues), and no
        // slot pair names it.
        let mut layers: Vec<LayerLayout> = (0..3).map(lhbnc).collect();
        layers[1].k_offset -= row;
        layers[1].v_offset -= row;
        let e = PoolLayout::new(layers.clone())
            .validate(&g, 5, &[3 * layer_bytes])
            .unwrap_err();
        assert_eq!(e.field, "layout.layers[1].k_offset", "{e}");
        // Layer 0's last K run (head 1, slot 4, token 3) is layer 1's first.
        assert!(
            e.reason
                .contains("layer 1's K of slot 0 overlaps layer 0's K of slot 4"),
            "{e}"
        );
        // With layer 1's strides changed too (a head stride of 21 rows), no slot pair is named.
        layers[1].head_stride = 21 * row;
        layers[1].k_offset -= 4 * row;
        layers[1].v_offset -= 4 * row;
        let e = PoolLayout::new(layers)
            .validate(&g, 5, &[3 * layer_bytes])
            .unwrap_err();
        assert_eq!(e.field, "layout.layers[1].k_offset", "{e}");
        assert!(
            e.reason.contains("shares bytes of buffer 0 with layer 0's K"),
            "{e}"
        );
    }

    /// Whether every run of every slot of every layer lies inside `bytes` and no byte is in two
    /// runs, by counting bytes.
    fn brute_force_fits(layout: &PoolLayout, g: &KvGeometry, slots: u32, bytes: u64) -> bool {
        let mut owner = vec![0u8; bytes as usize];
        let unit = head_bytes(g);
        for layer in layout.layers() {
            let (ts, hs) = layer.strides(g);
            for s in 0..u64::from(slots) {
                for t in 0..u64::from(g.block_tokens()) {
                    for h in 0..u64::from(g.kv_heads()) {
                        for base in [layer.k_offset, layer.v_offset] {
                            let at = base + s * layer.slot_stride + t * ts + h * hs;
                            if at + unit > bytes {
                                return false;
                            }
                            for b in at..at + unit {
                                owner[b as usize] += 1;
                                if owner[b as usize] > 1 {
                                    return false;
                                }
                            }
                        }
                    }
                }
            }
        }
        true
    }

    /// Every order of an engine tensor's (layer, block, token, head, K|V) dimensions (vLLM's
    /// LBNHC, BLHNC, HLBNC ... and 115 that no engine uses) validates and covers its bytes
    /// once; moving one layer's V by any amount is refused exactly when bytes would be shared
    /// or fall outside the buffer.
    #[test]
    fn every_dimension_order_validates_exactly_when_runs_are_apart() {
        let g = geo(); // 3 layers, 5 slots, 4 tokens, 2 heads, 16-byte runs
        let sizes = [3u64, 5, 4, 2, 2]; // layer, block, token, head, kv
        let bytes = sizes.iter().product::<u64>() * 16;
        let mut orders = vec![vec![]];
        for _ in 0..5 {
            orders = orders
                .into_iter()
                .flat_map(|o: Vec<usize>| {
                    (0..5)
                        .filter(|d| !o.contains(d))
                        .map(|d| [o.as_slice(), &[d]].concat())
                        .collect::<Vec<_>>()
                })
                .collect();
        }
        assert_eq!(orders.len(), 120);
        let mut refused = 0;
        for order in &orders {
            // Strides of a contiguous tensor whose dimensions come in `order`, outermost first.
            let mut stride = [0u64; 5];
            let mut acc = 16;
            for &d in order.iter().rev() {
                stride[d] = acc;
                acc *= sizes[d];
            }
            let layout = |shift: i64| {
                PoolLayout::new(
                    (0..3u64)
                        .map(|l| {
                            let k = l * stride[0];
                            let v = k + stride[4];
                            LayerLayout {
                                k_offset: k,
                                v_offset: if l == 1 { v.wrapping_add_signed(shift) } else { v },
                                slot_stride: stride[1],
                                token_stride: stride[2],
                                head_stride: stride[3],
                                ..LayerLayout::default()
                            }
                        })
                        .collect(),
                )
            };
            let exact = layout(0);
            exact
                .validate(&g, 5, &[bytes])
                .unwrap_or_else(|e| panic!("{order:?}: {e}"));
            assert!(brute_force_fits(&exact, &g, 5, bytes), "{order:?}");
            for shift in [-48i64, -16, -8, 8, 16, 32, 64, 160, 320] {
                let moved = layout(shift);
                if u64::try_from(i64::try_from(stride[0] + stride[4]).unwrap() + shift).is_err() {
                    continue;
                }
                let fits = brute_force_fits(&moved, &g, 5, bytes);
                let ok = moved.validate(&g, 5, &[bytes]);
                assert_eq!(ok.is_ok(), fits, "{order:?} shift {shift}: {ok:?}");
                refused += usize::from(!fits);
            }
            // Layer 1 with other strides: planes no longer on one lattice are checked
            // conservatively, never letting shared bytes through.
            for grow in [16u64, 32, 48] {
                let mut layers = exact.layers().to_vec();
                layers[1].slot_stride += grow;
                let changed = PoolLayout::new(layers);
                if !brute_force_fits(&changed, &g, 5, bytes) {
                    assert!(
                        changed.validate(&g, 5, &[bytes]).is_err(),
                        "{order:?} grow {grow}"
                    );
                }
            }
        }
        assert!(refused > 500, "{refused}");
    }
}
