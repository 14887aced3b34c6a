//! Where the store connects: `redis://HOST:PORT[/DB]` (one server) or
//! `redis+cluster://HOST:PORT[,HOST:PORT…]` (a Redis Cluster, from any of
//! its nodes).

use std::fmt;
use std::str::FromStr;

/// A Redis deployment to connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One server (or a proxy in front of several), as a `redis://` URL.
    Single(String),
    /// A Redis Cluster, from the `redis://` URLs of its seed nodes.
    Cluster(Vec<String>),
}

/// A store address that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid Redis address {given:?}: {why}; write redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT[,HOST:PORT...]"
)]
pub struct TargetError {
    given: String,
    why: String,
}

impl FromStr for Target {
    type Err = TargetError;

    fn from_str(s: &str) -> Result<Self, TargetError> {
        let err = |why: &str| TargetError { given: s.to_owned(), why: why.to_owned() };
        if let Some(nodes) = s.strip_prefix("redis+cluster://") {
            let urls = nodes
                .split(',')
                .map(|n| {
                    let n = n.trim();
                    if n.is_empty() {
                        return Err(err("a node address is empty"));
                    }
                    let url = format!("redis://{n}");
                    check(&url).map_err(|why| err(&format!("node {n:?}: {why}")))?;
                    Ok(url)
                })
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Self::Cluster(urls));
        }
        if s.starts_with("redis://") || s.starts_with("rediss://") || s.starts_with("redis+unix://") {
            check(s).map_err(|why| err(&why.to_string()))?;
            return Ok(Self::Single(s.to_owned()));
        }
        Err(err("the scheme must be redis:// or redis+cluster://"))
    }
}

fn check(url: &str) -> Result<(), redis::RedisError> {
    use redis::IntoConnectionInfo;
    url.into_connection_info().map(|_| ())
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Single(url) => f.write_str(url),
            Self::Cluster(urls) => {
                let nodes: Vec<&str> = urls.iter().map(|u| u.trim_start_matches("redis://")).collect();
                write!(f, "redis+cluster://{}", nodes.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_single_and_cluster() {
        assert_eq!("redis://127.0.0.1:6379".parse(), Ok(Target::Single("redis://127.0.0.1:6379".into())));
        assert_eq!(
            "redis+cluster://a:7000, b:7001".parse(),
            Ok(Target::Cluster(vec!["redis://a:7000".into(), "redis://b:7001".into()]))
        );
        assert_eq!(
            "redis+cluster://a:7000,b:7001".parse::<Target>().unwrap().to_string(),
            "redis+cluster://a:7000,b:7001"
        );
    }

    #[test]
    fn bad_addresses_say_what_to_write() {
        for bad in ["memory", "http://x:1", "redis+cluster://", "redis+cluster://a:1,,b:2", "redis://:notaport"] {
            let e = bad.parse::<Target>().unwrap_err().to_string();
            assert!(e.contains("redis://HOST:PORT"), "{bad}: {e}");
        }
    }
}
