//! Byte layout of frames, and the decoder contract.
//!
//! ```text
//! offset 0  u8   protocol version (1)
//!        1  u8   frame type
//!        2  u16  header length H (big-endian)
//!        4  u32  payload length P (big-endian)
//!        8  H bytes of type-specific header fields
//!      8+H  P bytes of payload (opaque to the relay)
//! ```
//!
//! Header fields are big-endian integers, fixed-size byte arrays, and strings
//! with a length prefix (`str8`: u8 length, `str16`: u16 length). A header
//! must be consumed exactly: trailing bytes are malformed. (`Open`'s
//! `trace`, added in protocol version 2, is its one optional last field:
//! present or absent, nothing else after it.)
//!
//! **Decoder contract** (tested below and fuzzed in `shared/fuzz`):
//! - fewer bytes than a whole frame is not an error: [`check`] answers
//!   [`Progress::Need`] with how many more bytes are needed;
//! - version, type and both lengths are checked from the 8-byte prefix alone,
//!   so a frame one byte over a limit is refused before its body is buffered;
//! - a malformed frame yields a typed [`FrameError`] that maps to a close code;
//! - a clean end of input between frames differs from an end mid-frame
//!   ([`FrameDecoder::decode_eof`]);
//! - no input makes the decoder panic or allocate more than the limits allow.
//!
//! Never: allocates or buffers for a frame before its 8-byte prefix passed the
//! version, type and length checks, and never copies a payload: a decoded
//! frame's payload and ids are slices of the received message.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::code::CloseCode;
use crate::digest::Digest;
use crate::frame::*;
use crate::ids::{
    DelegationKey, IdError, InstanceId, KeyId, PeerId, RelayId, RequestId, SessionId,
};
use crate::limits::{Limits, PREFIX_LEN};
use crate::trace::TraceId;

/// Every way a frame can be wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The prefix names a protocol version this side does not speak.
    #[error("unsupported protocol version {got} (this side speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion {
        /// The version byte received.
        got: u8,
    },
    /// The type byte is not a known frame type.
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    /// The header is longer than allowed.
    #[error("header of {len} bytes is over the limit of {max}")]
    HeaderTooLarge {
        /// Declared header length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The payload is longer than allowed.
    #[error("payload of {len} bytes is over the limit of {max}")]
    PayloadTooLarge {
        /// Declared payload length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A whole message holds more or fewer bytes than its prefix declares.
    #[error("message is {actual} bytes but its prefix declares {declared}")]
    LengthMismatch {
        /// Bytes the prefix declares.
        declared: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The header ended inside a field.
    #[error("header truncated in field {0}")]
    Truncated(&'static str),
    /// A header field holds an invalid value.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The header has bytes after its last field.
    #[error("{0} trailing header bytes")]
    TrailingBytes(usize),
    /// A frame type that carries no payload arrived with one.
    #[error("{0} frames carry no payload")]
    UnexpectedPayload(&'static str),
    /// The input ended in the middle of a frame.
    #[error("input ended inside a frame ({buffered} bytes buffered)")]
    EofMidFrame {
        /// Bytes of the incomplete frame.
        buffered: usize,
    },
    /// A frame to encode does not fit the format (a field over its length prefix).
    #[error("cannot encode: {0}")]
    Unencodable(&'static str),
}

impl FrameError {
    /// The close code a receiver sends when it drops a connection over this error.
    pub fn close_code(&self) -> CloseCode {
        match self {
            FrameError::UnsupportedVersion { .. } => CloseCode::UnsupportedVersion,
            FrameError::HeaderTooLarge { .. } | FrameError::PayloadTooLarge { .. } => {
                CloseCode::FrameTooLarge
            }
            _ => CloseCode::MalformedFrame,
        }
    }
}

impl From<IdError> for FrameError {
    fn from(e: IdError) -> Self {
        FrameError::Invalid {
            field: e.kind,
            reason: e.reason.to_string(),
        }
    }
}

/// What [`check`] found at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// At least this many more bytes are needed before a frame is complete.
    Need(usize),
    /// A whole frame of this many bytes is at the front of the buffer.
    Ready(usize),
}

/// The frame's declared shape, read from its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    /// The frame type.
    pub frame_type: FrameType,
    /// Header length.
    pub header_len: usize,
    /// Payload length.
    pub payload_len: usize,
}

impl Prefix {
    /// Whole frame length.
    pub fn frame_len(&self) -> usize {
        PREFIX_LEN + self.header_len + self.payload_len
    }
}

/// Reads and checks a prefix against the limits. `buf` must hold at least 8 bytes.
fn read_prefix(buf: &[u8], limits: &Limits) -> Result<Prefix, FrameError> {
    let Some(&[version, ty, h0, h1, p0, p1, p2, p3]) = buf.first_chunk::<PREFIX_LEN>() else {
        return Err(FrameError::Truncated("prefix"));
    };
    if version != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion { got: version });
    }
    let frame_type = FrameType::from_u8(ty).ok_or(FrameError::UnknownType(ty))?;
    let header_len = usize::from(u16::from_be_bytes([h0, h1]));
    let payload_len = u32::from_be_bytes([p0, p1, p2, p3]) as usize;
    if header_len > usize::from(limits.max_header) {
        return Err(FrameError::HeaderTooLarge {
            len: header_len,
            max: usize::from(limits.max_header),
        });
    }
    if payload_len > limits.max_payload as usize {
        return Err(FrameError::PayloadTooLarge {
            len: payload_len,
            max: limits.max_payload as usize,
        });
    }
    Ok(Prefix {
        frame_type,
        header_len,
        payload_len,
    })
}

/// Looks at the front of `buf`: is a whole frame there, and is it within limits?
///
/// Never allocates; refuses oversized frames from the prefix alone.
pub fn check(buf: &[u8], limits: &Limits) -> Result<Progress, FrameError> {
    if buf.len() < PREFIX_LEN {
        return Ok(Progress::Need(PREFIX_LEN - buf.len()));
    }
    let prefix = read_prefix(buf, limits)?;
    let total = prefix.frame_len();
    if buf.len() < total {
        Ok(Progress::Need(total - buf.len()))
    } else {
        Ok(Progress::Ready(total))
    }
}

/// Reads only the prefix of a complete message (cheap routing pre-check).
pub fn peek_prefix(msg: &[u8], limits: &Limits) -> Result<Prefix, FrameError> {
    if msg.len() < PREFIX_LEN {
        return Err(FrameError::LengthMismatch {
            declared: PREFIX_LEN,
            actual: msg.len(),
        });
    }
    read_prefix(msg, limits)
}

/// Decodes one whole message (one WebSocket binary message) as one frame.
///
/// Ids (peer, request, key and relay ids, at most 128 bytes each) are
/// copied, so an id kept after the frame never keeps `msg` alive; other
/// string fields and the payload are slices of `msg`.
pub fn decode_message(msg: Bytes, limits: &Limits) -> Result<Frame, FrameError> {
    let prefix = peek_prefix(&msg, limits)?;
    if prefix.frame_len() != msg.len() {
        return Err(FrameError::LengthMismatch {
            declared: prefix.frame_len(),
            actual: msg.len(),
        });
    }
    let header_end = PREFIX_LEN + prefix.header_len;
    let header = msg.slice(PREFIX_LEN..header_end);
    let payload = msg.slice(header_end..);
    decode_parts(prefix.frame_type, header, payload)
}

/// A stream decoder over a byte buffer (for byte-stream transports and tests).
#[derive(Debug, Clone, Default)]
pub struct FrameDecoder {
    limits: Limits,
}

impl FrameDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: Limits) -> Self {
        FrameDecoder { limits }
    }

    /// Takes one frame off the front of `buf` if a whole one is there.
    /// `Ok(None)` means "read more bytes"; the buffer is left untouched.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match check(buf, &self.limits)? {
            Progress::Need(_) => Ok(None),
            Progress::Ready(len) => {
                let msg = buf.split_to(len).freeze();
                decode_message(msg, &self.limits).map(Some)
            }
        }
    }

    /// Like [`decode`](Self::decode) at end of input: a clean end between
    /// frames is `Ok(None)`; leftover bytes are [`FrameError::EofMidFrame`].
    pub fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match self.decode(buf)? {
            Some(frame) => Ok(Some(frame)),
            None if buf.is_empty() => Ok(None),
            None => Err(FrameError::EofMidFrame {
                buffered: buf.len(),
            }),
        }
    }
}

/// Reads header fields front to back.
struct Reader {
    buf: Bytes,
}

impl Reader {
    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<Bytes, FrameError> {
        if self.buf.len() < n {
            return Err(FrameError::Truncated(field));
        }
        Ok(self.buf.split_to(n))
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, FrameError> {
        if self.buf.is_empty() {
            return Err(FrameError::Truncated(field));
        }
        Ok(self.buf.get_u8())
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        if self.buf.len() < 2 {
            return Err(FrameError::Truncated(field));
        }
        Ok(self.buf.get_u16())
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        if self.buf.len() < 4 {
            return Err(FrameError::Truncated(field));
        }
        Ok(self.buf.get_u32())
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, FrameError> {
        if self.buf.len() < 8 {
            return Err(FrameError::Truncated(field));
        }
        Ok(self.buf.get_u64())
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], FrameError> {
        let b = self.take(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(&b);
        Ok(out)
    }

    fn str8(&mut self, field: &'static str) -> Result<Bytes, FrameError> {
        let n = usize::from(self.u8(field)?);
        self.take(n, field)
    }

    fn str16(&mut self, field: &'static str) -> Result<Bytes, FrameError> {
        let n = usize::from(self.u16(field)?);
        self.take(n, field)
    }

    fn utf8(&mut self, b: &Bytes, field: &'static str) -> Result<String, FrameError> {
        String::from_utf8(b.to_vec()).map_err(|_| FrameError::Invalid {
            field,
            reason: "not UTF-8".into(),
        })
    }

    fn peer(&mut self, field: &'static str) -> Result<PeerId, FrameError> {
        Ok(PeerId::from_bytes(self.str8(field)?)?)
    }

    fn key(&mut self) -> Result<DelegationKey, FrameError> {
        let caller = self.peer("caller")?;
        let request_id = RequestId::from_bytes(self.str8("request_id")?)?;
        Ok(DelegationKey { caller, request_id })
    }

    fn direction(&mut self) -> Result<Direction, FrameError> {
        let b = self.u8("direction")?;
        Direction::from_u8(b).ok_or_else(|| invalid("direction", format!("{b} is not 0 or 1")))
    }

    fn seq(&mut self, field: &'static str) -> Result<u64, FrameError> {
        let s = self.u64(field)?;
        if s == 0 {
            return Err(invalid(field, "sequences start at 1".into()));
        }
        Ok(s)
    }

    fn outcome(&mut self) -> Result<Option<Outcome>, FrameError> {
        match self.u8("outcome")? {
            0 => Ok(None),
            b => Outcome::from_u8(b)
                .map(Some)
                .ok_or_else(|| invalid("outcome", format!("{b} is not a known outcome"))),
        }
    }

    fn finish(self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::TrailingBytes(self.buf.len()))
        }
    }
}

fn invalid(field: &'static str, reason: String) -> FrameError {
    FrameError::Invalid { field, reason }
}

fn no_payload(ty: FrameType, payload: &Bytes) -> Result<(), FrameError> {
    if payload.is_empty() {
        Ok(())
    } else {
        Err(FrameError::UnexpectedPayload(ty.name()))
    }
}

fn decode_parts(ty: FrameType, header: Bytes, payload: Bytes) -> Result<Frame, FrameError> {
    let mut r = Reader { buf: header };
    let frame = match ty {
        FrameType::Challenge => {
            no_payload(ty, &payload)?;
            Frame::Challenge(Challenge {
                nonce: r.array("nonce")?,
                relay_id: RelayId::from_bytes(r.str8("relay_id")?)?,
                server_time_ms: r.u64("server_time")?,
                min_version: r.u8("min_version")?,
                max_version: r.u8("max_version")?,
            })
        }
        FrameType::Hello => {
            no_payload(ty, &payload)?;
            let version = r.u8("version")?;
            let peer = r.peer("peer")?;
            let key_id = KeyId::from_bytes(r.str8("key_id")?)?;
            let instance = InstanceId(r.array("instance")?);
            let time_ms = r.u64("time")?;
            let relay_id = RelayId::from_bytes(r.str8("relay_id")?)?;
            let nonce = r.array("nonce")?;
            let b = r.u8("binding")?;
            let binding =
                Binding::from_u8(b).ok_or_else(|| invalid("binding", format!("{b} is unknown")))?;
            Frame::Hello(Hello {
                version,
                peer,
                key_id,
                instance,
                time_ms,
                relay_id,
                nonce,
                binding,
                signature: r.array("signature")?,
            })
        }
        FrameType::Welcome => Frame::Welcome(Welcome {
            session: SessionId(r.array("session")?),
            epoch: r.u64("epoch")?,
            heartbeat_ms: r.u32("heartbeat")?,
            max_header: r.u16("max_header")?,
            max_payload: r.u32("max_payload")?,
            max_in_flight: r.u32("max_in_flight")?,
            payload,
        }),
        FrameType::Open => {
            let key = r.key()?;
            let target = r.peer("target")?;
            let deadline_ms = r.u64("deadline")?;
            let depth = r.u8("depth")?;
            let digest = Digest(r.array("digest")?);
            let raw = r.str16("ceiling")?;
            let ceiling = r.utf8(&raw, "ceiling")?;
            // Version 2's one optional field: a trace id, or nothing.
            let trace = if r.is_empty() {
                None
            } else {
                let bytes = r.array("trace")?;
                Some(
                    TraceId::from_bytes(bytes)
                        .ok_or_else(|| invalid("trace", "all zeros".into()))?,
                )
            };
            Frame::Open(Open {
                key,
                target,
                deadline_ms,
                depth,
                digest,
                ceiling,
                trace,
                payload,
            })
        }
        FrameType::Data => {
            let key = r.key()?;
            let direction = r.direction()?;
            let seq = r.seq("seq")?;
            let terminal = r.outcome()?;
            let flags = r.u8("flags")?;
            if terminal.is_some() && direction == Direction::Down {
                return Err(invalid(
                    "outcome",
                    "only the up log carries a terminal".into(),
                ));
            }
            Frame::Data(Data {
                key,
                direction,
                seq,
                terminal,
                flags,
                payload,
            })
        }
        FrameType::Cancel => Frame::Cancel(Cancel {
            key: r.key()?,
            seq: r.seq("seq")?,
            flags: r.u8("flags")?,
            payload,
        }),
        FrameType::Ack => {
            no_payload(ty, &payload)?;
            Frame::Ack(Ack {
                key: r.key()?,
                direction: r.direction()?,
                seq: r.seq("seq")?,
            })
        }
        FrameType::Resume => {
            no_payload(ty, &payload)?;
            Frame::Resume(Resume {
                key: r.key()?,
                direction: r.direction()?,
                after: r.u64("after")?,
            })
        }
        FrameType::Gap => {
            no_payload(ty, &payload)?;
            let key = r.key()?;
            let direction = r.direction()?;
            let after = r.u64("after")?;
            let first_available = r.u64("first_available")?;
            let terminal = r.outcome()?;
            let b = r.u8("reason")?;
            let reason = GapReason::from_u8(b)
                .ok_or_else(|| invalid("reason", format!("{b} is unknown")))?;
            Frame::Gap(Gap {
                key,
                direction,
                after,
                first_available,
                terminal,
                reason,
            })
        }
        FrameType::Error => {
            no_payload(ty, &payload)?;
            let code = r.u16("code")?;
            let key = match r.u8("has_key")? {
                0 => None,
                1 => Some(r.key()?),
                b => return Err(invalid("has_key", format!("{b} is not 0 or 1"))),
            };
            let direction = r.direction()?;
            let seq = r.u64("seq")?;
            let raw = r.str8("message")?;
            let message = r.utf8(&raw, "message")?;
            Frame::Error(ErrorFrame {
                code,
                key,
                direction,
                seq,
                message,
            })
        }
        FrameType::Ping | FrameType::Pong => {
            no_payload(ty, &payload)?;
            let p = Ping {
                token: r.u64("token")?,
            };
            if ty == FrameType::Ping {
                Frame::Ping(p)
            } else {
                Frame::Pong(p)
            }
        }
        FrameType::Drain => {
            no_payload(ty, &payload)?;
            Frame::Drain(Drain {
                reconnect_after_ms: r.u32("reconnect_after")?,
            })
        }
        FrameType::PeersQuery => {
            no_payload(ty, &payload)?;
            Frame::PeersQuery
        }
        FrameType::Peers => Frame::Peers(payload),
        FrameType::Publish => Frame::Publish(payload),
    };
    r.finish()?;
    Ok(frame)
}

/// Writes header fields.
struct Writer<'a> {
    buf: &'a mut BytesMut,
}

impl Writer<'_> {
    fn str8(&mut self, s: &[u8], what: &'static str) -> Result<(), FrameError> {
        let n = u8::try_from(s.len()).map_err(|_| FrameError::Unencodable(what))?;
        self.buf.put_u8(n);
        self.buf.put_slice(s);
        Ok(())
    }

    fn str16(&mut self, s: &[u8], what: &'static str) -> Result<(), FrameError> {
        let n = u16::try_from(s.len()).map_err(|_| FrameError::Unencodable(what))?;
        self.buf.put_u16(n);
        self.buf.put_slice(s);
        Ok(())
    }

    fn key(&mut self, k: &DelegationKey) -> Result<(), FrameError> {
        self.str8(k.caller.as_bytes(), "caller")?;
        self.str8(k.request_id.as_bytes(), "request_id")
    }
}

/// Cuts a message to at most 255 bytes on a character boundary.
fn clip_message(s: &str) -> &str {
    if s.len() <= 255 {
        return s;
    }
    let mut end = 255;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or_default()
}

fn write_header(frame: &Frame, buf: &mut BytesMut) -> Result<(), FrameError> {
    let mut w = Writer { buf };
    match frame {
        Frame::Challenge(c) => {
            w.buf.put_slice(&c.nonce);
            w.str8(c.relay_id.as_bytes(), "relay_id")?;
            w.buf.put_u64(c.server_time_ms);
            w.buf.put_u8(c.min_version);
            w.buf.put_u8(c.max_version);
        }
        Frame::Hello(h) => {
            w.buf.put_u8(h.version);
            w.str8(h.peer.as_bytes(), "peer")?;
            w.str8(h.key_id.as_bytes(), "key_id")?;
            w.buf.put_slice(&h.instance.0);
            w.buf.put_u64(h.time_ms);
            w.str8(h.relay_id.as_bytes(), "relay_id")?;
            w.buf.put_slice(&h.nonce);
            w.buf.put_u8(h.binding as u8);
            w.buf.put_slice(&h.signature);
        }
        Frame::Welcome(x) => {
            w.buf.put_slice(&x.session.0);
            w.buf.put_u64(x.epoch);
            w.buf.put_u32(x.heartbeat_ms);
            w.buf.put_u16(x.max_header);
            w.buf.put_u32(x.max_payload);
            w.buf.put_u32(x.max_in_flight);
        }
        Frame::Open(o) => {
            w.key(&o.key)?;
            w.str8(o.target.as_bytes(), "target")?;
            w.buf.put_u64(o.deadline_ms);
            w.buf.put_u8(o.depth);
            w.buf.put_slice(&o.digest.0);
            w.str16(o.ceiling.as_bytes(), "ceiling")?;
            if let Some(t) = o.trace {
                w.buf.put_slice(&t.to_bytes());
            }
        }
        Frame::Data(d) => {
            w.key(&d.key)?;
            w.buf.put_u8(d.direction as u8);
            w.buf.put_u64(d.seq);
            w.buf.put_u8(d.terminal.map_or(0, |o| o as u8));
            w.buf.put_u8(d.flags);
        }
        Frame::Cancel(c) => {
            w.key(&c.key)?;
            w.buf.put_u64(c.seq);
            w.buf.put_u8(c.flags);
        }
        Frame::Ack(a) => {
            w.key(&a.key)?;
            w.buf.put_u8(a.direction as u8);
            w.buf.put_u64(a.seq);
        }
        Frame::Resume(r) => {
            w.key(&r.key)?;
            w.buf.put_u8(r.direction as u8);
            w.buf.put_u64(r.after);
        }
        Frame::Gap(g) => {
            w.key(&g.key)?;
            w.buf.put_u8(g.direction as u8);
            w.buf.put_u64(g.after);
            w.buf.put_u64(g.first_available);
            w.buf.put_u8(g.terminal.map_or(0, |o| o as u8));
            w.buf.put_u8(g.reason as u8);
        }
        Frame::Error(e) => {
            w.buf.put_u16(e.code);
            match &e.key {
                None => w.buf.put_u8(0),
                Some(k) => {
                    w.buf.put_u8(1);
                    w.key(k)?;
                }
            }
            w.buf.put_u8(e.direction as u8);
            w.buf.put_u64(e.seq);
            w.str8(clip_message(&e.message).as_bytes(), "message")?;
        }
        Frame::Ping(p) | Frame::Pong(p) => w.buf.put_u64(p.token),
        Frame::Drain(d) => w.buf.put_u32(d.reconnect_after_ms),
        Frame::PeersQuery | Frame::Peers(_) | Frame::Publish(_) => {}
    }
    Ok(())
}

/// Encodes a frame into one message.
///
/// Fails only if a field exceeds its length prefix or the header exceeds
/// 65,535 bytes; enforcing the receiver's [`Limits`] is [`encode_checked`]'s job.
pub fn encode(frame: &Frame) -> Result<Bytes, FrameError> {
    let payload = frame.payload();
    let mut buf = BytesMut::with_capacity(PREFIX_LEN + 96 + payload.len());
    buf.put_u8(PROTOCOL_VERSION);
    buf.put_u8(frame.frame_type() as u8);
    buf.put_u16(0);
    buf.put_u32(0);
    write_header(frame, &mut buf)?;
    let header_len = u16::try_from(buf.len() - PREFIX_LEN)
        .map_err(|_| FrameError::Unencodable("header over 65535 bytes"))?;
    let payload_len =
        u32::try_from(payload.len()).map_err(|_| FrameError::Unencodable("payload over 4 GiB"))?;
    buf.put_slice(payload);
    if let Some(h) = buf.get_mut(2..4) {
        h.copy_from_slice(&header_len.to_be_bytes());
    }
    if let Some(p) = buf.get_mut(4..8) {
        p.copy_from_slice(&payload_len.to_be_bytes());
    }
    Ok(buf.freeze())
}

/// Encodes a frame and checks it against the receiver's limits, so a sender
/// learns locally what the receiver would refuse.
pub fn encode_checked(frame: &Frame, limits: &Limits) -> Result<Bytes, FrameError> {
    let bytes = encode(frame)?;
    peek_prefix(&bytes, limits)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::ErrorCode;

    fn key() -> DelegationKey {
        DelegationKey::new(
            PeerId::new("acme/caller").unwrap(),
            RequestId::new("req-1").unwrap(),
        )
    }

    fn data(payload: &'static [u8]) -> Frame {
        Frame::Data(Data {
            key: key(),
            direction: Direction::Up,
            seq: 7,
            terminal: None,
            flags: 0,
            payload: Bytes::from_static(payload),
        })
    }

    #[test]
    fn data_round_trips_without_copying_payload() {
        let bytes = encode(&data(b"hello")).unwrap();
        let frame = decode_message(bytes.clone(), &Limits::default()).unwrap();
        assert_eq!(frame, data(b"hello"));
        let Frame::Data(d) = frame else {
            unreachable!()
        };
        // The payload is a view into the received message.
        let msg_range = bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len();
        assert!(msg_range.contains(&(d.payload.as_ptr() as usize)));
    }

    #[test]
    fn incomplete_input_asks_for_more() {
        let bytes = encode(&data(b"hello")).unwrap();
        let limits = Limits::default();
        for cut in 0..bytes.len() {
            match check(&bytes[..cut], &limits).unwrap() {
                Progress::Need(n) => assert!(n > 0 && cut + n <= bytes.len()),
                Progress::Ready(_) => panic!("ready at {cut}"),
            }
        }
        assert_eq!(
            check(&bytes, &limits).unwrap(),
            Progress::Ready(bytes.len())
        );
    }

    #[test]
    fn one_byte_over_a_limit_is_refused_from_the_prefix() {
        let limits = Limits::default();
        // Only the prefix is present: the refusal happens before any body is buffered.
        let mut prefix = vec![PROTOCOL_VERSION, FrameType::Data as u8];
        prefix.extend_from_slice(&(limits.max_header + 1).to_be_bytes());
        prefix.extend_from_slice(&0u32.to_be_bytes());
        assert!(matches!(
            check(&prefix, &limits),
            Err(FrameError::HeaderTooLarge {
                len: 1025,
                max: 1024
            })
        ));
        let mut prefix = vec![PROTOCOL_VERSION, FrameType::Data as u8, 0, 40];
        prefix.extend_from_slice(&(limits.max_payload + 1).to_be_bytes());
        let err = check(&prefix, &limits).unwrap_err();
        assert_eq!(err.close_code(), CloseCode::FrameTooLarge);
        // Exactly at the limit is fine.
        let mut prefix = vec![PROTOCOL_VERSION, FrameType::Data as u8, 0, 40];
        prefix.extend_from_slice(&limits.max_payload.to_be_bytes());
        assert!(matches!(check(&prefix, &limits), Ok(Progress::Need(_))));
    }

    #[test]
    fn bad_prefixes_are_typed() {
        let limits = Limits::default();
        assert_eq!(
            check(&[9, 5, 0, 0, 0, 0, 0, 0], &limits),
            Err(FrameError::UnsupportedVersion { got: 9 })
        );
        assert_eq!(
            check(&[1, 99, 0, 0, 0, 0, 0, 0], &limits),
            Err(FrameError::UnknownType(99))
        );
        assert_eq!(
            FrameError::UnsupportedVersion { got: 9 }.close_code(),
            CloseCode::UnsupportedVersion
        );
    }

    #[test]
    fn an_open_carries_its_trace_id_or_none_and_nothing_else() {
        let limits = Limits::default();
        let payload = Bytes::from_static(b"{}");
        let mut open = Open {
            key: DelegationKey::new(
                PeerId::new("acme/a").unwrap(),
                RequestId::new("r-1").unwrap(),
            ),
            target: PeerId::new("acme/b").unwrap(),
            deadline_ms: 1,
            depth: 1,
            digest: Digest::of(&payload),
            ceiling: String::new(),
            trace: None,
            payload,
        };
        let without = encode(&Frame::Open(open.clone())).unwrap();
        assert_eq!(
            decode_message(without.clone(), &limits).unwrap(),
            Frame::Open(open.clone())
        );
        open.trace = TraceId::from_bytes([0xab; 16]);
        let with = encode(&Frame::Open(open.clone())).unwrap();
        assert_eq!(with.len(), without.len() + 16, "the trace is 16 bytes");
        assert_eq!(decode_message(with, &limits).unwrap(), Frame::Open(open));
        // Rewrites the header to end with `tail` instead of the trace.
        let with_tail = |tail: &[u8]| {
            let mut m = without.to_vec();
            let h = u16::from_be_bytes([m[2], m[3]]) + u16::try_from(tail.len()).unwrap();
            m[2..4].copy_from_slice(&h.to_be_bytes());
            let at = without.len() - 2; // before the payload `{}`
            m.splice(at..at, tail.iter().copied());
            Bytes::from(m)
        };
        assert_eq!(
            decode_message(with_tail(&[0xab; 5]), &limits),
            Err(FrameError::Truncated("trace"))
        );
        assert!(matches!(
            decode_message(with_tail(&[0; 16]), &limits),
            Err(FrameError::Invalid { field: "trace", .. })
        ));
        assert_eq!(
            decode_message(with_tail(&[0xab; 17]), &limits),
            Err(FrameError::TrailingBytes(1))
        );
    }

    #[test]
    fn truncated_and_trailing_headers_are_typed() {
        let good = encode(&data(b"")).unwrap();
        let limits = Limits::default();
        // Declare a header one byte shorter: the last field is truncated.
        let mut short = good.to_vec();
        let h = u16::from_be_bytes([short[2], short[3]]) - 1;
        short[2..4].copy_from_slice(&h.to_be_bytes());
        short.pop();
        assert_eq!(
            decode_message(Bytes::from(short), &limits),
            Err(FrameError::Truncated("flags"))
        );
        // One extra header byte is trailing garbage.
        let mut long = good.to_vec();
        let h = u16::from_be_bytes([long[2], long[3]]) + 1;
        long[2..4].copy_from_slice(&h.to_be_bytes());
        long.push(0);
        assert_eq!(
            decode_message(Bytes::from(long), &limits),
            Err(FrameError::TrailingBytes(1))
        );
        // A message longer than its prefix says.
        let mut extra = good.to_vec();
        extra.push(0);
        assert!(matches!(
            decode_message(Bytes::from(extra), &limits),
            Err(FrameError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn invalid_fields_are_typed() {
        let limits = Limits::default();
        let mut zero_seq = encode(&data(b"")).unwrap().to_vec();
        // seq is after prefix(8) + caller(1+11) + request(1+5) + direction(1).
        let at = 8 + 12 + 6 + 1;
        zero_seq[at..at + 8].copy_from_slice(&0u64.to_be_bytes());
        let err = decode_message(Bytes::from(zero_seq), &limits).unwrap_err();
        assert!(
            matches!(err, FrameError::Invalid { field: "seq", .. }),
            "{err}"
        );

        let mut bad_peer = encode(&data(b"")).unwrap().to_vec();
        bad_peer[9] = b'A';
        let err = decode_message(Bytes::from(bad_peer), &limits).unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::Invalid {
                    field: "peer id",
                    ..
                }
            ),
            "{err}"
        );

        let down_terminal = Frame::Data(Data {
            key: key(),
            direction: Direction::Down,
            seq: 1,
            terminal: Some(Outcome::Completed),
            flags: 0,
            payload: Bytes::new(),
        });
        let err = decode_message(encode(&down_terminal).unwrap(), &limits).unwrap_err();
        assert!(matches!(
            err,
            FrameError::Invalid {
                field: "outcome",
                ..
            }
        ));

        let ping_with_payload = {
            let mut v = encode(&Frame::Ping(Ping { token: 1 })).unwrap().to_vec();
            v[7] = 1;
            v.push(b'x');
            Bytes::from(v)
        };
        assert_eq!(
            decode_message(ping_with_payload, &limits),
            Err(FrameError::UnexpectedPayload("ping"))
        );
    }

    #[test]
    fn stream_decoder_distinguishes_clean_and_dirty_eof() {
        let mut dec = FrameDecoder::default();
        let one = encode(&Frame::Ping(Ping { token: 3 })).unwrap();
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&one);
        buf.extend_from_slice(&one[..5]);
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(Frame::Ping(Ping { token: 3 }))
        );
        assert_eq!(dec.decode(&mut buf).unwrap(), None);
        assert_eq!(buf.len(), 5, "incomplete frame stays buffered");
        assert_eq!(
            dec.decode_eof(&mut buf),
            Err(FrameError::EofMidFrame { buffered: 5 })
        );
        let mut empty = BytesMut::new();
        assert_eq!(dec.decode_eof(&mut empty), Ok(None));
    }

    #[test]
    fn error_messages_are_clipped_on_char_boundaries() {
        let long = "é".repeat(200);
        let frame = Frame::error(ErrorCode::Internal, long);
        let decoded = decode_message(encode(&frame).unwrap(), &Limits::default()).unwrap();
        let Frame::Error(e) = decoded else {
            unreachable!()
        };
        assert!(e.message.len() <= 255);
        assert!(e.message.chars().all(|c| c == 'é'));
    }

    #[test]
    fn encode_checked_applies_receiver_limits() {
        let limits = Limits {
            max_header: 512,
            max_payload: 4,
        };
        assert!(matches!(
            encode_checked(&data(b"12345"), &limits),
            Err(FrameError::PayloadTooLarge { len: 5, max: 4 })
        ));
        assert!(encode_checked(&data(b"1234"), &limits).is_ok());
    }
}
