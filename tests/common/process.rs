//! Child processes of the cross-process tests: a free loopback port, and a `kvtier` process
//! started and awaited until it logs that it is ready, killed when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `kvtier` child, killed (and reaped) on drop.
pub struct Kvtier(pub Child);

impl Kvtier {
    /// Starts `kvtier` with `args` and returns once a stderr line contains `ready` (the rest
    /// of its stderr is drained in the background).
    pub fn spawn_until(args: &[&str], ready: &str) -> Kvtier {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        while !lines
            .next()
            .unwrap_or_else(|| panic!("kvtier {args:?} exited"))
            .unwrap()
            .contains(ready)
        {}
        std::thread::spawn(move || for _ in lines {});
        Kvtier(child)
    }
}

impl Drop for Kvtier {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
