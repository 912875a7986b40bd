//! A real Redis Cluster for tests (feature `test-util`): six `redis-server` processes on
//! loopback started by the project's `scripts/redis_cluster.sh` (which installs Debian's
//! redis-server if it is missing) and stopped by PID when the handle drops.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A running cluster of 3 masters + 3 replicas; stopped when dropped.
#[derive(Debug)]
pub struct TestCluster {
    dir: tempfile::TempDir,
    nodes: Vec<String>,
}

/// `scripts/redis_cluster.sh` of this repository.
pub fn cluster_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/redis_cluster.sh")
}

impl TestCluster {
    /// Starts a cluster (about 5 s); `args` go to the script (`--password P`, `--maxmemory M`).
    ///
    /// # Panics
    /// If the script fails (its output says why): a test that needs the cluster cannot run
    /// without it.
    pub fn start(args: &[&str]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("kvtier-redis-")
            .tempdir()
            .expect("a temporary directory");
        let out = Command::new(cluster_script())
            .arg("start")
            .arg(dir.path())
            .args(args)
            .output()
            .expect("run scripts/redis_cluster.sh");
        assert!(
            out.status.success(),
            "scripts/redis_cluster.sh start failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let nodes = String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(',')
            .map(str::to_owned)
            .collect();
        Self { dir, nodes }
    }

    /// The masters' `host:port`.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The PID of the node listening on `port`.
    pub fn pid(&self, port: u16) -> Option<u32> {
        std::fs::read_to_string(self.dir.path().join(format!("{port}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The port of the master that holds `key`'s slot now.
    ///
    /// # Panics
    /// If no master claims the slot.
    pub fn master_of(&self, key: &str) -> u16 {
        let slot: u16 = self
            .cli(&["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers a number");
        for line in self.cli(&["CLUSTER", "NODES"]).lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f.len() < 9 || !f[2].contains("master") {
                continue;
            }
            let owns = f[8..].iter().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if (a..=b).contains(&slot))
            });
            if owns {
                let addr = f[1].split('@').next().unwrap_or("");
                return addr
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse().ok())
                    .expect("host:port");
            }
        }
        panic!("no master holds slot {slot}")
    }

    /// Runs `redis-cli -c -p <first master's port> args…` and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let port = self.nodes[0].rsplit_once(':').map_or("0", |(_, p)| p);
        Self::cli_at(port, args)
    }

    /// `redis-cli -p port args…` against one node.
    pub fn cli_on(&self, port: u16, args: &[&str]) -> String {
        Self::cli_at(&port.to_string(), args)
    }

    fn cli_at(port: &str, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-c", "-p", port])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the master on `port` has a replica online that has acknowledged everything
    /// written to it (replication is asynchronous: a master killed before that loses writes its
    /// clients saw succeed). False if that did not happen within `timeout`.
    pub fn wait_replicated(&self, port: u16, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let info = Self::cli_at(&port.to_string(), &["INFO", "replication"]);
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.trim().strip_prefix(name))
                    .and_then(|v| v.parse::<u64>().ok())
            };
            let master = field("master_repl_offset:");
            let caught_up = info.lines().any(|l| {
                l.starts_with("slave")
                    && l.contains("state=online")
                    && l.split(',')
                        .find_map(|kv| kv.strip_prefix("offset="))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .is_some_and(|o| Some(o) == master)
            });
            if caught_up {
                return true;
            }
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        let _ = Command::new(cluster_script())
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}
