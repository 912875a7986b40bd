//! The `kvtier` binary as users run it.

use std::process::Command;

fn kvtier(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bench_offload_prints_the_seed_lines_then_baseline_and_checks() {
    let (ok, stdout, stderr) = kvtier(&[
        "bench",
        "offload",
        "--tokens",
        "1024",
        "--batch",
        "2",
        "--rounds",
        "2",
        "--warmup-rounds",
        "1",
    ]);
    assert!(ok, "{stderr}");
    let names: Vec<&str> = stdout
        .lines()
        .map(|l| l.split([' ', '=']).next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "load_span_ms",
            "store_span_ms",
            "e2e_ms",
            "load_active_sum_ms",
            "store_active_sum_ms",
            "load_bw_gib_s",
            "store_bw_gib_s",
            "duplex_bw_gib_s",
            "batch_makespan_ms",
            "batch_duplex_bw_gib_s",
            "memcpy_baseline_gib_s",
            "duplex_ratio_to_memcpy",
            "verified_blocks",
            "dropped_stores",
        ]
    );
    // 3 batches of 2 requests of 16 blocks, every one verified.
    assert!(
        stdout.contains("verified_blocks=96 mismatched_blocks=0"),
        "{stdout}"
    );
    assert!(stdout.contains("dropped_stores=0"), "{stdout}");
    assert!(stdout.lines().next().unwrap().contains(" p50=") && stdout.contains(" p99="));
}

#[test]
fn bench_offload_json_is_one_object() {
    let (ok, stdout, stderr) = kvtier(&[
        "bench", "offload", "--tokens", "640", "--batch", "1", "--rounds", "1", "--json", "--layers", "2",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(stdout.lines().count(), 1);
    for field in [
        "\"config\"",
        "\"load_span_ms\"",
        "\"memcpy_baseline_gib_s\"",
        "\"verified_blocks\":40",
        "\"layers\":2",
    ] {
        assert!(stdout.contains(field), "{field} missing: {stdout}");
    }
}

#[test]
fn bad_flags_get_clear_errors() {
    for (args, needle) in [
        (&["bench", "offload", "--hit-rate", "2"][..], "--hit-rate 2"),
        (&["bench", "offload", "--dtype", "int3"][..], "unknown dtype"),
        (
            &["bench", "offload", "--host-capacity", "12XB"][..],
            "invalid byte size",
        ),
        (&["bench", "offload", "--kv-heads", "0"][..], "kv_heads=0"),
        (
            &["bench", "offload", "--eviction", "random"][..],
            "unknown eviction policy",
        ),
    ] {
        let (ok, _, stderr) = kvtier(args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn keys_match_the_published_vectors() {
    // Case "tiny blocks of 4, counting tokens" of crates/kvtier-core/vectors/block_keys_v1.json.
    let (ok, stdout, stderr) = kvtier(&[
        "keys",
        "--model-id",
        "tiny",
        "--layers",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "8",
        "--dtype",
        "f32",
        "--block-tokens",
        "4",
        "--tokens",
        "1,2,3,4,5,6,7,8,9,10,11,12,13",
    ]);
    assert!(ok, "{stderr}");
    let vectors: serde_json::Value =
        serde_json::from_str(include_str!("../crates/kvtier-core/vectors/block_keys_v1.json")).unwrap();
    let case = &vectors["cases"][0];
    assert_eq!(case["name"], "tiny blocks of 4, counting tokens");
    let mut want = vec![format!("fingerprint={}", case["fingerprint"].as_str().unwrap())];
    for (i, k) in case["keys"].as_array().unwrap().iter().enumerate() {
        want.push(format!("key[{i}]={}", k.as_str().unwrap()));
    }
    assert_eq!(stdout.lines().collect::<Vec<_>>(), want);
    assert!(stderr.contains("1 trailing tokens"), "{stderr}");
}
