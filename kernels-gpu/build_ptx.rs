// Compiles the `kernels-gpu` crate to one PTX file. Shared by the root `build.rs` (which embeds
// the PTX in the library) and `cargo xtask build-ptx` (which writes it out and checks it with
// ptxas). Plain std only: it is `include!`d / `#[path]`-imported, not a crate.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds `kernels-gpu` (at `crate_dir`) for `nvptx64-nvidia-cuda` and `arch` (`sm_80`,
/// `sm_90`, `sm_90a`, ...) in its own `target_dir`, and writes the PTX to `out`.
///
/// The crate is built as a `staticlib` with fat LTO, so the one `.s` file holds every kernel and
/// whatever `core` code they use; no linker is involved (see `shared/toolchain.md`).
pub fn build_ptx(crate_dir: &Path, target_dir: &Path, arch: &str, out: &Path) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(crate_dir)
        .args(["rustc", "--release", "--lib", "--crate-type", "staticlib"])
        .args(["--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .args(["--config", "profile.release.lto=\"fat\""])
        .args(["--config", "profile.release.panic=\"abort\""])
        .args(["--config", "profile.release.codegen-units=1"])
        .args(["--config", "profile.release.debug=false"])
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--")
        .arg(format!("-Ctarget-cpu={arch}"))
        .arg(format!("--emit=asm={}", out.display()));
    // Flags meant for the host build (coverage, sanitizers, target-cpu=native) must not leak
    // into the device build.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_RUSTFLAGS",
    ] {
        cmd.env_remove(var);
    }
    let output = cmd.output().map_err(|e| format!("could not run cargo for the PTX build: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "the PTX build of kernels-gpu failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let ptx = std::fs::read_to_string(out).map_err(|e| format!("no PTX at {}: {e}", out.display()))?;
    if !ptx.contains(".entry") {
        return Err(format!("{} holds no kernel entry points", out.display()));
    }
    Ok(())
}

#[allow(dead_code)]
pub fn default_ptx_target_dir(workspace: &Path) -> PathBuf {
    workspace.join("target").join("ptx")
}
