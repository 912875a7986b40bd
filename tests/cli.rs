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
            "stream_copy_baseline_gib_s",
            "duplex_ratio_to_stream_copy",
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

#[test]
fn serve_help_shows_the_defaults_and_bench_match_says_where_it_runs() {
    let (ok, out, err) = kvtier(&["serve", "--help"]);
    assert!(ok, "{err}");
    let out = out.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "[default: 4GiB]",
        "[default: 127.0.0.1:9400]",
        "[default: off (no disk tier)]",
        "[default: off]",
        "[default: $XDG_RUNTIME_DIR/kvtier.sock, else /tmp/kvtier-<uid>.sock; here",
    ] {
        assert!(out.contains(want), "serve --help lacks {want:?}:\n{out}");
    }
    let (ok, out, _) = kvtier(&["bench", "match", "--help"]);
    let out = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        ok && out.contains("in-process") && out.contains("in this process"),
        "{out}"
    );
    // Every client command takes the same connection flags.
    for cmd in [
        &["health"][..],
        &["engine"],
        &["bench", "match"],
        &["bench", "offload"],
        &["bench", "engine"],
    ] {
        let (ok, out, _) = kvtier(&[cmd, &["--help"]].concat());
        for flag in ["--sidecar", "--tls-ca", "--tls-server-name", "--auth-token-file"] {
            assert!(ok && out.contains(flag), "{cmd:?} --help lacks {flag}");
        }
    }
}

#[test]
fn serve_configuration_errors_name_the_flag_key_and_form() {
    for (args, needles) in [
        (
            &["serve", "--metrics", "9400"][..],
            &["--metrics", "host:port", "off"][..],
        ),
        (
            &[
                "serve",
                "--host-capacity",
                "8GiB",
                "--set",
                "host.capacity=4GiB",
                "--print-config",
            ],
            &["--host-capacity", "host.capacity", "give one"],
        ),
        (
            &[
                "serve",
                "--set",
                "transfer.load_inflight_limit=0",
                "--print-config",
            ],
            &["transfer.load_inflight_limit", "at least"],
        ),
        (
            &["serve", "--set", "host.capacity=-1", "--print-config"],
            &["host.capacity = -1", "8GiB"],
        ),
        (
            &[
                "serve",
                "--disk-dir",
                "/tmp/kvtier-cli-test",
                "--set",
                "disk.capacity=1MiB",
                "--print-config",
            ],
            &["disk.capacity = \"1MiB\"", "region"],
        ),
        (
            &["serve", "--set", "remote.nodes=localhost", "--print-config"],
            &["remote.nodes", "is not host:port"],
        ),
        (
            &[
                "serve",
                "--set",
                "remote.nodes=h:1",
                "--set",
                "remote.timeout_ms=0",
                "--print-config",
            ],
            &["remote.timeout_ms = 0"],
        ),
    ] {
        let (ok, _, err) = kvtier(args);
        assert!(!ok, "{args:?} was accepted");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {err}");
        }
    }
}

#[test]
fn print_config_prints_every_key_and_redacts_the_token() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--disk-dir", "/var/cache/kvtier", "--print-config"])
        .args(["--set", "remote.nodes=10.0.0.1:6379,10.0.0.2:6379"])
        .env("KVTIER_SERVER__AUTH_TOKEN", "very-secret-token-0123")
        .env("KVTIER_REMOTE__PASSWORD", "very-secret-password")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!printed.contains("very-secret"), "{printed}");
    assert!(printed.contains("auth_token = \"<redacted>\""), "{printed}");
    assert!(printed.contains("password = \"<redacted>\""), "{printed}");
    let table: toml::Table = printed.parse().unwrap();
    assert_eq!(
        table["remote"]["nodes"],
        toml::Value::Array(vec!["10.0.0.1:6379".into(), "10.0.0.2:6379".into()]),
        "{printed}"
    );
    for key in kvtier_server::ServerConfig::key_paths() {
        let mut v = Some(&toml::Value::Table(table.clone()));
        for part in key.split('.') {
            v = v.and_then(|v| v.as_table()).and_then(|t| t.get(part));
        }
        assert!(v.is_some(), "--print-config lacks {key}:\n{printed}");
    }
}

#[test]
fn keys_default_to_the_geometry_serve_defaults_to() {
    let (ok, with_default, err) = kvtier(&["keys", "--model-id", "m", "--tokens", "1,2,3,4"]);
    assert!(ok, "{err}");
    let (ok, explicit, err) = kvtier(&["keys", "--model-id", "m", "--tokens", "1,2,3,4", "--layers", "48"]);
    assert!(ok, "{err}");
    assert_eq!(with_default, explicit);
}
