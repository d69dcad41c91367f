//! Reading what Redis answers: meta hashes, script replies and fleet
//! replies become [`DelegationMeta`], [`AppendOutcome`], [`ReadOutcome`] and
//! [`Liveness`]; a server error in a reply becomes
//! [`StoreError::Unavailable`], anything this version does not understand
//! [`StoreError::Corrupt`] with a shortened excerpt of the reply. Pure
//! functions over `redis::Value`: it never sends a command, and never panics
//! on what a server returns.

use std::collections::HashMap;

use bytes::Bytes;
use oab_wire::{DelegationKey, Digest, InstanceId, Outcome, PeerId};
use redis::{RedisError, ServerErrorKind, Value};

use super::keys::{LEFT_SUFFIX, meta_field};
use crate::store::{
    AppendOutcome, AppendRequest, Budget, DelegationMeta, Liveness, ReadOutcome, StoreError,
};

pub(super) fn unavailable(context: &str, e: &RedisError) -> StoreError {
    StoreError::unavailable(format!("redis {context}"), e)
}

pub(super) fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

/// A reply for an error message, cut short (it may hold a whole frame).
pub(super) fn excerpt(v: &Value) -> String {
    const MAX: usize = 96;
    let mut s = format!("{v:?}");
    if s.len() > MAX {
        let mut cut = MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

pub(super) fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript))
}

/// A reply's bytes, for string-like replies.
pub(super) fn bytes_of(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        Value::Okay => Some(b"OK"),
        _ => None,
    }
}

pub(super) fn str_of(v: &Value) -> Option<&str> {
    std::str::from_utf8(bytes_of(v)?).ok()
}

pub(super) fn u64_of(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => str_of(v)?.parse().ok(),
    }
}

/// A script's reply as an array; server errors become `Unavailable`.
pub(super) fn reply_array(v: Value, context: &str) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(items) => Ok(items),
        Value::ServerError(e) => Err(StoreError::unavailable(format!("redis {context}"), e)),
        other => Err(corrupt(format!(
            "{context}: expected an array, got {}",
            excerpt(&other)
        ))),
    }
}

/// A hash reply (`HGETALL`: RESP2 flat array or RESP3 map) as a field map.
pub(super) fn hash_fields(v: Value) -> Result<HashMap<String, Value>, StoreError> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Map(pairs) => pairs,
        Value::Array(flat) => pairs_of(flat),
        Value::Nil => Vec::new(),
        Value::ServerError(e) => return Err(StoreError::unavailable("redis", e)),
        other => return Err(corrupt(format!("expected a hash, got {}", excerpt(&other)))),
    };
    let mut out = HashMap::with_capacity(pairs.len());
    for (k, v) in pairs {
        let k = str_of(&k).ok_or_else(|| corrupt("meta field name is not text"))?;
        out.insert(k.to_owned(), v);
    }
    Ok(out)
}

/// `[k1, v1, k2, v2, ...]` as pairs (a trailing odd item is dropped).
pub(super) fn pairs_of(flat: Vec<Value>) -> Vec<(Value, Value)> {
    let mut out = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    out
}

/// Builds a [`DelegationMeta`] from the meta hash fields.
pub(super) fn parse_meta(
    key: &DelegationKey,
    fields: &HashMap<String, Value>,
) -> Result<DelegationMeta, StoreError> {
    let text = |name: &str| -> Result<&str, StoreError> {
        fields
            .get(name)
            .and_then(str_of)
            .ok_or_else(|| corrupt(format!("delegation {key}: meta field {name} missing")))
    };
    let number = |name: &str| -> Result<u64, StoreError> {
        text(name)?
            .parse()
            .map_err(|_| corrupt(format!("delegation {key}: meta field {name} not a number")))
    };
    let bad = |name: &str| corrupt(format!("delegation {key}: meta field {name} malformed"));
    let terminal = match text(meta_field::TERMINAL)? {
        "" => None,
        name => Some(parse_outcome(name).ok_or_else(|| bad(meta_field::TERMINAL))?),
    };
    let terminal_ms = match text(meta_field::TERMINAL_MS)? {
        "" => None,
        ms => Some(ms.parse().map_err(|_| bad(meta_field::TERMINAL_MS))?),
    };
    let accepted_by = match text(meta_field::ACCEPTED_BY)? {
        "" => None,
        hex => Some(parse_instance(hex).ok_or_else(|| bad(meta_field::ACCEPTED_BY))?),
    };
    Ok(DelegationMeta {
        key: key.clone(),
        callee: PeerId::new(text(meta_field::CALLEE)?).map_err(|_| bad(meta_field::CALLEE))?,
        deadline_ms: number(meta_field::DEADLINE)?,
        // `sha256:<hex>`, or the bare hex of a compacted delegation.
        digest: {
            let dg = text(meta_field::DIGEST)?;
            Digest::parse(dg)
                .or_else(|| Digest::parse(&format!("sha256:{dg}")))
                .ok_or_else(|| bad(meta_field::DIGEST))?
        },
        created_ms: number(meta_field::CREATED)?,
        down_tail: number(meta_field::DOWN_TAIL)?,
        up_tail: number(meta_field::UP_TAIL)?,
        down_sender_tail: number(meta_field::DOWN_SENDER_TAIL)?,
        up_sender_tail: number(meta_field::UP_SENDER_TAIL)?,
        terminal,
        terminal_ms,
        accepted_by,
        // Optional: written only for an `Open` that carried one.
        trace: fields
            .get(meta_field::TRACE)
            .and_then(str_of)
            .and_then(oab_wire::TraceId::parse),
    })
}

/// The terminal name in a script reply: `''` means none.
pub(super) fn parse_terminal(v: Option<&Value>) -> Result<Option<Outcome>, StoreError> {
    match v.and_then(str_of) {
        Some("") => Ok(None),
        Some(name) => parse_outcome(name)
            .map(Some)
            .ok_or_else(|| corrupt(format!("unknown outcome {name:?}"))),
        None => Err(corrupt("script reply lacks the terminal")),
    }
}

/// Index work that follows an append that set a terminal.
pub(super) struct Finished {
    pub(super) key: DelegationKey,
    pub(super) deadline_ms: u64,
    pub(super) terminal_ms: u64,
    pub(super) callee: PeerId,
}

/// One `append` script call's reply, split per entry: each entry's code
/// and value, and the delegation's deadline and callee (what a terminal's
/// index entry needs). A delegation the store does not know gives every
/// entry the code `U`.
pub(super) struct GroupReply {
    pub(super) entries: Vec<EntryReply>,
    deadline: Value,
    callee: Value,
}

/// One entry's part of an `append` reply.
pub(super) enum EntryReply {
    /// A code and a value, as the script gave them.
    Pair(Value, Value),
    /// Appended, nothing trimmed because of it, no terminal: an entry of a
    /// run the script appended whole, before the run's last (`R, count`).
    Appended,
}

/// Splits an `append` script reply (`{'U'}`, or per entry a code and a
/// value, where `R, count` stands for that many entries appended with
/// nothing trimmed, followed by the deadline and the callee) for a call of
/// `entries` entries.
pub(super) fn split_append(v: Value, entries: usize) -> Result<GroupReply, StoreError> {
    let mut items = reply_array(v, "append")?;
    if items.len() == 1 && items.first().and_then(str_of) == Some("U") {
        return Ok(GroupReply {
            entries: (0..entries)
                .map(|_| EntryReply::Pair(Value::SimpleString("U".into()), Value::Nil))
                .collect(),
            deadline: Value::Nil,
            callee: Value::Nil,
        });
    }
    if items.len() < 2 || items.len() % 2 != 0 {
        return Err(corrupt(format!(
            "append: a reply of {} items for {entries} entries",
            items.len()
        )));
    }
    let callee = items.pop().unwrap_or(Value::Nil);
    let deadline = items.pop().unwrap_or(Value::Nil);
    let mut it = items.into_iter();
    let mut pairs = Vec::with_capacity(entries);
    while let (Some(code), Some(value)) = (it.next(), it.next()) {
        if str_of(&code) == Some("R") {
            let run = u64_of(&value)
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n <= entries.saturating_sub(pairs.len()))
                .ok_or_else(|| corrupt(format!("append: a run of {value:?} entries")))?;
            pairs.extend((0..run).map(|_| EntryReply::Appended));
        } else {
            pairs.push(EntryReply::Pair(code, value));
        }
    }
    if pairs.len() != entries {
        return Err(corrupt(format!(
            "append: a reply for {} entries for {entries} entries",
            pairs.len()
        )));
    }
    Ok(GroupReply {
        entries: pairs,
        deadline,
        callee,
    })
}

/// One entry of an `append` reply: the outcome, the index work if it set
/// the terminal, and the bytes its log's trim dropped because of it.
pub(super) fn parse_append(
    req: &AppendRequest,
    entry: &EntryReply,
    group: &GroupReply,
) -> Result<(AppendOutcome, Option<Finished>, u64), StoreError> {
    let (code, value) = match entry {
        EntryReply::Appended => return Ok((AppendOutcome::Appended { seq: req.seq }, None, 0)),
        EntryReply::Pair(code, value) => (code, value),
    };
    let code = str_of(code);
    let num = || -> Result<u64, StoreError> {
        u64_of(value).ok_or_else(|| corrupt(format!("append reply {code:?} lacks a number")))
    };
    let outcome = match code {
        // `I`: it set the terminal, and the script updated the indexes.
        Some("A" | "I") => {
            return Ok((AppendOutcome::Appended { seq: req.seq }, None, num()?));
        }
        Some("F") => {
            let deadline_ms = u64_of(&group.deadline)
                .ok_or_else(|| corrupt(format!("delegation {}: bad deadline", req.key)))?;
            let callee = str_of(&group.callee)
                .and_then(|s| PeerId::new(s).ok())
                .ok_or_else(|| corrupt(format!("delegation {}: bad callee", req.key)))?;
            let finished = Finished {
                key: req.key.clone(),
                deadline_ms,
                terminal_ms: req.now_ms,
                callee,
            };
            return Ok((
                AppendOutcome::Appended { seq: req.seq },
                Some(finished),
                num()?,
            ));
        }
        Some("D") => AppendOutcome::Duplicate { tail: num()? },
        Some("H") => AppendOutcome::Hole { tail: num()? },
        Some("C") => AppendOutcome::Conflict { tail: num()? },
        Some("T") => AppendOutcome::AlreadyTerminal {
            // An empty name: the slot holds a relay entry and no terminal was
            // recorded, which the memory store also reports as `unknown`.
            outcome: parse_terminal(Some(value))?.unwrap_or(Outcome::Unknown),
        },
        Some("U") => AppendOutcome::Unknown,
        Some("P") => AppendOutcome::NotParty,
        Some("B") => AppendOutcome::OverBudget {
            budget: match str_of(value) {
                Some("d") => Budget::Delegation,
                Some("p") => Budget::Peer,
                other => return Err(corrupt(format!("append: unknown budget {other:?}"))),
            },
        },
        other => return Err(corrupt(format!("append: unexpected reply {other:?}"))),
    };
    Ok((outcome, None, 0))
}

/// Parses a `read` script reply.
pub(super) fn parse_read(v: Value) -> Result<ReadOutcome, StoreError> {
    let items = reply_array(v, "read")?;
    let code = items.first().and_then(str_of);
    if code == Some("U") {
        return Ok(ReadOutcome::Unknown);
    }
    let num = |i: usize| -> Result<u64, StoreError> {
        items
            .get(i)
            .and_then(u64_of)
            .ok_or_else(|| corrupt(format!("read reply {code:?} lacks a number")))
    };
    let terminal = parse_terminal(items.get(2))?;
    match code {
        Some("L") => Ok(ReadOutcome::Lost {
            tail: num(1)?,
            terminal,
        }),
        Some("T") => Ok(ReadOutcome::Trimmed {
            first_available: num(1)?,
            terminal,
        }),
        Some("E") => {
            let tail = num(1)?;
            let mut entries = Vec::with_capacity(items.len().saturating_sub(3) / 2);
            let mut rest = items.into_iter().skip(3);
            while let (Some(id), Some(frame)) = (rest.next(), rest.next()) {
                let seq = str_of(&id)
                    .and_then(|s| s.split_once('-'))
                    .and_then(|(seq, _)| seq.parse::<u64>().ok())
                    .ok_or_else(|| corrupt(format!("read: bad stream id {}", excerpt(&id))))?;
                let Value::BulkString(frame) = frame else {
                    return Err(corrupt("read: frame is not a bulk string"));
                };
                entries.push((seq, Bytes::from(frame)));
            }
            Ok(ReadOutcome::Entries {
                entries,
                tail,
                terminal,
            })
        }
        other => Err(corrupt(format!("read: unexpected reply {other:?}"))),
    }
}

pub(super) fn parse_outcome(name: &str) -> Option<Outcome> {
    Outcome::ALL.iter().copied().find(|o| o.name() == name)
}

pub(super) fn parse_instance(hex: &str) -> Option<InstanceId> {
    let mut out = [0u8; 16];
    if hex.len() != 32 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(InstanceId(out))
}

/// The first server error among pipeline replies, as `Unavailable`.
pub(super) fn first_error(values: &[Value], context: &str) -> Result<(), StoreError> {
    match values.iter().find_map(|v| match v {
        Value::ServerError(e) => Some(e),
        _ => None,
    }) {
        Some(e) => Err(StoreError::unavailable(format!("redis {context}"), e)),
        None => Ok(()),
    }
}

/// The liveness a renewal returned: live node names, and the incarnation
/// members (`<node>|<incarnation>`, or with `|left` for a departure).
/// A live node without an incarnation member (an instance that does not
/// record one) is live with incarnation `""`.
pub(super) fn liveness(v: &Value) -> Result<Liveness, StoreError> {
    let corrupt = || StoreError::Corrupt(format!("renew node: unexpected reply {v:?}"));
    let Value::Array(parts) = v else {
        return Err(corrupt());
    };
    let (Some(Value::Array(names)), Some(Value::Array(members))) = (parts.first(), parts.get(1))
    else {
        return Err(corrupt());
    };
    let mut out = Liveness::default();
    let mut incarnations = std::collections::HashMap::new();
    // Ascending by lease end: a later renewal of the same name wins.
    for m in members.iter().filter_map(reply_text) {
        if let Some(gone) = m.strip_suffix(LEFT_SUFFIX) {
            if let Some((node, inc)) = gone.split_once('|') {
                out.left.push((node.to_owned(), inc.to_owned()));
            }
        } else if let Some((node, inc)) = m.split_once('|') {
            incarnations.insert(node.to_owned(), inc.to_owned());
        }
    }
    for name in names.iter().filter_map(reply_text) {
        let inc = incarnations.remove(&name).unwrap_or_default();
        out.live.push((name, inc));
    }
    Ok(out)
}

/// A fleet reply's text, owned; an integer reply as its decimal digits.
pub(super) fn reply_text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// A fleet reply's number: an integer reply, or text holding one.
pub(super) fn reply_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => reply_text(other)?.parse().ok(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn instance_hex_round_trips() {
        let i = InstanceId::random();
        assert_eq!(parse_instance(&i.to_hex()), Some(i));
        assert_eq!(parse_instance("zz"), None);
    }
}
