//! The rules loader: YAML bytes to validated rules (and the limits of an
//! override, which the same parser reads). Never a panic or a hang, and
//! every error names the file and a position inside the text.
#![no_main]

use floodgate_core::rules::{ConfigErrors, RuleSet, parse_limits};
use libfuzzer_sys::fuzz_target;

fn check_errors(errors: &ConfigErrors, text: &str) {
    assert!(!errors.0.is_empty(), "an error result lists its errors");
    // YAML breaks lines at \n, \r\n and a lone \r.
    let breaks = text.matches('\n').count() + text.matches('\r').count() - text.matches("\r\n").count();
    let lines = u32::try_from(breaks + 1).unwrap_or(u32::MAX);
    for e in &errors.0 {
        assert!(!e.message.is_empty(), "{e:?}");
        assert!(e.pos.line <= lines, "line {} past the text's {lines}: {e}", e.pos.line);
        assert!(e.to_string().starts_with("fuzz.yaml"), "{e}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match RuleSet::from_yaml("fuzz.yaml", text) {
        Ok(set) => {
            for domain in set.domains() {
                assert!(set.domain(domain.name()).is_some(), "a listed domain is there");
                let _ = (domain.rules().count(), domain.request_descriptors().len());
            }
        }
        Err(errors) => check_errors(&errors, text),
    }
    if let Err(errors) = parse_limits("fuzz.yaml", text, "fuzz") {
        check_errors(&errors, text);
    }
});
