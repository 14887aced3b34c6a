//! Durations (`--sync-interval 100ms`, `window: 1s`): never a panic, and
//! what parses prints back as text that parses to the same duration.
#![no_main]

use floodgate_core::{HumanDuration, parse_duration};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match parse_duration(text) {
        Ok(d) => {
            let shown = HumanDuration(d).to_string();
            assert_eq!(parse_duration(&shown), Ok(d), "{text:?} shown as {shown:?}");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
