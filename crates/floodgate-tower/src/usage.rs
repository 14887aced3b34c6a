//! Reading an OpenAI-compatible `usage` object out of a response body as it
//! streams past, in a JSON body or in a server-sent-event stream, without
//! holding the body.
//!
//! The scanner looks for the key `"usage"` followed by `:` and an object,
//! and keeps only that object (at most [`MAX_USAGE`] bytes) until its braces
//! close; then its whole-number fields are merged into what it has seen,
//! field by field, the later value winning. So a JSON body's `usage`, the
//! last chunk of an OpenAI stream (`stream_options.include_usage`), usage
//! repeated cumulatively in every chunk (vLLM's `continuous_usage_stats`),
//! and usage split across events (Anthropic's `message_start` with the
//! input tokens, `message_delta` with the output ones) all read right.
//!
//! Text inside a JSON string is not mistaken for the key: a quote there is
//! written `\"`, so `"usage"` appears in a string's bytes only at the end
//! of one that ends in `\"usage` — and it is read as the key only if that
//! string is itself an object's key followed by an object (no API writes
//! one; the latest value wins anyway). The bytes between usage objects are
//! only searched (SIMD `memmem`), never copied or parsed.

use memchr::memmem;

/// The longest `usage` object kept (a larger one is skipped).
pub const MAX_USAGE: usize = 16 * 1024;

const KEY: &[u8] = b"\"usage\"";

/// The key's searcher, built once.
static FINDER: std::sync::LazyLock<memmem::Finder<'static>> = std::sync::LazyLock::new(|| memmem::Finder::new(KEY));

/// The usage fields seen in a body so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Usage {
    fields: Vec<(Box<str>, u64)>,
}

impl Usage {
    /// A field's value, if seen.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.fields.iter().find(|(n, _)| &**n == name).map(|(_, v)| *v)
    }

    /// Whether no usage was seen.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    fn merge(&mut self, object: &[u8]) {
        let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(object) else { return };
        for (name, value) in map {
            let Some(v) = value.as_u64() else { continue };
            match self.fields.iter_mut().find(|(n, _)| **n == *name) {
                Some(slot) => slot.1 = v,
                None => self.fields.push((name.into_boxed_str(), v)),
            }
        }
    }
}

/// Where the scanner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Looking for the key.
    Search,
    /// After the key: whitespace, then `:`.
    Colon,
    /// After the colon: whitespace, then `{`.
    Open,
    /// Inside the object: its depth, whether in a string, whether the last
    /// byte was a backslash in one.
    Object { depth: u32, in_string: bool, escaped: bool },
}

/// Finds `usage` objects in a body fed to it piece by piece.
#[derive(Debug)]
pub struct Scanner {
    state: State,
    /// The object so far, while in one.
    object: Vec<u8>,
    /// The last bytes of the previous piece (a key split between pieces),
    /// and how many.
    tail: [u8; 2 * KEY.len()],
    tail_len: usize,
    usage: Usage,
}

impl Default for Scanner {
    fn default() -> Self {
        Self::new()
    }
}

impl Scanner {
    /// A scanner that has seen nothing.
    pub fn new() -> Self {
        Self {
            state: State::Search,
            object: Vec::new(),
            tail: [0; 2 * KEY.len()],
            tail_len: 0,
            usage: Usage::default(),
        }
    }

    /// What was seen so far.
    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    /// Feed the next piece of the body.
    pub fn feed(&mut self, mut piece: &[u8]) {
        while !piece.is_empty() {
            piece = match self.state {
                State::Search => self.search(piece),
                _ => self.step(piece),
            };
        }
    }

    /// In `Search`: the rest of `piece` after a key found in it (or across
    /// from the previous piece), or nothing.
    fn search<'p>(&mut self, piece: &'p [u8]) -> &'p [u8] {
        // A key split between the previous piece and this one.
        // (The tail is shorter than the key: a match ends in this piece.)
        if self.tail_len > 0 {
            let (tail_len, take) = (self.tail_len, piece.len().min(KEY.len() - 1));
            let joined = tail_len + take;
            self.tail[tail_len..joined].copy_from_slice(&piece[..take]);
            self.tail_len = 0;
            if let Some(at) = FINDER.find(&self.tail[..joined]) {
                self.state = State::Colon;
                return &piece[at + KEY.len() - tail_len..];
            }
            if take == piece.len() {
                // A short piece: the tail is its last bytes and the ones
                // before.
                let keep = joined.min(KEY.len() - 1);
                self.tail.copy_within(joined - keep..joined, 0);
                self.tail_len = keep;
                return &[];
            }
        }
        match FINDER.find(piece) {
            Some(at) => {
                self.state = State::Colon;
                &piece[at + KEY.len()..]
            }
            None => {
                let keep = piece.len().min(KEY.len() - 1);
                self.tail[..keep].copy_from_slice(&piece[piece.len() - keep..]);
                self.tail_len = keep;
                &[]
            }
        }
    }

    /// After a key: byte by byte, until the object ends or the key turns out
    /// not to hold one. The rest of `piece`.
    fn step<'p>(&mut self, piece: &'p [u8]) -> &'p [u8] {
        for (i, &b) in piece.iter().enumerate() {
            match &mut self.state {
                State::Search => return &piece[i..],
                State::Colon | State::Open if b.is_ascii_whitespace() => {}
                State::Colon if b == b':' => self.state = State::Open,
                State::Open if b == b'{' => {
                    self.object.clear();
                    self.object.push(b);
                    self.state = State::Object { depth: 1, in_string: false, escaped: false };
                }
                // `"usage": null`, `"usage"` as a value, …: search again
                // from this byte.
                State::Colon | State::Open => {
                    self.state = State::Search;
                    return &piece[i..];
                }
                State::Object { depth, in_string, escaped } => {
                    self.object.push(b);
                    if *in_string {
                        match (*escaped, b) {
                            (true, _) => *escaped = false,
                            (false, b'\\') => *escaped = true,
                            (false, b'"') => *in_string = false,
                            _ => {}
                        }
                    } else {
                        match b {
                            b'"' => *in_string = true,
                            b'{' | b'[' => *depth += 1,
                            b'}' | b']' => *depth -= 1,
                            _ => {}
                        }
                    }
                    if *depth == 0 {
                        self.usage.merge(&self.object);
                        self.object.clear();
                        self.state = State::Search;
                        return &piece[i + 1..];
                    }
                    if self.object.len() > MAX_USAGE {
                        self.object = Vec::new();
                        self.state = State::Search;
                        return &piece[i + 1..];
                    }
                }
            }
        }
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(pieces: &[&[u8]]) -> Usage {
        let mut s = Scanner::new();
        for p in pieces {
            s.feed(p);
        }
        s.usage().clone()
    }

    const JSON: &str = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"say \"usage\": {\"total_tokens\": 1}"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42,"prompt_tokens_details":{"cached_tokens":0}}}"#;

    #[test]
    fn a_json_bodys_usage_is_read_whatever_the_pieces() {
        let whole = scan(&[JSON.as_bytes()]);
        assert_eq!(
            (whole.get("prompt_tokens"), whole.get("completion_tokens"), whole.get("total_tokens")),
            (Some(12), Some(30), Some(42))
        );
        assert_eq!(whole.get("prompt_tokens_details"), None, "only whole numbers");
        // Every split point, and byte by byte: the same.
        let b = JSON.as_bytes();
        for at in 0..b.len() {
            assert_eq!(scan(&[&b[..at], &b[at..]]), whole, "split at {at}");
        }
        let bytes: Vec<&[u8]> = b.chunks(1).collect();
        assert_eq!(scan(&bytes), whole);
    }

    #[test]
    fn a_streams_usage_chunk_is_read_and_later_values_win() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
                   data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n\
                   data: [DONE]\n\n";
        let u = scan(&[sse.as_bytes()]);
        assert_eq!(u.get("total_tokens"), Some(7));
        // Anthropic: input tokens first, output tokens later, merged.
        let anthropic = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                         event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
        let u = scan(&[anthropic.as_bytes()]);
        assert_eq!((u.get("input_tokens"), u.get("output_tokens")), (Some(25), Some(15)));
    }

    #[test]
    fn no_usage_and_broken_usage_read_as_nothing() {
        assert!(scan(&[b"{\"choices\":[]}"]).is_empty());
        assert!(scan(&[b"{\"usage\": \"none\", \"x\": 1}"]).is_empty());
        assert!(scan(&[b"{\"usage\": {\"total_tokens\": 4"]).is_empty(), "cut mid-object");
        let mut huge = b"{\"usage\":{\"a\":\"".to_vec();
        huge.extend(std::iter::repeat_n(b'x', MAX_USAGE + 10));
        huge.extend_from_slice(b"\"},\"usage\":{\"total_tokens\":3}}");
        assert_eq!(scan(&[&huge]).get("total_tokens"), Some(3), "an oversized object is skipped, the next one read");
    }
}
