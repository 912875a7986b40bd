//! The queue tests' rig and fixtures: the crate's `test_util` (one copy for every crate).
#![allow(unused_imports)]

pub use kvtier_transfer::test_util::*;
