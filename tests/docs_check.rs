//! The README and the book (docs/src, built by `make docs`) are checked like
//! code, so a newcomer never follows a link to nowhere, copies a
//! configuration the filter refuses, or reads a generated page or a quoted
//! figure older than what generates it:
//!
//! * every relative link (and its `#anchor`) resolves; a book page's links
//!   stay inside the book, and every `{{#include}}` names a file;
//! * every JSON block that is a configuration, or a piece of one (a limit, a
//!   recipe's fields, an `idempotency` list), passes `redis-guard check`
//!   (pieces are put beside a `redis` section first, as the book says);
//! * the configuration reference is what `envoy/docs_ref.py` writes now from
//!   `envoy/filter.schema.json`;
//! * a figure quoted from a generated table names its run as
//!   `(generated: make bench, <date>, commit <c>)` or `make bench-tier`, and
//!   that run must be the one BENCHMARKS.md holds now: a new run makes every
//!   quote of the old one fail until it is read again.
//!
//! Built with the `cli` feature (it runs the CLI binary).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn book_src() -> PathBuf {
    root().join("docs/src")
}

/// The README and every page of the book, as (path, text).
fn documents() -> Vec<(PathBuf, String)> {
    let mut out = vec![(
        root().join("README.md"),
        fs::read_to_string(root().join("README.md")).unwrap(),
    )];
    let mut dirs = vec![book_src()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "md") {
                let text = fs::read_to_string(&path).unwrap();
                out.push((path, text));
            }
        }
    }
    out.sort();
    assert!(out.len() > 20, "the book has its pages: {}", out.len());
    out
}

fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The lines outside fenced code blocks, with their numbers (1-based).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// A line without its inline code spans (a link shown as code is no link).
fn without_code(line: &str) -> String {
    let mut out = String::new();
    for (i, piece) in line.split('`').enumerate() {
        if i % 2 == 0 {
            out.push_str(piece);
        }
    }
    out
}

/// Every `[text](target)` target in a line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.to_string());
        rest = &after[end..];
    }
    out
}

/// The id mdBook (and GitHub, for the README) gives a heading: lower case,
/// letters, digits, `-` and `_` kept, spaces as `-`, the rest dropped.
fn heading_id(heading: &str) -> String {
    // A link in a heading shows its text only.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](") {
            Some(mid) => {
                let close = rest[open + mid..].find(')').map(|c| open + mid + c);
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..open + mid]);
                rest = close.map_or("", |c| &rest[c + 1..]);
            }
            None => {
                text.push_str(&rest[..=open]);
                rest = &rest[open + 1..];
            }
        }
    }
    text.push_str(rest);
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The anchors a page has: its headings' ids (a repeated one gets `-1`,
/// `-2`…, as mdBook numbers them).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let id = heading_id(line[hashes..].trim());
        let n = seen.entry(id.clone()).or_insert(0);
        out.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    out
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// What is wrong with each relative link and include of one document.
fn link_problems(path: &Path, text: &str, pages: &BTreeMap<PathBuf, String>) -> Vec<String> {
    let in_book = path.starts_with(book_src());
    let dir = path.parent().unwrap();
    let mut problems = Vec::new();
    for (n, line) in prose_lines(text) {
        let mut targets = link_targets(line);
        // mdBook's include: the file must exist (it need not be in the book).
        let mut rest = line;
        while let Some(at) = rest.find("{{#include ") {
            let after = &rest[at + "{{#include ".len()..];
            let end = after.find("}}").unwrap_or(after.len());
            let file = normalise(&dir.join(after[..end].trim()));
            if !file.is_file() {
                problems.push(format!(
                    "{}:{n}: include of {} finds no file",
                    shown(path),
                    shown(&file)
                ));
            }
            rest = &after[end..];
        }
        targets.retain(|t| !t.contains("://") && !t.starts_with("mailto:"));
        for target in targets {
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if file.is_empty() {
                path.to_path_buf()
            } else {
                normalise(&dir.join(file))
            };
            let at = format!("{}:{n}: `{target}`", shown(path));
            if !resolved.exists() {
                problems.push(format!(
                    "{at} points nowhere ({} does not exist)",
                    shown(&resolved)
                ));
                continue;
            }
            if in_book && !resolved.starts_with(book_src()) {
                problems.push(format!(
                    "{at} leaves the book: the built book has no such page"
                ));
                continue;
            }
            if let Some(anchor) = anchor {
                let Some(page) = pages.get(&resolved) else {
                    problems.push(format!("{at}: an anchor into a file that is not a page"));
                    continue;
                };
                if !anchors(page).contains(anchor) {
                    problems.push(format!(
                        "{at}: {} has no heading `#{anchor}`",
                        shown(&resolved)
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn every_link_of_the_readme_and_the_book_resolves() {
    let docs = documents();
    let pages: BTreeMap<PathBuf, String> = docs.iter().cloned().collect();
    let mut problems = Vec::new();
    let mut links = 0;
    for (path, text) in &docs {
        links += prose_lines(text)
            .iter()
            .map(|(_, l)| link_targets(l).len())
            .sum::<usize>();
        problems.extend(link_problems(path, text, &pages));
    }
    // Every page of the book is reachable from its table of contents.
    let summary = fs::read_to_string(book_src().join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<PathBuf> = prose_lines(&summary)
        .iter()
        .flat_map(|(_, l)| link_targets(l))
        .map(|t| normalise(&book_src().join(t)))
        .collect();
    for (path, _) in &docs {
        if path.starts_with(book_src()) && !path.ends_with("SUMMARY.md") && !listed.contains(path) {
            problems.push(format!("{} is not in SUMMARY.md", shown(path)));
        }
    }
    assert!(links > 100, "the links were found: {links}");
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_link_check_finds_what_it_must() {
    // The checker itself: a page with one link of each kind, good and bad.
    let page = book_src().join("using/limits.md");
    let text = "# Limits\n\n## Two words\n\n[ok](#two-words) [bad](#three-words) \
                [ok](keys.md) [bad](nowhere.md) `[code](nowhere.md)` \
                [out](../../../README.md) [ok](https://example.com)\n";
    let mut pages = BTreeMap::new();
    pages.insert(page.clone(), text.to_string());
    pages.insert(
        book_src().join("using/keys.md"),
        fs::read_to_string(book_src().join("using/keys.md")).unwrap(),
    );
    let problems = link_problems(&page, text, &pages);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(problems[0].contains("#three-words"));
    assert!(problems[1].contains("nowhere.md"));
    assert!(problems[2].contains("leaves the book"));
    assert_eq!(
        heading_id("Fast paths: the over-limit cache and `lease`"),
        "fast-paths-the-over-limit-cache-and-lease"
    );
    assert_eq!(
        heading_id("Failover (Redis Cluster)"),
        "failover-redis-cluster"
    );
}

/// Each JSON block of the README and the book that configures the filter,
/// as a whole configuration: (where, JSON). Pieces get a `redis` section;
/// a lone limit becomes the only limit.
fn config_blocks() -> (Vec<(String, Value)>, usize) {
    const TOP: [&str; 8] = [
        "limits",
        "idempotency",
        "deny",
        "objectStore",
        "hashTag",
        "accessLog",
        "failureMode",
        "keyPrefix",
    ];
    let mut out = Vec::new();
    let mut other = 0;
    for (path, text) in documents() {
        let mut block: Option<(usize, String)> = None;
        for (i, line) in text.lines().enumerate() {
            match &mut block {
                None if line.trim_start().starts_with("```json") => {
                    block = Some((i + 1, String::new()))
                }
                None => {}
                Some((start, body)) => {
                    if line.trim_start().starts_with("```") {
                        let at = format!("{}:{start}", shown(&path));
                        let parsed = serde_json::from_str::<Value>(body)
                            .or_else(|_| serde_json::from_str::<Value>(&format!("{{{body}}}")));
                        let Ok(Value::Object(mut doc)) = parsed else {
                            other += 1;
                            block = None;
                            continue;
                        };
                        let is_limit = doc.contains_key("name") && doc.contains_key("descriptor");
                        if doc.contains_key("redis") {
                            out.push((at, Value::Object(doc)));
                        } else if is_limit {
                            out.push((
                                at,
                                json!({"redis": {"cluster": "webdis"}, "limits": [doc]}),
                            ));
                        } else if TOP.iter().any(|k| doc.contains_key(*k)) {
                            doc.insert("redis".into(), json!({"cluster": "webdis"}));
                            out.push((at, Value::Object(doc)));
                        } else {
                            other += 1;
                        }
                        block = None;
                    } else {
                        body.push_str(line);
                        body.push('\n');
                    }
                }
            }
        }
    }
    (out, other)
}

/// `redis-guard check` on one configuration: None when it passes, else
/// what it said.
fn cli_check(doc: &Value, dir: &Path, n: usize) -> Option<String> {
    let file = dir.join(format!("block-{n}.json"));
    fs::write(&file, serde_json::to_vec_pretty(doc).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .args(["check", "--assume-env"])
        .arg(&file)
        .output()
        .unwrap();
    (!out.status.success()).then(|| {
        format!(
            "exit {:?}: {}{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

#[test]
fn every_configuration_block_passes_redis_guard_check() {
    let (blocks, other) = config_blocks();
    let dir = std::env::temp_dir().join(format!("redis-guard-docs-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let mut problems = Vec::new();
    for (n, (at, doc)) in blocks.iter().enumerate() {
        if let Some(said) = cli_check(doc, &dir, n) {
            problems.push(format!("{at}: redis-guard check refuses it: {said}"));
        }
    }
    // The check can refuse: a block with a limit of no algorithm.
    let refused = cli_check(
        &json!({"redis": {"cluster": "webdis"}, "limits": [{"name": "x"}]}),
        &dir,
        9999,
    );
    fs::remove_dir_all(&dir).unwrap();
    assert!(
        refused.is_some_and(|s| s.contains("exit Some(3)")),
        "check refuses a bad block"
    );
    // The README's one configuration, the book's examples, the four recipes.
    assert!(
        blocks.len() >= 11,
        "config blocks found: {} (other JSON: {other})",
        blocks.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The object a schema node stands for: through `$ref`, `allOf`/`anyOf`
/// (a field that may be null) and a list's `items`.
fn object_of<'a>(schema: &'a Value, mut node: &'a Value) -> &'a Value {
    for _ in 0..8 {
        if let Some(r) = node.get("$ref").and_then(Value::as_str) {
            let name = r.trim_start_matches("#/definitions/");
            node = &schema["definitions"][name];
        } else if let Some(alts) = node
            .get("allOf")
            .or(node.get("anyOf"))
            .and_then(Value::as_array)
        {
            match alts.iter().find(|a| a.get("type") != Some(&json!("null"))) {
                Some(a) => node = a,
                None => break,
            }
        } else if let Some(items) = node.get("items") {
            node = items;
        } else {
            break;
        }
    }
    node
}

/// Whether `limits[].usage.countStatuses` (or a field of an idempotency
/// rule, `maxStoredBodyBytes`) names a field the schema has.
fn schema_has(schema: &Value, path: &str) -> bool {
    let from = |start: &Value| {
        let mut node = start;
        for part in path.split('.') {
            let part = part.trim_end_matches("[]");
            match object_of(schema, node)
                .get("properties")
                .and_then(|p| p.get(part))
            {
                Some(next) => node = next,
                None => return false,
            }
        }
        true
    };
    from(schema) || from(&schema["definitions"]["IdempotencyRule"])
}

#[test]
fn every_field_the_configuration_guide_tabulates_is_in_the_schema() {
    // The guide's tables say what a field is for in words; the reference
    // (generated) says its type, bounds and description. A field the guide
    // names that the parser no longer has is a drift this catches.
    let schema: Value =
        serde_json::from_str(&fs::read_to_string(root().join("envoy/filter.schema.json")).unwrap())
            .unwrap();
    let guide = fs::read_to_string(book_src().join("using/configuration.md")).unwrap();
    let mut fields = 0;
    let mut unknown = Vec::new();
    for (n, line) in prose_lines(&guide) {
        let Some(cell) = line.strip_prefix("| `") else {
            continue;
        };
        let Some(end) = cell.find('`') else { continue };
        let field = &cell[..end];
        fields += 1;
        if !schema_has(&schema, field) {
            unknown.push(format!(
                "docs/src/using/configuration.md:{n}: `{field}` is not in the schema"
            ));
        }
    }
    assert!(
        !schema_has(&schema, "limits[].noSuchField"),
        "the lookup can fail"
    );
    assert!(fields >= 50, "the guide's fields were found: {fields}");
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
}

#[test]
fn the_readme_stays_short() {
    let lines = fs::read_to_string(root().join("README.md"))
        .unwrap()
        .lines()
        .count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: at most 300, the rest belongs in the book"
    );
}

#[test]
fn the_configuration_reference_is_what_its_generator_writes_from_the_schema() {
    let out = Command::new("python3")
        .arg(root().join("envoy/docs_ref.py"))
        .arg("--check")
        .output()
        .expect("python3 runs envoy/docs_ref.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Each field's default as the reference shows it: (section, field) to the
/// default cell's JSON, for every field table row with a default.
fn reference_defaults(page: &str) -> BTreeMap<(String, String), Value> {
    let mut out = BTreeMap::new();
    let mut section = String::new();
    for (_, line) in prose_lines(page) {
        if let Some(h) = line.strip_prefix("## ") {
            section = if h == "The top level" {
                "top".into()
            } else {
                h.into()
            };
            continue;
        }
        let cells: Vec<&str> = line.split(" | ").collect();
        let Some(field) = cells.first().and_then(|c| c.strip_prefix("| `")) else {
            continue;
        };
        let field = field.split('`').next().unwrap();
        // | field | type | bounds | default | description |
        if let Some(cell) = cells.get(3).map(|c| c.trim()).filter(|c| !c.is_empty()) {
            let json = cell.trim_matches('`');
            if let Ok(v) = serde_json::from_str::<Value>(json) {
                out.insert((section.clone(), field.to_string()), v);
            }
        }
    }
    out
}

/// What is wrong between the schema's defaults and the reference: a field
/// whose description names a default value the schema does not state (its
/// `#[schemars(default = …)]` is missing in src/config/), and a stated
/// default the reference does not show.
fn default_problems(schema: &Value, page: &str) -> Vec<String> {
    let shown = reference_defaults(page);
    let mut problems = Vec::new();
    let mut objects = vec![("top".to_string(), schema)];
    for (name, node) in schema["definitions"].as_object().unwrap() {
        objects.push((name.clone(), node));
    }
    for (name, node) in objects {
        for (field, sub) in node["properties"].as_object().into_iter().flatten() {
            let stated = sub.get("default").filter(|d| !d.is_null());
            let text = sub["description"].as_str().unwrap_or_default();
            // "(default 50)", "default \"rg\"": a value; "(default: the
            // cluster name)", "methods default to POST": words, no value.
            let names_a_value = text.match_indices("default").any(|(at, _)| {
                let rest = &text[at + "default".len()..];
                rest.starts_with(' ') && !rest.starts_with(" to ")
            });
            if names_a_value && stated.is_none() {
                problems.push(format!(
                    "{name}.{field}: its description names a default, the schema states none (add #[schemars(default = …)] in src/config/, then make schema)"
                ));
            }
            if let Some(d) = stated {
                match shown.get(&(name.clone(), field.clone())) {
                    Some(v) if v == d => {}
                    other => problems.push(format!(
                        "{name}.{field}: the schema's default is {d}, the reference shows {other:?}"
                    )),
                }
            }
        }
    }
    problems
}

#[test]
fn every_default_the_schema_states_is_in_the_reference() {
    let schema: Value =
        serde_json::from_str(&fs::read_to_string(root().join("envoy/filter.schema.json")).unwrap())
            .unwrap();
    let page = fs::read_to_string(book_src().join("reference/configuration.md")).unwrap();
    assert!(
        reference_defaults(&page).len() >= 50,
        "the reference's defaults were found"
    );
    let problems = default_problems(&schema, &page);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The check itself: a default taken out of the schema, and a page
    // without its default column's values.
    let mut bare = schema.clone();
    bare["definitions"]["Redis"]["properties"]["timeoutMs"]["default"] = Value::Null;
    assert!(default_problems(&bare, &page)
        .iter()
        .any(|p| p.starts_with("Redis.timeoutMs: its description")));
    let blank = page.replace("| `50` |", "|  |");
    assert!(default_problems(&schema, &blank)
        .iter()
        .any(|p| p.starts_with("Redis.timeoutMs: the schema's default is 50")));
}

/// The date and commit of the run whose part of BENCHMARKS.md starts at
/// `marker` (the whole file for `make bench`): its `date:` and `commit`
/// lines for make bench, its "Measured <date> … commit <c>" for bench-tier
/// and bench-peers.
fn run_of(benchmarks: &str, which: &str) -> (String, String) {
    if which == "make bench" {
        let part = benchmarks.split("<!-- bench:end").next().unwrap();
        let date = part
            .lines()
            .find_map(|l| l.strip_prefix("* date: "))
            .and_then(|l| l.split(';').next())
            .expect("make bench's date line");
        let commit = part
            .lines()
            .find_map(|l| l.strip_prefix("* filter: commit "))
            .and_then(|l| l.split(',').next())
            .expect("make bench's commit line");
        (date.to_string(), commit.to_string())
    } else {
        let marker = format!("<!-- {}:start -->", which.trim_start_matches("make "));
        let part = benchmarks
            .split(marker.as_str())
            .nth(1)
            .unwrap_or_else(|| panic!("{which}'s part"));
        let line = part
            .lines()
            .find(|l| l.starts_with("Measured "))
            .unwrap_or_else(|| panic!("{which}'s Measured line"));
        let date = line["Measured ".len()..].split(" on ").next().unwrap();
        let commit = line
            .split("commit ")
            .nth(1)
            .and_then(|c| c.split([',', ' ']).next())
            .expect("bench-tier's commit");
        (date.to_string(), commit.to_string())
    }
}

/// Every `(generated: make bench…, <date>, commit <c>)` quote of the README
/// and the book whose run is not the one BENCHMARKS.md holds.
fn stale_quotes(benchmarks: &str, docs: &[(PathBuf, String)]) -> (usize, Vec<String>) {
    let mut quotes = 0;
    let mut stale = Vec::new();
    for (path, text) in docs {
        if path.ends_with("results.md") || path.starts_with(book_src().join("notes")) {
            continue;
        }
        for (n, line) in prose_lines(text) {
            // A quote names its run on one line; inline code only shows the form.
            let line = without_code(line);
            let mut rest = line.as_str();
            while let Some(at) = rest.find("generated: make bench") {
                let after = &rest[at + "generated: ".len()..];
                let end = after.find([')', ';']).unwrap_or(after.len());
                let quote = &after[..end];
                rest = &after[end..];
                quotes += 1;
                let which = if quote.starts_with("make bench-tier") {
                    "make bench-tier"
                } else if quote.starts_with("make bench-peers") {
                    "make bench-peers"
                } else {
                    "make bench"
                };
                let (date, commit) = run_of(benchmarks, which);
                let want = format!("{which}, {date}, commit {commit}");
                if quote != want {
                    stale.push(format!(
                        "{}:{}: quotes `{quote}`, but BENCHMARKS.md holds `{want}`: read the figures again from it",
                        shown(path),
                        n
                    ));
                }
            }
        }
    }
    (quotes, stale)
}

#[test]
fn every_quoted_figure_names_the_run_benchmarks_md_holds() {
    let benchmarks = fs::read_to_string(root().join("BENCHMARKS.md")).unwrap();
    let docs = documents();
    let (quotes, stale) = stale_quotes(&benchmarks, &docs);
    assert!(quotes >= 4, "quotes of generated tables found: {quotes}");
    assert!(stale.is_empty(), "{}", stale.join("\n"));
    // A newer run makes the same quotes stale.
    let (date, _) = run_of(&benchmarks, "make bench");
    let newer = benchmarks.replacen(
        &format!("* date: {date}"),
        "* date: 2099-01-01 00:00 UTC",
        1,
    );
    let (_, now_stale) = stale_quotes(&newer, &docs);
    assert!(!now_stale.is_empty(), "a newer make bench run is noticed");
}

#[test]
fn benchmarks_md_holds_only_what_its_generators_write() {
    // bench.py writes up to its end marker; bench_tier.py between its two,
    // then envoy/peers/bench_peers.py between its two.
    let text = fs::read_to_string(root().join("BENCHMARKS.md")).unwrap();
    let (_, after) = text
        .split_once("<!-- bench:end")
        .expect("make bench's end marker");
    let after = &after[after.find('\n').unwrap()..];
    let (between, tail) = after
        .split_once("<!-- bench-tier:start -->")
        .expect("make bench-tier's start marker");
    let (_, tail) = tail
        .split_once("<!-- bench-tier:end -->")
        .expect("make bench-tier's end marker");
    let (gap, peers) = tail
        .split_once("<!-- bench-peers:start -->")
        .expect("make bench-peers' start marker");
    let (_, tail) = peers
        .split_once("<!-- bench-peers:end -->")
        .expect("make bench-peers' end marker");
    assert!(
        between.trim().is_empty() && gap.trim().is_empty() && tail.trim().is_empty(),
        "BENCHMARKS.md holds text no generator writes (hand notes go to docs/src/notes/)"
    );
}

// Pointers into the docs from envoy/ and src/, issue numbers on user pages,
// the schema's descriptions and the guide's completeness.
#[path = "docs_check/pointers.rs"]
mod pointers;
