//! A large stored response goes to the object store first; the record that
//! points at it follows once it is there, so a record never points at an
//! object that was not stored.

use crate::codec;
use crate::config::Config;
use crate::filter::owner::{Calls, Owner};
use crate::filter::{Action, CalloutReply, Counter, Host};
use crate::offload::{self, check_put, ObjectRef};

use super::record::{Lock, Record};

/// An upload's answer is empty or a short XML error; more is not read.
pub const UPLOAD_REPLY_LIMIT: usize = 64 << 10;

impl Record {
    /// Sends the body to the object store; the response's end waits.
    pub(super) fn upload<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) -> Action {
        let (Some(keyed), Some(store)) = (&self.keyed, &config.object_store) else {
            return Action::Continue;
        };
        let rule = &config.idempotency[keyed.rule];
        let sha256 = codec::sha256_hex(&body);
        // Read after hashing (a large body takes a while): the record is
        // written within the upload's and then the write's deadline from now.
        let now = host.now();
        let expires = offload::expires_at(
            now,
            rule.record_ttl_ms,
            store.timeout + config.redis.timeout,
        );
        let object = ObjectRef {
            key: offload::object_key(
                store,
                &rule.name,
                &keyed.args.key,
                &keyed.args.owner,
                expires,
            ),
            sha256,
            len: body.len(),
        };
        let request = offload::put_headers(store, &object, now);
        match host.dispatch_object(store, &request, Some(&body), store.timeout) {
            Ok(token) => {
                // `body` is dropped here: Envoy has its own copy for the upload.
                calls.expect(token, Owner::Upload);
                self.lock = Lock::Uploading {
                    status,
                    headers,
                    object,
                };
                Action::Pause
            }
            Err(e) => {
                log::warn!("redis-guard: cannot upload the response to the object store: {e}");
                host.count(Counter::IdemOffloadFailed);
                self.release_held_end(host, config, calls)
            }
        }
    }

    pub fn on_upload_reply<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        reply: &CalloutReply,
    ) {
        let Lock::Uploading {
            status,
            headers,
            object,
        } = std::mem::replace(&mut self.lock, Lock::Held)
        else {
            return;
        };
        let next = match check_put(reply.status) {
            Ok(()) => self.store_record(
                host,
                config,
                calls,
                status,
                &headers,
                Vec::new(),
                Some(object),
            ),
            Err(e) => {
                // Nothing to point at: the key is freed so a retry runs again,
                // as after any failed store; the response still goes out.
                log::warn!("redis-guard: response not offloaded ({e}); key released");
                host.count(Counter::IdemOffloadFailed);
                self.release_held_end(host, config, calls)
            }
        };
        if next == Action::Continue {
            host.resume_response();
        }
    }
}
