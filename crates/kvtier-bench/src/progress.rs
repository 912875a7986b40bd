//! A one-line progress bar on stderr, drawn only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Redraws at most every 100 ms; prints nothing when stderr is not a terminal (logs, CI).
#[derive(Debug)]
pub struct ProgressBar {
    label: String,
    total: u64,
    enabled: bool,
    last_draw: Option<Instant>,
    started: Instant,
}

impl ProgressBar {
    /// A bar for `total` steps.
    pub fn new(label: &str, total: u64) -> Self {
        Self {
            label: label.to_owned(),
            total: total.max(1),
            enabled: std::io::stderr().is_terminal(),
            last_draw: None,
            started: Instant::now(),
        }
    }

    /// Changes the number of steps.
    pub fn set_total(&mut self, total: u64) {
        self.total = total.max(1);
    }

    /// Shows `done` of `total` steps.
    pub fn update(&mut self, done: u64) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if done < self.total
            && self
                .last_draw
                .is_some_and(|t| now - t < Duration::from_millis(100))
        {
            return;
        }
        self.last_draw = Some(now);
        let width = 30;
        let filled = (done.min(self.total) * width / self.total) as usize;
        let _ = write!(
            std::io::stderr(),
            "\r{} [{}{}] {done}/{} {:.1}s",
            self.label,
            "#".repeat(filled),
            " ".repeat(width as usize - filled),
            self.total,
            self.started.elapsed().as_secs_f64()
        );
    }

    /// Clears the bar.
    pub fn finish(&mut self) {
        if self.enabled && self.last_draw.is_some() {
            let _ = write!(std::io::stderr(), "\r{}\r", " ".repeat(self.label.len() + 60));
        }
    }
}
