//! The Lua scripts, embedded at build time, with the SHA-1 that EVALSHA names
//! them by.

use std::sync::LazyLock;

use sha1::{Digest, Sha1};

use crate::codec::hex;
use crate::webdis::Command;

#[derive(Debug)]
pub struct Script {
    pub source: String,
    pub sha1: String,
}

impl Script {
    fn new(source: String) -> Script {
        let sha1 = hex(&Sha1::digest(source.as_bytes()));
        Script { source, sha1 }
    }

    /// The Webdis request that runs this script on `keys` and `argv`:
    /// EVALSHA by its SHA-1, or (`eval`) EVAL with its source. With
    /// `packed`, the arguments are one binary string (a batch, see
    /// lua/batch.lua) sent as a PUT's body, byte for byte; EVAL stays a POST
    /// (a composed source is tens of kB, too long for a path). The one
    /// encoder of a script call, the filter's and `redis-guard wire`'s.
    pub fn call(&self, eval: bool, keys: &[Vec<u8>], argv: Args) -> Command {
        let nkeys = keys.len().to_string();
        let mut args: Vec<&[u8]> = Vec::with_capacity(3 + keys.len());
        let command = if eval {
            args.push(self.source.as_bytes());
            "EVAL"
        } else {
            args.push(self.sha1.as_bytes());
            "EVALSHA"
        };
        args.push(nkeys.as_bytes());
        args.extend(keys.iter().map(Vec::as_slice));
        match argv {
            Args::Strings(argv) => {
                args.extend(argv.iter().map(Vec::as_slice));
                Command::post(command, &args)
            }
            Args::Packed(packed) if eval => {
                args.push(packed);
                Command::post(command, &args)
            }
            Args::Packed(packed) => Command::put(command, &args, packed.to_vec()),
        }
    }
}

/// A script call's ARGV: strings, or one packed binary string.
#[derive(Debug, Clone, Copy)]
pub enum Args<'a> {
    Strings(&'a [Vec<u8>]),
    Packed(&'a [u8]),
}

/// The clock preamble of the decision scripts (lua/ratelimit.lua,
/// lua/batch.lua, lua/settle.lua): Redis TIME in ms, read once.
#[cfg(feature = "test-clock")]
const TIME_PREAMBLE: &str = "local t = redis.call('TIME')\n\
     local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// Test builds only (feature `test-clock`, tests/e2e_quota.rs): the
/// decision scripts read `now` from the key `rg:test:clock` instead of TIME
/// (as tests/support/script.rs's with_test_clock does for the Lua tests), so
/// an Envoy test crosses a month's end or a daylight-saving change at will.
/// Under the tests' key prefix, which their Redis ACL confines the filter
/// to; a key outside KEYS: a standalone Redis only. The release build reads
/// TIME.
#[cfg(feature = "test-clock")]
fn clocked(source: String) -> String {
    source.replacen(
        TIME_PREAMBLE,
        "local now = tonumber(redis.call('GET', 'rg:test:clock'))\n",
        1,
    )
}

#[cfg(not(feature = "test-clock"))]
fn clocked(source: String) -> String {
    source
}

/// Where lua/ratelimit.lua takes the algorithm files.
const ALGORITHMS: &str = "-- @@ALGORITHMS@@\n";

/// Inserts `parts` at the marker line of `main` (at its end if it has none;
/// a unit test keeps the marker in place).
fn compose<P: AsRef<str>>(main: &str, parts: &[P]) -> String {
    let (head, tail) = main.split_once(ALGORITHMS).unwrap_or((main, ""));
    let len = parts.iter().map(|p| p.as_ref().len()).sum::<usize>();
    let mut out = String::with_capacity(main.len() + len);
    out.push_str(head);
    for part in parts {
        out.push_str(part.as_ref());
    }
    out.push_str(tail);
    out
}

/// What a decision runs, in the order it is joined in after the clock: the
/// call's nonce (lua/nonce.lua), the reply helper, every limit kind and the
/// idempotency record (each defined only once a call needs it), the key
/// helpers and the driver.
/// RATELIMIT, BATCH and INSPECT share them, so a batch decides as single
/// calls do.
static DECISION_PARTS: LazyLock<[String; 5]> = LazyLock::new(|| {
    [
        include_str!("../lua/nonce.lua").to_string(),
        include_str!("../lua/wire.lua").to_string(),
        on_demand(&[
            ("tb", &[include_str!("../lua/token_bucket.lua")]),
            ("sw", &[include_str!("../lua/sliding_window.lua")]),
            ("gcra", &[include_str!("../lua/gcra.lua")]),
            ("fw", &[include_str!("../lua/fixed_window.lua")]),
            ("swc", &[include_str!("../lua/sliding_window_counter.lua")]),
            ("cq", &[include_str!("../lua/quota.lua")]),
            (
                "cc",
                &[
                    include_str!("../lua/concurrency_slots.lua"),
                    include_str!("../lua/concurrency.lua"),
                ],
            ),
            ("idem", &[include_str!("../lua/idempotency.lua")]),
        ]),
        include_str!("../lua/keys.lua").to_string(),
        include_str!("../lua/decide.lua").to_string(),
    ]
});

/// The kinds' files inside one function, `need(kind)`, that defines a
/// kind's functions the first time a call meets the kind (lua/decide.lua
/// calls it as it checks each request). A script's functions are made anew
/// on every call (Redis keeps the compiled script, not its closures), and
/// making every kind's cost a lone request more Redis CPU than its token
/// bucket's commands (BENCHMARKS.md): a call now makes only the functions of
/// the kinds its requests use. Each file's top-level functions become locals
/// of the script, declared before `need` (so the driver names them as
/// before) and assigned when their kind is needed; everything else in the
/// file stays local to its kind's branch.
fn on_demand(kinds: &[(&str, &[&str])]) -> String {
    const DEF: &str = "\nlocal function ";
    // A file may open with a definition: every definition follows a newline.
    let functions = |files: &[&str]| -> Vec<String> {
        files
            .iter()
            .flat_map(|f| {
                format!("\n{f}")
                    .split(DEF)
                    .skip(1)
                    .filter_map(|rest| rest.split('(').next().map(str::to_string))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let names: Vec<String> = kinds.iter().flat_map(|(_, f)| functions(f)).collect();
    let mut out = format!(
        "-- The kinds, defined on demand (src/scripts.rs, on_demand).\nlocal {}\n\
         local function need(kind)\n",
        names.join(", ")
    );
    let mut branch = "if";
    for (kind, files) in kinds {
        // A kind without functions defines nothing a caller could use.
        let Some(first) = functions(files).into_iter().next() else {
            continue;
        };
        // Its first function, once defined, says the kind is: the kind's
        // per-call state must not be made again mid-call.
        out.push_str(&format!(
            "{branch} kind == '{kind}' then\nif {first} then return end\n"
        ));
        branch = "elseif";
        for file in *files {
            out.push_str(&format!("\n{file}").replace(DEF, "\nfunction "));
        }
    }
    out.push_str("end\nend\n");
    out
}

/// A request's idempotency lock and every rate limit in one atomic call: the
/// driver and clock from lua/ratelimit.lua, with every limit kind and the
/// idempotency record joined in.
pub static RATELIMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(clocked(compose(
        include_str!("../lua/ratelimit.lua"),
        &DECISION_PARTS[..],
    )))
});

/// Requests of one worker decided in one call, one after another, each as
/// its own RATELIMIT call would be (lua/batch.lua around the same parts).
pub static BATCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(clocked(compose(
        include_str!("../lua/batch.lua"),
        &DECISION_PARTS[..],
    )))
});

/// One request admitted against a token bucket plus a batch of tokens leased
/// to the calling Envoy (lua/lease.lua with the token bucket and the key
/// helpers, for a stored plan, joined in).
pub static LEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/lease.lua"),
        &[
            include_str!("../lua/nonce.lua"),
            include_str!("../lua/wire.lua"),
            include_str!("../lua/token_bucket.lua"),
            include_str!("../lua/keys.lua"),
        ],
    ))
});

/// Leased tokens an Envoy gives back, every bucket of one hash tag in one
/// call (lua/lease_return.lua with the token bucket and the key helpers
/// joined in).
pub static LEASE_RETURN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/lease_return.lua"),
        &[
            include_str!("../lua/wire.lua"),
            include_str!("../lua/token_bucket.lua"),
            include_str!("../lua/keys.lua"),
        ],
    ))
});

/// Renews the leases of a running request's concurrency slots
/// (lua/concurrency_renew.lua with lua/concurrency_slots.lua joined in).
pub static CC_RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/concurrency_renew.lua"),
        &[include_str!("../lua/concurrency_slots.lua")],
    ))
});

/// Gives back the concurrency slots of requests whose streams ended
/// (lua/concurrency_release.lua with lua/concurrency_slots.lua joined in).
pub static CC_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/concurrency_release.lua"),
        &[include_str!("../lua/concurrency_slots.lua")],
    ))
});

/// Settles usage-based costs after the response (lua/settle.lua with the
/// kinds that settle joined in).
pub static SETTLE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(clocked(compose(
        include_str!("../lua/settle.lua"),
        &[
            include_str!("../lua/wire.lua"),
            include_str!("../lua/token_bucket.lua"),
            include_str!("../lua/fixed_window.lua"),
            include_str!("../lua/sliding_window_counter.lua"),
            include_str!("../lua/quota.lua"),
            include_str!("../lua/keys.lua"),
        ],
    )))
});

/// IN_PROGRESS -> COMPLETED for the lock's owner.
pub static IDEM_COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/idempotency_complete.lua").to_string()));

/// IN_PROGRESS -> released for the lock's owner.
pub static IDEM_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/idempotency_release.lua").to_string()));

/// One limit's state read for an operator (lua/inspect.lua, flagged
/// no-writes, with the decision parts joined in): what a request of a given
/// cost would get now, and nothing spent.
pub static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/inspect.lua"),
        &DECISION_PARTS[..],
    ))
});

/// An operator's forget of one idempotency record, refused while it is in
/// progress unless forced.
pub static IDEM_FORGET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/idempotency_forget.lua").to_string()));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_is_forty_hex_digits_of_the_source() {
        assert_eq!(RATELIMIT.sha1.len(), 40);
        assert!(RATELIMIT.source.starts_with("--[[ redis-guard"));
        // The well-known SHA-1 of the empty script, as Redis computes it.
        assert_eq!(
            Script::new(String::new()).sha1,
            "da39a3ee5e6b4b0d3255bfef95601890afd80709"
        );
    }

    #[test]
    fn every_limit_kind_is_joined_into_ratelimit_and_batch_before_the_driver() {
        for (name, script, main) in [
            (
                "RATELIMIT",
                &*RATELIMIT,
                include_str!("../lua/ratelimit.lua"),
            ),
            ("BATCH", &*BATCH, include_str!("../lua/batch.lua")),
        ] {
            assert!(main.contains(ALGORITHMS), "{name}: marker");
            let src = &script.source;
            let at = |needle: &str| {
                src.find(needle)
                    .unwrap_or_else(|| panic!("{name} lacks {needle}"))
            };
            let order = [
                at("redis.call('TIME')"),
                at("local function need"),
                at("kind == 'tb' then"),
                at("\nfunction tb_check("),
                at("\nfunction sw_check("),
                at("\nfunction gcra_check("),
                at("\nfunction fw_check("),
                at("\nfunction swc_check("),
                at("\nfunction cc_check("),
                at("\nfunction idem_check("),
                at("local function flush_all"),
                at("flush_all()\nreturn"),
            ];
            assert!(order.windows(2).all(|w| w[0] < w[1]), "{name}: {order:?}");
            // Each kind joined once, in its loader, and nothing left of the
            // marker.
            for f in ["gcra_check", "fw_check", "swc_check", "cc_check"] {
                assert_eq!(src.matches(&format!("function {f}(")).count(), 1, "{name}");
                assert!(!src.contains(&format!("local function {f}(")), "{name}");
            }
            assert!(!src.contains(ALGORITHMS), "{name}");
        }
    }

    #[test]
    fn every_script_returning_limit_figures_hands_large_ones_over_as_strings() {
        for script in [&*RATELIMIT, &*BATCH, &*LEASE] {
            let src = &script.source;
            let wire = src.find("local function wire").unwrap();
            assert!(wire < src.find("function tb_check(").unwrap());
            assert!(src.contains("wire(r.remaining)") || src.contains("wire(granted)"));
        }
    }

    #[test]
    fn the_inspection_is_flagged_no_writes_and_checks_every_kind_without_charging() {
        let src = &INSPECT.source;
        // Redis reads the flags from the first line only.
        assert!(src.starts_with("#!lua flags=no-writes\n"));
        for f in [
            "tb_check",
            "sw_check",
            "gcra_check",
            "fw_check",
            "swc_check",
            "cc_check",
        ] {
            assert!(src.contains(&format!("r = {f}(")), "{f}");
        }
        assert!(src.find("local function report_uncharged") < src.find("local function inspect"));
        assert!(!src.contains(ALGORITHMS));
    }

    #[test]
    fn kinds_on_demand_declare_their_files_functions_and_define_them_when_needed() {
        let a = "--[[ a ]]\nlocal seen = {}\nlocal function a_check(k)\n  local function inner() end\nend\n";
        let b = "\nlocal function b_first()\nend\nlocal function b_check(k) return b_first() end\n";
        let c = "local function c_check()\nend\n";
        let none = "local x = 1\n";
        assert_eq!(
            on_demand(&[("a", &[a]), ("z", &[none]), ("bc", &[none, b, c])]),
            "-- The kinds, defined on demand (src/scripts.rs, on_demand).\n\
             local a_check, b_first, b_check, c_check\nlocal function need(kind)\n\
             if kind == 'a' then\nif a_check then return end\n\
             \n--[[ a ]]\nlocal seen = {}\nfunction a_check(k)\n  local function inner() end\nend\n\
             elseif kind == 'bc' then\nif b_first then return end\n\
             \nlocal x = 1\n\
             \n\nfunction b_first()\nend\nfunction b_check(k) return b_first() end\n\
             \nfunction c_check()\nend\nend\nend\n"
        );
        // Every kind and the record are defined on demand.
        let kinds = &DECISION_PARTS[2];
        assert_eq!(
            kinds.matches("\nlocal function ").count(),
            1,
            "need() alone"
        );
        for kind in ["tb", "sw", "gcra", "fw", "swc", "cc", "idem"] {
            assert!(
                kinds.contains(&format!("if kind == '{kind}' then\n")),
                "{kind}"
            );
        }
    }

    #[test]
    fn the_lease_script_takes_only_the_token_bucket() {
        let src = &LEASE.source;
        assert!(src.contains("local function tb_check"));
        assert!(src.contains("tb_flush()"));
        assert!(!src.contains("gcra_check") && !src.contains("flush_all"));
        let back = &LEASE_RETURN.source;
        assert!(back.find("local function wire") < back.find("local function tb_check"));
        assert!(back.find("local function tb_check") < back.find("local OLDEST"));
        assert!(!back.contains(ALGORITHMS) && !back.contains("gcra_check"));
    }

    #[test]
    fn the_slot_scripts_take_the_concurrency_part_after_their_clock() {
        for script in [&*CC_RENEW, &*CC_RELEASE] {
            let src = &script.source;
            let part = src.find("local function cc_members").unwrap();
            assert!(part < src.find("for i = 1, #KEYS do").unwrap());
            assert!(!src.contains(ALGORITHMS) && !src.contains("tb_check"));
            assert!(!src.contains("cc_check"), "only the slots part");
            assert!(src.contains("cc_slot_bad("));
        }
        let renew = &CC_RENEW.source;
        assert!(renew.find("redis.call('TIME')") < renew.find("local function cc_members"));
    }

    #[test]
    fn both_algorithms_are_joined_in_before_the_driver() {
        assert!(include_str!("../lua/ratelimit.lua").contains(ALGORITHMS));
        let src = &RATELIMIT.source;
        let tb = src.find("\nfunction tb_check(").unwrap();
        let sw = src.find("\nfunction sw_check(").unwrap();
        let idem = src.find("\nfunction idem_check(").unwrap();
        let driver = src.find("local results = {}").unwrap();
        let clock = src.find("redis.call('TIME')").unwrap();
        assert!(clock < tb && tb < sw && sw < idem && idem < driver);
        assert!(!src.contains(ALGORITHMS));
    }
}
