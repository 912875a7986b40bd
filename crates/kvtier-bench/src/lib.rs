//! kvtier-bench: the benchmarks users size their tiers with.
//!
//! - [`run_offload`]: the seed-003 offload microbenchmark behind `kvtier bench offload`.
//! - [`run_recovery`]: disk tier reopen time, behind `kvtier bench recovery`.
#![warn(missing_docs)]

mod baselines;
mod engine_bench;
mod error;
mod http_client;
mod offload;
mod progress;
mod recovery;
mod serve;
mod sidecar;
mod slot_pool;
mod summary;
mod workload;

pub use engine_bench::{EngineBenchConfig, EngineBenchReport, TtftFigures, run_engine_bench};
pub use error::BenchError;
pub use offload::{DiskFigures, OffloadConfig, OffloadReport, run_offload};
pub use progress::ProgressBar;
pub use recovery::{RecoveryConfig, RecoveryReport, run_recovery};
pub use serve::{Scenario, ServeConfig, ServeReport, ServeRun, run_serve};
pub use sidecar::{
    MatchBenchConfig, MatchBenchReport, MatchFigures, SidecarOffloadReport, SidecarTarget, run_match,
    run_offload_sidecar, sidecar_geometry,
};
pub use slot_pool::BenchDevice;
pub use summary::Summary;
pub use workload::SeedFigures;
