//! Batches without the host: the one call that decides several requests of
//! one worker (lua/batch.lua), and each member's part of its reply.

use crate::ratelimit::ScriptArgs;
use crate::webdis::Reply;

/// KEYS and ARGV of lua/batch.lua for `members` (each a request's own KEYS
/// and ARGV for lua/ratelimit.lua), decided in this order. The members'
/// arguments are moved, not copied: a batch is built on the request path.
pub fn batch_args(members: Vec<ScriptArgs>) -> ScriptArgs {
    let mut keys = Vec::with_capacity(members.iter().map(|(k, _)| k.len()).sum());
    let mut argv = Vec::with_capacity(
        1 + 2 * members.len() + members.iter().map(|(_, a)| a.len()).sum::<usize>(),
    );
    argv.push(members.len().to_string().into_bytes());
    for (k, a) in &members {
        argv.push(k.len().to_string().into_bytes());
        argv.push(a.len().to_string().into_bytes());
    }
    for (k, a) in members {
        keys.extend(k);
        argv.extend(a);
    }
    (keys, argv)
}

/// Splits lua/batch.lua's flat reply into each member's own reply, in the
/// form lua/ratelimit.lua gives it; `m` members were sent.
pub fn split_reply(reply: Reply, m: usize) -> Result<Vec<Reply>, String> {
    let Reply::Array(Some(items)) = reply else {
        return Err(format!("expected an array, got {reply:?}"));
    };
    let mut items = items.into_iter();
    let count = items.next().as_ref().and_then(Reply::as_int);
    if count != i64::try_from(m).ok() {
        return Err(format!("a batch of {m} answered for {count:?}"));
    }
    let mut out = Vec::with_capacity(m);
    for j in 0..m {
        let len = items
            .next()
            .as_ref()
            .and_then(Reply::as_int)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("member {j}: no length"))?;
        let part: Vec<Reply> = items.by_ref().take(len).collect();
        if part.len() != len {
            return Err(format!(
                "member {j}: {len} values announced, {} left",
                part.len()
            ));
        }
        out.push(Reply::Array(Some(part)));
    }
    if items.next().is_some() {
        return Err("values after the last member".to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &[&str]) -> Vec<Vec<u8>> {
        v.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    #[test]
    fn members_are_laid_out_sizes_first_then_in_order() {
        let a = (
            bytes(&["k1"]),
            bytes(&["1", "tb", "5", "1", "1000", "1", "1"]),
        );
        let b = (bytes(&["k1", "k2"]), bytes(&["2", "x"]));
        let (keys, argv) = batch_args(vec![a, b]);
        assert_eq!(keys, bytes(&["k1", "k1", "k2"]));
        assert_eq!(
            argv,
            bytes(&["2", "1", "7", "2", "2", "1", "tb", "5", "1", "1000", "1", "1", "2", "x"])
        );
    }

    fn int(n: i64) -> Reply {
        Reply::Int(n)
    }

    #[test]
    fn a_reply_splits_into_each_members_own_reply() {
        let flat = Reply::Array(Some(vec![
            int(2),
            int(5),
            int(1),
            int(1),
            int(4),
            int(0),
            int(1000),
            int(2),
            int(2),
            int(150),
        ]));
        let parts = split_reply(flat, 2).unwrap();
        assert_eq!(
            parts,
            [
                Reply::Array(Some(vec![int(1), int(1), int(4), int(0), int(1000)])),
                Reply::Array(Some(vec![int(2), int(150)])),
            ]
        );
    }

    #[test]
    fn a_reply_that_does_not_add_up_is_an_error_not_a_verdict() {
        let short = Reply::Array(Some(vec![int(2), int(1), int(1)]));
        assert!(split_reply(short, 2).is_err(), "second member missing");
        let long = Reply::Array(Some(vec![int(1), int(1), int(1), int(9)]));
        assert!(split_reply(long, 1).is_err(), "values left over");
        let count = Reply::Array(Some(vec![int(3), int(1), int(1)]));
        assert!(split_reply(count, 1).is_err(), "another batch's count");
        assert!(split_reply(Reply::Error("ERR x".into()), 1).is_err());
    }
}
