//! Text a peer sent (error messages, export names and descriptions), made safe to print: a
//! hostile server must not be able to flood the user's terminal or drive it with escape
//! sequences.

/// Characters of peer text shown at most; the rest is cut and marked.
pub const MAX_SHOWN: usize = 512;

/// `bytes` as printable text: invalid UTF-8 replaced, control characters (escape sequences,
/// newlines, bidi overrides) escaped as `\u{..}`, and cut after [`MAX_SHOWN`] characters.
pub fn printable(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len().min(MAX_SHOWN + 16));
    for (i, ch) in text.chars().enumerate() {
        if i == MAX_SHOWN {
            out.push_str("[…]");
            break;
        }
        if ch.is_control() || is_bidi_control(ch) {
            out.extend(ch.escape_unicode());
        } else {
            out.push(ch);
        }
    }
    out
}

/// Unicode's explicit directional formatting characters, which can make printed text read
/// differently from what it is.
fn is_bidi_control(ch: char) -> bool {
    matches!(ch, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_caps() {
        assert_eq!(printable(b"disk full"), "disk full");
        assert_eq!(printable(b"\x1b[2Jgone\n"), "\\u{1b}[2Jgone\\u{a}");
        assert_eq!(printable(b"\xff"), "\u{fffd}");
        assert_eq!(printable("a\u{202e}b".as_bytes()), "a\\u{202e}b");
        let long = printable(&[b'x'; 60_000]);
        assert_eq!(long.chars().count(), MAX_SHOWN + 3);
        assert!(long.ends_with("[…]"));
    }
}
