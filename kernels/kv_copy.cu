// kvtier device copy kernels. kvtier_copy_pieces: one launch copies a batch of up to
// KVTIER_MAX_PIECES byte ranges
// ("pieces") between device addresses.
//
// What it serves: gathering an engine's paged, strided K/V planes into kvtier's contiguous host
// pages ([K|V] per block-layer) on save, and scattering them back on load:
//   - vLLM: one tensor per layer, [2, num_blocks, block_size, heads, dim]; a block's K and V are
//     two ranges num_blocks * block_size * heads * dim elements apart;
//   - SGLang: separate K and V buffers per layer, [tokens, heads, dim] each.
// The host side turns a layer's blocks into pieces (an engine K or V range <-> the matching
// range of the page's K or V half) and launches one batch per layer and direction, so a layer's
// copies complete with one CUDA event. Host pages are pinned and mapped
// into the device address space (cuMemHostGetDevicePointer), so src/dst are plain device
// addresses whichever side is the host.
//
// ABI (the Rust side builds the parameter struct byte for byte; x86-64 little-endian layout):
// the batch is passed BY VALUE as the only parameter: 8 + 128 * 24 = 3080 bytes, under the
// 4 KiB kernel parameter limit.
//
// Launch shape: gridDim.y = batch.count (one y-row of blocks per piece), gridDim.x = blocks per
// piece (the host picks, e.g. up to 32), blockDim.x = any multiple of 32 (256 by default). The
// blocks of a row copy their piece in a grid-stride loop.
//
// Alignment paths: src, dst and bytes all multiples of 16 -> 16-byte (uint4) copies only, the
// fast path the page layouts normally give; src and dst equal mod 16 -> byte head, 16-byte body,
// byte tail; otherwise byte copies (correct, slow; not expected for K/V planes).
//
// NVRTC-compilable as is: no #include (NVRTC has no libc headers); uint4 is NVRTC's builtin.

#define KVTIER_MAX_PIECES 128

typedef unsigned long long kvtier_u64;

struct kvtier_piece {
    kvtier_u64 src;    // device address to read
    kvtier_u64 dst;    // device address to write
    kvtier_u64 bytes;  // length; 0 is allowed
};  // 24 bytes

struct kvtier_batch {
    unsigned int count;  // pieces used, <= KVTIER_MAX_PIECES
    unsigned int pad;    // 0; keeps pieces 8-byte aligned
    kvtier_piece pieces[KVTIER_MAX_PIECES];
};  // 8 + 3072 bytes

// Bytes [0, n) from s to d, element i by thread i of the row, then i + stride, ...
__device__ __forceinline__ void kvtier_copy_bytes(unsigned char* __restrict__ d,
                                                  const unsigned char* __restrict__ s,
                                                  kvtier_u64 n, kvtier_u64 i, kvtier_u64 stride)
{
    for (; i < n; i += stride) d[i] = s[i];
}

// n 16-byte units from s to d (both 16-byte aligned), same striding.
__device__ __forceinline__ void kvtier_copy_16(uint4* __restrict__ d,
                                               const uint4* __restrict__ s,
                                               kvtier_u64 n, kvtier_u64 i, kvtier_u64 stride)
{
    for (; i < n; i += stride) d[i] = s[i];
}

extern "C" __global__ void kvtier_copy_pieces(const kvtier_batch batch)
{
    if (blockIdx.y >= batch.count) return;
    const kvtier_piece p = batch.pieces[blockIdx.y];
    // Thread index within this piece's row of blocks, and the row's thread count.
    const kvtier_u64 i = (kvtier_u64)blockIdx.x * blockDim.x + threadIdx.x;
    const kvtier_u64 stride = (kvtier_u64)gridDim.x * blockDim.x;
    unsigned char* d = (unsigned char*)p.dst;
    const unsigned char* s = (const unsigned char*)p.src;

    if (((p.src | p.dst | p.bytes) & 15) == 0) {
        // Fast path: everything 16-byte aligned.
        kvtier_copy_16((uint4*)d, (const uint4*)s, p.bytes >> 4, i, stride);
    } else if (((p.src ^ p.dst) & 15) == 0) {
        // Same alignment mod 16: bytes up to the first 16-byte boundary, the aligned body in
        // 16-byte units, then the remaining tail bytes.
        kvtier_u64 head = (16 - (p.src & 15)) & 15;
        if (head > p.bytes) head = p.bytes;
        const kvtier_u64 body = (p.bytes - head) >> 4;
        const kvtier_u64 done = head + (body << 4);
        kvtier_copy_bytes(d, s, head, i, stride);
        kvtier_copy_16((uint4*)(d + head), (const uint4*)(s + head), body, i, stride);
        kvtier_copy_bytes(d + done, s + done, p.bytes - done, i, stride);
    } else {
        // Alignments differ: byte copies.
        kvtier_copy_bytes(d, s, p.bytes, i, stride);
    }
}

// ---------------------------------------------------------------------------------------------
// kvtier_copy_runs: one launch copies a layer's slots whose K and V the engine splits per token
// and head (vLLM >= 0.34's [.., K||V] rows: 2 x block_tokens x heads runs of head_dim elements
// per block-layer, which as pieces would be thousands per layer). The batch names each slot's
// K or V plane once, and the kernel computes every run's address from the layer's strides.
//
// Plane: `runs` runs of `run_bytes`; run r lies at
//   dev  + (r / per_token) * token_stride + (r % per_token) * head_stride   (engine side)
//   host + r * run_bytes                                                   (host page side,
//                                                    kvtier's [token][head][dim] order)
// to_host 1: engine -> host (save), 0: host -> engine (load). Addresses, strides and run_bytes
// are multiples of 16 (the Rust side checks and uses kvtier_copy_pieces otherwise).
//
// ABI: the batch by value, 48 + 240 * 16 = 3888 bytes (under the 4 KiB parameter limit).
// Launch shape: gridDim.y = count (one row of blocks per plane), gridDim.x = blocks per plane,
// blockDim.x any multiple of 32; a row's threads stride over the plane's 16-byte units, so
// consecutive threads touch consecutive bytes of a run on both sides.

#define KVTIER_MAX_PLANES 240

struct kvtier_plane {
    kvtier_u64 dev;   // engine address of the plane's run 0 (token 0, head 0)
    kvtier_u64 host;  // device address (mapped pinned page) of the plane in the host page
};  // 16 bytes

struct kvtier_runs_batch {
    kvtier_u64 token_stride;
    kvtier_u64 head_stride;
    kvtier_u64 run_bytes;     // bytes per run, a multiple of 16
    unsigned int per_token;   // runs per token: 1 (heads packed) or kv_heads
    unsigned int runs;        // runs per plane
    unsigned int count;       // planes used, <= KVTIER_MAX_PLANES
    unsigned int to_host;     // 1: engine -> host, 0: host -> engine
    kvtier_u64 pad;           // 0; the header is 48 bytes
    kvtier_plane planes[KVTIER_MAX_PLANES];
};  // 48 + 3840 bytes

extern "C" __global__ void kvtier_copy_runs(const kvtier_runs_batch batch)
{
    if (blockIdx.y >= batch.count) return;
    const kvtier_plane p = batch.planes[blockIdx.y];
    const kvtier_u64 units_per_run = batch.run_bytes >> 4;
    const kvtier_u64 units = units_per_run * batch.runs;
    const kvtier_u64 stride = (kvtier_u64)gridDim.x * blockDim.x;
    for (kvtier_u64 u = (kvtier_u64)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
        const kvtier_u64 r = u / units_per_run;
        const kvtier_u64 within = (u - r * units_per_run) << 4;
        const kvtier_u64 dev = p.dev + (r / batch.per_token) * batch.token_stride
                             + (r % batch.per_token) * batch.head_stride + within;
        const kvtier_u64 host = p.host + (u << 4);
        if (batch.to_host) {
            *(uint4*)host = *(const uint4*)dev;
        } else {
            *(uint4*)dev = *(const uint4*)host;
        }
    }
}
