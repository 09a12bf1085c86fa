#![no_main]
//! See `tollgate_fuzz::identity`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tollgate_fuzz::identity(data));
