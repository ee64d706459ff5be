//! The configuration's JSON Schema (`envoy/filter.schema.json`), which editors
//! use to validate configs. It is generated from the parser's own types; these
//! tests keep the committed file current and check that the schema and the
//! parser agree on every example config in the repository, on every bad
//! fixture whose problem is one of shape, and on every numeric bound the
//! schema states.
//!
//! Regenerate the file with `make schema`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::path::{Path, PathBuf};

use redis_guard::config::{
    json_schema, Config, ConfigError, ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY,
};
use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The parser, with an environment of its own: examples with objectStore
/// credentials `fromEnvironment` (envoy/filter.json) read AWS_* variables,
/// and what the test process happens to have set must not decide the result.
fn parse(json: &[u8]) -> Result<Config, ConfigError> {
    Config::parse_with_env(json, &|name| match name {
        ENV_ACCESS_KEY_ID => Some("AKIAIOSFODNN7EXAMPLE".to_string()),
        ENV_SECRET_ACCESS_KEY => Some("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".to_string()),
        "REDIS_GUARD_WEBDIS_USERNAME" => Some("redis-guard".to_string()),
        "REDIS_GUARD_WEBDIS_PASSWORD" => Some("example-password".to_string()),
        _ => None,
    })
}

fn schema_path() -> PathBuf {
    root().join("envoy/filter.schema.json")
}

fn rendered_schema() -> String {
    format!(
        "{}\n",
        serde_json::to_string_pretty(&json_schema()).unwrap()
    )
}

fn validator() -> jsonschema::Validator {
    let committed: Value = serde_json::from_slice(&fs::read(schema_path()).unwrap()).unwrap();
    jsonschema::draft7::new(&committed).unwrap()
}

/// Schema errors for `doc`, as "path: message" lines.
fn schema_errors(v: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    v.iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn json_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

fn md_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.sort();
    files
}

/// Every filter configuration the repository ships or documents: the demo
/// config, the good fixtures, the README's and the book's examples and the Istio
/// WasmPlugin's `pluginConfig`.
fn example_configs() -> Vec<(String, Vec<u8>)> {
    let mut out = vec![(
        "envoy/filter.json".to_string(),
        fs::read(root().join("envoy/filter.json")).unwrap(),
    )];
    for p in json_files(&root().join("tests/fixtures/config/good")) {
        out.push((p.display().to_string(), fs::read(&p).unwrap()));
    }
    let mut docs = vec![root().join("README.md")];
    for dir in ["using", "running", "inside"] {
        docs.extend(md_files(&root().join("docs/src").join(dir)));
    }
    for (i, block) in docs
        .iter()
        .map(|p| fs::read_to_string(p).unwrap())
        .collect::<Vec<_>>()
        .iter()
        .flat_map(|text| text.split("```json\n").skip(1))
        .enumerate()
    {
        let body = &block[..block.find("```").unwrap()];
        // Config examples are the JSON blocks with a top-level `redis`
        // section; others show replies, records and recipes (below).
        let top_level_redis =
            serde_json::from_str::<Value>(body).is_ok_and(|v| v.get("redis").is_some());
        if top_level_redis {
            out.push((
                format!("README.md or book json block {i}"),
                body.as_bytes().to_vec(),
            ));
        }
    }
    // The recipes, merged beside a `redis` section as the book says.
    for p in json_files(&root().join("envoy/recipes")) {
        let mut doc: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
        doc["redis"] = serde_json::json!({"cluster": "webdis"});
        out.push((p.display().to_string(), serde_json::to_vec(&doc).unwrap()));
    }
    let istio = root().join("envoy/istio/wasmplugin.yaml");
    let text = fs::read_to_string(&istio).unwrap();
    let before = out.len();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).unwrap();
        if v["kind"] == "WasmPlugin" {
            out.push((
                format!("{} pluginConfig", istio.display()),
                serde_json::to_vec(&v["spec"]["pluginConfig"]).unwrap(),
            ));
        }
    }
    assert_eq!(out.len(), before + 1, "one WasmPlugin pluginConfig");
    out
}

#[test]
fn committed_schema_is_generated_from_the_parser_types() {
    let want = rendered_schema();
    if std::env::var_os("REDIS_GUARD_WRITE_SCHEMA").is_some() {
        fs::write(schema_path(), &want).unwrap();
    }
    let have = fs::read_to_string(schema_path()).unwrap_or_default();
    assert!(
        have == want,
        "envoy/filter.schema.json is stale: run `make schema` and commit it"
    );
}

#[test]
fn every_example_config_in_the_repo_passes_schema_and_parser() {
    let v = validator();
    let examples = example_configs();
    // The demo config, four good fixtures, at least one README example.
    assert!(
        examples.len() >= 6,
        "found only {} examples",
        examples.len()
    );
    let mut problems = Vec::new();
    for (name, bytes) in &examples {
        if let Err(e) = parse(bytes) {
            problems.push(format!("{name}: parser: {e}"));
        }
        let doc: Value = serde_json::from_slice(bytes).unwrap();
        for e in schema_errors(&v, &doc) {
            problems.push(format!("{name}: schema: {e}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Parser reasons that are about the document's shape (names, types,
/// required fields), which a JSON Schema states as well as the parser does.
const SHAPE_REASONS: &[&str] = &[
    "unknown field",
    "unknown variant",
    "invalid type",
    "missing field",
    "invalid value: integer `-",
    "found an array",
    "set exactly one of `tokenBucket`",
];

#[test]
fn schema_rejects_every_bad_fixture_whose_problem_is_its_shape() {
    let v = validator();
    let mut shape_fixtures = 0;
    let mut problems = Vec::new();
    for p in json_files(&root().join("tests/fixtures/config/bad")) {
        let bytes = fs::read(&p).unwrap();
        let Ok(doc) = serde_json::from_slice::<Value>(&bytes) else {
            continue; // not JSON at all: no schema question
        };
        let err = parse(&bytes).expect_err("bad fixtures are rejected");
        if !SHAPE_REASONS.iter().any(|r| err.reason.contains(r)) {
            continue;
        }
        shape_fixtures += 1;
        if v.is_valid(&doc) {
            problems.push(format!(
                "{}: parser says `{}` at `{}`, schema accepts it",
                p.display(),
                err.reason,
                err.field
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The bad/ directory holds this many shape problems today; fewer would
    // mean the check above silently covers less.
    assert!(shape_fixtures >= 25, "only {shape_fixtures} shape fixtures");
}

/// A config with every numeric field the schema bounds, each at a value both
/// accept, so one field at a time can be moved to and past its bounds.
fn base() -> Value {
    json!({
        "redis": {"cluster": "webdis", "timeoutMs": 75,
                  "circuitBreaker": {"failures": 5, "coolDownMs": 1000}},
        "limits": [
            {"name": "tb", "tokenBucket": {"capacity": 1000000, "refill": 1, "periodMs": 1000},
             "cost": 1, "costHeader": {"name": "x-cost", "max": 1},
             "failureMode": "local", "localFraction": 0.5,
             "lease": {"tokens": 1, "ttlMs": 1000}},
            {"name": "sw", "slidingWindow": {"limit": 1000000, "windowMs": 60000}},
            {"name": "gcra", "gcra": {"rate": 10, "periodMs": 1000, "burst": 20}},
            {"name": "fw", "fixedWindow": {"limit": 1000, "windowMs": 60000}},
            {"name": "swc", "slidingWindowCounter": {"limit": 1000, "windowMs": 60000}},
            // A lease of at least 4 × redis.timeoutMs at every edge of
            // either (a rule across fields, the parser's alone).
            {"name": "cc", "concurrency": {"max": 1000, "leaseMs": 3600000}},
            {"name": "usage", "tokenBucket": {"capacity": 1000, "refill": 1, "periodMs": 1000},
             "usage": {"json": [{"pointer": "/usage/total_tokens", "weight": 1}], "reserve": 1,
                       "maxBodyBytes": 1024}}
        ],
        "idempotency": [
            {"name": "pay", "lockTtlMs": 30000, "recordTtlMs": 86400000,
             "maxRequestBodyBytes": 1000, "maxStoredBodyBytes": 1000}
        ]
    })
}

/// (JSON pointer into `base()`, schema definition, property).
const BOUNDED: &[(&str, &str, &str)] = &[
    ("/redis/timeoutMs", "Redis", "timeoutMs"),
    (
        "/redis/circuitBreaker/failures",
        "CircuitBreaker",
        "failures",
    ),
    (
        "/redis/circuitBreaker/coolDownMs",
        "CircuitBreaker",
        "coolDownMs",
    ),
    ("/limits/0/tokenBucket/capacity", "TokenBucket", "capacity"),
    ("/limits/0/tokenBucket/refill", "TokenBucket", "refill"),
    ("/limits/0/tokenBucket/periodMs", "TokenBucket", "periodMs"),
    ("/limits/1/slidingWindow/limit", "SlidingWindow", "limit"),
    (
        "/limits/1/slidingWindow/windowMs",
        "SlidingWindow",
        "windowMs",
    ),
    ("/limits/2/gcra/rate", "Gcra", "rate"),
    ("/limits/2/gcra/periodMs", "Gcra", "periodMs"),
    ("/limits/2/gcra/burst", "Gcra", "burst"),
    ("/limits/3/fixedWindow/limit", "FixedWindow", "limit"),
    ("/limits/3/fixedWindow/windowMs", "FixedWindow", "windowMs"),
    (
        "/limits/4/slidingWindowCounter/limit",
        "SlidingWindowCounter",
        "limit",
    ),
    (
        "/limits/4/slidingWindowCounter/windowMs",
        "SlidingWindowCounter",
        "windowMs",
    ),
    ("/limits/5/concurrency/max", "Concurrency", "max"),
    ("/limits/5/concurrency/leaseMs", "Concurrency", "leaseMs"),
    ("/limits/6/usage/maxBodyBytes", "Usage", "maxBodyBytes"),
    ("/limits/6/usage/reserve", "Usage", "reserve"),
    ("/limits/6/usage/json/0/weight", "UsageTerm", "weight"),
    ("/limits/0/cost", "Limit", "cost"),
    ("/limits/0/costHeader/max", "CostHeader", "max"),
    ("/limits/0/localFraction", "Limit", "localFraction"),
    ("/limits/0/lease/tokens", "Lease", "tokens"),
    ("/limits/0/lease/ttlMs", "Lease", "ttlMs"),
    ("/idempotency/0/lockTtlMs", "IdempotencyRule", "lockTtlMs"),
    (
        "/idempotency/0/recordTtlMs",
        "IdempotencyRule",
        "recordTtlMs",
    ),
    (
        "/idempotency/0/maxRequestBodyBytes",
        "IdempotencyRule",
        "maxRequestBodyBytes",
    ),
    (
        "/idempotency/0/maxStoredBodyBytes",
        "IdempotencyRule",
        "maxStoredBodyBytes",
    ),
];

#[test]
fn schema_bounds_match_the_parser_at_and_past_each_edge() {
    let schema = json_schema();
    let v = validator();
    let mut problems = Vec::new();
    let agree = |doc: &Value, what: &str, problems: &mut Vec<String>| {
        let parser = parse(&serde_json::to_vec(doc).unwrap());
        let schema_ok = v.is_valid(doc);
        if parser.is_ok() != schema_ok {
            problems.push(format!(
                "{what}: parser {}, schema {}",
                parser
                    .map(|_| "accepts".to_string())
                    .unwrap_or_else(|e| format!("rejects ({e})")),
                if schema_ok { "accepts" } else { "rejects" }
            ));
        }
    };
    agree(&base(), "base config", &mut problems);
    let mut edges = 0;
    for &(pointer, def, prop) in BOUNDED {
        let spec = &schema["definitions"][def]["properties"][prop];
        assert!(spec.is_object(), "schema has no {def}.{prop}");
        let integer = spec["type"] == "integer" || spec["type"][0] == "integer";
        let step = if integer { json!(1) } else { json!(0.001) };
        let mut values = Vec::new();
        for (bound, inside) in [("minimum", true), ("maximum", true)] {
            if let Some(b) = spec[bound].as_f64() {
                let past = if bound == "minimum" {
                    b - step.as_f64().unwrap()
                } else {
                    b + step.as_f64().unwrap()
                };
                values.push((b, inside));
                values.push((past, false));
            }
        }
        if let Some(b) = spec["exclusiveMinimum"].as_f64() {
            values.push((b, false));
            values.push((b + step.as_f64().unwrap(), true));
        }
        assert!(!values.is_empty(), "{def}.{prop} states no bound");
        for (value, _) in values {
            let mut doc = base();
            *doc.pointer_mut(pointer).unwrap() = if integer {
                if value < 0.0 {
                    json!(value as i64)
                } else {
                    json!(value as u64)
                }
            } else {
                json!(value)
            };
            edges += 1;
            agree(&doc, &format!("{pointer} = {value}"), &mut problems);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(edges >= 2 * BOUNDED.len());
}

#[test]
fn schema_names_the_misspelled_field() {
    let v = validator();
    let mut doc = base();
    doc["limits"][0]["tokenBucket"]["periodMS"] = json!(1000);
    let errors = schema_errors(&v, &doc);
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("/limits/0/tokenBucket") && e.contains("periodMS")),
        "{errors:?}"
    );
    // The parser says the same thing, in its own words.
    let e = parse(&serde_json::to_vec(&doc).unwrap()).unwrap_err();
    assert_eq!(e.field, "limits[0].tokenBucket.periodMS");
}

/// `base()` with an object store and a rule that offloads.
fn base_offload() -> Value {
    let mut doc = base();
    doc["objectStore"] = json!({
        "cluster": "objectstore", "bucket": "redis-guard", "region": "us-east-1",
        "timeoutMs": 5000,
        "credentials": {"accessKeyId": "AKIDEXAMPLE", "secretAccessKey": "secret"}
    });
    doc["idempotency"][0]["maxStoredBodyBytes"] = json!(67_108_864u64);
    doc["idempotency"][0]["offloadAboveBytes"] = json!(65_536);
    // Above the longest upload the store's timeout allows.
    doc["idempotency"][0]["lockTtlMs"] = json!(400_000);
    doc
}

/// (base config, JSON pointer, value, whether it is valid).
type Edge = (fn() -> Value, &'static str, u64, bool);

/// The bounds that depend on another field (maxStoredBodyBytes: 8 MiB
/// without offloadAboveBytes, 64 MiB with it) and the object store's: the
/// schema (an if/then on the rule) and the parser agree at and past each.
#[test]
fn object_store_bounds_match_the_parser_at_and_past_each_edge() {
    let v = validator();
    let mut problems = Vec::new();
    let cases: &[Edge] = &[
        (base, "/idempotency/0/maxStoredBodyBytes", 8_388_608, true),
        (base, "/idempotency/0/maxStoredBodyBytes", 8_388_609, false),
        (base, "/idempotency/0/maxStoredBodyBytes", 67_108_864, false),
        (
            base_offload,
            "/idempotency/0/maxStoredBodyBytes",
            67_108_864,
            true,
        ),
        (
            base_offload,
            "/idempotency/0/maxStoredBodyBytes",
            67_108_865,
            false,
        ),
        (base_offload, "/idempotency/0/offloadAboveBytes", 0, true),
        (
            base_offload,
            "/idempotency/0/offloadAboveBytes",
            8_388_608,
            true,
        ),
        (
            base_offload,
            "/idempotency/0/offloadAboveBytes",
            8_388_609,
            false,
        ),
        (base_offload, "/objectStore/timeoutMs", 1, true),
        (base_offload, "/objectStore/timeoutMs", 0, false),
        (base_offload, "/objectStore/timeoutMs", 300_000, true),
        (base_offload, "/objectStore/timeoutMs", 300_001, false),
    ];
    for &(make, pointer, value, valid) in cases {
        let mut doc = make();
        *doc.pointer_mut(pointer).unwrap() = json!(value);
        let parser = parse(&serde_json::to_vec(&doc).unwrap());
        let schema = v.is_valid(&doc);
        if parser.is_ok() != valid || schema != valid {
            problems.push(format!(
                "{pointer} = {value}: want {}, parser {}, schema {}",
                if valid { "accepted" } else { "rejected" },
                parser
                    .map(|_| "accepts".to_string())
                    .unwrap_or_else(|e| format!("rejects ({e})")),
                if schema { "accepts" } else { "rejects" }
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A schema node's own object or list: through `$ref` (named by its
/// definition) and `anyOf`/`allOf` (a field that may be null: the other
/// branch).
fn resolve<'a>(schema: &'a Value, mut node: &'a Value, mut name: String) -> (&'a Value, String) {
    for _ in 0..8 {
        if let Some(r) = node.get("$ref").and_then(Value::as_str) {
            name = r.trim_start_matches("#/definitions/").to_string();
            node = &schema["definitions"][name.as_str()];
        } else if let Some(alts) = node
            .get("anyOf")
            .or(node.get("allOf"))
            .and_then(Value::as_array)
        {
            match alts.iter().find(|a| a.get("type") != Some(&json!("null"))) {
                Some(a) => node = a,
                None => break,
            }
        } else {
            break;
        }
    }
    (node, name)
}

/// Every field of `doc` that is left out where the schema states a
/// default: (JSON pointer of the field, `Definition.field`, the default).
fn left_out_defaults(
    schema: &Value,
    node: &Value,
    name: String,
    doc: &Value,
    at: &str,
    out: &mut Vec<(String, String, Value)>,
) {
    let (node, name) = resolve(schema, node, name);
    match doc {
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let items_schema = node.get("items").unwrap_or(&Value::Null);
                left_out_defaults(
                    schema,
                    items_schema,
                    name.clone(),
                    item,
                    &format!("{at}/{i}"),
                    out,
                );
            }
        }
        Value::Object(map) => {
            if let Some(props) = node.get("properties").and_then(Value::as_object) {
                for (field, sub) in props {
                    match map.get(field) {
                        Some(value) => left_out_defaults(
                            schema,
                            sub,
                            format!("{name}.{field}"),
                            value,
                            &format!("{at}/{field}"),
                            out,
                        ),
                        None => {
                            if let Some(d) = sub.get("default").filter(|d| !d.is_null()) {
                                out.push((
                                    format!("{at}/{field}"),
                                    format!("{name}.{field}"),
                                    d.clone(),
                                ));
                            }
                        }
                    }
                }
            } else if let Some(alts) = node.get("oneOf").and_then(Value::as_array) {
                // A descriptor part: the alternative whose key this is.
                for alt in alts {
                    let required = alt["required"].as_array().cloned().unwrap_or_default();
                    if !required.is_empty()
                        && required
                            .iter()
                            .all(|k| k.as_str().is_some_and(|k| map.contains_key(k)))
                    {
                        left_out_defaults(schema, alt, name.clone(), doc, at, out);
                    }
                }
            }
        }
        _ => {}
    }
}

/// Every `Definition.field` the schema gives a default (not null).
fn stated_defaults(schema: &Value) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut add = |name: &str, node: &Value| {
        for (field, sub) in node["properties"].as_object().into_iter().flatten() {
            if sub.get("default").is_some_and(|d| !d.is_null()) {
                out.insert(format!("{name}.{field}"));
            }
        }
    };
    add("top", schema);
    for (name, node) in schema["definitions"].as_object().unwrap() {
        add(name, node);
    }
    out
}

/// The reference's default column comes from the schema (envoy/docs_ref.py),
/// and the schema's defaults from src/config/defaults.rs. Each must be what
/// the parser does with the field left out: written into every example
/// configuration where the field is absent, it leaves the parsed
/// configuration as it was (or is refused, where writing the field says
/// something: a `cost` beside `usage`); and every default is seen to do so
/// at least once.
#[test]
fn every_default_the_schema_states_is_what_the_parser_takes_for_the_field_left_out() {
    let schema = json_schema();
    let mut docs: Vec<(String, Value)> = example_configs()
        .into_iter()
        .map(|(name, bytes)| (name, serde_json::from_slice(&bytes).unwrap()))
        .collect();
    docs.push(("base()".into(), base()));
    docs.push(("base_offload()".into(), base_offload()));
    docs.push(("defaults' own fixture".into(), defaults_fixture()));
    let mut confirmed = std::collections::BTreeSet::new();
    let mut problems = Vec::new();
    for (doc_name, doc) in &docs {
        let before =
            parse(&serde_json::to_vec(doc).unwrap()).unwrap_or_else(|e| panic!("{doc_name}: {e}"));
        let mut gaps = Vec::new();
        left_out_defaults(&schema, &schema, "top".into(), doc, "", &mut gaps);
        for (pointer, field, default) in gaps {
            let mut with = doc.clone();
            let (parent, key) = pointer.rsplit_once('/').unwrap();
            with.pointer_mut(parent).unwrap()[key] = default.clone();
            match parse(&serde_json::to_vec(&with).unwrap()) {
                Ok(after) if after == before => {
                    confirmed.insert(field);
                }
                Ok(_) => problems.push(format!(
                    "{doc_name}: {pointer} = {default} (the schema's default of {field}) parses to another configuration than the field left out"
                )),
                Err(_) => {}
            }
        }
    }
    let stated = stated_defaults(&schema);
    let unseen: Vec<&String> = stated.difference(&confirmed).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        unseen.is_empty(),
        "defaults no example config confirmed (add the object to defaults_fixture()): {unseen:?}"
    );
    assert!(
        stated.len() >= 50,
        "the schema states its defaults: {}",
        stated.len()
    );

    // The check notices a default that is not the parser's.
    let mut doc = base();
    doc["redis"].as_object_mut().unwrap().remove("timeoutMs");
    let left_out = parse(&serde_json::to_vec(&doc).unwrap()).unwrap();
    doc["redis"]["timeoutMs"] = json!(51);
    assert_ne!(parse(&serde_json::to_vec(&doc).unwrap()).unwrap(), left_out);
}

/// The objects with defaults that no example configuration holds with a
/// field left out.
fn defaults_fixture() -> Value {
    json!({
        "redis": {"cluster": "webdis", "batch": {}, "circuitBreaker": {},
                  "credentials": {"username": "u", "password": "p"}},
        "accessLog": {},
        "objectStore": {
            "cluster": "objectstore", "bucket": "redis-guard", "region": "us-east-1",
            "credentials": {"accessKeyId": "AKIDEXAMPLE", "secretAccessKey": "secret"}
        },
        "limits": [
            {"name": "cc", "concurrency": {"max": 10}},
            {"name": "q", "quota": {"amount": 100, "per": "month", "timeZone": "UTC"}},
            {"name": "net", "descriptor": [{"clientPrefix": {}},
                                           {"metadata": {"namespace": "n", "path": ["sub"]}}],
             "tokenBucket": {"capacity": 10, "refill": 1, "periodMs": 1000},
             "overrides": {"request": {"header": "x-plan"}}},
            {"name": "usage", "tokenBucket": {"capacity": 1000, "refill": 1, "periodMs": 1000},
             "usage": {"json": [{"pointer": "/usage/total_tokens"}]}}
        ],
        "idempotency": [{"name": "pay"}]
    })
}
