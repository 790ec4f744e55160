//! The on-disk form of one lock's record: two checksummed slots written in turn, so a
//! writer killed in the middle of a write leaves the previous state intact.
//!
//! ```text
//! slot 0 at offset 0, slot 1 at offset SLOT; each: "LHS1" seq:u64le len:u32le crc32:u32le json
//! ```
//! A state with sequence number `seq` lives in slot `seq % 2`; the valid slot with the
//! higher sequence number is current.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

const MAGIC: &[u8; 4] = b"LHS1";
const HEADER: usize = 20;
/// Offset of the second slot; files are sparse, so this costs no disk.
pub(crate) const SLOT: u64 = 1 << 20;
/// Largest record that fits a slot.
pub(crate) const MAX_RECORD: usize = SLOT as usize - HEADER;
const FIRST_READ: usize = 4096;

/// What a read found.
pub(crate) enum Found {
    /// A new, empty file.
    Empty,
    /// The current state and its sequence number.
    State { seq: u64, json: Vec<u8> },
    /// Bytes, but no slot that passes its checksum.
    Corrupt(String),
}

fn read_slot(file: &File, offset: u64) -> io::Result<Option<(u64, Vec<u8>)>> {
    let mut buf = vec![0u8; FIRST_READ];
    let n = read_at_most(file, &mut buf, offset)?;
    if n < HEADER || &buf[..4] != MAGIC {
        return Ok(None);
    }
    let seq = u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(buf[12..16].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes"));
    if len > MAX_RECORD {
        return Ok(None);
    }
    if HEADER + len > n {
        buf.resize(HEADER + len, 0);
        let more = read_at_most(file, &mut buf[n..], offset + n as u64)?;
        if n + more < HEADER + len {
            return Ok(None);
        }
    }
    buf.truncate(HEADER + len);
    let json = buf.split_off(HEADER);
    Ok((crc32fast::hash(&json) == crc).then_some((seq, json)))
}

fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

pub(crate) fn read(file: &File) -> io::Result<Found> {
    let a = read_slot(file, 0)?;
    let b = read_slot(file, SLOT)?;
    Ok(match (a, b) {
        (Some(a), Some(b)) => {
            let (seq, json) = if a.0 > b.0 { a } else { b };
            Found::State { seq, json }
        }
        (Some((seq, json)), None) | (None, Some((seq, json))) => Found::State { seq, json },
        (None, None) if file.metadata()?.len() == 0 => Found::Empty,
        (None, None) => Found::Corrupt(
            "neither of its two copies passes its checksum (it was not written by leasehold, or the disk lost data)".into(),
        ),
    })
}

/// Writes state `seq` into its slot with one positioned write.
pub(crate) fn write(file: &File, seq: u64, json: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + json.len());
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
    buf.extend_from_slice(&crc32fast::hash(json).to_le_bytes());
    buf.extend_from_slice(json);
    file.write_all_at(&buf, (seq % 2) * SLOT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_write_leaves_the_previous_state() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.path().join("x"))
            .unwrap();
        assert!(matches!(read(&file).unwrap(), Found::Empty));
        write(&file, 1, b"{\"a\":1}").unwrap();
        write(&file, 2, b"{\"a\":2}").unwrap();
        // Tear the write of state 3 (slot 1): header written, payload garbage.
        write(&file, 3, b"{\"a\":3}").unwrap();
        file.write_all_at(b"XX", SLOT + HEADER as u64).unwrap();
        match read(&file).unwrap() {
            Found::State { seq, json } => {
                assert_eq!(seq, 2);
                assert_eq!(json, b"{\"a\":2}");
            }
            _ => panic!("expected state 2"),
        }
        file.write_all_at(b"garbage!", 0).unwrap();
        assert!(matches!(read(&file).unwrap(), Found::Corrupt(_)));
    }
}
