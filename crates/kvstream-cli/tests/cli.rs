//! The CLI on any machine (no GPU, no NVRTC needed): its answers to bad flags name the flag as
//! typed and what is allowed, with a non-zero exit status; `plan` reads as a plan.

use std::process::Command;

/// `kvstream <args>`: (exit success, stdout, stderr).
fn kvstream(args: &[&str]) -> (bool, String, String) {
    kvstream_in(&std::env::current_dir().expect("a current folder"), args)
}

/// The same, run from folder `dir`.
fn kvstream_in(dir: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvstream"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the kvstream binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn shape_errors_name_the_flag_typed() {
    for (args, want) in [
        (&["demo", "--len", "0"][..], "invalid --len: got 0"),
        (
            &["demo", "--hq", "30", "--hkv", "4"][..],
            "invalid --hq: got 30",
        ),
        (
            &["demo", "--head-dim", "80"][..],
            "invalid --head-dim: got 80, allowed: [64, 96, 128, 256]",
        ),
        (
            &["demo", "--window", "-2"][..],
            "invalid --window: got -2, allowed: -1 (unbounded)",
        ),
        (
            &["demo", "--window", "128,x"][..],
            "invalid --window: got 128,x, allowed: LEFT or LEFT,RIGHT",
        ),
        (
            &["demo", "--softcap=-1"][..],
            "invalid --softcap: got -1, allowed: a finite positive number",
        ),
        (
            &["plan", "--head-dim", "256", "--engine", "split"][..],
            "the persistent engine",
        ),
        (
            &["demo", "--q-len", "9"][..],
            "invalid --q-len: got 9, allowed: 1..=8",
        ),
        (
            &["demo", "--page-size", "3"][..],
            "invalid --page-size: got 3",
        ),
        (&["plan", "--batch", "0"][..], "invalid --batch: got 0"),
    ] {
        let (ok, _, err) = kvstream(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(
            err.contains(want),
            "{args:?}: stderr {err:?} lacks {want:?}"
        );
    }
}

#[test]
fn kernels_only_matching_nothing_fails_and_says_so() {
    let (ok, _, err) = kvstream(&["kernels", "--only", "no_such_variant"]);
    assert!(!ok);
    assert!(
        err.contains("invalid --only: got no_such_variant"),
        "stderr {err:?}"
    );
}

#[test]
fn kernels_jobs_names_its_range() {
    let (ok, _, err) = kvstream(&["kernels", "--jobs", "0"]);
    assert!(!ok);
    assert!(
        err.contains("--jobs") && err.contains("1..=256"),
        "stderr {err:?}"
    );
}

#[test]
fn demo_without_a_gpu_uses_the_shape_given() {
    // (on a GPU machine the demo runs the kernels instead: nothing to check here then)
    let (ok, out, err) = kvstream(&[
        "demo",
        "--hq",
        "30",
        "--hkv",
        "2",
        "--head-dim",
        "64",
        "--dtype",
        "f16",
    ]);
    if !out.contains("No usable GPU") {
        return;
    }
    assert!(ok, "stderr {err:?}");
    assert!(
        out.contains("CPU reference: batch 1, 30/2 heads, d 64, L 4096, f16"),
        "stdout {out:?}"
    );
}

#[test]
fn plan_names_the_engine_kernel_grid_and_workspace() {
    let (ok, out, err) = kvstream(&[
        "plan", "--batch", "64", "--hq", "32", "--hkv", "8", "--len", "32768",
    ]);
    assert!(ok, "stderr {err:?}");
    for line in [
        "problem: batch 64, 32/8 heads, head dim 128, L 32768",
        "planned for: ",
        "engine: persistent",
        "grid: ",
        "workspace: ",
    ] {
        assert!(out.contains(line), "stdout {out:?} lacks {line:?}");
    }
    // the kernel line names a variant that `kernels --only` finds
    let kernel = out
        .lines()
        .find_map(|l| l.strip_prefix("kernel: "))
        .expect("a kernel line");
    let name = kernel.split_whitespace().next().unwrap();
    assert!(
        kvstream::kernels::all_variants()
            .iter()
            .any(|v| v.as_variant().name() == name),
        "{name}"
    );
    let (ok, out, _) = kvstream(&["plan", "--splits", "4"]);
    assert!(
        ok && out.contains("engine: split") && out.contains("splits: 4 a request"),
        "{out:?}"
    );
}

#[test]
fn bench_matrix_is_found_from_another_folder() {
    // from a folder outside the repository the default `bench/matrix.json` is found above the
    // binary; --ids with no such shape then fails on the id, not on the file
    let (ok, _, err) = kvstream_in(&std::env::temp_dir(), &["bench", "--ids", "no-such-shape"]);
    assert!(!ok);
    assert!(err.contains("no shape \"no-such-shape\""), "stderr {err:?}");
    let (ok, _, err) = kvstream(&["bench", "--matrix", "bench/no-such-matrix.json"]);
    assert!(
        !ok && err.contains("no file bench/no-such-matrix.json"),
        "stderr {err:?}"
    );
}
