//! `floodgate simulate`'s input: JSON lines, one request each, sorted by
//! time.
//!
//! ```text
//! {"at_ms": 0, "key": "alice"}
//! {"at_ms": 1200, "key": "alice", "hits": 3}
//! ```

use std::borrow::Cow;
use std::fmt;
use std::io::{self, BufRead};

use serde::Deserialize;

/// One input line.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event<'a> {
    /// When, in milliseconds from the trace's start.
    pub at_ms: u64,
    /// The counter's key.
    #[serde(borrow)]
    pub key: Cow<'a, str>,
    /// The request's cost (default 1).
    #[serde(default = "one")]
    pub hits: u64,
}

fn one() -> u64 {
    1
}

/// Why a trace stopped being read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceError {
    /// A line that is not an event, or out of order: its number and what to
    /// write instead (bad input).
    Bad(String),
    /// The input could not be read (a runtime failure).
    Read(String),
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Bad(m) | TraceError::Read(m) => f.write_str(m),
        }
    }
}

/// Read JSON lines, check them, and hand each event to `f`. Stops at the
/// first bad line with its number and what is wrong, or at `f`'s first
/// error.
pub fn for_each_event<E: From<TraceError>>(
    mut input: impl BufRead,
    mut f: impl FnMut(&Event<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let mut line = String::new();
    let mut number = 0u64;
    let mut last_at = 0u64;
    loop {
        line.clear();
        match input.read_line(&mut line) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return Err(TraceError::Bad(format!("stdin line {}: not valid UTF-8", number + 1)).into());
            }
            Err(e) => return Err(TraceError::Read(format!("reading stdin: {e}")).into()),
        }
        number += 1;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let ev: Event<'_> = serde_json::from_str(text).map_err(|e| {
            let msg = e.to_string();
            let msg = msg.rsplit_once(" at line ").map_or(msg.as_str(), |(m, _)| m);
            TraceError::Bad(format!(
                "stdin line {number}, column {}: {msg}; expected {{\"at_ms\": 1200, \"key\": \"alice\", \"hits\": 1}}",
                e.column()
            ))
        })?;
        if ev.at_ms < last_at {
            return Err(TraceError::Bad(format!(
                "stdin line {number}: at_ms {} is before the previous line's {last_at}; sort the trace by at_ms",
                ev.at_ms
            ))
            .into());
        }
        last_at = ev.at_ms;
        f(&ev)?;
    }
}
