//! kvtier-bench: the benchmarks users size their tiers with.
//!
//! - [`run_offload`]: the seed-003 offload microbenchmark behind `kvtier bench offload`.
#![warn(missing_docs)]

mod error;
mod offload;
mod progress;
mod summary;

pub use error::BenchError;
pub use offload::{OffloadConfig, OffloadReport, run_offload};
pub use progress::ProgressBar;
pub use summary::Summary;
