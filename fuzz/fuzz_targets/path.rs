#![no_main]
//! See `tollgate_fuzz::path`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tollgate_fuzz::path(data));
