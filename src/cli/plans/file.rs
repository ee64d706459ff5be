//! A plans file as `redis-guard plans import|diff` read it and `plans
//! export` writes it: JSON lines, or CSV with a header row. Only the
//! syntax is here; what a line means (its limit, key and figures) is
//! checked against the configuration in src/cli/plans.rs.

use std::collections::BTreeMap;

use redis_guard::overrides::Override;
use serde::Deserialize;

use crate::output::printable;

/// One line of the file, as written.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Row {
    pub limit: String,
    /// Part values by the names `--value` takes (`x-api-key`, `query:key`).
    #[serde(default)]
    pub values: BTreeMap<String, String>,
    /// The override key itself, as `export` writes it for a plan whose
    /// values the key does not hold (a long value's digest).
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub capacity: Option<u64>,
    #[serde(default)]
    pub refill: Option<u64>,
    #[serde(default)]
    pub quota: Option<u64>,
    #[serde(default)]
    pub anchor_day: Option<u8>,
}

/// A line's number and what it holds, or why it cannot be read.
pub type Line = (usize, Result<Row, String>);

/// Each line with its number (1-based, as an editor shows it) and what it
/// holds or why it cannot be read; blank lines are skipped. A file whose
/// first line starts with `{` is JSON lines; any other is CSV, its first
/// line the header (`Err` when the header itself is wrong).
pub fn rows(text: &str) -> Result<Vec<Line>, (usize, String)> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((first_n, first)) = lines.next() else {
        return Ok(Vec::new());
    };
    if first.trim_start().starts_with('{') {
        let json = |(n, line): (usize, &str)| {
            let row = serde_json::from_str::<Row>(line)
                .map_err(|e| format!("not a plan's JSON object: {e}"));
            (n, row)
        };
        return Ok(std::iter::once((first_n, first))
            .chain(lines)
            .map(json)
            .collect());
    }
    let header = fields(first).map_err(|why| (first_n, why))?;
    for (i, name) in header.iter().enumerate() {
        if name.is_empty() || header[..i].contains(name) {
            let why = format!("header column {}: `{name}` is empty or named twice", i + 1);
            return Err((first_n, why));
        }
    }
    if !header.iter().any(|h| h == "limit") {
        return Err((first_n, "the header has no `limit` column".to_string()));
    }
    Ok(lines.map(|(n, line)| (n, csv_row(&header, line))).collect())
}

/// One CSV line under `header`: an empty cell is no value.
fn csv_row(header: &[String], line: &str) -> Result<Row, String> {
    let cells = fields(line)?;
    if cells.len() != header.len() {
        return Err(format!(
            "{} cells where the header has {} columns",
            cells.len(),
            header.len()
        ));
    }
    let mut row = Row::default();
    for (name, cell) in header.iter().zip(cells) {
        if cell.is_empty() {
            continue;
        }
        let number = |what: &str| {
            cell.parse::<u64>()
                .map_err(|_| format!("{what} `{cell}` is not a whole number"))
        };
        match name.as_str() {
            "limit" => row.limit = cell,
            "key" => row.key = Some(cell),
            "capacity" => row.capacity = Some(number(name)?),
            "refill" => row.refill = Some(number(name)?),
            "quota" => row.quota = Some(number(name)?),
            "anchorDay" => {
                row.anchor_day = Some(
                    u8::try_from(number(name)?)
                        .map_err(|_| format!("anchorDay `{cell}` is past 255"))?,
                )
            }
            part => {
                row.values.insert(part.to_string(), cell);
            }
        }
    }
    Ok(row)
}

/// The cells of one CSV line (RFC 4180 within a line: a quoted cell may
/// hold commas and `""` for a quote; no cell spans lines).
fn fields(line: &str) -> Result<Vec<String>, String> {
    let mut cells = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        let mut cell = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        cell.push('"');
                    }
                    Some('"') => break,
                    Some(c) => cell.push(c),
                    None => return Err("a quoted cell is not closed".to_string()),
                }
            }
            if !matches!(chars.peek(), None | Some(',')) {
                return Err("text after a quoted cell's closing quote".to_string());
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                if c == '"' {
                    return Err("a quote inside an unquoted cell".to_string());
                }
                cell.push(c);
                chars.next();
            }
        }
        cells.push(cell);
        if chars.next().is_none() {
            return Ok(cells);
        }
    }
}

/// Who a plan is for: part values, or the key itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Who {
    Values(BTreeMap<String, String>),
    Key(Vec<u8>),
}

fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// The canonical line of a plan: no spaces, keys in a fixed order (limit,
/// values by name or key, then the figures), so that export, import and
/// export again gives the same bytes.
pub fn canonical(limit: &str, who: &Who, plan: &Override) -> String {
    let mut line = format!("{{\"limit\":{}", quoted(limit));
    match who {
        Who::Values(values) => {
            let pairs: Vec<String> = values
                .iter()
                .map(|(n, v)| format!("{}:{}", quoted(n), quoted(v)))
                .collect();
            line.push_str(&format!(",\"values\":{{{}}}", pairs.join(",")));
        }
        Who::Key(key) => line.push_str(&format!(",\"key\":{}", quoted(&printable(key)))),
    }
    line.push_str(&figures(plan));
    line.push('}');
    line
}

/// The line of a stored plan the filter ignores: its limit and key only.
pub fn canonical_key(limit: &str, key: &[u8]) -> String {
    format!(
        "{{\"limit\":{},\"key\":{}}}",
        quoted(limit),
        quoted(&printable(key))
    )
}

/// A plan's figures as the fields of its line, each after a comma.
pub fn figures(plan: &Override) -> String {
    match *plan {
        Override::TokenBucket { capacity, refill } => {
            format!(",\"capacity\":{capacity},\"refill\":{refill}")
        }
        Override::Limit(n) => format!(",\"quota\":{n}"),
        Override::Quota { amount, anchor } => format!(",\"quota\":{amount},\"anchorDay\":{anchor}"),
    }
}

/// The bytes of a key as `printable` shows it (`\\` and `\xNN` escapes);
/// `None` for text `printable` never writes.
pub fn unprintable(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len());
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'\\' => match bytes.next()? {
                b'\\' => out.push(b'\\'),
                b'x' => {
                    let hex = [bytes.next()?, bytes.next()?];
                    let hex = std::str::from_utf8(&hex).ok()?;
                    out.push(u8::from_str_radix(hex, 16).ok()?);
                }
                _ => return None,
            },
            0x20..=0x7e => out.push(b),
            _ => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn json_lines_and_csv_read_the_same_plans() {
        let json = "{\"limit\":\"a\",\"values\":{\"x-api-key\":\"acme\"},\"capacity\":5,\"refill\":2}\n\n{\"limit\":\"q\",\"values\":{\"x\":\"a,b\"},\"quota\":9,\"anchorDay\":3}\n";
        let csv = "limit,x-api-key,x,capacity,refill,quota,anchorDay\r\na,acme,,5,2,,\n\nq,,\"a,b\",,,9,3\n";
        let (a, b) = (rows(json).unwrap(), rows(csv).unwrap());
        let rows_of = |r: &[Line]| r.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>();
        assert_eq!(rows_of(&a), rows_of(&b));
        // Numbered as an editor shows them: the CSV's header is line 1.
        assert_eq!(a.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(b.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [2, 4]);
        assert_eq!(a[1].1.as_ref().unwrap().anchor_day, Some(3));
    }

    #[test]
    fn a_bad_line_is_named_by_its_number() {
        // Every line is read: each bad one says why.
        let bad = |text: &str| -> Vec<usize> {
            let rows = rows(text).unwrap();
            rows.iter()
                .filter(|(_, r)| r.is_err())
                .map(|(n, _)| *n)
                .collect()
        };
        let json =
            "{\"limit\":\"a\",\"quota\":1}\n{\"limit\":\"a\",\"quota\":-1}\n{\"limit\":\"a\"}\n{";
        assert_eq!(bad(json), [2, 4]);
        let unknown = "{\"limit\":\"a\",\"quotas\":1}\n";
        assert!(rows(unknown).unwrap()[0]
            .1
            .as_ref()
            .unwrap_err()
            .contains("quotas"));
        assert_eq!(bad("limit,quota\na,1\na,1,2\na,\"1\"\"\n"), [3, 4]);
        assert_eq!(bad("limit,quota\na,x\n"), [2]);
        assert_eq!(bad("limit,anchorDay\na,256\n"), [2]);
        assert_eq!(rows("limit,\"q\n").unwrap_err().0, 1);
        assert_eq!(rows("quota\n1\n").unwrap_err().0, 1);
        assert_eq!(rows("limit,quota,quota\n").unwrap_err().0, 1);
    }

    #[test]
    fn the_canonical_line_reads_back_as_the_same_row() {
        let values = Who::Values(BTreeMap::from([("x-k\"".to_string(), "é,\\".to_string())]));
        let line = canonical(
            "a",
            &values,
            &Override::TokenBucket {
                capacity: 7,
                refill: 1,
            },
        );
        assert_eq!(
            line,
            r#"{"limit":"a","values":{"x-k\"":"é,\\"},"capacity":7,"refill":1}"#
        );
        let row: Row = serde_json::from_str(&line).unwrap();
        assert_eq!(
            (row.capacity, row.refill, row.values.len()),
            (Some(7), Some(1), 1)
        );
        let key = b"rg:ov:{t}:a:#\\\x00\xff".to_vec();
        let line = canonical(
            "a",
            &Who::Key(key.clone()),
            &Override::Quota {
                amount: 3,
                anchor: 15,
            },
        );
        let row: Row = serde_json::from_str(&line).unwrap();
        assert_eq!(unprintable(&row.key.unwrap()).unwrap(), key);
        assert!(line.ends_with(",\"quota\":3,\"anchorDay\":15}"));
        assert_eq!(unprintable("\\q"), None);
        assert_eq!(unprintable("é"), None);
    }
}
