//! Machine-code facts of a decode variant, read from the SASS of its NVRTC CUBIN: tensor cores
//! are used (HMMA), K/V arrive by TMA (UTMALDG) or, for gathered pages, by 16-byte asynchronous
//! copies (LDGSTS) and then no TMA, P^T is transposed in registers (MOVM), fp8 caches are
//! widened in registers by the e4m3 conversion (F2FP.F16.E4M3) for f16 MMAs, and nothing lives
//! in local memory (no LDL/STL). Needs `cuobjdump` + `nvdisasm` on the PATH (the README's test
//! command installs both); a missing tool fails, it does not skip.

use std::process::Command;

use kvstream::KvDType;

fn sass_of(name: &str, cubin: &[u8]) -> String {
    let path =
        std::env::temp_dir().join(format!("kvstream-sass-{}-{name}.cubin", std::process::id()));
    std::fs::write(&path, cubin).unwrap();
    let out = Command::new("cuobjdump")
        .arg("-sass")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("cuobjdump must be on the PATH for this test: {e}"));
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "cuobjdump failed on {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn count(sass: &str, opcode: &str) -> usize {
    sass.lines()
        .filter(|l| l.split_whitespace().any(|w| w.starts_with(opcode)))
        .count()
}

/// How a variant's K and V reach shared memory.
#[derive(Clone, Copy)]
pub enum KvCopies {
    /// Tensor-map boxes.
    Tma,
    /// 16-byte asynchronous copies.
    Gathered,
}

/// The SASS facts of one decode variant with `n_tiles` n8 tiles of query rows, rows of
/// `head_dim` dims and tiles of `tile_tokens` positions (four warps of tile_tokens / 64 m16
/// slices each): per m16 slice and n8 tile, d/16 HMMA for S^T and d/16 for O^T in the one KV
/// loop. The wide consumer (blocks of 64 or 128 rows, a warpgroup's 64 on each tile it takes):
/// warpgroup MMAs only, d/16 m64n64k16 for S and tile_tokens/16 m64n{d}k16 for P V (P from
/// registers), none serialised by ptxas (one wait for each product).
pub fn check_decode_sass(
    name: &str,
    cubin: &[u8],
    (n_tiles, head_dim, tile_tokens): (usize, usize, usize),
    copies: KvCopies,
    kv_dtype: KvDType,
) {
    let sass = sass_of(name, cubin);
    let widened = count(&sass, "F2FP.F16.E4M3");
    match kv_dtype {
        KvDType::Fp8E4m3 => {
            assert!(widened > 0, "{name}: no e4m3 conversions");
            assert_eq!(count(&sass, "HMMA.16816.F32.BF16"), 0, "{name}: bf16 MMAs");
        }
        KvDType::AsQuery => assert_eq!(widened, 0, "{name}: e4m3 conversions"),
    }
    let hmma = count(&sass, "HMMA");
    if kvstream::kernels::WIDE_BLOCK_N_TILES.contains(&n_tiles) {
        assert_eq!(hmma, 0, "{name}: {hmma} HMMA");
        let s = count(&sass, "HGMMA.64x64x16.F32");
        let pv = count(&sass, &format!("HGMMA.64x{head_dim}x16.F32"));
        let (want_s, want_pv) = (head_dim / 16, tile_tokens / 16);
        if head_dim == 64 {
            // both products are m64n64k16
            assert_eq!(s, want_s + want_pv, "{name}: {s} m64n64k16 products");
        } else {
            assert_eq!((s, pv), (want_s, want_pv), "{name}: S and P V products");
        }
        let waits = count(&sass, "WARPGROUP.DEPBAR");
        assert_eq!(waits, 2, "{name}: {waits} wgmma waits (serialised?)");
    } else {
        let want = n_tiles * (tile_tokens / 64) * 2 * (head_dim / 16);
        assert_eq!(hmma, want, "{name}: {hmma} HMMA");
        assert!(count(&sass, "MOVM") > 0, "{name}: no in-register transpose");
    }
    let (tma, ldgsts) = (count(&sass, "UTMALDG"), count(&sass, "LDGSTS"));
    match copies {
        KvCopies::Tma => assert!(tma > 0, "{name}: no TMA loads"),
        KvCopies::Gathered => {
            assert!(ldgsts > 0, "{name}: no asynchronous copies");
            assert_eq!(tma, 0, "{name}: TMA loads in a gathering variant");
        }
    }
    for local in ["LDL", "STL"] {
        assert_eq!(count(&sass, local), 0, "{name}: local memory ({local})");
    }
}

/// The SASS facts of one MLA variant.
/// Narrow (16 or 32 rows): per 64-position tile, each warp scores every column over half of the
/// 576 dims (18 k-steps) and accumulates 64 output dims over 64 positions (4 m-tiles x 4 k-steps
/// x every column tile): 34 HMMA per n8 tile, all unrolled; a 128-position tile twice that (each
/// warp scores all the dims). Wide (64 rows): warpgroup MMAs only, 36 m64n64k16 for S and 4
/// m64n256k16 for each warpgroup's half of O, none serialised by ptxas (four waits: warpgroup
/// 0's before S and for S, after its loop, and warpgroup 1's).
/// Either way the tiles arrive by TMA, e4m3 caches are widened in registers, the producer
/// warpgroup hands registers to the consumers, and nothing lives in local memory.
pub fn check_mla_sass(name: &str, cubin: &[u8], variant: &kvstream::kernels::MlaVariant) {
    let (n_tiles, kv_dtype) = (variant.n_tiles, variant.kv_dtype);
    let sass = sass_of(name, cubin);
    let widened = count(&sass, "F2FP.F16.E4M3");
    match kv_dtype {
        KvDType::Fp8E4m3 => {
            assert!(widened > 0, "{name}: no e4m3 conversions");
            assert_eq!(count(&sass, "HMMA.16816.F32.BF16"), 0, "{name}: bf16 MMAs");
        }
        KvDType::AsQuery => assert_eq!(widened, 0, "{name}: e4m3 conversions"),
    }
    let (hmma, hgmma) = (count(&sass, "HMMA"), count(&sass, "HGMMA"));
    if n_tiles == kvstream::plan::MLA_WIDE_N_TILES {
        assert_eq!(hmma, 0, "{name}: {hmma} HMMA");
        assert_eq!(count(&sass, "HGMMA.64x64x16.F32"), 36, "{name}: S products");
        assert_eq!(
            count(&sass, "HGMMA.64x256x16.F32"),
            8,
            "{name}: P V products"
        );
        // (an e4m3 cache: one more, before warpgroup 0 widens the next tile over the last)
        let waits = count(&sass, "WARPGROUP.DEPBAR");
        let want = if kv_dtype == KvDType::Fp8E4m3 { 4 } else { 3 };
        assert_eq!(waits, want, "{name}: {waits} wgmma waits (serialised?)");
    } else {
        assert_eq!(hgmma, 0, "{name}: {hgmma} HGMMA");
        // (a 64-position tile: 18 k-step pairs of S and 16 of P V an n8 tile; twice that for
        // 128 positions)
        let want = 34 * n_tiles * variant.tile_tokens / 64;
        assert_eq!(hmma, want, "{name}: {hmma} HMMA");
    }
    assert!(count(&sass, "UTMALDG") > 0, "{name}: no TMA loads");
    assert!(
        count(&sass, "USETMAXREG") >= 2,
        "{name}: no register hand-over"
    );
    for local in ["LDL", "STL"] {
        assert_eq!(count(&sass, local), 0, "{name}: local memory ({local})");
    }
}
