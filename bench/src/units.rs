//! Byte counts as the command line takes them (`1G`, `256k`) and as the tables print them.

use anyhow::{Result, anyhow};

/// A size such as `1G`, `64M`, `256k`, `4096` (binary units, as fio reads them), not zero.
pub(crate) fn parse_size(s: &str) -> Result<u64> {
    match qpip_cli::size::parse_size(s) {
        Ok(0) => Err(anyhow!("size {s:?} is zero")),
        Ok(n) => Ok(n),
        Err(e) => Err(anyhow!(e)),
    }
}

pub(crate) fn human_bytes(b: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{} {unit}", b >> shift);
        }
    }
    format!("{b} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("256k").unwrap(), 256 << 10);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("0").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(1 << 30), "1 GiB");
        assert_eq!(human_bytes(256 << 10), "256 KiB");
        assert_eq!(human_bytes(1000), "1000 B");
    }
}
