//! Machine-code facts of every decode variant, read from the SASS of the NVRTC CUBINs: tensor
//! cores are used (HMMA), K/V arrive by TMA (UTMALDG) or, for gathered pages, by 16-byte
//! asynchronous copies (LDGSTS) and then no TMA, P^T is transposed in registers (MOVM), fp8
//! caches are widened in registers by the e4m3 conversion (F2FP.F16.E4M3) for f16 MMAs, and
//! nothing lives in local memory (no LDL/STL). Needs NVRTC and `cuobjdump` + `nvdisasm` on the
//! PATH (the README's test command installs both); a missing tool fails here, it does not skip.

mod common;

use std::process::Command;

use kvstream::jit::compile;
use kvstream::kernels::{all_variants, AnyVariant, KvSource, Variant};
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
enum KvCopies {
    Tma,
    Gathered,
}

/// The SASS facts of one decode variant with `n_tiles` n8 tiles of query rows: per m16 slice
/// and n8 tile, d/16 HMMA for S^T and d/16 for O^T in the one KV loop.
fn check_decode_sass(
    name: &str,
    cubin: &[u8],
    n_tiles: usize,
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
    assert_eq!(hmma, 16 * n_tiles, "{name}: {hmma} HMMA");
    let (tma, ldgsts) = (count(&sass, "UTMALDG"), count(&sass, "LDGSTS"));
    match copies {
        KvCopies::Tma => assert!(tma > 0, "{name}: no TMA loads"),
        KvCopies::Gathered => {
            assert!(ldgsts > 0, "{name}: no asynchronous copies");
            assert_eq!(tma, 0, "{name}: TMA loads in a gathering variant");
        }
    }
    assert!(count(&sass, "MOVM") > 0, "{name}: no in-register transpose");
    for local in ["LDL", "STL"] {
        assert_eq!(count(&sass, local), 0, "{name}: local memory ({local})");
    }
}

#[test]
fn decode_variants_use_tensor_cores_and_tma_and_no_local_memory() {
    common::par_map(&all_variants(), |v| match *v {
        AnyVariant::Decode(d) => {
            let c = compile::compile(&d).unwrap_or_else(|e| panic!("{e}"));
            check_decode_sass(&d.name(), &c.cubin, d.n_tiles, KvCopies::Tma, d.kv_dtype);
        }
        AnyVariant::Persistent(d) => {
            let c = compile::compile(&d).unwrap_or_else(|e| panic!("{e}"));
            let copies = match d.kv_source {
                KvSource::PagedGather => KvCopies::Gathered,
                KvSource::Contiguous | KvSource::PagedBoxes => KvCopies::Tma,
            };
            check_decode_sass(&d.name(), &c.cubin, d.n_tiles, copies, d.kv_dtype);
        }
        _ => {}
    });
}
