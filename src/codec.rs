//! Byte encodings shared by keys, signatures and checksums. A leaf: it imports
//! nothing from the crate, so any module may use it without a cycle.

use sha2::{Digest, Sha256};

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0x0f) as usize] as char);
    }
    s
}

/// `n`'s decimal digits, written into `buf` without the formatting
/// machinery or an allocation (the hot path's keys, headers and record).
fn decimal_digits(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    let mut n = n;
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

/// Appends `n` in decimal to bytes (the access-log record).
pub fn extend_decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(decimal_digits(n, &mut [0u8; 20]));
}

/// Appends `n` in decimal to a string (keys and headers).
pub fn push_decimal(out: &mut String, n: u64) {
    // ASCII digits: always UTF-8.
    out.push_str(std::str::from_utf8(decimal_digits(n, &mut [0u8; 20])).unwrap_or_default());
}

/// `n` in decimal, as bytes (a script call's numbers).
pub fn decimal(n: u64) -> Vec<u8> {
    let mut s = String::with_capacity(20);
    push_decimal(&mut s, n);
    s.into_bytes()
}

/// Lower-case hex SHA-256: digests in keys, object names and checksums.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_are_what_display_writes() {
        for n in [0, 1, 9, 10, 99, 100, 4096, 1 << 53, u64::MAX - 1, u64::MAX] {
            assert_eq!(decimal(n), n.to_string().into_bytes());
        }
        let mut s = String::from("t/");
        push_decimal(&mut s, 4095);
        assert_eq!(s, "t/4095");
    }

    #[test]
    fn hex_encodes_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
