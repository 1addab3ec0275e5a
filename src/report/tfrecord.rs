//! TFRecord framing, the container of TensorBoard event files.
//!
//! Each record is `u64 length (LE) | masked crc32c(length) | payload |
//! masked crc32c(payload)`, as TensorFlow's `core/lib/io/record_writer.cc`
//! writes it. The CRC is CRC-32C (Castagnoli), masked so that a CRC of data
//! that itself holds CRCs does not degenerate (`core/lib/hash/crc32c.h`).

/// CRC-32C lookup table for the reflected polynomial 0x82F63B78, built at
/// compile time.
const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC-32C of `bytes`, one table lookup per byte (event records are small,
/// so the slicing-by-8 variants would not pay for their size).
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc = TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The masked CRC that TFRecord stores: rotate right by 15, add a constant.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    let crc = crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xA282_EAD8)
}

/// Frames `payload` as one TFRecord.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out
}

/// Splits a buffer of TFRecords into payloads, checking both CRCs of each;
/// the error says which record (0-based) is bad and why.
#[cfg(test)]
pub(crate) fn unframe(bytes: &[u8]) -> Result<Vec<&[u8]>, String> {
    let (records, end) = intact_records(bytes);
    end.map(|_| records)
}

/// The payloads of the records before the first bad or cut-off one, and
/// why reading stopped there (`Ok` when the buffer ended cleanly).
pub fn intact_records(mut bytes: &[u8]) -> (Vec<&[u8]>, Result<(), String>) {
    let mut records = Vec::new();
    while !bytes.is_empty() {
        let n = records.len();
        if bytes.len() < 12 {
            return (records, Err(format!("record {n}: {} bytes left, header needs 12", bytes.len())));
        }
        let (len_bytes, rest) = bytes.split_at(8);
        let len_crc = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        if len_crc != masked_crc32c(len_bytes) {
            return (records, Err(format!("record {n}: length CRC mismatch")));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let rest = &rest[4..];
        if rest.len() < len.saturating_add(4) {
            return (records, Err(format!("record {n}: payload of {len} bytes is cut off")));
        }
        let (payload, rest) = rest.split_at(len);
        let crc = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        if crc != masked_crc32c(payload) {
            return (records, Err(format!("record {n}: payload CRC mismatch")));
        }
        records.push(payload);
        bytes = &rest[4..];
    }
    (records, Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        // The check value of the CRC catalogue, and RFC 3720 (iSCSI) B.4 vectors.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn frame_round_trips_and_a_flipped_bit_is_caught() {
        let mut bytes = frame(b"hello");
        bytes.extend(frame(b""));
        assert_eq!(bytes.len(), 16 + 5 + 16);
        let records = unframe(&bytes).unwrap();
        assert_eq!(records, [&b"hello"[..], &b""[..]]);

        bytes[13] ^= 1;
        assert_eq!(unframe(&bytes).unwrap_err(), "record 0: payload CRC mismatch");
        assert_eq!(unframe(&bytes[..20]).unwrap_err(), "record 0: payload of 5 bytes is cut off");
    }
}
