//! The S3-compatible object store that takes large idempotent responses, and
//! the credentials its requests are signed with.

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::ConfigError;

pub const DEFAULT_OBJECT_TIMEOUT_MS: u64 = 5000;
const MAX_OBJECT_TIMEOUT_MS: u64 = 300_000;
pub const DEFAULT_OBJECT_KEY_PREFIX: &str = "redis-guard/";
/// The standard AWS SDK variable names, so existing secrets plumbing works.
pub const ENV_ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
pub const ENV_SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
pub const ENV_SESSION_TOKEN: &str = "AWS_SESSION_TOKEN";

/// An S3-compatible object store reached through an Envoy cluster; requests
/// are signed with AWS Signature Version 4 (path-style addressing).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "ObjectStore")]
pub(super) struct RawObjectStore {
    /// Envoy cluster of the store's endpoint.
    #[schemars(length(min = 1))]
    cluster: String,
    /// Host the requests are signed for and sent with, e.g.
    /// "s3.eu-west-1.amazonaws.com" (default: the cluster name).
    #[serde(default)]
    authority: Option<String>,
    /// Bucket name (3 to 63 of a-z 0-9 . -).
    #[schemars(
        length(min = 3, max = 63),
        regex(pattern = r"^[a-z0-9][a-z0-9.-]+[a-z0-9]$")
    )]
    bucket: String,
    /// Signing region, e.g. "us-east-1".
    #[schemars(length(min = 1, max = 32), regex(pattern = r"^[a-z0-9-]+$"))]
    region: String,
    /// Start of every object key (default "redis-guard/"); a bucket lifecycle
    /// rule on this prefix removes objects after their records expire.
    #[serde(default)]
    #[schemars(length(max = 256))]
    #[schemars(default = "super::defaults::object_key_prefix")]
    key_prefix: Option<String>,
    /// Deadline of one upload or fetch (ms, default 5000).
    #[serde(default)]
    #[schemars(range(min = 1, max = 300000))]
    #[schemars(default = "super::defaults::object_timeout_ms")]
    timeout_ms: Option<u64>,
    /// Access key: given here, or read from the Envoy environment.
    credentials: RawCredentials,
}

/// Either accessKeyId and secretAccessKey (and sessionToken), or
/// fromEnvironment: true to read AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
/// AWS_SESSION_TOKEN from the Wasm VM's environment (Envoy
/// vm_config.environment_variables; Istio WasmPlugin vmConfig.env).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Credentials")]
struct RawCredentials {
    /// The AWS access key id.
    #[serde(default)]
    access_key_id: Option<String>,
    /// Its secret (never logged).
    #[serde(default)]
    secret_access_key: Option<String>,
    /// A temporary credential's session token (never logged).
    #[serde(default)]
    session_token: Option<String>,
    /// true: read all three from the VM's environment instead.
    #[serde(default)]
    #[schemars(default = "super::defaults::off")]
    from_environment: Option<bool>,
}

/// Where offloaded bodies go, and how requests to it are signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectStore {
    pub cluster: String,
    pub authority: String,
    pub bucket: String,
    pub region: String,
    pub key_prefix: String,
    pub timeout: Duration,
    pub credentials: crate::sigv4::Credentials,
}

pub(super) fn compile_object_store(
    raw: RawObjectStore,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ObjectStore, ConfigError> {
    let printable = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic());
    if !printable(&raw.cluster) {
        return Err(ConfigError::new(
            "objectStore.cluster",
            "must name the Envoy cluster of the object store (printable ASCII, no spaces)",
        ));
    }
    let authority = raw.authority.unwrap_or_else(|| raw.cluster.clone());
    if !printable(&authority) || authority.contains('/') {
        return Err(ConfigError::new(
            "objectStore.authority",
            "must be a host[:port], printable ASCII without spaces or '/'",
        ));
    }
    // S3's bucket naming rules; path-style requests put the name in the path
    // unescaped, so anything else would be signed differently than sent.
    let b = raw.bucket.as_bytes();
    let bucket_ok = (3..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'.' || *c == b'-')
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric);
    if !bucket_ok {
        return Err(ConfigError::new(
            "objectStore.bucket",
            "must be 3 to 63 of a-z 0-9 . - starting and ending with a letter or digit",
        ));
    }
    let region_ok = !raw.region.is_empty()
        && raw.region.len() <= 32
        && raw
            .region
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-');
    if !region_ok {
        return Err(ConfigError::new(
            "objectStore.region",
            "must be a region name such as us-east-1 (a-z 0-9 -)",
        ));
    }
    let key_prefix = raw
        .key_prefix
        .unwrap_or_else(|| DEFAULT_OBJECT_KEY_PREFIX.to_string());
    // Printable ASCII keeps the signed path and the sent path one string; a
    // leading '/' would make an empty first path segment.
    if key_prefix.len() > 256
        || key_prefix.starts_with('/')
        || !key_prefix.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ConfigError::new(
            "objectStore.keyPrefix",
            "must be at most 256 printable ASCII characters without spaces, not starting with '/'",
        ));
    }
    // Path segments that stores and proxies normalise (`a//b`, `.`, `..`)
    // would make the key used differ from the key signed.
    let segments = key_prefix.strip_suffix('/').unwrap_or(&key_prefix);
    if !segments.is_empty()
        && segments
            .split('/')
            .any(|seg| matches!(seg, "" | "." | ".."))
    {
        return Err(ConfigError::new(
            "objectStore.keyPrefix",
            "must not contain empty, `.` or `..` path segments",
        ));
    }
    let timeout_ms = raw.timeout_ms.unwrap_or(DEFAULT_OBJECT_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > MAX_OBJECT_TIMEOUT_MS {
        return Err(ConfigError::new(
            "objectStore.timeoutMs",
            format!("must be between 1 and {MAX_OBJECT_TIMEOUT_MS}"),
        ));
    }
    let credentials = compile_credentials(raw.credentials, env)?;
    Ok(ObjectStore {
        cluster: raw.cluster,
        authority,
        bucket: raw.bucket,
        region: raw.region,
        key_prefix,
        timeout: Duration::from_millis(timeout_ms),
        credentials,
    })
}

/// Credentials are never echoed in an error: errors name the field or the
/// environment variable, not its value.
fn compile_credentials(
    raw: RawCredentials,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<crate::sigv4::Credentials, ConfigError> {
    const AT: &str = "objectStore.credentials";
    let given = raw.access_key_id.is_some()
        || raw.secret_access_key.is_some()
        || raw.session_token.is_some();
    let from_env = raw.from_environment == Some(true);
    let (access_key_id, secret_access_key, session_token) = match raw.from_environment {
        Some(true) if given => {
            return Err(ConfigError::new(
                AT,
                "set either fromEnvironment or accessKeyId/secretAccessKey, not both",
            ))
        }
        Some(true) => (
            super::from_vm_env(env, AT, ENV_ACCESS_KEY_ID)?,
            super::from_vm_env(env, AT, ENV_SECRET_ACCESS_KEY)?,
            env(ENV_SESSION_TOKEN).filter(|v| !v.is_empty()),
        ),
        _ => match (raw.access_key_id, raw.secret_access_key) {
            (Some(id), Some(secret)) => (id, secret, raw.session_token),
            (None, _) => {
                return Err(ConfigError::new(
                    format!("{AT}.accessKeyId"),
                    "is required (or set fromEnvironment: true)",
                ))
            }
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{AT}.secretAccessKey"),
                    "is required with accessKeyId",
                ))
            }
        },
    };
    // They go into request headers (the key id in Authorization, the token
    // as itself): printable ASCII only.
    let header_safe =
        |v: &str| !v.is_empty() && v.len() <= 4096 && v.bytes().all(|b| b.is_ascii_graphic());
    let unsafe_value = |field: &str, var: &str| {
        if from_env {
            ConfigError::new(
                format!("{AT}.fromEnvironment"),
                format!("{var} must be printable ASCII without spaces"),
            )
        } else {
            ConfigError::new(
                format!("{AT}.{field}"),
                "must be printable ASCII without spaces",
            )
        }
    };
    if !header_safe(&access_key_id) {
        return Err(unsafe_value("accessKeyId", ENV_ACCESS_KEY_ID));
    }
    if !header_safe(&secret_access_key) {
        return Err(unsafe_value("secretAccessKey", ENV_SECRET_ACCESS_KEY));
    }
    if session_token.as_deref().is_some_and(|t| !header_safe(t)) {
        return Err(unsafe_value("sessionToken", ENV_SESSION_TOKEN));
    }
    Ok(crate::sigv4::Credentials {
        access_key_id,
        secret_access_key,
        session_token,
    })
}
