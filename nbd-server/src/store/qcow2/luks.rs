//! LUKS inside qcow2 (`qemu-img create -o encrypt.format=luks`): the LUKS1 header the
//! image's full disk encryption header extension points at, unlocked with a passphrase,
//! and the data clusters' cipher.
//!
//! As qemu's crypto/block-luks.c reads it: each active key slot's key is PBKDF2 of the
//! passphrase (the header's hash), its key material (stripes × key bytes, encrypted with
//! that key as sectors 0, 1, ... of the header's cipher) is merged by the anti-forensic
//! splitter into a candidate master key, which opens the image if its PBKDF2 digest is
//! the header's. Served: AES (128, 192 or 256 bits) in XTS mode with plain64 IVs, what
//! qemu-img makes by default; other ciphers, modes and IV generators are refused by name.
//! In qcow2 the IV of a 512-byte sector is its host offset / 512 (qemu's
//! crypt_physical_offset), not its guest offset.
//!
//! Sizes from the header are bounded as qemu bounds them (4000 stripes, key material inside
//! the header's area and off the header), and the PBKDF2 iteration counts by
//! [`MAX_ITERATIONS`], which qemu does not bound: a crafted count cannot keep the open busy
//! for hours. Keys live in memory only, zeroed when dropped.

use std::fs::File;
use std::io;
use std::path::Path;

use aes::cipher::consts::U16;
use aes::cipher::{BlockCipher, BlockDecrypt, BlockEncrypt, BlockSizeUser, KeyInit};
use aes::{Aes128, Aes192, Aes256};
use sha2::Digest;
use xts_mode::{Xts128, get_tweak_default};
use zeroize::Zeroizing;

use super::{be32, read_some};

/// The sector the cipher works on, and the IVs count.
pub(super) const SECTOR: u64 = 512;

/// The LUKS1 header's length (the key slots' material follows it).
const HEADER_LEN: usize = 592;
/// The stripes of the anti-forensic splitter, the only count qemu and cryptsetup accept.
const STRIPES: u32 = 4000;
/// A key slot in use, and one not.
const SLOT_ACTIVE: u32 = 0x00ac_71f3;
const SLOT_INACTIVE: u32 = 0x0000_dead;
/// The length of the master key digest.
const DIGEST_LEN: usize = 20;

/// The most PBKDF2 iterations one key slot or the master key digest may ask for. qemu-img
/// counts what takes `iter-time` (2 s by default) on the machine that makes the image:
/// a few million; 2^27 is some 30 s here, past which a header is taken as crafted.
pub(super) const MAX_ITERATIONS: u32 = 1 << 27;

/// The hashes a LUKS header may name (PBKDF2 and the splitter's diffusion).
#[derive(Clone, Copy, Debug)]
enum Hash {
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
}

impl Hash {
    fn parse(name: &str) -> Option<Hash> {
        Some(match name {
            "sha1" => Hash::Sha1,
            "sha224" => Hash::Sha224,
            "sha256" => Hash::Sha256,
            "sha384" => Hash::Sha384,
            "sha512" => Hash::Sha512,
            _ => return None,
        })
    }

    fn pbkdf2(self, password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2_hmac;
        match self {
            Hash::Sha1 => pbkdf2_hmac::<sha1::Sha1>(password, salt, rounds, out),
            Hash::Sha224 => pbkdf2_hmac::<sha2::Sha224>(password, salt, rounds, out),
            Hash::Sha256 => pbkdf2_hmac::<sha2::Sha256>(password, salt, rounds, out),
            Hash::Sha384 => pbkdf2_hmac::<sha2::Sha384>(password, salt, rounds, out),
            Hash::Sha512 => pbkdf2_hmac::<sha2::Sha512>(password, salt, rounds, out),
        }
    }

    /// The splitter's diffusion of `block`, in place: each digest-sized piece (the last
    /// one shorter) replaced by the hash of its index (big-endian 32 bits) and itself.
    fn diffuse(self, block: &mut [u8]) {
        fn run<D: Digest>(block: &mut [u8]) {
            for (i, piece) in block.chunks_mut(<D as Digest>::output_size()).enumerate() {
                let mut d = D::new();
                d.update((i as u32).to_be_bytes());
                d.update(&*piece);
                let out = d.finalize();
                piece.copy_from_slice(&out[..piece.len()]);
            }
        }
        match self {
            Hash::Sha1 => run::<sha1::Sha1>(block),
            Hash::Sha224 => run::<sha2::Sha224>(block),
            Hash::Sha256 => run::<sha2::Sha256>(block),
            Hash::Sha384 => run::<sha2::Sha384>(block),
            Hash::Sha512 => run::<sha2::Sha512>(block),
        }
    }
}

/// AES-XTS with plain64 IVs, keyed: the cipher of a key slot's material or of the data.
/// Boxed: the round keys stay in one place (zeroed when dropped), and they are large.
pub(super) enum Cipher {
    Aes128(Box<Xts128<Aes128>>),
    Aes192(Box<Xts128<Aes192>>),
    Aes256(Box<Xts128<Aes256>>),
}

impl Cipher {
    /// The cipher for an XTS key (two AES keys, the data's then the tweak's), or None for a
    /// length that is not one.
    fn new(key: &[u8]) -> Option<Cipher> {
        fn xts<
            C: KeyInit + BlockCipher + BlockEncrypt + BlockDecrypt + BlockSizeUser<BlockSize = U16>,
        >(
            key: &[u8],
        ) -> Option<Box<Xts128<C>>> {
            let (k1, k2) = key.split_at(key.len() / 2);
            Some(Box::new(Xts128::new(
                C::new_from_slice(k1).ok()?,
                C::new_from_slice(k2).ok()?,
            )))
        }
        Some(match key.len() {
            32 => Cipher::Aes128(xts(key)?),
            48 => Cipher::Aes192(xts(key)?),
            64 => Cipher::Aes256(xts(key)?),
            _ => return None,
        })
    }

    /// Encrypts `buf` (whole sectors), the first of which is sector `sector`.
    pub(super) fn encrypt(&self, buf: &mut [u8], sector: u64) {
        debug_assert!((buf.len() as u64).is_multiple_of(SECTOR));
        let (s, n) = (u128::from(sector), SECTOR as usize);
        match self {
            Cipher::Aes128(x) => x.encrypt_area(buf, n, s, get_tweak_default),
            Cipher::Aes192(x) => x.encrypt_area(buf, n, s, get_tweak_default),
            Cipher::Aes256(x) => x.encrypt_area(buf, n, s, get_tweak_default),
        }
    }

    /// Decrypts `buf` (whole sectors), the first of which is sector `sector`.
    pub(super) fn decrypt(&self, buf: &mut [u8], sector: u64) {
        debug_assert!((buf.len() as u64).is_multiple_of(SECTOR));
        let (s, n) = (u128::from(sector), SECTOR as usize);
        match self {
            Cipher::Aes128(x) => x.decrypt_area(buf, n, s, get_tweak_default),
            Cipher::Aes192(x) => x.decrypt_area(buf, n, s, get_tweak_default),
            Cipher::Aes256(x) => x.decrypt_area(buf, n, s, get_tweak_default),
        }
    }
}

/// A crafted or foreign LUKS header: refused (the export is left out, as other images not
/// served are).
fn bad(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("qcow2 image's LUKS header {what}"),
    )
}

/// One key slot as the header has it.
struct Slot {
    iterations: u32,
    salt: [u8; 32],
    /// Where its key material starts, in bytes from the LUKS header.
    material: u64,
}

/// The LUKS header at `at` (its area `len` bytes) of `file`, unlocked with the passphrase
/// in `passphrase_file`: the data clusters' cipher.
pub(super) fn unlock(file: &File, at: u64, len: u64, passphrase_file: &Path) -> io::Result<Cipher> {
    let mut h = [0u8; HEADER_LEN];
    if (len as usize) < HEADER_LEN || read_some(file, &mut h, at)? < HEADER_LEN {
        return Err(bad("is truncated"));
    }
    if &h[..6] != b"LUKS\xba\xbe" {
        return Err(bad("has no LUKS magic"));
    }
    let version = u16::from_be_bytes([h[6], h[7]]);
    if version != 1 {
        return Err(bad(format!(
            "is LUKS version {version}: only version 1 (qemu's) is served"
        )));
    }
    // Names as the header has them, up to their NUL; control characters (a crafted header's
    // line breaks) shown as '?', so that a refusal stays one line.
    let text = |b: &[u8]| -> String {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end])
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect()
    };
    let (cipher, mode, hash_name) = (text(&h[8..40]), text(&h[40..72]), text(&h[72..104]));
    let key_bytes = be32(&h, 108) as usize;
    if cipher != "aes" || mode != "xts-plain64" || ![32, 48, 64].contains(&key_bytes) {
        return Err(bad(format!(
            "names cipher {cipher}-{mode} with a {}-bit key: only aes-xts-plain64 (qemu-img's default) is served, with 256, 384 or 512-bit keys",
            key_bytes * 8
        )));
    }
    let hash = Hash::parse(&hash_name).ok_or_else(|| {
        bad(format!(
            "names hash {hash_name}: only sha1, sha224, sha256, sha384 and sha512 are served"
        ))
    })?;
    let mk_digest = &h[112..112 + DIGEST_LEN];
    let mk_salt = &h[132..164];
    let mk_iterations = be32(&h, 164);
    check_iterations("the master key digest", mk_iterations)?;
    let material_len = key_bytes as u64 * u64::from(STRIPES);
    let mut slots = Vec::new();
    let mut areas: Vec<(u64, u64)> = Vec::new();
    for i in 0..8 {
        let s = &h[208 + i * 48..208 + (i + 1) * 48];
        let state = be32(s, 0);
        let material = u64::from(be32(s, 40)) * SECTOR;
        let stripes = be32(s, 44);
        match state {
            SLOT_INACTIVE => continue,
            SLOT_ACTIVE => {}
            _ => return Err(bad(format!("has key slot {i} in unknown state {state:#x}"))),
        }
        // qemu's checks: 4000 stripes, the material past the header and off the other
        // slots'; and here, inside the area the extension gives.
        if stripes != STRIPES {
            return Err(bad(format!(
                "has key slot {i} with {stripes} stripes, not {STRIPES}"
            )));
        }
        if material < HEADER_LEN as u64
            || material
                .checked_add(material_len)
                .is_none_or(|end| end > len)
        {
            return Err(bad(format!(
                "has key slot {i}'s key material at byte {material}, on the header or past the end of its area ({len} bytes)"
            )));
        }
        if areas
            .iter()
            .any(|&(a, l)| material < a + l && a < material + material_len)
        {
            return Err(bad(format!(
                "has key slot {i}'s key material overlapping another slot's"
            )));
        }
        areas.push((material, material_len));
        let iterations = be32(s, 4);
        check_iterations(&format!("key slot {i}"), iterations)?;
        let mut salt = [0u8; 32];
        salt.copy_from_slice(&s[8..40]);
        slots.push(Slot {
            iterations,
            salt,
            material,
        });
    }
    if slots.is_empty() {
        return Err(bad("has no active key slot"));
    }
    let passphrase = Zeroizing::new(std::fs::read(passphrase_file).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "reading the passphrase file {}: {e}",
                passphrase_file.display()
            ),
        )
    })?);
    let mut material = Zeroizing::new(vec![0u8; material_len as usize]);
    for slot in &slots {
        let mut slot_key = Zeroizing::new(vec![0u8; key_bytes]);
        hash.pbkdf2(&passphrase, &slot.salt, slot.iterations, &mut slot_key);
        if read_some(file, &mut material, at + slot.material)? < material.len() {
            return Err(bad("has key material past the end of the file"));
        }
        cipher_for(&slot_key)?.decrypt(&mut material, 0);
        let key = af_merge(hash, &material, key_bytes);
        let mut digest = [0u8; DIGEST_LEN];
        hash.pbkdf2(&key, mk_salt, mk_iterations, &mut digest);
        if digest == mk_digest {
            return cipher_for(&key);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "no key slot of its LUKS header opens with the passphrase in {} (the file's bytes are the passphrase, a trailing newline included)",
            passphrase_file.display()
        ),
    ))
}

/// The cipher of a key of the header's length (checked to be an XTS key's).
fn cipher_for(key: &[u8]) -> io::Result<Cipher> {
    Cipher::new(key).ok_or_else(|| bad(format!("has a {}-byte key", key.len())))
}

fn check_iterations(what: &str, n: u32) -> io::Result<()> {
    if n == 0 || n > MAX_ITERATIONS {
        return Err(bad(format!(
            "asks for {n} PBKDF2 iterations for {what}: this server takes 1 to {MAX_ITERATIONS} (qemu-img makes a few million)"
        )));
    }
    Ok(())
}

/// The anti-forensic merge: the master key out of its `stripes` split copies, each XORed
/// in and diffused but the last, which is XORed only.
fn af_merge(hash: Hash, split: &[u8], key_bytes: usize) -> Zeroizing<Vec<u8>> {
    let mut block = Zeroizing::new(vec![0u8; key_bytes]);
    let mut stripes = split.chunks_exact(key_bytes).peekable();
    while let Some(stripe) = stripes.next() {
        block.iter_mut().zip(stripe).for_each(|(b, s)| *b ^= s);
        if stripes.peek().is_some() {
            hash.diffuse(&mut block);
        }
    }
    block
}

#[cfg(test)]
mod tests {
    use super::*;

    /// IEEE 1619's XTS-AES-128 vector 4 (sector 0 of 512 bytes: 0, 1, ..., 255 twice):
    /// the crates' XTS with plain64 tweaks is the standard's.
    #[test]
    fn xts_aes128_matches_ieee_1619_vector_4() {
        let mut key = [0u8; 32];
        key[..16].copy_from_slice(&hex("27182818284590452353602874713526"));
        key[16..].copy_from_slice(&hex("31415926535897932384626433832795"));
        let c = Cipher::new(&key).unwrap();
        let mut buf: Vec<u8> = (0..512).map(|i| i as u8).collect();
        c.encrypt(&mut buf, 0);
        assert_eq!(
            buf[..32],
            hex("27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c")[..]
        );
        c.decrypt(&mut buf, 0);
        assert!(buf.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}
