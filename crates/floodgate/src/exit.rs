//! Exit codes and the error that carries one.

use std::fmt;

/// Success (for `check`: allowed).
pub(crate) const OK: u8 = 0;
/// `check`: the request was denied; `simulate --regions`: the bounded cap
/// was broken in some seed.
pub(crate) const DENIED: u8 = 1;
/// Runtime failure: cannot read, write, connect or bind.
pub(crate) const FAILURE: u8 = 2;
/// Bad usage, bad configuration or bad input.
pub(crate) const USAGE: u8 = 64;

/// A command's failure: what to print and how to exit.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    message: String,
}

impl Failure {
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self { code: USAGE, message: message.into() }
    }

    /// Stop early without an error (the reader went away).
    pub(crate) fn stop() -> Self {
        Self { code: OK, message: String::new() }
    }

    /// Exit with `code` and nothing to print (e.g. `check`: denied).
    pub(crate) fn quiet(code: u8) -> Self {
        Self { code, message: String::new() }
    }

    /// Exit with `code`, saying `message`.
    pub(crate) fn with_code(code: u8, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    pub(crate) fn runtime(message: impl Into<String>) -> Self {
        Self { code: FAILURE, message: message.into() }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<floodgate::trace::TraceError> for Failure {
    fn from(e: floodgate::trace::TraceError) -> Self {
        match e {
            floodgate::trace::TraceError::Bad(m) => Failure::usage(m),
            floodgate::trace::TraceError::Read(m) => Failure::runtime(m),
        }
    }
}
