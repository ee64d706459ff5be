//! The checks of what points into the docs from outside them, and of what
//! user pages and the schema must hold:
//!
//! * every pointer in a shipped file under `envoy/`, `src/` or `lua/` (a
//!   comment in a config a user copies or a script, a log line, a schema
//!   description) resolves: a
//!   path `docs/src/<page>.md` (with its `#anchor`), a `README.md` path (with
//!   its anchor), or `the book, <part>: <page title>` as SUMMARY.md names
//!   them; any other mention of a README (`README "Stats"`) is a pointer to
//!   a section that may be gone, and fails;
//! * no user page (the README and the book but for its contributor pages:
//!   `inside/`, `notes/`, the cost gate) names an issue number: users have
//!   no tracker to look it up in;
//! * every field of `envoy/filter.schema.json` has a description (the
//!   generated reference shows it), and every definition;
//! * the configuration guide has a row for every field of the top level,
//!   `redis`, `limits[]`, the idempotency rules, `objectStore` and
//!   `accessLog`.

use super::*;

/// The files of `envoy/`, `src/` and `lua/` a pointer can sit in (text
/// files; the schema included).
fn shipped_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root().join("envoy"), root().join("src"), root().join("lua")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                if name != "__pycache__" {
                    dirs.push(path);
                }
            } else if [
                ".rs", ".py", ".sh", ".yaml", ".yml", ".json", ".md", ".toml", ".wat", ".acl",
                ".lua",
            ]
            .iter()
            .any(|x| name.ends_with(x))
                || name.ends_with("Dockerfile")
            {
                out.push(path);
            }
        }
    }
    out.sort();
    assert!(
        out.len() > 100,
        "the shipped files were found: {}",
        out.len()
    );
    out
}

/// The book's parts and their pages' titles, as SUMMARY.md lists them.
fn summary_titles() -> BTreeMap<String, Vec<String>> {
    let summary = fs::read_to_string(book_src().join("SUMMARY.md")).unwrap();
    let mut parts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut part = String::new();
    for line in summary.lines() {
        if let Some(title) = line.strip_prefix("# ") {
            part = title.trim().to_string();
        } else if let Some(open) = line.find('[') {
            if let Some(close) = line[open..].find("](") {
                parts
                    .entry(part.clone())
                    .or_default()
                    .push(line[open + 1..open + close].to_string());
            }
        }
    }
    parts
}

/// A path-like token starting at `at` in `text`: letters, digits and
/// `/._-#`, without a trailing `.`.
fn token_at(text: &str, at: usize) -> &str {
    let end = text[at..]
        .find(|c: char| !(c.is_ascii_alphanumeric() || "/._-#".contains(c)))
        .map_or(text.len(), |e| at + e);
    text[at..end].trim_end_matches('.')
}

/// `file` and its anchor, resolved from the repository's root or from
/// `dir`: what is wrong with them, if anything.
fn resolve(file: &str, dir: &Path, pages: &BTreeMap<PathBuf, String>) -> Option<String> {
    let (path, anchor) = match file.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (file, None),
    };
    let found = [root().join(path), dir.join(path)]
        .into_iter()
        .map(|p| normalise(&p))
        .find(|p| p.is_file());
    let Some(found) = found else {
        return Some(format!("`{file}`: no such file"));
    };
    let anchor = anchor?;
    let text = pages
        .get(&found)
        .cloned()
        .unwrap_or_else(|| fs::read_to_string(&found).unwrap_or_default());
    (!anchors(&text).contains(anchor)).then(|| format!("`{file}`: no heading `#{anchor}`"))
}

/// What is wrong with each pointer of one shipped file's text.
fn pointer_problems(
    path: &Path,
    text: &str,
    pages: &BTreeMap<PathBuf, String>,
    parts: &BTreeMap<String, Vec<String>>,
) -> Vec<String> {
    let dir = path.parent().unwrap();
    let mut problems = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = format!("{}:{}", shown(path), n + 1);
        // README: only as a path to an existing README.md.
        for (i, _) in line.match_indices("README") {
            let start = line[..i]
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || "/._-".contains(c)))
                .map_or(0, |s| s + 1);
            let token = token_at(line, start);
            if !token.contains("README.md") {
                problems.push(format!(
                    "{at}: a README mention that is not a README.md path (point to docs/src/<page>.md instead): {}",
                    line.trim()
                ));
            } else if let Some(p) = resolve(token, dir, pages) {
                problems.push(format!("{at}: {p}"));
            }
        }
        for (i, _) in line.match_indices("docs/src/") {
            let token = token_at(line, i);
            if let Some(p) = resolve(token, dir, pages) {
                problems.push(format!("{at}: {p}"));
            }
        }
        // `the book, <part>: <page title>`, the title maybe wrapped onto
        // the next line of a comment.
        for (i, _) in line.match_indices("the book, ") {
            let next = text.lines().nth(n + 1).unwrap_or("");
            let next = next.trim_start_matches(|c: char| " /#!*-".contains(c));
            let rest = line[i + "the book, ".len()..].trim_end_matches(|c: char| " /#".contains(c));
            let joined = format!("{rest} {next}");
            let Some((part, said)) = joined.split_once(": ") else {
                problems.push(format!("{at}: `the book, …` without `<part>: <page>`"));
                continue;
            };
            let title = said.split(')').next().unwrap_or(said).trim();
            match parts.get(part) {
                None => problems.push(format!("{at}: the book has no part `{part}`")),
                Some(titles) if !titles.iter().any(|t| said.starts_with(t.as_str())) => problems
                    .push(format!(
                        "{at}: the book's part `{part}` has no page titled as `{title}` begins"
                    )),
                Some(_) => {}
            }
        }
    }
    problems
}

#[test]
fn every_pointer_in_envoy_src_and_lua_resolves() {
    let pages: BTreeMap<PathBuf, String> = documents().into_iter().collect();
    let parts = summary_titles();
    let mut problems = Vec::new();
    let mut files = 0;
    for path in shipped_files() {
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        files += 1;
        problems.extend(pointer_problems(&path, &text, &pages, &parts));
    }
    assert!(files > 100, "{files}");
    assert!(
        problems.is_empty(),
        "dead pointers:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_pointer_check_finds_what_it_must() {
    let pages: BTreeMap<PathBuf, String> = documents().into_iter().collect();
    let parts = summary_titles();
    let path = root().join("envoy/envoy.yaml");
    let text =
        "# ok: docs/src/running/stats.md and docs/src/using/configuration.md#descriptor-parts\n\
                # ok: envoy/peers/README.md, README.md#prerequisites, (the book, Running it: When\n\
                # things fail)\n\
                # bad: README \"Stats\"\n\
                # bad: docs/src/running/gone.md\n\
                # bad: docs/src/running/stats.md#no-such-heading\n\
                # bad: the book, Running it: No such page\n";
    let problems = pointer_problems(&path, text, &pages, &parts);
    assert_eq!(problems.len(), 4, "{problems:#?}");
    assert!(problems[0].contains("envoy/envoy.yaml:4: a README mention"));
    assert!(problems[1].contains("gone.md`: no such file"));
    assert!(problems[2].contains("no heading `#no-such-heading`"));
    assert!(problems[3].contains("no page titled as `No such page` begins"));
}

/// Pages for contributors, where the project's own history may stay.
fn contributor_page(path: &Path) -> bool {
    path.starts_with(book_src().join("inside"))
        || path.starts_with(book_src().join("notes"))
        || path.ends_with("performance/cost-gate.md")
}

/// Each `issue 12` / `issues 12` / `#12` of a user page's prose, outside
/// code (an upstream `owner/repo#12` names its own tracker and passes).
fn issue_numbers(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose_lines(text) {
        let line = without_code(line);
        let lower = line.to_lowercase();
        for word in ["issue ", "issues ", "issue #"] {
            for (i, _) in lower.match_indices(word) {
                let after = &lower[i + word.len()..];
                if after.starts_with(|c: char| c.is_ascii_digit()) {
                    out.push((n, line.trim().to_string()));
                }
            }
        }
        for (i, _) in line.match_indices('#') {
            let before = line[..i].chars().next_back();
            let after = &line[i + 1..];
            if after.starts_with(|c: char| c.is_ascii_digit())
                && !before.is_some_and(|c| c.is_ascii_alphanumeric() || "/-_.".contains(c))
            {
                out.push((n, line.trim().to_string()));
            }
        }
    }
    out.dedup();
    out
}

/// User pages that still name an issue, each by its page and the words.
/// Each must still hold its words (so the entry goes when the page is
/// fixed). None left.
const KNOWN: [(&str, &str); 0] = [];

#[test]
fn no_user_page_names_an_issue_number() {
    let mut problems = Vec::new();
    let mut known_seen = Vec::new();
    for (path, text) in documents() {
        if contributor_page(&path) {
            continue;
        }
        for (n, line) in issue_numbers(&text) {
            let known = KNOWN
                .iter()
                .any(|(p, words)| path.ends_with(p) && line.contains(words));
            if known {
                known_seen.push(shown(&path));
            } else {
                problems.push(format!("{}:{n}: {line}", shown(&path)));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "user pages naming an issue:\n{}",
        problems.join("\n")
    );
    assert_eq!(
        known_seen.len(),
        KNOWN.len(),
        "a known exception no longer applies: take it out of KNOWN"
    );
    // The check itself.
    let found = issue_numbers(
        "issue 43 asked\nsee #12\nenvoyproxy/envoy#9652 is upstream's\n`issue 7` in code\n\
         ```\nissue 8\n```\n#1 in a list\nissue number\n",
    );
    let lines: Vec<usize> = found.iter().map(|(n, _)| *n).collect();
    assert_eq!(lines, [1, 2, 8]);
}

/// Every property of `node` (and of its alternatives) without a description:
/// `at` names where. The one property of an alternative that carries its own
/// description (an enum variant's wrapper) takes that description.
fn undescribed(at: &str, node: &Value, out: &mut Vec<String>) {
    let described = |v: &Value| {
        v.get("description")
            .and_then(Value::as_str)
            .is_some_and(|d| !d.trim().is_empty())
    };
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (name, prop) in props {
            // An enum variant's wrapper: its one property takes the
            // variant's description.
            let variant = props.len() == 1 && described(node);
            if !(described(prop) || variant) {
                out.push(format!("{at}.{name}"));
            }
        }
    }
    for key in ["oneOf", "anyOf"] {
        for alt in node
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let is_value = alt.get("const").is_some() || alt.get("enum").is_some();
            if is_value && !described(alt) {
                out.push(format!("{at}: the value {}", alt["const"]));
            }
            undescribed(at, alt, out);
        }
    }
}

fn schema_gaps(schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    undescribed("(top level)", schema, &mut out);
    for (name, def) in schema["definitions"].as_object().unwrap() {
        if def
            .get("description")
            .and_then(Value::as_str)
            .is_none_or(|d| d.trim().is_empty())
        {
            out.push(format!("definition {name}"));
        }
        undescribed(name, def, &mut out);
    }
    out
}

#[test]
fn every_field_of_the_schema_has_a_description() {
    let schema: Value =
        serde_json::from_str(&fs::read_to_string(root().join("envoy/filter.schema.json")).unwrap())
            .unwrap();
    let gaps = schema_gaps(&schema);
    assert!(
        gaps.is_empty(),
        "fields of envoy/filter.schema.json without a description (write the doc comment on the \
         field in src/config/, then make schema and python3 envoy/docs_ref.py):\n{}",
        gaps.join("\n")
    );
    // An empty one is found.
    let mut bad = schema.clone();
    bad["definitions"]["TokenBucket"]["properties"]["capacity"]["description"] = json!(" ");
    assert_eq!(schema_gaps(&bad), ["TokenBucket.capacity"]);
}

#[test]
fn the_configuration_guide_has_a_row_for_every_field() {
    let schema: Value =
        serde_json::from_str(&fs::read_to_string(root().join("envoy/filter.schema.json")).unwrap())
            .unwrap();
    let guide = fs::read_to_string(book_src().join("using/configuration.md")).unwrap();
    let rows: BTreeSet<String> = prose_lines(&guide)
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("| `"))
        .filter_map(|c| c.split_once('`').map(|(f, _)| f.to_string()))
        .collect();
    let keys = |node: &Value| -> Vec<String> {
        object_of(&schema, node)["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    };
    let mut missing = Vec::new();
    for field in keys(&schema) {
        let nested = ["redis", "limits", "idempotency", "objectStore", "accessLog"];
        if !nested.contains(&field.as_str()) && !rows.contains(&field) {
            missing.push(field);
        }
    }
    for (prefix, node) in [
        ("redis.", &schema["properties"]["redis"]),
        ("limits[].", &schema["properties"]["limits"]),
        ("objectStore.", &schema["properties"]["objectStore"]),
        ("accessLog.", &schema["properties"]["accessLog"]),
        ("", &schema["definitions"]["IdempotencyRule"]),
    ] {
        for field in keys(node) {
            let row = format!("{prefix}{field}");
            // A nested object's fields may be tabulated one by one.
            let by_fields = rows.iter().any(|r| r.starts_with(&format!("{row}.")));
            if !rows.contains(&row) && !by_fields {
                missing.push(row);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "fields the configuration guide (docs/src/using/configuration.md) has no row for: {}",
        missing.join(", ")
    );
}
