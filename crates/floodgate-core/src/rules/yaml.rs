//! A YAML document as a small tree whose every node knows its line and
//! column, built from `saphyr-parser`'s events, with bounds on nesting depth
//! and on the number of nodes (aliases included, so an alias "billion
//! laughs" is an error, not an out-of-memory). Duplicate mapping keys are an
//! error here, as in YAML 1.2. Merge keys (`<<: *defaults`, YAML 1.1, which
//! envoyproxy/ratelimit's parser reads) are merged: a mapping's own keys
//! win, and of a list of mappings the earlier ones.

use std::collections::HashMap;
use std::fmt;

use saphyr_parser::{Event, Marker, Parser, ScalarStyle, Span};

/// A position in a file: 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Pos {
    /// Line, from 1.
    pub line: u32,
    /// Column, from 1 (in characters).
    pub col: u32,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

impl Pos {
    fn of(span: &Span) -> Self {
        Self::at(&span.start)
    }

    fn at(m: &Marker) -> Self {
        Self { line: u32::try_from(m.line()).unwrap_or(u32::MAX), col: u32::try_from(m.col() + 1).unwrap_or(u32::MAX) }
    }

    /// The position just after the last character of `text`: where an
    /// error, or a node missing at the end (`---` alone, `? `), is placed
    /// when the parser puts it on the line after the last, where no editor
    /// can go.
    fn end(text: &str) -> Self {
        // YAML breaks lines at \n, \r\n and a lone \r.
        let mut line = 1u32;
        let mut col = 1u32;
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\n' || (c == '\r' && chars.peek() != Some(&'\n')) {
                line = line.saturating_add(1);
                col = 1;
            } else if c != '\r' {
                col = col.saturating_add(1);
            }
        }
        Self { line, col }
    }

    fn min(self, other: Self) -> Self {
        if (self.line, self.col) > (other.line, other.col) { other } else { self }
    }
}

/// One YAML node.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    /// A scalar as written; `plain` is false for quoted and block scalars
    /// (which are always strings).
    Scalar {
        value: String,
        plain: bool,
        pos: Pos,
    },
    Seq {
        items: Vec<Node>,
        pos: Pos,
    },
    Map {
        entries: Vec<(Node, Node)>,
        pos: Pos,
    },
}

impl Node {
    pub(crate) fn pos(&self) -> Pos {
        match self {
            Node::Scalar { pos, .. } | Node::Seq { pos, .. } | Node::Map { pos, .. } => *pos,
        }
    }

    /// A plain `~`, `null`, `Null`, `NULL` or empty scalar.
    pub(crate) fn is_null(&self) -> bool {
        matches!(self, Node::Scalar { value, plain: true, .. } if matches!(value.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    /// What kind of node this is, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            _ if self.is_null() => "nothing",
            Node::Scalar { .. } => "a scalar",
            Node::Seq { .. } => "a list",
            Node::Map { .. } => "a mapping",
        }
    }
}

/// Bounds on one document.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) max_depth: usize,
    pub(crate) max_nodes: usize,
}

/// Why a document could not be read as YAML.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct YamlError {
    pub(crate) pos: Pos,
    pub(crate) message: String,
}

enum Frame {
    Seq { items: Vec<Node>, pos: Pos, anchor: usize },
    Map { entries: Vec<(Node, Node)>, key: Option<Node>, seen: HashMap<String, Pos>, pos: Pos, anchor: usize },
}

/// Parse one YAML document; `Ok(None)` for a file with no document (empty,
/// or only comments).
pub(crate) fn parse(text: &str, bounds: Bounds) -> Result<Option<Node>, YamlError> {
    let mut stack: Vec<Frame> = Vec::new();
    let mut anchors: HashMap<usize, Node> = HashMap::new();
    let mut nodes = 0usize;
    let mut root: Option<Node> = None;
    let mut documents = 0;
    let err = |pos: Pos, message: String| YamlError { pos, message };
    let end = Pos::end(text);
    for event in Parser::new_from_str(text) {
        let (event, span) =
            event.map_err(|e| err(Pos::at(e.marker()).min(end), format!("YAML syntax error: {}", e.info())))?;
        let pos = Pos::of(&span).min(end);
        let (node, anchor) = match event {
            Event::DocumentStart(_) => {
                documents += 1;
                if documents > 1 {
                    return Err(err(pos, "a second YAML document: put one domain per file".into()));
                }
                continue;
            }
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                if stack.len() >= bounds.max_depth {
                    return Err(err(pos, format!("nested deeper than {} levels", bounds.max_depth)));
                }
                stack.push(if matches!(event, Event::SequenceStart(..)) {
                    Frame::Seq { items: Vec::new(), pos, anchor }
                } else {
                    Frame::Map { entries: Vec::new(), key: None, seen: HashMap::new(), pos, anchor }
                });
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => match stack.pop() {
                Some(Frame::Seq { items, pos, anchor }) => (Node::Seq { items, pos }, anchor),
                Some(Frame::Map { entries, pos, anchor, .. }) => (Node::Map { entries: merged(entries)?, pos }, anchor),
                None => continue,
            },
            Event::Scalar(value, style, anchor, _) => {
                let plain = style == ScalarStyle::Plain;
                (Node::Scalar { value: value.into_owned(), plain, pos }, anchor)
            }
            Event::Alias(id) => {
                let node = anchors.get(&id).cloned().ok_or_else(|| err(pos, "alias to an unknown anchor".into()))?;
                nodes += count(&node);
                if nodes > bounds.max_nodes {
                    return Err(err(pos, format!("more than {} YAML nodes (aliases expanded)", bounds.max_nodes)));
                }
                (node, 0)
            }
            Event::StreamStart | Event::StreamEnd | Event::DocumentEnd | Event::Nothing => continue,
        };
        nodes += 1;
        if nodes > bounds.max_nodes {
            return Err(err(pos, format!("more than {} YAML nodes", bounds.max_nodes)));
        }
        if anchor != 0 {
            anchors.insert(anchor, node.clone());
        }
        match stack.last_mut() {
            None => root = Some(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map { entries, key, seen, .. }) => match key.take() {
                None => {
                    if let Node::Scalar { value, .. } = &node
                        && let Some(first) = seen.insert(value.clone(), node.pos())
                    {
                        return Err(err(
                            node.pos(),
                            format!("duplicate key `{value}` (first at {first}): each key may appear once per mapping"),
                        ));
                    }
                    *key = Some(node);
                }
                Some(k) => entries.push((k, node)),
            },
        }
    }
    Ok(root)
}

/// A mapping's entries with its merge key (`<<`, plain) replaced by the
/// entries of the mapping (or list of mappings) it names that the mapping
/// does not set itself.
fn merged(entries: Vec<(Node, Node)>) -> Result<Vec<(Node, Node)>, YamlError> {
    let is_merge = |k: &Node| matches!(k, Node::Scalar { value, plain: true, .. } if value == "<<");
    if !entries.iter().any(|(k, _)| is_merge(k)) {
        return Ok(entries);
    }
    let key_text = |k: &Node| match k {
        Node::Scalar { value, .. } => Some(value.clone()),
        _ => None,
    };
    let (merges, mut own): (Vec<_>, Vec<_>) = entries.into_iter().partition(|(k, _)| is_merge(k));
    let mut present: std::collections::HashSet<String> = own.iter().filter_map(|(k, _)| key_text(k)).collect();
    for (_, value) in merges {
        let sources = match value {
            Node::Seq { items, .. } => items,
            other => vec![other],
        };
        for source in sources {
            let Node::Map { entries, .. } = source else {
                return Err(YamlError {
                    pos: source.pos(),
                    message: "a merge key (`<<`) takes a mapping or a list of mappings, e.g. `<<: *defaults`".into(),
                });
            };
            for (k, v) in entries {
                if key_text(&k).is_none_or(|t| present.insert(t)) {
                    own.push((k, v));
                }
            }
        }
    }
    Ok(own)
}

fn count(node: &Node) -> usize {
    match node {
        Node::Scalar { .. } => 1,
        Node::Seq { items, .. } => 1 + items.iter().map(count).sum::<usize>(),
        Node::Map { entries, .. } => 1 + entries.iter().map(|(k, v)| count(k) + count(v)).sum::<usize>(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Bounds = Bounds { max_depth: 16, max_nodes: 1_000 };

    fn scalar(n: &Node) -> &str {
        match n {
            Node::Scalar { value, .. } => value,
            _ => panic!("not a scalar"),
        }
    }

    #[test]
    fn merge_keys_merge_as_yaml_1_1_does() {
        let text = "base: &b {unit: minute, requests_per_unit: 5}\nother: &o {name: x, unit: hour}\nrule:\n  <<: [*b, *o]\n  requests_per_unit: 7\n";
        let Node::Map { entries, .. } = parse(text, B).unwrap().unwrap() else { panic!() };
        let Node::Map { entries: rule, .. } = &entries[2].1 else { panic!() };
        let got: Vec<(&str, &str)> = rule.iter().map(|(k, v)| (scalar(k), scalar(v))).collect();
        // Its own key wins; of the list, the earlier mapping's `unit`.
        assert_eq!(got, [("requests_per_unit", "7"), ("unit", "minute"), ("name", "x")]);
        // A merged entry keeps the position it was written at.
        assert_eq!(rule[1].0.pos(), Pos { line: 1, col: 11 });
        let e = parse("a: &a 1\nb:\n  <<: *a\n", B).unwrap_err();
        assert!(e.message.contains("takes a mapping"), "{e:?}");
        // A quoted "<<" is an ordinary key.
        let Node::Map { entries, .. } = parse("'<<': 1\n", B).unwrap().unwrap() else { panic!() };
        assert_eq!(scalar(&entries[0].0), "<<");
    }

    #[test]
    fn every_node_knows_its_position() {
        let doc = parse("domain: api\ndescriptors:\n  - key: user\n    value: 'alice'\n", B).unwrap().unwrap();
        let Node::Map { entries, .. } = doc else { panic!() };
        assert_eq!(entries[0].0.pos(), Pos { line: 1, col: 1 });
        assert_eq!(entries[0].1.pos(), Pos { line: 1, col: 9 });
        let Node::Seq { items, .. } = &entries[1].1 else { panic!() };
        let Node::Map { entries: d, .. } = &items[0] else { panic!() };
        assert_eq!(d[1].1.pos(), Pos { line: 4, col: 12 });
        assert_eq!(scalar(&d[1].1), "alice");
        assert!(matches!(&d[1].1, Node::Scalar { plain: false, .. }));
    }

    #[test]
    fn empty_and_comment_only_files_have_no_document() {
        assert_eq!(parse("", B), Ok(None));
        assert_eq!(parse("# nothing here\n", B), Ok(None));
    }

    /// Found by the `rules` fuzz target: an error at the end of a file
    /// with no final line break was placed on the line after the last.
    #[test]
    fn fuzz_a_syntax_error_at_the_end_points_inside_the_file() {
        let e = parse("doain: d\ndescr", B).unwrap_err();
        assert!(e.message.starts_with("YAML syntax error"), "{e:?}");
        assert_eq!(e.pos, Pos { line: 2, col: 6 });
        // A lone \r breaks a line, as YAML says.
        assert_eq!(Pos { line: 9, col: 9 }.min(Pos::end("a\rb\r\nc")), Pos { line: 3, col: 2 });
        assert_eq!(Pos { line: 1, col: 2 }.min(Pos::end("ab\n")), Pos { line: 1, col: 2 });
    }

    /// Found by the `rules` fuzz target: a file of `---` alone was told it
    /// lacks a mapping on line 2, which it does not have; so were an
    /// override's limits of `? ` alone.
    #[test]
    fn fuzz_an_empty_document_points_inside_the_file() {
        let e = crate::rules::RuleSet::from_yaml("t.yaml", "---").unwrap_err();
        assert_eq!(e.0[0].pos, Pos { line: 1, col: 4 }, "{e}");
        assert!(e.to_string().starts_with("t.yaml:1:4: "), "{e}");
        let e = crate::rules::parse_limits("override", "? ", "k").unwrap_err();
        assert!(e.0.iter().all(|e| e.pos.line <= 1), "{e}");
    }

    #[test]
    fn syntax_errors_duplicates_and_bounds_are_positioned() {
        let e = parse("a: [1, 2\nb: 3\n", B).unwrap_err();
        assert!(e.message.starts_with("YAML syntax error"), "{e:?}");
        let e = parse("a: 1\nb: 2\na: 3\n", B).unwrap_err();
        assert_eq!(e.pos, Pos { line: 3, col: 1 });
        assert!(e.message.contains("duplicate key `a` (first at 1:1)"), "{e:?}");
        let deep = "[".repeat(100) + &"]".repeat(100);
        assert!(parse(&deep, B).unwrap_err().message.contains("nested deeper than 16"));
        let e = parse("a: 1\n---\nb: 2\n", B).unwrap_err();
        assert!(e.message.contains("one domain per file"), "{e:?}");
    }

    #[test]
    fn alias_bombs_hit_the_node_bound() {
        let mut doc = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 0..9 {
            let prev = if i == 0 { "a".to_string() } else { format!("l{}", i - 1) };
            doc.push_str(&format!("l{i}: &l{i} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
        }
        let e = parse(&doc, B).unwrap_err();
        assert!(e.message.contains("more than 1000 YAML nodes"), "{e:?}");
        assert!(parse("a: &x [1]\nb: *x\n", B).is_ok());
    }
}
