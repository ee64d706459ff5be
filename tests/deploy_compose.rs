//! `envoy/compose.yaml`, checked without Docker (no engine runs on the build
//! machines): it validates against the Compose Specification JSON schema,
//! every file it mounts exists, and the stack it describes is consistent: the
//! render service's command, run here with the real renderer, yields an
//! envoy.yaml whose listener, admin port, clusters, wasm path and filter config
//! agree with the services, the published ports and the mounts, and that the
//! real Envoy binary accepts (`--mode validate`); the object store is the moto
//! release the tests run, bootstrapped for the bucket, key prefix and record
//! lifetime envoy/filter.json names, and its key reaches Envoy's environment.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use redis_guard::config::{Config, ConfigError, ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY};
use serde_json::Value;
use support::{envoy_bin, root, sha256_hex, Scratch};

fn envoy_dir() -> PathBuf {
    root().join("envoy")
}

fn compose() -> Value {
    let text = std::fs::read_to_string(envoy_dir().join("compose.yaml")).unwrap();
    serde_yaml_ng::from_str(&text).unwrap()
}

/// The Compose Specification schema, fetched by `make compose-schema` (a
/// dependency of `make test`) from the docker-compose release on PyPI.
fn compose_schema() -> jsonschema::Validator {
    let path = root().join(".venv/share/compose-spec/compose_spec.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run `make test` (it fetches the Compose Specification schema)",
            path.display()
        )
    });
    let schema: Value = serde_json::from_str(&text).unwrap();
    jsonschema::options().build(&schema).unwrap()
}

fn service<'a>(c: &'a Value, name: &str) -> &'a Value {
    let s = &c["services"][name];
    assert!(s.is_object(), "compose.yaml has no service `{name}`");
    s
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected a list, found {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Short-syntax volume entries as (source, target).
fn mounts(svc: &Value) -> Vec<(String, String)> {
    strings(&svc["volumes"])
        .into_iter()
        .map(|m| {
            let mut parts = m.split(':');
            let src = parts.next().unwrap().to_string();
            let dst = parts
                .next()
                .unwrap_or_else(|| panic!("{m}: no target"))
                .to_string();
            (src, dst)
        })
        .collect()
}

fn is_bind(src: &str) -> bool {
    src.starts_with("./") || src.starts_with("../") || src.starts_with('/')
}

/// A command's `--flag value` arguments, in order.
fn flag_values(cmd: &[String], flag: &str) -> Vec<String> {
    cmd.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].clone())
        .collect()
}

/// Runs the render service's command here: container paths of its bind
/// mounts become the host files, its volume becomes a scratch directory.
/// Returns that directory and the `--set` values.
fn run_render_service(c: &Value) -> (Scratch, BTreeMap<String, String>) {
    let render = service(c, "render");
    let cmd = strings(&render["command"]);
    let out = Scratch::new("compose-render");
    let mut host_path = BTreeMap::new();
    for (src, dst) in mounts(render) {
        if is_bind(&src) {
            host_path.insert(dst, envoy_dir().join(&src));
        } else {
            host_path.insert(dst, out.0.clone());
        }
    }
    assert_eq!(cmd[0], "python3");
    let args: Vec<String> = cmd[1..]
        .iter()
        .map(|a| match host_path.get(a) {
            Some(p) => p.display().to_string(),
            // A file inside a mount (the credentials the render writes).
            None => host_path
                .iter()
                .find_map(|(dst, p)| {
                    let rest = a.strip_prefix(dst.as_str())?.strip_prefix('/')?;
                    Some(p.join(rest).display().to_string())
                })
                .unwrap_or_else(|| a.clone()),
        })
        .collect();
    let status = Command::new("python3").args(&args).status().unwrap();
    assert!(status.success(), "render service command failed: {args:?}");
    let sets = flag_values(&cmd, "--set")
        .into_iter()
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect();
    (out, sets)
}

fn socket(v: &Value) -> (String, u64) {
    let a = &v["socket_address"];
    (
        a["address"].as_str().unwrap().to_string(),
        a["port_value"].as_u64().unwrap(),
    )
}

fn cluster_endpoint(envoy: &Value, name: &str) -> (String, u64) {
    let cluster = envoy["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("envoy.yaml has no cluster `{name}`"));
    socket(&cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"])
}

/// An environment with nothing set: what `make compose-up` meets in a shell
/// that sets none of the file's variables.
fn unset(_: &str) -> Option<String> {
    None
}

/// Compose's interpolation of one value: `${NAME:-default}` (the default
/// when NAME is unset or empty), `${NAME}` and `$$` (a `$`), with `env` as
/// the environment.
fn interpolate(value: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at + 1..];
        if let Some(after) = rest.strip_prefix('$') {
            out.push('$');
            rest = after;
            continue;
        }
        let body = rest
            .strip_prefix('{')
            .and_then(|r| r.split_once('}'))
            .unwrap_or_else(|| panic!("{value}: only ${{NAME}} and ${{NAME:-default}} are used"));
        let (name, default) = body.0.split_once(":-").unwrap_or((body.0, ""));
        out.push_str(
            &env(name)
                .filter(|v| !v.is_empty())
                .unwrap_or(default.to_string()),
        );
        rest = body.1;
    }
    out + rest
}

/// Container ports a service publishes, as (host ip, host port, container
/// port), in the environment `env`.
fn published(svc: &Value, env: &dyn Fn(&str) -> Option<String>) -> Vec<(String, u64, u64)> {
    strings(&svc["ports"])
        .iter()
        .map(|p| interpolate(p, env))
        .map(|p| {
            let parts: Vec<&str> = p.split(':').collect();
            assert_eq!(parts.len(), 3, "{p}: expected ip:host:container");
            (
                parts[0].to_string(),
                parts[1].parse().unwrap(),
                parts[2].parse().unwrap(),
            )
        })
        .collect()
}

/// The environment the envoy service gets from the file objectstore-init
/// writes: these names, with values known only once the store issued a key.
const STACK_ENV: [(&str, &str); 4] = [
    (ENV_ACCESS_KEY_ID, "AKIAIOSFODNN7EXAMPLE"),
    (
        ENV_SECRET_ACCESS_KEY,
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ),
    ("REDIS_GUARD_WEBDIS_USERNAME", "redis-guard"),
    ("REDIS_GUARD_WEBDIS_PASSWORD", "rendered-per-up"),
];

fn parse_as_in_the_stack(json: &[u8]) -> Result<Config, ConfigError> {
    Config::parse_with_env(json, &|name| {
        STACK_ENV
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.to_string())
    })
}

/// A service's `depends_on` condition on `other`.
fn condition<'a>(c: &'a Value, svc: &str, other: &str) -> &'a str {
    service(c, svc)["depends_on"][other]["condition"]
        .as_str()
        .unwrap_or_else(|| panic!("{svc} does not wait for {other} with a condition"))
}

/// The version pinned by a `NAME := pkg==VERSION` line of the Makefile.
fn makefile_pin(var: &str) -> String {
    let makefile = std::fs::read_to_string(root().join("Makefile")).unwrap();
    let line = makefile
        .lines()
        .find(|l| l.split_whitespace().next() == Some(var))
        .unwrap_or_else(|| panic!("Makefile has no {var}"));
    line.split_once("==")
        .unwrap_or_else(|| panic!("{line}: not pinned with =="))
        .1
        .trim()
        .to_string()
}

fn wasm_filter_config(envoy: &Value) -> &Value {
    let filters = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"]
        .as_array()
        .unwrap();
    let wasm = filters
        .iter()
        .find(|f| f["name"] == "envoy.filters.http.wasm")
        .expect("the wasm filter");
    &wasm["typed_config"]["config"]
}

#[test]
fn compose_file_validates_against_the_compose_specification() {
    let schema = compose_schema();
    let c = compose();
    let errors: Vec<String> = schema.iter_errors(&c).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // The check can fail: a misspelled service key is not Compose.
    let mut broken = c.clone();
    broken["services"]["envoy"]["volume"] = broken["services"]["envoy"]["volumes"].clone();
    assert!(!schema.is_valid(&broken), "schema accepted `volume:`");
}

#[test]
fn every_bind_mount_exists_and_named_volumes_are_declared() {
    let c = compose();
    let mut binds = 0;
    for (name, svc) in c["services"].as_object().unwrap() {
        if svc.get("volumes").is_none() {
            continue;
        }
        for (src, _) in mounts(svc) {
            if is_bind(&src) {
                binds += 1;
                let p = envoy_dir().join(&src);
                assert!(
                    p.exists(),
                    "service {name} mounts {src}, missing ({}): run `make build`",
                    p.display()
                );
            } else {
                assert!(
                    c["volumes"].get(&src).is_some(),
                    "service {name} uses volume {src}, not declared"
                );
            }
        }
    }
    assert!(binds >= 7, "only {binds} bind mounts");
    // The filter comes from the build output, not a copy that could go stale.
    let envoy_mounts = mounts(service(&c, "envoy"));
    let wasm = envoy_mounts
        .iter()
        .find(|(src, _)| src.ends_with(".wasm"))
        .expect("envoy mounts the filter");
    assert_eq!(
        envoy_dir().join(&wasm.0).canonicalize().unwrap(),
        support::wasm_path().canonicalize().unwrap()
    );
}

#[test]
fn rendered_stack_agrees_with_the_services_ports_and_mounts() {
    let c = compose();
    let (out, sets) = run_render_service(&c);
    let envoy: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(out.0.join("envoy.yaml")).unwrap())
            .unwrap();
    let webdis: Value =
        serde_json::from_str(&std::fs::read_to_string(out.0.join("webdis.json")).unwrap()).unwrap();

    // Envoy listens where compose publishes, on every interface of its container.
    let ports = published(service(&c, "envoy"), &unset);
    let (addr, listen) = socket(&envoy["static_resources"]["listeners"][0]["address"]);
    let (admin_addr, admin) = socket(&envoy["admin"]["address"]);
    assert_eq!((addr.as_str(), admin_addr.as_str()), ("0.0.0.0", "0.0.0.0"));
    let container_ports: Vec<u64> = ports.iter().map(|p| p.2).collect();
    assert_eq!(container_ports, vec![listen, admin]);
    for (ip, host_port, container_port) in &ports {
        assert_eq!(ip, "127.0.0.1", "published beyond loopback");
        assert_eq!(host_port, container_port);
    }
    // Nothing else is published, not even on loopback: Webdis runs whatever
    // Lua it is sent, and the object store lets unsigned IAM calls through
    // while objectstore-init bootstraps it.
    for (name, svc) in c["services"].as_object().unwrap() {
        if name != "envoy" {
            assert!(svc.get("ports").is_none(), "{name} publishes ports");
        }
    }

    // Envoy and Webdis read the files the render service wrote: its --out
    // directory is the volume they mount.
    let render_cmd = strings(&service(&c, "render")["command"]);
    let out_dir = &flag_values(&render_cmd, "--out")[0];
    let volume_of = |svc: &str, dst: &str| {
        mounts(service(&c, svc))
            .into_iter()
            .find(|(_, d)| d == dst)
            .map(|(src, _)| src)
            .unwrap_or_else(|| panic!("{svc} mounts nothing at {dst}"))
    };
    let rendered_volume = volume_of("render", out_dir);
    let envoy_cmd = strings(&service(&c, "envoy")["command"]);
    let envoy_conf = &flag_values(&envoy_cmd, "-c")[0];
    assert_eq!(envoy_conf, &format!("{out_dir}/envoy.yaml"));
    assert_eq!(volume_of("envoy", out_dir), rendered_volume);
    let webdis_cmd = strings(&service(&c, "webdis")["command"]);
    assert_eq!(
        webdis_cmd.last().unwrap(),
        &format!("{out_dir}/webdis.json")
    );
    assert_eq!(volume_of("webdis", out_dir), rendered_volume);

    // Clusters point at the compose services, on the ports they listen on.
    let upstream_cmd = strings(&service(&c, "upstream")["command"]);
    // Reachable from the Envoy container, not only its own loopback.
    assert_eq!(flag_values(&upstream_cmd, "--host"), vec!["0.0.0.0"]);
    let upstream_port: u64 = flag_values(&upstream_cmd, "--port")[0].parse().unwrap();
    assert_eq!(
        cluster_endpoint(&envoy, "upstream"),
        ("upstream".to_string(), upstream_port)
    );
    assert_eq!(
        cluster_endpoint(&envoy, "webdis"),
        ("webdis".to_string(), webdis["http_port"].as_u64().unwrap())
    );
    assert_eq!(webdis["http_host"], "0.0.0.0");
    // Webdis reaches the redis service on Redis's default port (its command
    // sets no other).
    assert_eq!(webdis["redis_host"], "redis");
    assert_eq!(webdis["redis_port"], 6379);
    assert!(!strings(&service(&c, "redis")["command"]).contains(&"--port".to_string()));
    // The hardened ACL: everything off but the two script commands, and
    // those only with the credentials (see the test below).
    assert_eq!(webdis["acl"][0], serde_json::json!({"disabled": ["*"]}));
    assert_eq!(
        webdis["acl"][1]["enabled"],
        serde_json::json!(["EVALSHA", "EVAL"])
    );

    // The filter: its code is the mounted build output, its config is
    // envoy/filter.json, and the cluster it calls exists.
    let config = wasm_filter_config(&envoy);
    let wasm_in_container = config["vm_config"]["code"]["local"]["filename"]
        .as_str()
        .unwrap();
    assert_eq!(sets["WASM_PATH"], wasm_in_container);
    assert!(mounts(service(&c, "envoy"))
        .iter()
        .any(|(src, dst)| src.ends_with("redis_guard.wasm") && dst == wasm_in_container));
    let filter_json = config["configuration"]["value"].as_str().unwrap();
    assert_eq!(
        filter_json,
        std::fs::read_to_string(envoy_dir().join("filter.json")).unwrap()
    );
    let parsed = parse_as_in_the_stack(filter_json.as_bytes()).unwrap();
    cluster_endpoint(&envoy, &parsed.redis.cluster);

    // The object store: its cluster points at the objectstore service, on
    // the port moto listens on, on every interface of its container.
    let store = parsed
        .object_store
        .as_ref()
        .expect("filter.json has an objectStore");
    let moto = strings(&service(&c, "objectstore")["entrypoint"]);
    assert_eq!(moto[0], "moto_server");
    assert_eq!(flag_values(&moto, "-H"), vec!["0.0.0.0"]);
    let moto_port: u64 = flag_values(&moto, "-p")[0].parse().unwrap();
    assert_eq!(
        cluster_endpoint(&envoy, &store.cluster),
        ("objectstore".to_string(), moto_port)
    );
    assert_eq!(
        (
            sets["OBJECT_STORE_HOST"].as_str(),
            sets["OBJECT_STORE_PORT"].parse::<u64>().unwrap()
        ),
        ("objectstore", moto_port)
    );
    // IAM access control is on only with a finite INITIAL_NO_AUTH_ACTION_COUNT.
    let no_auth = &service(&c, "objectstore")["environment"]["INITIAL_NO_AUTH_ACTION_COUNT"];
    assert!(
        no_auth.as_str().is_some_and(|n| n.parse::<u32>().is_ok()),
        "objectstore runs without IAM access control: INITIAL_NO_AUTH_ACTION_COUNT = {no_auth}"
    );
    let health = strings(&service(&c, "objectstore")["healthcheck"]["test"]).join(" ");
    assert!(
        health.contains(&format!("'127.0.0.1', {moto_port})")),
        "the healthcheck probes another port: {health}"
    );

    // objectstore-init bootstraps that server for the bucket and key prefix
    // the filter uses, with a lifecycle rule that outlives every offloading
    // rule's records.
    let init = service(&c, "objectstore-init");
    let init_cmd: Vec<String> = strings(&init["entrypoint"])
        .into_iter()
        .chain(strings(&init["command"]))
        .collect();
    let (py, script) = (&init_cmd[0], &init_cmd[1]);
    assert_eq!(py, "python3");
    let s3ctl = envoy_dir().join("s3ctl.py").canonicalize().unwrap();
    assert!(mounts(init).iter().any(|(src, dst)| {
        dst == script && envoy_dir().join(src).canonicalize().ok() == Some(s3ctl.clone())
    }));
    assert_eq!(flag_values(&init_cmd, "--host"), vec!["objectstore"]);
    let at = init_cmd
        .iter()
        .position(|a| a == "bootstrap")
        .expect("objectstore-init runs s3ctl.py bootstrap");
    assert_eq!(init_cmd[at + 1], moto_port.to_string());
    assert_eq!(init_cmd[at + 2], store.bucket);
    assert_eq!(
        flag_values(&init_cmd, "--lifecycle-prefix"),
        vec![store.key_prefix.clone()]
    );
    let longest_ttl = parsed
        .idempotency
        .iter()
        .filter(|r| r.offload_above.is_some())
        .map(|r| r.record_ttl_ms)
        .max()
        .expect("a rule in filter.json offloads");
    assert_eq!(
        flag_values(&init_cmd, "--lifecycle-days"),
        vec![redis_guard::offload::lifecycle_days(longest_ttl).to_string()]
    );

    // Its key reaches the filter: written into the rendered volume, loaded
    // into Envoy's environment before the image's entrypoint runs `command`
    // (so the `-c` above is what starts), and passed on to the VM by envoy.yaml.
    let env_file = &flag_values(&init_cmd, "--env-file")[0];
    let env_dir = env_file.rsplit_once('/').unwrap().0;
    assert_eq!(env_dir, out_dir);
    assert_eq!(volume_of("objectstore-init", out_dir), rendered_volume);
    let entrypoint = strings(&service(&c, "envoy")["entrypoint"]);
    assert_eq!(&entrypoint[..2], ["/bin/sh", "-c"]);
    assert!(
        entrypoint[2].starts_with(&format!(
            "set -a && . {env_file} && . {out_dir}/webdis.env && set +a && "
        )) && entrypoint[2].ends_with(r#"exec /docker-entrypoint.sh "$$@""#),
        "envoy's entrypoint does not load {env_file} and run the image's entrypoint: {}",
        entrypoint[2]
    );
    let raw: Value = serde_json::from_str(filter_json).unwrap();
    assert_eq!(
        raw["objectStore"]["credentials"],
        serde_json::json!({"fromEnvironment": true}),
        "the stack hands filter.json its key through the environment only"
    );
    let host_env = strings(&config["vm_config"]["environment_variables"]["host_env_keys"]);
    for name in [ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY] {
        assert!(
            host_env.iter().any(|k| k == name),
            "{name} not passed to the VM"
        );
    }

    // Started in that order: the key exists before Envoy reads it.
    assert_eq!(
        condition(&c, "objectstore-init", "objectstore"),
        "service_healthy"
    );
    assert_eq!(
        condition(&c, "envoy", "objectstore-init"),
        "service_completed_successfully"
    );

    // The rendered file is a config the real Envoy accepts (the wasm path
    // swapped for the build output, which is where compose mounts it from),
    // in the environment the envoy service has: the filter reads its key there.
    let local = out.0.join("envoy-local.yaml");
    let text = std::fs::read_to_string(out.0.join("envoy.yaml")).unwrap();
    let wasm = support::wasm_path();
    std::fs::write(
        &local,
        text.replace(wasm_in_container, wasm.to_str().unwrap()),
    )
    .unwrap();
    let validated = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&local)
        .envs(STACK_ENV)
        .output()
        .unwrap();
    assert!(
        validated.status.success(),
        "envoy --mode validate: {}{}",
        String::from_utf8_lossy(&validated.stdout),
        String::from_utf8_lossy(&validated.stderr)
    );
}

#[test]
fn compose_runs_the_envoy_release_the_tests_run() {
    let c = compose();
    let image = service(&c, "envoy")["image"].as_str().unwrap().to_string();
    let tag = image
        .strip_prefix("envoyproxy/envoy:v")
        .unwrap_or_else(|| panic!("{image}: not the official Envoy image"));
    let out = Command::new(envoy_bin()).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout).to_string();
    // "envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL"
    let tested = version
        .split("version:")
        .nth(1)
        .and_then(|v| v.split('/').nth(1))
        .unwrap_or_else(|| panic!("unexpected --version output: {version}"));
    assert_eq!(major_minor(tag), major_minor(tested), "{image} vs {tested}");
}

#[test]
fn envoy_is_published_on_10000_and_9901_unless_the_environment_moves_it() {
    let c = compose();
    let envoy = service(&c, "envoy");
    let on = |listen: u64, admin: u64| {
        vec![
            ("127.0.0.1".to_string(), listen, 10000),
            ("127.0.0.1".to_string(), admin, 9901),
        ]
    };
    // make compose-up in a shell that sets neither: the ports it always had.
    assert_eq!(published(envoy, &unset), on(10000, 9901));
    let empty = |_: &str| Some(String::new());
    assert_eq!(published(envoy, &empty), on(10000, 9901), "set but empty");
    // make compose-test's own stack, beside a user's on the defaults.
    let moved = |name: &str| match name {
        "REDIS_GUARD_PORT" => Some("21000".to_string()),
        "REDIS_GUARD_ADMIN_PORT" => Some("21001".to_string()),
        _ => None,
    };
    assert_eq!(published(envoy, &moved), on(21000, 21001));
}

/// `major.minor` of a version such as 9.1.2 or 9.1.2.post2.
fn major_minor(version: &str) -> String {
    version.split('.').take(2).collect::<Vec<_>>().join(".")
}

#[test]
fn compose_runs_redis_7_0_by_default_and_the_valkey_release_the_tests_run_when_asked() {
    let c = compose();
    let image = service(&c, "redis")["image"].as_str().unwrap();
    let default = interpolate(image, &unset);
    let tag = default
        .strip_prefix("redis:")
        .and_then(|t| t.strip_suffix("-alpine"))
        .unwrap_or_else(|| panic!("{default}: not the official Redis image"));
    // "Redis server v=7.0.15 sha=..." (Debian's, what the tests run).
    let out = Command::new(support::on_path("redis-server"))
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&out.stdout).to_string();
    let tested = version
        .split("v=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected --version output: {version}"));
    assert_eq!(
        tag,
        major_minor(tested),
        "{default} vs redis-server {tested}"
    );
    // The image is the one variable chooses, and Valkey's is the release
    // the tests run (Makefile VALKEY_PKG), as the file's comments name it.
    let valkey = format!(
        "valkey/valkey:{}-alpine",
        major_minor(&makefile_pin("VALKEY_PKG"))
    );
    let asked = |name: &str| (name == "REDIS_IMAGE").then(|| valkey.clone());
    assert_eq!(interpolate(image, &asked), valkey);
    let text = std::fs::read_to_string(envoy_dir().join("compose.yaml")).unwrap();
    let named: Vec<&str> = text
        .split_whitespace()
        .filter_map(|w| w.find("valkey/valkey:").map(|at| &w[at..]))
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()))
        .collect();
    assert!(
        !named.is_empty(),
        "compose.yaml does not say how to pick Valkey"
    );
    for n in named {
        assert_eq!(n, valkey, "compose.yaml names another Valkey image");
    }
}

#[test]
fn compose_runs_the_moto_release_the_tests_run() {
    let c = compose();
    // The tests' S3 server is `moto[server]` from PyPI; its official image
    // is tagged with the same version.
    let want = format!("motoserver/moto:{}", makefile_pin("S3_PKG"));
    for svc in ["objectstore", "objectstore-init"] {
        assert_eq!(service(&c, svc)["image"], want.as_str(), "{svc}");
    }
}

#[test]
fn makefile_drives_this_compose_file() {
    let makefile = std::fs::read_to_string(root().join("Makefile")).unwrap();
    for target in ["compose-up:", "compose-down:"] {
        let at = makefile
            .find(&format!("\n{target}"))
            .unwrap_or_else(|| panic!("Makefile has no {target}"));
        let body: String = makefile[at + 1..]
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with('\t'))
            .collect();
        assert!(
            body.contains("$(COMPOSE)"),
            "{target} does not run $(COMPOSE)"
        );
    }
    let compose_var = makefile
        .lines()
        .find(|l| l.starts_with("COMPOSE "))
        .expect("a COMPOSE variable");
    assert!(
        compose_var.contains("docker compose") && compose_var.contains("-f envoy/compose.yaml"),
        "{compose_var}"
    );
}

#[test]
fn webdis_answers_only_the_credentials_the_render_made_for_envoy() {
    use std::os::unix::fs::PermissionsExt;
    let c = compose();
    let (out, _) = run_render_service(&c);
    let env_path = out.0.join("webdis.env");
    let env = std::fs::read_to_string(&env_path).unwrap();
    let mode = std::fs::metadata(&env_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "only its owner reads it");
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} not in webdis.env: {env}"))
            .to_string()
    };
    let (user, password) = (
        var("REDIS_GUARD_WEBDIS_USERNAME"),
        var("REDIS_GUARD_WEBDIS_PASSWORD"),
    );
    assert!(
        password.len() >= 32,
        "a password of {} characters",
        password.len()
    );
    let webdis: Value =
        serde_json::from_str(&std::fs::read_to_string(out.0.join("webdis.json")).unwrap()).unwrap();
    let acl = webdis["acl"].as_array().unwrap();
    assert_eq!(
        acl[0],
        serde_json::json!({"disabled": ["*"]}),
        "closed by default"
    );
    assert_eq!(acl.len(), 2);
    assert_eq!(acl[1]["http_basic_auth"], format!("{user}:{password}"));
    assert_eq!(acl[1]["enabled"], serde_json::json!(["EVALSHA", "EVAL"]));
    // Envoy sends them: its webdis cluster adds the header from its
    // environment, so no log line and no config dump holds them, and the
    // filter (configured without credentials) never sees them.
    use base64::Engine;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    assert_eq!(
        var("REDIS_GUARD_WEBDIS_AUTHORIZATION"),
        format!("'Basic {basic}'")
    );
    let envoy: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(out.0.join("envoy.yaml")).unwrap())
            .unwrap();
    let clusters = envoy["static_resources"]["clusters"].as_sequence().unwrap();
    let cluster = clusters.iter().find(|c| c["name"] == "webdis").unwrap();
    let options = &cluster["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    let mutation =
        &options["http_filters"][0]["typed_config"]["mutations"]["request_mutations"][0]["append"];
    assert_eq!(mutation["header"]["key"], "authorization");
    assert_eq!(
        mutation["header"]["value"],
        "%ENVIRONMENT(REDIS_GUARD_WEBDIS_AUTHORIZATION)%"
    );
    assert_eq!(mutation["append_action"], "ADD_IF_ABSENT");
    let filter: Value =
        serde_json::from_str(&std::fs::read_to_string(envoy_dir().join("filter.json")).unwrap())
            .unwrap();
    assert_eq!(
        filter["redis"].get("credentials"),
        None,
        "the filter sends none"
    );
    // Redis' users: Webdis connects as the restricted default user, with the
    // password whose hash redis.acl holds; the file holds no password.
    let acl = std::fs::read_to_string(out.0.join("redis.acl")).unwrap();
    let redis_auth = webdis["redis_auth"]
        .as_str()
        .expect("webdis authenticates to Redis");
    let hash = sha256_hex(redis_auth);
    let default = acl
        .lines()
        .find(|l| l.starts_with("user default "))
        .unwrap();
    assert!(default.contains(&format!(" #{hash} ")), "{default}");
    assert!(
        default.contains(" ~rg:* ") && default.contains(" -@all "),
        "{default}"
    );
    assert!(!acl.contains(redis_auth), "a password in redis.acl");
    let redis = service(&c, "redis");
    assert!(strings(&redis["command"])
        .windows(2)
        .any(|w| w == ["--aclfile", "/rendered/redis.acl"]));
    // A second render makes another password.
    let (again, _) = run_render_service(&c);
    let env2 = std::fs::read_to_string(again.0.join("webdis.env")).unwrap();
    assert_ne!(env, env2);
}

#[test]
fn only_envoy_is_reachable_from_outside_the_stacks_internal_network() {
    let c = compose();
    assert_eq!(
        c["networks"]["backend"]["internal"], true,
        "backend has no route out"
    );
    let services = c["services"].as_object().unwrap();
    for (name, svc) in services {
        // A list of networks, or a map of them (a network's aliases).
        let nets: Vec<String> = match svc["networks"].as_object() {
            Some(map) => map.keys().cloned().collect(),
            None => strings(&svc["networks"]),
        };
        if name == "envoy" {
            assert_eq!(
                nets,
                ["backend", "edge"],
                "envoy reaches the backend and is published"
            );
            assert!(!published(svc, &unset).is_empty());
        } else {
            assert_eq!(nets, ["backend"], "{name} is on the internal network only");
            assert!(svc.get("ports").is_none(), "{name} publishes a port");
            assert!(
                svc.get("network_mode").is_none(),
                "{name} leaves the networks"
            );
        }
    }
    assert_eq!(
        c["networks"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["backend", "edge"]
    );
}

#[test]
fn a_second_webdis_answers_to_the_webdis_name_with_the_same_command_and_files() {
    let c = compose();
    let (a, b) = (service(&c, "webdis"), service(&c, "webdis-b"));
    assert_eq!(
        b["networks"]["backend"]["aliases"],
        serde_json::json!(["webdis"]),
        "the cluster's one DNS name resolves both"
    );
    for field in ["image", "command", "volumes", "depends_on"] {
        assert_eq!(a[field], b[field], "{field}");
    }
}

/// The permission bits of `path`.
fn mode(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// The mode a new file gets in `dir` under this process's umask: what a
/// rendered file without a secret has.
fn fresh_file_mode(dir: &std::path::Path) -> u32 {
    let probe = dir.join("fresh-file-probe");
    std::fs::write(&probe, b"").unwrap();
    let m = mode(&probe);
    std::fs::remove_file(&probe).unwrap();
    m
}

/// Each of `secret` is readable by its owner only; each of `public` has a
/// new file's mode.
fn assert_modes(dir: &std::path::Path, secret: &[&str], public: &[&str]) {
    let fresh = fresh_file_mode(dir);
    assert_ne!(fresh, 0o600, "the umask would hide a difference");
    for name in secret {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name} holds a secret");
    }
    for name in public {
        assert_eq!(mode(&dir.join(name)), fresh, "{name} holds none");
    }
}

#[test]
fn the_compose_render_writes_every_file_holding_a_secret_for_its_owner_only() {
    let c = compose();
    let (out, _) = run_render_service(&c);
    // webdis.json: Webdis' Basic password and redis_auth; the env files:
    // the same password, the Authorization header, the Redis admin's.
    // redis.acl holds SHA-256s only, and Redis reads it as another user.
    assert_modes(
        &out.0,
        &["webdis.json", "webdis.env", "redis.env"],
        &["envoy.yaml", "redis.acl"],
    );
}

/// The lines of envoy/demo.sh from the one starting with `start` to the
/// first that does not continue onto the next (no trailing backslash).
fn demo_command(demo: &str, start: &str) -> String {
    let lines: Vec<&str> = demo.lines().collect();
    let first = lines
        .iter()
        .position(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("demo.sh no longer runs {start}"));
    let last = first
        + lines[first..]
            .iter()
            .position(|l| !l.ends_with('\\'))
            .unwrap();
    lines[first..=last].join("\n")
}

#[test]
fn the_demo_renders_its_secrets_for_its_owner_only_even_over_an_earlier_runs_files() {
    let demo = std::fs::read_to_string(envoy_dir().join("demo.sh")).unwrap();
    let stack = Scratch::new("demo-render");
    // An earlier run's files, readable by anyone (what a render before this
    // fix left in .stack): the new ones must not inherit their mode.
    let secret = ["webdis.json", "webdis.env", "redis.env", "jwt.secret"];
    for name in secret {
        let path = stack.0.join(name);
        std::fs::write(&path, b"old").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    // demo.sh's own two commands, with its variables.
    let script = format!(
        "set -euo pipefail\nSTACK={}\nENVOY_PORT=10000 ADMIN_PORT=9901 WEBDIS_PORT=17379 REDIS_PORT=16379\n\
         UPSTREAM_PORT=18080 GRPC_UPSTREAM_PORT=18081 OBJECT_STORE_PORT=17900\n\
         WASM=target/wasm32-wasip1/release/redis_guard.wasm\n{}\n{}\n",
        stack.0.display(),
        demo_command(&demo, "python3 envoy/demo_jwt.py keys"),
        demo_command(&demo, "python3 envoy/render.py"),
    );
    let status = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(root())
        .status()
        .unwrap();
    assert!(status.success(), "{script}");
    assert_modes(&stack.0, &secret, &["envoy.yaml", "redis.acl", "jwks.json"]);
    // Rewritten, not merely re-moded.
    assert_ne!(std::fs::read(stack.0.join("jwt.secret")).unwrap(), b"old");
}
