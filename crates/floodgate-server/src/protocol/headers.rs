//! The rate-limit headers of a service [`Answer`]: `floodgate_core::headers`
//! over the answer's headline limit.

pub use floodgate_core::headers::HeaderMode;
use floodgate_core::headers::{Headline, rate_limit_headers};

use crate::service::Answer;

/// The headers for `answer`, as `(name, value)` pairs.
pub fn headers(answer: &Answer, mode: HeaderMode) -> Vec<(&'static str, String)> {
    let headline = answer.headline.as_ref().map(|(info, decision)| Headline {
        name: info.name.as_deref(),
        requests_per_unit: info.requests_per_unit,
        window: info.window,
        decision,
    });
    rate_limit_headers(answer.allowed, answer.retry_after, headline, mode)
}
