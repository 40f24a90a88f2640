//! Every kernel variant the planner can choose compiles to an sm_90a CUBIN with NVRTC, without
//! spills, with the SASS facts of tests/common/sass.rs (each variant compiled once for both),
//! and the disk cache serves it back. Needs libnvrtc.so.13 on the library path and `cuobjdump`
//! on the PATH (the README's test command installs both); a missing tool fails, it does not skip.

mod common;

use common::sass::{check_decode_sass, check_mla_sass, KvCopies};

use kvstream::jit::{self, cache, compile, Origin};
use kvstream::kernels::{all_variants, AnyVariant, KvSource};

/// ELF machine number of NVIDIA CUDA objects.
const EM_CUDA: u16 = 190;

#[test]
fn every_variant_compiles_to_sm90a_without_spills_with_its_sass_facts() {
    let (major, minor) = compile::nvrtc_version().expect("NVRTC must be installed for the tests");
    assert!(
        major >= 13,
        "NVRTC {major}.{minor}: CUDA 13 or newer needed for sm_90a CUBINs"
    );
    let variants = all_variants();
    let lines = common::par_map(&variants, |v| {
        let v = *v;
        let var = v.as_variant();
        let c = compile::compile(var).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            &c.cubin[..4],
            b"\x7fELF",
            "{}: not an ELF image",
            var.name()
        );
        let machine = u16::from_le_bytes([c.cubin[18], c.cubin[19]]);
        assert_eq!(machine, EM_CUDA, "{}: not a CUDA ELF", var.name());
        let r = c.report();
        assert!(
            r.registers > 0,
            "{}: no ptxas report in log:\n{}",
            var.name(),
            c.log
        );
        assert_eq!(
            r.spill_stores + r.spill_loads,
            0,
            "{}: spills ({r})",
            var.name()
        );
        assert_eq!(
            r.stack_bytes,
            0,
            "{}: local-memory stack frame ({r})",
            var.name()
        );
        if let AnyVariant::Decode(d) = v {
            // one CTA of 160 threads per SM: 65536 registers / 160 threads
            assert!(r.registers <= 255, "{}: {r}", var.name());
            assert!(d.shared_bytes() <= 227 * 1024);
            let shape = (d.n_tiles, d.head_dim, d.tile_tokens);
            check_decode_sass(&var.name(), &c.cubin, shape, KvCopies::Tma, d.kv_dtype);
        }
        if let AnyVariant::Persistent(d) = v {
            // one CTA per SM: its threads share the register file, and the shared memory fits
            assert!(
                r.registers as usize * d.threads() as usize <= 65536,
                "{}: {r}",
                var.name()
            );
            assert!(d.shared_bytes() <= 227 * 1024, "{}", var.name());
            let copies = match d.kv_source {
                KvSource::PagedGather => KvCopies::Gathered,
                KvSource::Contiguous | KvSource::PagedBoxes => KvCopies::Tma,
            };
            let shape = (d.n_tiles, d.head_dim, d.tile_tokens);
            check_decode_sass(&var.name(), &c.cubin, shape, copies, d.kv_dtype);
        }
        if let AnyVariant::Mla(m) = v {
            // the producer warpgroup hands its registers to the consumers (setmaxnreg): the
            // kernel's own count is the launch-bound share
            assert!(
                r.registers as usize * m.threads() as usize <= 65536,
                "{}: {r}",
                var.name()
            );
            assert!(m.shared_bytes() <= 227 * 1024, "{}", var.name());
            check_mla_sass(&var.name(), &c.cubin, &m);
        }
        format!("{:<36} {r}\n", var.name())
    });
    println!("{}", lines.concat());
}

/// The paired online-softmax step (`PlanOptions::persistent_softmax_slices`, a tuning knob the
/// plan does not choose yet) compiles without spills where a sweep would use it: d 64's default
/// tiles and d 128 with 128-position tiles, 2-byte and e4m3 caches, one and two column tiles.
#[test]
fn paired_softmax_steps_compile_without_spills() {
    use kvstream::plan::{persistent_variant, persistent_variant_forced, PlanOptions};
    use kvstream::{DType, KvDType};
    for (d, tile) in [(64, None), (128, Some(128))] {
        for kv in [KvDType::AsQuery, KvDType::Fp8E4m3] {
            for n_tiles in [1, 2] {
                let v = persistent_variant(
                    DType::Bf16,
                    kv,
                    d,
                    n_tiles,
                    kvstream::kernels::KvSource::Contiguous,
                );
                let o = PlanOptions {
                    persistent_softmax_slices: Some(2),
                    persistent_tile_tokens: tile,
                    ..Default::default()
                };
                let v = persistent_variant_forced(v, &o).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(v.softmax_slices, 2);
                let c = compile::compile(&v).unwrap_or_else(|e| panic!("{e}"));
                let r = c.report();
                let name = kvstream::kernels::Variant::name(&v);
                assert!(name.ends_with(".sm2"), "{name}");
                assert_eq!(r.spill_stores + r.spill_loads, 0, "{name}: spills ({r})");
            }
        }
    }
}

/// The phase-trace build (decode_gqa.cu `KVS_TRACE`, `KVSTREAM_TRACE=<dir> kvstream bench`) of
/// the batch-1 serving variants keeps compiling, without spills, and exports the record ring the
/// bench reads by name.
#[test]
fn traced_decode_kernels_compile_and_export_their_records() {
    let traced: Vec<_> = all_variants()
        .into_iter()
        .filter(|v| {
            v.as_variant()
                .name()
                .starts_with("decode_gqa.bf16.d128.n1.t64.s4.g2")
        })
        .collect();
    assert_eq!(traced.len(), 3, "contiguous, paged and joined-halves paged");
    for v in traced {
        let var = v.as_variant();
        let c = compile::compile_with(var, &["-DKVS_TRACE=1".to_string()])
            .unwrap_or_else(|e| panic!("{e}"));
        let r = c.report();
        assert_eq!(
            r.spill_stores + r.spill_loads,
            0,
            "{} traced: spills ({r})",
            var.name()
        );
        let release = compile::compile(var).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !release.cubin.windows(16).any(|w| w == b"kvs_trace_count\0"),
            "{}: the release build carries the trace",
            var.name()
        );
        for symbol in [&b"kvs_trace\0"[..], &b"kvs_trace_count\0"[..]] {
            assert!(
                c.cubin.windows(symbol.len()).any(|w| w == symbol),
                "{} traced: no symbol {}",
                var.name(),
                String::from_utf8_lossy(&symbol[..symbol.len() - 1])
            );
        }
    }
}

#[test]
fn cache_serves_what_was_compiled_and_rebuilds_damage() {
    let dir = std::env::temp_dir().join(format!("kvstream-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // This is the only test in this binary that reads the variable.
    std::env::set_var(cache::CACHE_DIR_ENV, &dir);
    let v = all_variants()[0];
    let (first, origin) = jit::cubin(v.as_variant()).unwrap();
    assert_eq!(origin, Origin::Compiled);
    let (second, origin) = jit::cubin(v.as_variant()).unwrap();
    assert_eq!(origin, Origin::Cache);
    assert_eq!(first, second);
    // damage every entry: the next lookup must compile again, not load garbage
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 0x55;
        std::fs::write(&path, bytes).unwrap();
    }
    let (third, origin) = jit::cubin(v.as_variant()).unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(third.cubin, first.cubin);
    let _ = std::fs::remove_dir_all(&dir);
}
