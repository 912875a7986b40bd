#!/usr/bin/env python3
"""Reference implementation of kvtier block keys, independent of the Rust code.

It writes or checks the published test vectors (crates/kvtier-core/vectors/block_keys_v1.json)
so that a Python or C++ client can verify it computes the same keys as kvtier:

    key[i] = xxh3_128(fingerprint (16 B LE) || key[i-1] (16 B LE, zero for i = 0)
                      || tokens[i*B:(i+1)*B] as u32 LE)
    fingerprint = xxh3_128(canonical namespace encoding, see namespace_bytes below)

Usage: block_keys.py [--write] [PATH]   (needs `pip install xxhash`)
"""
import json
import os
import struct
import sys

import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "crates", "kvtier-core", "vectors", "block_keys_v1.json")


def put_str(s):
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def namespace_bytes(ns):
    g = ns["geometry"]
    return (
        b"kvtier-ns-v1"
        + put_str(ns["model_id"])
        + struct.pack("<III", g["layers"], g["kv_heads"], g["head_dim"])
        + put_str(g["dtype"])
        + struct.pack("<III", g["block_tokens"], ns["tp_rank"], ns["tp_size"])
        + put_str(ns["cache_salt"])
    )


def u128_le(v):
    return v.to_bytes(16, "little")


def block_keys(fingerprint, tokens, block_tokens):
    keys, prev = [], 0
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens:(i + 1) * block_tokens]
        data = u128_le(fingerprint) + u128_le(prev) + struct.pack("<%dI" % block_tokens, *block)
        prev = xxhash.xxh3_128_intdigest(data)
        keys.append(prev)
    return keys


def lcg_tokens(n, seed, vocab):
    out, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % vocab)
    return out


def ns(model, layers, kv_heads, head_dim, dtype, block_tokens, tp_rank=0, tp_size=1, salt=""):
    return {
        "model_id": model,
        "geometry": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                     "dtype": dtype, "block_tokens": block_tokens},
        "tp_rank": tp_rank, "tp_size": tp_size, "cache_salt": salt,
    }


def cases():
    q = "Qwen/Qwen3-30B-A3B"
    return [
        ("tiny blocks of 4, counting tokens", ns("tiny", 2, 1, 8, "f32", 4), list(range(1, 13))),
        ("partial tail block is not keyed", ns("tiny", 2, 1, 8, "f32", 4), list(range(1, 11))),
        ("fewer tokens than one block", ns("tiny", 2, 1, 8, "f32", 4), [7, 8, 9]),
        ("edge token values", ns("tiny", 1, 1, 1, "f16", 2), [0, 4294967295, 1, 2147483648]),
        ("qwen3-30b-a3b one layer, 200 tokens of block 64",
         ns(q, 1, 4, 128, "bf16", 64), lcg_tokens(200, 1, 151936)),
        ("qwen3-30b-a3b 48 layers, tp rank 1 of 2, tenant salt",
         ns(q, 48, 2, 128, "bf16", 64, 1, 2, "tenant-42"), lcg_tokens(256, 2, 151936)),
        ("fp8 KV, block 16, unicode model id",
         ns("模型/qwen3-0.6b", 28, 8, 128, "fp8_e4m3", 16), lcg_tokens(100, 3, 151936)),
        ("same tokens, other salt: other keys",
         ns(q, 1, 4, 128, "bf16", 64, 0, 1, "tenant-a"), lcg_tokens(200, 1, 151936)),
    ]


def build():
    out = []
    for name, n, tokens in cases():
        canon = namespace_bytes(n)
        fp = xxhash.xxh3_128_intdigest(canon)
        keys = block_keys(fp, tokens, n["geometry"]["block_tokens"])
        out.append({
            "name": name,
            "namespace": n,
            "namespace_canonical_hex": canon.hex(),
            "fingerprint": "%032x" % fp,
            "tokens": tokens,
            "keys": ["%032x" % k for k in keys],
        })
    return {
        "format": "kvtier-block-keys-v1",
        "definition": "key[i] = xxh3_128(fingerprint 16B LE || key[i-1] 16B LE (zero for i=0) || "
                      "tokens of block i as u32 LE); fingerprint = xxh3_128(canonical namespace "
                      "bytes); keys and fingerprints printed as 32 hex digits of the u128 value",
        "cases": out,
    }


def main(argv):
    write = "--write" in argv
    paths = [a for a in argv if not a.startswith("--")]
    path = paths[0] if paths else DEFAULT
    want = build()
    if write:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(want, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print("wrote %d cases to %s" % (len(want["cases"]), path))
        return 0
    with open(path, encoding="utf-8") as f:
        have = json.load(f)
    if have != want:
        for a, b in zip(have["cases"], want["cases"]):
            if a != b:
                print("MISMATCH in case %r" % b["name"], file=sys.stderr)
        print("block key vectors in %s do not match the reference" % path, file=sys.stderr)
        return 1
    print("block key vectors OK: %d cases, %d keys" % (len(want["cases"]),
                                                        sum(len(c["keys"]) for c in want["cases"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
