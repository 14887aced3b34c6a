//! The usage scanner on an upstream's response body (issue 47): any bytes,
//! fed whole and fed in the pieces the input's first byte picks. Never a
//! panic, and the same usage however the body is cut.
#![no_main]

use floodgate_tower::usage::Scanner;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&step, body)) = data.split_first() else { return };
    let mut whole = Scanner::new();
    whole.feed(body);
    let mut pieces = Scanner::new();
    for piece in body.chunks(usize::from(step).max(1)) {
        pieces.feed(piece);
    }
    assert_eq!(whole.usage(), pieces.usage(), "cut every {step} bytes");
});
