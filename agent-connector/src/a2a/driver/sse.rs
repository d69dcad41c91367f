//! Server-sent events framing for the driver's streams (both bindings send
//! their stream elements as SSE `data:`).

use bytes::{Bytes, BytesMut};

/// SSE framing: splits a byte stream into events (`event:` name, joined
/// `data:` lines).
#[derive(Default)]
pub(crate) struct SseParser {
    buf: BytesMut,
}

pub(crate) struct SseEvent {
    pub(crate) name: String,
    pub(crate) data: String,
}

impl SseParser {
    /// Largest event accepted (the server is local, but bounds are bounds).
    const MAX_EVENT: usize = 16 << 20;

    pub(crate) fn push(&mut self, chunk: &Bytes) -> Result<Vec<SseEvent>, String> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            let text = &self.buf[..];
            let end = find_blank_line(text);
            let Some((end, sep)) = end else {
                if self.buf.len() > Self::MAX_EVENT {
                    return Err("an SSE event is larger than 16 MiB".into());
                }
                return Ok(out);
            };
            let raw = self.buf.split_to(end + sep);
            let block = String::from_utf8_lossy(&raw[..end]);
            let mut name = String::from("message");
            let mut data: Vec<&str> = Vec::new();
            for line in block.lines() {
                if line.starts_with(':') {
                    continue;
                }
                let (k, v) = line.split_once(':').unwrap_or((line, ""));
                let v = v.strip_prefix(' ').unwrap_or(v);
                match k {
                    "event" => name = v.to_string(),
                    "data" => data.push(v),
                    _ => {}
                }
            }
            if !data.is_empty() {
                out.push(SseEvent {
                    name,
                    data: data.join("\n"),
                });
            }
        }
    }
}

fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if b[i] == b'\r' && b.get(i + 1..i + 4) == Some(b"\n\r\n") {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn sse_framing() {
        let mut p = SseParser::default();
        let evs = p
            .push(&Bytes::from_static(
                b": keep-alive\n\ndata: {\"a\":1}\n\nid: 3\ndata: x",
            ))
            .unwrap();
        assert_eq!(evs.len(), 1);
        assert_eq!(evs[0].data, "{\"a\":1}");
        let evs = p
            .push(&Bytes::from_static(
                b"\ndata: y\r\n\r\nevent: error\ndata: z\n\n",
            ))
            .unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].data, "x\ny");
        assert_eq!(evs[1].name, "error");
    }
}
