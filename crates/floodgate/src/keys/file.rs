//! The files `floodgate keys import` reads and `keys export` writes.
//!
//! * **JSON lines** (`.jsonl`, `.ndjson`, `.json`): one entry per line, as
//!   the admin API takes it: `{"domain": "api", "descriptor": [{"key":
//!   "user", "value": "alice"}], "tier": "pro"}`, or `"limits": {...}`
//!   instead of `tier`, and an optional `"name"`. Blank lines are skipped.
//! * **CSV with a header** (`.csv`): the columns `domain`, `tier`, `limits`
//!   (a `rate_limit` block or a list of them, as JSON) and `name` are the
//!   entry's; every other column is a descriptor key, in column order, and
//!   its cell the value (an empty cell leaves that entry out). E.g.
//!   `domain,user,tier` then `api,alice,pro`.

use std::io::{BufRead, Write};

use floodgate_perkey::{Entry, KeySpec};

/// A file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// One JSON object per line.
    Jsonl,
    /// CSV with a header.
    Csv,
}

impl Format {
    /// `--format`, or from the file name (`.csv` is CSV, anything else
    /// JSON lines).
    pub(crate) fn choose(flag: Option<&str>, file: Option<&str>) -> Result<Format, String> {
        match flag {
            Some("jsonl" | "ndjson" | "json") => Ok(Format::Jsonl),
            Some("csv") => Ok(Format::Csv),
            Some(other) => Err(format!("--format `{other}`: give jsonl or csv")),
            None if file.is_some_and(|f| f.to_ascii_lowercase().ends_with(".csv")) => Ok(Format::Csv),
            None => Ok(Format::Jsonl),
        }
    }
}

/// The entry columns of a CSV file.
const CSV_FIELDS: [&str; 4] = ["domain", "tier", "limits", "name"];

/// Reads entries one at a time, each with its line number.
pub(crate) enum Reader<R: BufRead> {
    /// JSON lines.
    Jsonl { input: R, line: u64, buf: String },
    /// CSV: the reader and the header's roles.
    Csv { rows: csv::Reader<R>, header: Vec<Column> },
}

/// What a CSV column holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Column {
    Domain,
    Tier,
    Limits,
    Name,
    Key(String),
}

impl<R: BufRead> Reader<R> {
    /// A reader of `input` in `format` (a CSV header is read now).
    pub(crate) fn new(input: R, format: Format) -> Result<Self, String> {
        match format {
            Format::Jsonl => Ok(Reader::Jsonl { input, line: 0, buf: String::new() }),
            Format::Csv => {
                let mut rows = csv::ReaderBuilder::new().has_headers(true).trim(csv::Trim::All).from_reader(input);
                let names = rows.headers().map_err(|e| format!("the CSV header: {e}"))?.clone();
                let mut header = Vec::with_capacity(names.len());
                for name in &names {
                    header.push(match name {
                        "domain" => Column::Domain,
                        "tier" => Column::Tier,
                        "limits" => Column::Limits,
                        "name" => Column::Name,
                        "" => return Err("an empty column name in the CSV header".into()),
                        key => Column::Key(key.to_owned()),
                    });
                }
                if !header.contains(&Column::Domain) {
                    return Err(format!(
                        "the CSV header has no `domain` column: write e.g. `domain,user,tier` (entry columns: {}; every other column is a descriptor key)",
                        CSV_FIELDS.join(", ")
                    ));
                }
                if !header.iter().any(|c| matches!(c, Column::Key(_))) {
                    return Err("the CSV header names no descriptor key: add a column such as `user`".into());
                }
                if !header.iter().any(|c| matches!(c, Column::Tier | Column::Limits)) {
                    return Err("the CSV header has neither `tier` nor `limits`: add one".into());
                }
                Ok(Reader::Csv { rows, header })
            }
        }
    }

    /// The next entry and its line number; `Ok(None)` at the end. A bad
    /// entry is `Err((line, why))`; reading may go on after it.
    pub(crate) fn next_entry(&mut self) -> Result<Option<(u64, KeySpec)>, (u64, String)> {
        match self {
            Reader::Jsonl { input, line, buf } => loop {
                buf.clear();
                *line += 1;
                match input.read_line(buf) {
                    Ok(0) => return Ok(None),
                    Ok(_) => {}
                    Err(e) => return Err((*line, format!("cannot read: {e}"))),
                }
                let text = buf.trim();
                if text.is_empty() {
                    continue;
                }
                return serde_json::from_str::<KeySpec>(text)
                    .map(|s| Some((*line, s)))
                    .map_err(|e| (*line, e.to_string()));
            },
            Reader::Csv { rows, header } => {
                let mut record = csv::StringRecord::new();
                match rows.read_record(&mut record) {
                    Ok(false) => Ok(None),
                    Ok(true) => {
                        let line = record.position().map_or(0, csv::Position::line);
                        csv_entry(header, &record).map(|s| Some((line, s))).map_err(|e| (line, e))
                    }
                    Err(e) => Err((e.position().map_or(0, csv::Position::line), e.to_string())),
                }
            }
        }
    }
}

fn csv_entry(header: &[Column], record: &csv::StringRecord) -> Result<KeySpec, String> {
    if record.len() != header.len() {
        return Err(format!("{} fields, but the header has {}", record.len(), header.len()));
    }
    let mut spec = KeySpec { domain: String::new(), descriptor: Vec::new(), tier: None, limits: None, name: None };
    for (col, cell) in header.iter().zip(record.iter()) {
        let cell = cell.to_owned();
        match col {
            Column::Domain => spec.domain = cell,
            Column::Tier => spec.tier = (!cell.is_empty()).then_some(cell),
            Column::Limits if cell.is_empty() => {}
            Column::Limits => {
                spec.limits =
                    Some(serde_json::from_str(&cell).map_err(|e| format!("limits: not JSON ({e}): write e.g. \"{{\"\"unit\"\": \"\"second\"\", \"\"requests_per_unit\"\": 5}}\""))?);
            }
            Column::Name => spec.name = (!cell.is_empty()).then_some(cell),
            Column::Key(_) if cell.is_empty() => {}
            Column::Key(key) => spec.descriptor.push(Entry { key: key.clone(), value: cell }),
        }
    }
    if spec.domain.is_empty() {
        return Err("domain: empty".into());
    }
    if spec.descriptor.is_empty() {
        return Err("every descriptor column is empty: give at least one value".into());
    }
    Ok(spec)
}

/// Writes entries in a format.
pub(crate) enum Writer<W: Write> {
    /// JSON lines.
    Jsonl(W),
    /// CSV: the header comes from the first entry's descriptor keys, which
    /// every later entry must share.
    Csv { out: Box<csv::Writer<W>>, keys: Option<Vec<String>> },
}

impl<W: Write> Writer<W> {
    pub(crate) fn new(out: W, format: Format) -> Self {
        match format {
            Format::Jsonl => Writer::Jsonl(out),
            Format::Csv => Writer::Csv { out: Box::new(csv::Writer::from_writer(out)), keys: None },
        }
    }

    /// Write one entry.
    pub(crate) fn write(&mut self, spec: &KeySpec) -> Result<(), String> {
        match self {
            Writer::Jsonl(out) => {
                serde_json::to_writer(&mut *out, spec).map_err(|e| e.to_string())?;
                out.write_all(b"\n").map_err(|e| e.to_string())
            }
            Writer::Csv { out, keys } => {
                let mine: Vec<String> = spec.descriptor.iter().map(|e| e.key.clone()).collect();
                let keys = match keys {
                    Some(k) => k,
                    None => {
                        let mut header = vec!["domain".to_owned()];
                        header.extend(mine.iter().cloned());
                        header.extend(["tier", "limits", "name"].map(str::to_owned));
                        out.write_record(&header).map_err(|e| e.to_string())?;
                        keys.insert(mine.clone())
                    }
                };
                if *keys != mine {
                    return Err(format!(
                        "entry {} {:?} has descriptor keys [{}], unlike the first entry's [{}]: CSV needs one set of keys; export as JSON lines (--format jsonl), or one domain at a time",
                        spec.domain,
                        spec.descriptor.iter().map(|e| format!("{}={}", e.key, e.value)).collect::<Vec<_>>().join(", "),
                        mine.join(", "),
                        keys.join(", ")
                    ));
                }
                let mut row = vec![spec.domain.clone()];
                row.extend(spec.descriptor.iter().map(|e| e.value.clone()));
                row.push(spec.tier.clone().unwrap_or_default());
                row.push(spec.limits.as_ref().map(ToString::to_string).unwrap_or_default());
                row.push(spec.name.clone().unwrap_or_default());
                out.write_record(&row).map_err(|e| e.to_string())
            }
        }
    }

    /// Flush what is buffered.
    pub(crate) fn finish(self) -> Result<(), String> {
        match self {
            Writer::Jsonl(mut out) => out.flush().map_err(|e| e.to_string()),
            Writer::Csv { mut out, .. } => out.flush().map_err(|e| e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &str, format: Format) -> Vec<Result<(u64, KeySpec), (u64, String)>> {
        let mut r = Reader::new(text.as_bytes(), format).unwrap();
        let mut out = Vec::new();
        loop {
            match r.next_entry() {
                Ok(None) => return out,
                Ok(Some(e)) => out.push(Ok(e)),
                Err(e) => out.push(Err(e)),
            }
        }
    }

    #[test]
    fn csv_and_jsonl_read_the_same_entries_and_export_round_trips() {
        let csv = "domain,user,tier,limits\napi,alice,pro,\napi,bob,,\"{\"\"unit\"\": \"\"second\"\", \"\"requests_per_unit\"\": 5}\"\n";
        let jsonl = "{\"domain\":\"api\",\"descriptor\":[{\"key\":\"user\",\"value\":\"alice\"}],\"tier\":\"pro\"}\n\n{\"domain\":\"api\",\"descriptor\":[{\"key\":\"user\",\"value\":\"bob\"}],\"limits\":{\"unit\":\"second\",\"requests_per_unit\":5}}\n";
        let a: Vec<_> = read_all(csv, Format::Csv).into_iter().map(Result::unwrap).collect();
        let b: Vec<_> = read_all(jsonl, Format::Jsonl).into_iter().map(Result::unwrap).collect();
        assert_eq!(a.iter().map(|e| &e.1).collect::<Vec<_>>(), b.iter().map(|e| &e.1).collect::<Vec<_>>());
        assert_eq!(a.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 3], "CSV line numbers count the header");
        assert_eq!(b.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 3], "blank lines are skipped but counted");
        for format in [Format::Csv, Format::Jsonl] {
            let mut w = Writer::new(Vec::new(), format);
            for (_, s) in &a {
                w.write(s).unwrap();
            }
            let out = match w {
                Writer::Jsonl(v) => v,
                Writer::Csv { out, .. } => out.into_inner().unwrap(),
            };
            let back: Vec<_> =
                read_all(std::str::from_utf8(&out).unwrap(), format).into_iter().map(|e| e.unwrap().1).collect();
            assert_eq!(back, a.iter().map(|e| e.1.clone()).collect::<Vec<_>>(), "{format:?}");
        }
    }

    #[test]
    fn bad_lines_are_reported_with_their_numbers() {
        let got = read_all("{\"domain\":\"api\"}\nnot json\n", Format::Jsonl);
        assert!(matches!(&got[0], Err((1, m)) if m.contains("descriptor")), "{got:?}");
        assert!(matches!(&got[1], Err((2, _))), "{got:?}");
        let got = read_all("domain,user,tier\napi,alice\n,bob,pro\n", Format::Csv);
        assert!(matches!(&got[0], Err((2, m)) if m.contains("2 fields")), "{got:?}");
        assert!(matches!(&got[1], Err((3, m)) if m.contains("domain")), "{got:?}");
        for (header, want) in
            [("user,tier\n", "no `domain`"), ("domain,tier\n", "no descriptor key"), ("domain,user\n", "neither")]
        {
            let err = Reader::new(header.as_bytes(), Format::Csv).err().unwrap();
            assert!(err.contains(want), "{header}: {err}");
        }
    }

    #[test]
    fn csv_export_refuses_mixed_descriptor_keys() {
        let mut w = Writer::new(Vec::new(), Format::Csv);
        let e = |k: &str| KeySpec {
            domain: "api".into(),
            descriptor: vec![Entry { key: k.into(), value: "x".into() }],
            tier: Some("pro".into()),
            limits: None,
            name: None,
        };
        w.write(&e("user")).unwrap();
        let err = w.write(&e("ip")).unwrap_err();
        assert!(err.contains("--format jsonl"), "{err}");
    }
}
