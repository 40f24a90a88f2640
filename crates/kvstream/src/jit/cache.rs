//! On-disk cache of compiled CUBINs.
//!
//! Key: hash of (every source the variant sees, the NVRTC options, the NVRTC version, the arch).
//! An entry holds a header with that key, lengths and a checksum; anything that does not match
//! is treated as absent and rebuilt, never loaded. Writes go to a temporary file renamed into
//! place, so concurrent processes never see half an entry.

use std::path::{Path, PathBuf};

use super::compile::Compiled;
use crate::error::{Error, Result};

/// Environment variable that overrides the cache directory.
pub const CACHE_DIR_ENV: &str = "KVSTREAM_CACHE_DIR";
const MAGIC: &[u8; 10] = b"KVSCUBIN1\n";

/// The cache directory: `$KVSTREAM_CACHE_DIR`, else `$XDG_CACHE_HOME/kvstream`, else
/// `$HOME/.cache/kvstream`, else a `kvstream` folder in the system temp directory.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(CACHE_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("kvstream");
    }
    if let Some(d) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join(".cache").join("kvstream");
    }
    std::env::temp_dir().join("kvstream")
}

/// 64-bit FNV-1a, seeded; two seeds make the 128-bit key.
fn fnv1a(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut h = seed;
    for part in parts {
        for &b in part.iter() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        // separate parts so ("ab","c") and ("a","bc") differ
        h ^= 0xff;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Hex cache key of the given inputs.
pub fn key(parts: &[&[u8]]) -> String {
    format!(
        "{:016x}{:016x}",
        fnv1a(0xcbf2_9ce4_8422_2325, parts),
        fnv1a(0x6c62_272e_07bb_0142, parts)
    )
}

fn entry_path(dir: &Path, name: &str, key: &str) -> PathBuf {
    dir.join(format!("{name}-{key}.cubin"))
}

/// The cached entry, if present and intact.
pub fn load(dir: &Path, name: &str, key: &str) -> Option<Compiled> {
    let bytes = std::fs::read(entry_path(dir, name, key)).ok()?;
    decode(&bytes, key)
}

fn decode(bytes: &[u8], key: &str) -> Option<Compiled> {
    let rest = bytes.strip_prefix(MAGIC.as_slice())?;
    let (stored_key, rest) = rest.split_at_checked(key.len())?;
    if stored_key != key.as_bytes() {
        return None;
    }
    let word = |b: &[u8]| -> Option<u64> { Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?)) };
    let cubin_len = word(rest)? as usize;
    let log_len = word(rest.get(8..)?)? as usize;
    let checksum = word(rest.get(16..)?)?;
    let body = rest.get(24..)?;
    if body.len() != cubin_len.checked_add(log_len)? {
        return None;
    }
    let (cubin, log) = body.split_at(cubin_len);
    if fnv1a(0, &[cubin, log]) != checksum || cubin.is_empty() {
        return None;
    }
    Some(Compiled {
        cubin: cubin.to_vec(),
        log: String::from_utf8(log.to_vec()).ok()?,
    })
}

fn encode(compiled: &Compiled, key: &str) -> Vec<u8> {
    let log = compiled.log.as_bytes();
    let mut out =
        Vec::with_capacity(MAGIC.len() + key.len() + 24 + compiled.cubin.len() + log.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(compiled.cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&(log.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a(0, &[&compiled.cubin, log]).to_le_bytes());
    out.extend_from_slice(&compiled.cubin);
    out.extend_from_slice(log);
    out
}

/// Stores an entry atomically (temporary file + rename).
pub fn store(dir: &Path, name: &str, key: &str, compiled: &Compiled) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Cache(format!("cannot create {}: {e}", dir.display())))?;
    let path = entry_path(dir, name, key);
    let tmp = dir.join(format!(".{name}-{key}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, encode(compiled, key))
        .and_then(|_| std::fs::rename(&tmp, &path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::Cache(format!("cannot write {}: {e}", path.display()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Compiled {
        Compiled {
            cubin: (0..=255u8).cycle().take(5000).collect(),
            log: "ptxas info    : Used 40 registers".into(),
        }
    }

    fn scratch_dir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("kvstream-cache-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trips_and_rejects_damage() {
        let dir = scratch_dir("rt");
        let k = key(&[b"src", b"opts"]);
        assert!(load(&dir, "v", &k).is_none());
        store(&dir, "v", &k, &sample()).unwrap();
        assert_eq!(load(&dir, "v", &k), Some(sample()));

        let path = entry_path(&dir, "v", &k);
        let good = std::fs::read(&path).unwrap();
        // flipped byte in the cubin -> checksum mismatch
        let mut bad = good.clone();
        let n = bad.len();
        bad[n - 100] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(load(&dir, "v", &k).is_none());
        // truncated
        std::fs::write(&path, &good[..good.len() / 2]).unwrap();
        assert!(load(&dir, "v", &k).is_none());
        // an entry stored under another key (stale) is not accepted for this one
        std::fs::write(&path, encode(&sample(), &key(&[b"other"]))).unwrap();
        assert!(load(&dir, "v", &k).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn key_depends_on_every_part_and_its_boundaries() {
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        assert_ne!(key(&[b"x"]), key(&[b"y"]));
        assert_eq!(key(&[b"x"]).len(), 32);
    }
}
