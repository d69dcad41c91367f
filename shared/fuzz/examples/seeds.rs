//! Writes seed inputs into `<corpus>/frame_decoder` and
//! `<corpus>/handshake_envelope`: a valid encoding of every frame type, a
//! concatenated stream, valid envelopes, and hellos with control bytes that
//! reach the accepted path. Usage: `cargo run --example seeds -- <corpus>`.

use std::path::{Path, PathBuf};

use oab_wire::encode;
use oab_wire_fuzz::{control, seed_envelopes, seed_frames};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::write(dir.join(name), bytes)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let corpus = PathBuf::from(std::env::args().nth(1).ok_or("usage: seeds <corpus dir>")?);
    let frames_dir = corpus.join("frame_decoder");
    let auth_dir = corpus.join("handshake_envelope");
    std::fs::create_dir_all(&frames_dir)?;
    std::fs::create_dir_all(&auth_dir)?;

    let mut stream = Vec::new();
    let mut n = 0;
    for frame in seed_frames() {
        let bytes = encode(&frame)?;
        let name = format!("seed-{}", frame.frame_type().name());
        write(&frames_dir, &name, &bytes)?;
        stream.extend_from_slice(&bytes);
        n += 1;
        if let oab_wire::Frame::Hello(_) | oab_wire::Frame::Challenge(_) = frame {
            let everything = control::SPLICE_NONCE
                | control::SPLICE_RELAY
                | control::SPLICE_TIME
                | control::OBSERVE_TLS
                | control::REQUIRE_TLS
                | control::RESIGN;
            for ctl in [0, everything, everything & !control::RESIGN] {
                write(
                    &auth_dir,
                    &format!("{name}-{ctl:02x}"),
                    &[&[ctl][..], &bytes].concat(),
                )?;
                n += 1;
            }
        }
    }
    write(&frames_dir, "seed-stream", &stream)?;
    n += 1;
    for (i, env) in seed_envelopes().into_iter().enumerate() {
        write(
            &auth_dir,
            &format!("seed-envelope-{i}"),
            &[&[0u8][..], &env].concat(),
        )?;
        n += 1;
    }
    println!("wrote {n} seeds under {}", corpus.display());
    Ok(())
}
