//! The filter's JSON configuration for the end-to-end tests. The Redis part
//! is the same in every test but for its timeout (and, in a few, the circuit
//! breaker); the rest (limits, idempotency, object store, hash tag) is what a
//! test is about, and stays JSON in the test.

/// `redis.credentials` as every test's Webdis admits them (JSON).
pub fn credentials() -> String {
    serde_json::json!({
        "username": super::WEBDIS_USERNAME,
        "password": super::WEBDIS_PASSWORD,
    })
    .to_string()
}

/// A filter configuration being built: see [`filter_config`].
#[derive(Debug, Clone)]
pub struct FilterConfig {
    timeout_ms: u64,
    breaker: Option<(u32, u64)>,
    batch: Option<String>,
    failure_mode: String,
    fields: Vec<(String, String)>,
}

/// The configuration with Redis reached through the `webdis` cluster (the
/// name envoy/envoy.yaml gives it), `timeout_ms` per call and
/// `"failureMode":"deny"`; add the rest, then [`FilterConfig::build`].
pub fn filter_config(timeout_ms: u64) -> FilterConfig {
    FilterConfig {
        timeout_ms,
        breaker: None,
        batch: None,
        failure_mode: "deny".to_string(),
        fields: Vec::new(),
    }
}

impl FilterConfig {
    /// The top-level `failureMode` ("deny", "allow" or "local").
    pub fn failure_mode(mut self, mode: &str) -> FilterConfig {
        self.failure_mode = mode.to_string();
        self
    }

    /// `redis.circuitBreaker`: open after `failures`, probe after `cool_down_ms`.
    pub fn circuit_breaker(mut self, failures: u32, cool_down_ms: u64) -> FilterConfig {
        self.breaker = Some((failures, cool_down_ms));
        self
    }

    /// `redis.batch`, a JSON object (`{"enabled": false}` for single calls).
    pub fn batch(mut self, json: &str) -> FilterConfig {
        if let Err(e) = serde_json::from_str::<serde_json::Value>(json) {
            panic!("`redis.batch` is not JSON ({e}): {json}");
        }
        self.batch = Some(json.to_string());
        self
    }

    /// `hashTag`: the parts every key's Redis Cluster hash tag is made of.
    pub fn hash_tag(self, json: &str) -> FilterConfig {
        self.field("hashTag", json)
    }

    /// `limits`: the rate limits, a JSON array.
    pub fn limits(self, json: &str) -> FilterConfig {
        self.field("limits", json)
    }

    /// `idempotency`: the idempotency rules, a JSON array.
    pub fn idempotency(self, json: &str) -> FilterConfig {
        self.field("idempotency", json)
    }

    /// `objectStore`: where large idempotent responses go, a JSON object.
    pub fn object_store(self, json: &str) -> FilterConfig {
        self.field("objectStore", json)
    }

    /// Every field of a recipe in envoy/recipes/ (the README's *Recipes*
    /// quote them): the configuration a user merges beside `redis`.
    pub fn recipe(self, name: &str) -> FilterConfig {
        let path = super::root()
            .join("envoy/recipes")
            .join(format!("{name}.json"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        let fields = doc.as_object().unwrap().clone();
        fields.into_iter().fold(self, |cfg, (name, value)| {
            cfg.field(&name, &value.to_string())
        })
    }

    /// Any other top-level field, written after the ones before it. The
    /// value must be JSON on its own, so a typo fails here, naming the field,
    /// rather than as a refused configuration in Envoy's log.
    pub fn field(mut self, name: &str, json: &str) -> FilterConfig {
        if let Err(e) = serde_json::from_str::<serde_json::Value>(json) {
            panic!("`{name}` is not JSON ({e}): {json}");
        }
        self.fields.push((name.to_string(), json.to_string()));
        self
    }

    /// The configuration's JSON text.
    pub fn build(&self) -> String {
        let breaker = match self.breaker {
            Some((failures, cool_down_ms)) => format!(
                r#","circuitBreaker":{{"failures":{failures},"coolDownMs":{cool_down_ms}}}"#
            ),
            None => String::new(),
        };
        let batch = match &self.batch {
            Some(json) => format!(r#","batch":{json}"#),
            None => String::new(),
        };
        let mut json = format!(
            r#"{{"redis":{{"cluster":"webdis","timeoutMs":{}{breaker}{batch},"credentials":{}}},"failureMode":{}"#,
            self.timeout_ms,
            credentials(),
            serde_json::to_string(&self.failure_mode).unwrap()
        );
        for (name, value) in &self.fields {
            json.push_str(&format!(
                ",{}:{value}",
                serde_json::to_string(name).unwrap()
            ));
        }
        json.push('}');
        json
    }
}
