//! What a response says it cost, read as it streams past: an
//! OpenAI-compatible `usage` object (`prompt_tokens`, `completion_tokens`,
//! `total_tokens`) in a JSON body, or in a server-sent-event stream (the
//! event that carries it: with `stream_options.include_usage`, the last
//! one before `[DONE]`). The bytes are fed as they arrive and never kept
//! whole: the scanner holds its place in the JSON (depth, inside a string or
//! not) and copies only the `usage` value, at most [`MAX_USAGE_BYTES`], so a
//! response of any size costs a few hundred bytes of memory.
//!
//! The proxy and the tower layer (issue 47) settle a reservation with what
//! it reads; a response without usage settles at the estimate.

/// The most of a `usage` value kept (a real one is under 300 bytes); a
/// larger one is not read.
pub const MAX_USAGE_BYTES: usize = 4_096;

/// Tokens a response reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens` (input), when given.
    pub prompt: Option<u64>,
    /// `completion_tokens` (output), when given.
    pub completion: Option<u64>,
    /// `total_tokens`, when given.
    pub total: Option<u64>,
}

impl Usage {
    /// The total: `total_tokens`, or the sum of the other two when it is
    /// missing.
    pub fn total(&self) -> Option<u64> {
        self.total.or_else(|| match (self.prompt, self.completion) {
            (None, None) => None,
            (p, c) => Some(p.unwrap_or(0).saturating_add(c.unwrap_or(0))),
        })
    }
}

/// How the body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One JSON document (`application/json`).
    Json,
    /// Server-sent events (`text/event-stream`): each `data:` line a JSON
    /// document (or `[DONE]`).
    EventStream,
}

impl Framing {
    /// The framing a `Content-Type` names, if it is one of the two.
    pub fn of_content_type(content_type: &str) -> Option<Framing> {
        let essence = content_type.split(';').next().unwrap_or("").trim();
        if essence.eq_ignore_ascii_case("application/json") {
            Some(Framing::Json)
        } else if essence.eq_ignore_ascii_case("text/event-stream") {
            Some(Framing::EventStream)
        } else {
            None
        }
    }
}

/// Reads the `usage` of a response body fed in pieces of any size.
#[derive(Debug, Clone)]
pub struct Scanner {
    framing: Framing,
    json: Json,
    /// Event stream: where in a line we are.
    line: Line,
    /// The last usage read (in a stream, a later one wins).
    found: Option<Usage>,
    /// Event stream: a `data:` line's value starts in the piece being fed
    /// (so a whole line without `"usage"` in it can be passed over).
    fresh: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At a line's start: matching `data:` (how much matched).
    Start(u8),
    /// In a `data:` line's value: fed to the JSON scanner.
    Data,
    /// In any other line: skipped to its end.
    Skip,
}

impl Scanner {
    /// A scanner for a body framed as `framing`.
    pub fn new(framing: Framing) -> Self {
        Scanner { framing, json: Json::default(), line: Line::Start(0), found: None, fresh: false }
    }

    /// Feed the next piece of the body.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        if self.framing == Framing::Json {
            if let Some(u) = self.json.feed(bytes) {
                self.found = Some(u);
            }
            return;
        }
        const DATA: &[u8] = b"data:";
        while let Some((&b, rest)) = bytes.split_first() {
            if b == b'\n' || b == b'\r' {
                // An event's data ends with its line (one JSON document per
                // data line, as OpenAI sends).
                if self.line == Line::Data {
                    self.json = Json::default();
                }
                self.line = Line::Start(0);
                bytes = rest;
                continue;
            }
            match self.line {
                Line::Start(n) if usize::from(n) < DATA.len() && b == DATA[usize::from(n)] => {
                    self.line = if usize::from(n) + 1 == DATA.len() { Line::Data } else { Line::Start(n + 1) };
                    self.fresh = self.line == Line::Data;
                    bytes = rest;
                }
                Line::Start(_) | Line::Skip => {
                    // The rest of the line is not data.
                    self.line = Line::Skip;
                    bytes = &bytes[find_newline(bytes).unwrap_or(bytes.len())..];
                }
                Line::Data => {
                    // The line's value, at once; a whole one that never
                    // names "usage" (most chunks of a stream) is passed over.
                    let end = find_newline(bytes);
                    let value = &bytes[..end.unwrap_or(bytes.len())];
                    if !(self.fresh && end.is_some() && !names_usage(value))
                        && let Some(u) = self.json.feed(value)
                    {
                        self.found = Some(u);
                    }
                    self.fresh = false;
                    bytes = &bytes[value.len()..];
                }
            }
        }
    }

    /// The usage read so far (the last one of a stream).
    pub fn usage(&self) -> Option<Usage> {
        self.found
    }
}

/// A JSON document's place, byte by byte: only the top-level object's
/// `usage` member is copied.
#[derive(Debug, Clone, Default)]
struct Json {
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The current top-level key, while it is read (bounded).
    key: Vec<u8>,
    /// A top-level key was just closed: its value comes after the colon.
    after_key: bool,
    /// The key just read was `usage`, and its value is being copied.
    copying: bool,
    /// Depth at which the copy started.
    copy_depth: u32,
    copy: Vec<u8>,
    /// At depth 1, whether the next string is a key (after `{` or `,`).
    expect_key: bool,
}

impl Json {
    /// A run of bytes; the last usage whose value ended in it. Inside a
    /// string that is not a key nor copied (most of a response: its text),
    /// it jumps to the next quote or backslash eight bytes at a time.
    fn feed(&mut self, mut bytes: &[u8]) -> Option<Usage> {
        let mut found = None;
        while !bytes.is_empty() {
            let key = self.depth == 1 && self.expect_key;
            if self.in_string && !self.escaped && !self.copying && !key {
                match find_quote_or_backslash(bytes) {
                    Some(i) => bytes = &bytes[i..],
                    None => return found,
                }
            }
            if let Some(u) = self.byte(bytes[0]) {
                found = Some(u);
            }
            bytes = &bytes[1..];
        }
        found
    }

    /// One byte; the usage when its value just ended.
    fn byte(&mut self, b: u8) -> Option<Usage> {
        if self.copying {
            if self.copy.len() < MAX_USAGE_BYTES {
                self.copy.push(b);
            } else {
                self.copying = false;
                self.copy.clear();
            }
        }
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.depth == 1 && self.expect_key {
                    self.expect_key = false;
                    self.after_key = true;
                }
            } else if self.depth == 1 && self.expect_key && self.key.len() < 16 {
                self.key.push(b);
            }
            return None;
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 1 && self.expect_key {
                    self.key.clear();
                }
            }
            b':' if self.depth == 1 && self.after_key => {
                self.after_key = false;
                if self.key == b"usage" {
                    self.copying = true;
                    self.copy_depth = self.depth;
                    self.copy.clear();
                }
            }
            b'{' | b'[' => {
                self.depth += 1;
                if self.depth == 1 {
                    self.expect_key = b == b'{';
                }
            }
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.copying && self.depth == self.copy_depth {
                    // The value ended with this bracket.
                    self.copying = false;
                    return parse_usage(&self.copy);
                }
            }
            b',' if self.depth == 1 => {
                self.expect_key = true;
                if self.copying {
                    // A scalar value (null, a number) ended: not an object.
                    self.copying = false;
                }
            }
            _ => {}
        }
        None
    }
}

/// Whether `"usage"` followed by `:` and `{` (whitespace between) occurs in
/// `bytes`: a chunk with `"usage":null` (every chunk but the last, with
/// `stream_options.include_usage`) has nothing to read.
fn names_usage(bytes: &[u8]) -> bool {
    let skip_ws = |b: &[u8]| b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let mut from = 0;
    // By its `u` (rarer than quotes), then the quote before it.
    while let Some(i) = find_either(&bytes[from..], b'u', b'u').map(|i| from + i) {
        if i > 0
            && bytes[i - 1] == b'"'
            && let Some(after) = bytes[i..].strip_prefix(b"usage\"")
            && let Some(value) = after[skip_ws(after)..].strip_prefix(b":")
            && value[skip_ws(value)..].first() == Some(&b'{')
        {
            return true;
        }
        from = i + 1;
    }
    false
}

/// Where the next `\n` or `\r` is.
fn find_newline(bytes: &[u8]) -> Option<usize> {
    find_either(bytes, b'\n', b'\r')
}

/// Where the next `"` or `\\` is.
fn find_quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    find_either(bytes, b'"', b'\\')
}

/// The first position of `a` or `b`, eight bytes at a time (a word has a
/// zero byte where it equals the broadcast byte: the classic test).
fn find_either(bytes: &[u8], a: u8, b: u8) -> Option<usize> {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let (wa, wb) = (LO * u64::from(a), LO * u64::from(b));
    let has_zero = |x: u64| x.wrapping_sub(LO) & !x & HI;
    let mut i = 0;
    while i + 8 <= bytes.len() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[i..i + 8]);
        let x = u64::from_le_bytes(w);
        if has_zero(x ^ wa) | has_zero(x ^ wb) != 0 {
            break;
        }
        i += 8;
    }
    bytes[i..].iter().position(|&c| c == a || c == b).map(|p| i + p)
}

/// The three counts of a copied `usage` object (`{"prompt_tokens": 9,
/// ...}`, nested objects such as `prompt_tokens_details` skipped).
fn parse_usage(v: &[u8]) -> Option<Usage> {
    let text = std::str::from_utf8(v).ok()?.trim();
    if !text.starts_with('{') {
        return None;
    }
    let mut u = Usage::default();
    let mut depth = 0u32;
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < bytes.len() {
        match bytes[i] {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            b'"' if depth == 1 => {
                let end = i + 1 + text[i + 1..].find('"')?;
                let key = &text[i + 1..end];
                let rest = text[end + 1..].trim_start();
                if let Some(value) = rest.strip_prefix(':') {
                    let value = value.trim_start();
                    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
                    let n = value[..digits].parse::<u64>().ok();
                    match key {
                        "prompt_tokens" | "input_tokens" => u.prompt = n.or(u.prompt),
                        "completion_tokens" | "output_tokens" => u.completion = n.or(u.completion),
                        "total_tokens" => u.total = n.or(u.total),
                        _ => {}
                    }
                }
                i = end;
            }
            _ => {}
        }
        i += 1;
    }
    (u != Usage::default()).then_some(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of cutting `body` in two gives the same answer as one piece.
    fn read(framing: Framing, body: &str) -> Option<Usage> {
        let whole = {
            let mut s = Scanner::new(framing);
            s.feed(body.as_bytes());
            s.usage()
        };
        for cut in 0..body.len() {
            let mut s = Scanner::new(framing);
            s.feed(&body.as_bytes()[..cut]);
            s.feed(&body.as_bytes()[cut..]);
            assert_eq!(s.usage(), whole, "cut at {cut}");
        }
        let mut s = Scanner::new(framing);
        for b in body.as_bytes() {
            s.feed(std::slice::from_ref(b));
        }
        assert_eq!(s.usage(), whole, "a byte at a time");
        whole
    }

    const U: Usage = Usage { prompt: Some(9), completion: Some(12), total: Some(21) };

    #[test]
    fn a_json_body_gives_its_usage_and_only_the_top_levels() {
        let body = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a \"usage\": {\"total_tokens\": 99}"},"usage":{"total_tokens":5}}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        assert_eq!(read(Framing::Json, body), Some(U));
        assert_eq!(read(Framing::Json, r#"{"usage": null, "x": 1}"#), None);
        assert_eq!(read(Framing::Json, r#"{"error": {"message": "rate limited"}}"#), None);
        assert_eq!(read(Framing::Json, "not json at all"), None);
        assert_eq!(
            read(Framing::Json, r#"{"usage": {"input_tokens": 3, "output_tokens": 4}}"#).and_then(|u| u.total()),
            Some(7)
        );
    }

    #[test]
    fn an_event_stream_gives_the_usage_its_chunk_carries() {
        let stream = concat!(
            ": keep-alive\n\n",
            "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
            "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"lo data: {\\\"usage\\\"\"}}],\"usage\":null}\r\n\r\n",
            "event: message\n",
            "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n",
            "data: [DONE]\n\n"
        );
        assert_eq!(read(Framing::EventStream, stream), Some(U));
        let spaced = "data: {\"choices\":[], \"usage\" :\t{ \"total_tokens\": 21 }}\n\n";
        assert_eq!(read(Framing::EventStream, spaced).and_then(|u| u.total()), Some(21));
        // No usage chunk (no stream_options.include_usage): nothing read.
        let bare = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(read(Framing::EventStream, bare), None);
        // Cut mid-way: what was read so far.
        assert_eq!(read(Framing::EventStream, &stream[..stream.find("\"total_tokens\":21").unwrap()]), None);
    }

    #[test]
    fn a_huge_usage_value_is_not_kept() {
        let body = format!(r#"{{"usage": {{"pad": "{}", "total_tokens": 3}}}}"#, "x".repeat(MAX_USAGE_BYTES));
        let mut s = Scanner::new(Framing::Json);
        s.feed(body.as_bytes());
        assert_eq!(s.usage(), None);
    }

    proptest::proptest! {
        /// Whatever an upstream sends, the scanner answers (never panics),
        /// and keeps no more than its bound.
        #[test]
        fn any_bytes_are_read_without_a_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3_000),
            stream in proptest::prelude::any::<bool>(),
        ) {
            let mut s = Scanner::new(if stream { Framing::EventStream } else { Framing::Json });
            s.feed(&bytes);
            let _ = s.usage();
            proptest::prop_assert!(s.json.copy.len() <= MAX_USAGE_BYTES && s.json.key.len() <= 16);
        }

        /// The word-at-a-time search finds what a byte-by-byte one does.
        #[test]
        fn find_either_is_a_plain_search(
            bytes in proptest::collection::vec(proptest::sample::select(vec![b'a', b'"', b'\\', b'\n', 0xff, 0x22 ^ 0x80]), 0..64),
        ) {
            let naive = bytes.iter().position(|&c| c == b'"' || c == b'\\');
            proptest::prop_assert_eq!(find_quote_or_backslash(&bytes), naive);
        }
    }

    #[test]
    fn content_types_name_their_framing() {
        assert_eq!(Framing::of_content_type("application/json; charset=utf-8"), Some(Framing::Json));
        assert_eq!(Framing::of_content_type("text/event-stream"), Some(Framing::EventStream));
        assert_eq!(Framing::of_content_type("text/html"), None);
    }
}
