//! Sizes as every binary's command line and configuration take them: bytes, or a number with
//! K, M, G or T (powers of 1024, any case, an optional trailing B or iB) — as qemu-img, fio
//! and `rbd resize` read them.

/// Parses a size; the error names it and says what a size looks like.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = || format!("size {s:?}: not a size (bytes, or a number with K, M, G or T)");
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let t = if lower.ends_with("ib") && t.len() > 2 {
        &t[..t.len() - 2]
    } else if lower.ends_with('b') && t.len() > 1 {
        &t[..t.len() - 1]
    } else {
        t
    };
    let (num, shift) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (t[..t.len() - 1].trim_end(), shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_as_qemu_img_and_fio_take_them() {
        for (s, want) in [
            ("4096", 4096),
            ("0", 0),
            ("256k", 256 << 10),
            ("64M", 64 << 20),
            ("64MiB", 64 << 20),
            ("2g", 2 << 30),
            ("1TiB", 1 << 40),
            ("8KB", 8 << 10),
            (" 1 G ", 1 << 30),
            ("64MIB", 64 << 20),
            ("64mb", 64 << 20),
        ] {
            assert_eq!(parse_size(s), Ok(want), "{s}");
        }
        for bad in [
            "",
            "M",
            "B",
            "iB",
            "1.5G",
            "12Q",
            "-1",
            "99999999999T",
            "1X",
        ] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }
}
