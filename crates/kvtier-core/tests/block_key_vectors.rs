//! The published block-key vectors (written by the independent Python reference in
//! `scripts/block_keys.py`) must be reproduced exactly by the Rust implementation.

use kvtier_core::{BlockHasher, BlockKey, Namespace};
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    format: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    namespace: Namespace,
    namespace_canonical_hex: String,
    fingerprint: String,
    tokens: Vec<u32>,
    keys: Vec<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn published_vectors_reproduce() {
    let text = include_str!("../vectors/block_keys_v1.json");
    let v: Vectors = serde_json::from_str(text).expect("vector file parses");
    assert_eq!(v.format, "kvtier-block-keys-v1");
    assert!(v.cases.len() >= 8, "the vector file lost cases");
    let mut total_keys = 0;
    for case in &v.cases {
        let ns = &case.namespace;
        assert_eq!(
            hex(&ns.canonical_bytes()),
            case.namespace_canonical_hex,
            "{}",
            case.name
        );
        let fp = ns.fingerprint();
        assert_eq!(fp.to_string(), case.fingerprint, "{}", case.name);
        let keys = BlockHasher::new(fp, ns.geometry().block_tokens()).keys(&case.tokens);
        let want: Vec<BlockKey> = case.keys.iter().map(|k| k.parse().unwrap()).collect();
        assert_eq!(keys, want, "{}", case.name);
        total_keys += keys.len();
    }
    assert!(total_keys >= 20);
}
