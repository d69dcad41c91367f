//! Test harness pieces shared by this crate's tests and other crates' tests.
