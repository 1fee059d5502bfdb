// Compiles the `kernels-gpu` crate to one PTX file. Shared by the root `build.rs` (which embeds
// the PTX in the library) and `cargo xtask build-ptx` (which writes it out and checks it with
// ptxas). Plain std only: it is `include!`d / `#[path]`-imported, not a crate.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The cargo that runs the device build. `-Zbuild-std=core` needs a nightly, and the PTX is that
/// of the nightly pinned in `rust-toolchain.toml`, with its `rust-src`.
pub enum DeviceCargo {
    /// The cargo running this build, which is that nightly (the workspace's own builds).
    Direct(OsString),
    /// The pinned toolchain's own cargo and rustc (by path, so that no `rustc` on PATH and no
    /// rustup setting can substitute another), for a build by another toolchain (a dependent on
    /// stable).
    Pinned { channel: String, sysroot: PathBuf },
}

impl DeviceCargo {
    fn command(&self) -> Command {
        match self {
            DeviceCargo::Direct(cargo) => Command::new(cargo),
            DeviceCargo::Pinned { channel, sysroot } => {
                let bin = |name: &str| sysroot.join("bin").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
                let mut cmd = Command::new(bin("cargo"));
                without_outer_toolchain(&mut cmd);
                cmd.env("RUSTC", bin("rustc")).env("RUSTUP_TOOLCHAIN", channel);
                cmd
            }
        }
    }
}

/// Removes the outer build's choice of toolchain and compiler from `cmd`'s environment: cargo
/// hands a build script its own `rustc` (`RUSTC`) and rustup its toolchain (`RUSTUP_TOOLCHAIN`),
/// which would override the pinned one, as would a `build.rustc` or `build.rustc-wrapper`
/// (`CARGO_BUILD_*`).
fn without_outer_toolchain(cmd: &mut Command) {
    for var in
        ["RUSTUP_TOOLCHAIN", "RUSTC", "RUSTDOC", "RUSTC_WRAPPER", "CARGO", "RUSTDOCFLAGS", "CARGO_ENCODED_RUSTDOCFLAGS"]
    {
        cmd.env_remove(var);
    }
    for (var, _) in std::env::vars_os() {
        if var.to_str().is_some_and(|v| v.starts_with("CARGO_BUILD_")) {
            cmd.env_remove(var);
        }
    }
}

/// `rustup`, for the pinned toolchain whatever the outer build's, installing nothing unasked.
fn rustup() -> Command {
    let mut cmd = Command::new("rustup");
    without_outer_toolchain(&mut cmd);
    cmd.env("RUSTUP_AUTO_INSTALL", "0").env("RUST_BACKTRACE", "0");
    cmd
}

/// The `channel` of the `[toolchain]` table of a `rust-toolchain.toml`.
pub fn toolchain_channel(toml: &str) -> Option<String> {
    let mut in_toolchain = false;
    for line in toml.lines().map(|l| l.split('#').next().unwrap_or("").trim()) {
        if line.starts_with('[') {
            in_toolchain = line == "[toolchain]";
        } else if in_toolchain
            && let Some((key, value)) = line.split_once('=')
            && key.trim() == "channel"
        {
            let value = value.trim().trim_matches('"').trim();
            return (!value.is_empty()).then(|| value.to_string());
        }
    }
    None
}

/// Finds the device build's cargo for the workspace at `workspace`, installing the nightly its
/// `rust-toolchain.toml` names through rustup when it is missing (rustup 1.28 and later no
/// longer install it on first use). Errors are one sentence that says what to install.
pub fn device_cargo(workspace: &Path) -> Result<DeviceCargo, String> {
    let file = workspace.join("rust-toolchain.toml");
    let channel = std::fs::read_to_string(&file)
        .ok()
        .and_then(|t| toolchain_channel(&t))
        .ok_or_else(|| format!("no toolchain channel in {}", file.display()))?;
    let install = format!("rustup toolchain install {channel} --profile minimal --component rust-src");
    let need = format!("the GPU kernels are compiled by Rust {channel} with its rust-src component");
    let outer = std::env::var_os("CARGO");
    let sysroot = match pinned_sysroot(&channel) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // No rustup: a nightly cargo may do (a toolchain from elsewhere, with rust-src).
            if let Some(cargo) = outer.filter(is_nightly) {
                return Ok(DeviceCargo::Direct(cargo));
            }
            return Err(format!(
                "{need}, which the build gets through rustup: install rustup (https://rustup.rs), then run `{install}`"
            ));
        }
        Err(e) => return Err(format!("{need}, but rustup could not be run ({e}): run `{install}`")),
        Ok(Some(sysroot)) => sysroot,
        Ok(None) => {
            let out = rustup()
                .args(["toolchain", "install", &channel, "--profile", "minimal", "--component", "rust-src"])
                .output();
            match out {
                Ok(o) if o.status.success() => {}
                Ok(o) => {
                    return Err(format!(
                        "{need}, which rustup failed to install ({}): run `{install}`",
                        rustup_error(&o.stderr)
                    ));
                }
                Err(e) => return Err(format!("{need}, which rustup failed to install ({e}): run `{install}`")),
            }
            pinned_sysroot(&channel)
                .ok()
                .flatten()
                .ok_or_else(|| format!("{need}, which rustup installed but cannot run: run `{install}`"))?
        }
    };
    if !sysroot.join("lib/rustlib/src/rust/library/core/Cargo.toml").is_file() {
        let added = rustup().args(["component", "add", "rust-src", "--toolchain", &channel]).output();
        if !added.is_ok_and(|o| o.status.success()) {
            return Err(format!("{need}, which is missing: run `rustup component add rust-src --toolchain {channel}`"));
        }
    }
    // The outer cargo is `<sysroot>/bin/cargo`: when it is the pinned toolchain's, it runs the
    // device build itself.
    let same = |cargo: &OsString| {
        let outer_root = Path::new(cargo).parent().and_then(Path::parent).and_then(|p| p.canonicalize().ok());
        outer_root.is_some() && outer_root == sysroot.canonicalize().ok()
    };
    Ok(match outer {
        Some(cargo) if same(&cargo) => DeviceCargo::Direct(cargo),
        _ => DeviceCargo::Pinned { channel, sysroot },
    })
}

/// The sysroot of an installed rustup toolchain, `None` where it is not installed.
fn pinned_sysroot(channel: &str) -> std::io::Result<Option<PathBuf>> {
    let out = rustup().args(["run", channel, "rustc", "--print", "sysroot"]).output()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok((out.status.success() && !path.is_empty()).then(|| PathBuf::from(path)))
}

fn is_nightly(cargo: &OsString) -> bool {
    Command::new(cargo).arg("-V").output().is_ok_and(|o| {
        let v = String::from_utf8_lossy(&o.stdout);
        v.contains("-nightly") || v.contains("-dev")
    })
}

/// rustup's error message (its first `error:` line; it may be followed by a backtrace).
fn rustup_error(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let error = lines.clone().find_map(|l| l.strip_prefix("error: "));
    error.or_else(|| lines.next_back()).unwrap_or("no message").to_string()
}

/// Builds `kernels-gpu` (at `crate_dir`) for `nvptx64-nvidia-cuda` and `arch` (`sm_80`,
/// `sm_90`, `sm_90a`, ...) with `cargo`, in its own `target_dir`, and writes the PTX to `out`.
///
/// The crate is built as a `staticlib` with fat LTO, so the one `.s` file holds every kernel and
/// whatever `core` code they use; no linker is involved.
/// Returns rustc's warnings about the device crate (the lines of each `warning:` block), which
/// the callers show: cargo hides a build script's output.
pub fn build_ptx(
    cargo: &DeviceCargo,
    crate_dir: &Path,
    target_dir: &Path,
    arch: &str,
    out: &Path,
) -> Result<Vec<String>, String> {
    let mut cmd = cargo.command();
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
    std::fs::write(out, add_launch_bounds(&raise_ptx_isa(&ptx)))
        .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    Ok(stderr
        .lines()
        .filter(|l| l.starts_with("warning:") && !l.contains("generated") && !l.contains("profiles for the non root"))
        .map(str::to_string)
        .collect())
}

/// Raises the PTX ISA version of sm_90 PTX from LLVM's default 7.8 to 8.1, for the cluster
/// exchange's instructions (`st.async` with an mbarrier's transaction count, 8.1; the cluster
/// barrier's explicit `.release`/`.acquire`, 8.0; see prim.rs). Each version only adds to the
/// last, so the rest of the text stays valid; drivers from CUDA 12.1 on read it. rustc's
/// `-Ctarget-feature=+ptx81` would do the same but is an unstable flag that warns.
pub fn raise_ptx_isa(ptx: &str) -> String {
    if ptx.contains("\n.target sm_90a") || ptx.contains("\n.target\tsm_90a") {
        // sm_90a (LLVM's default 8.0) also fences tensor maps (`fence.proxy.tensormap`, 8.3).
        ptx.replacen("\n.version 8.0\n", "\n.version 8.3\n", 1)
    } else if ptx.contains("\n.target sm_90") || ptx.contains("\n.target\tsm_90") {
        ptx.replacen("\n.version 7.8\n", "\n.version 8.1\n", 1)
    } else {
        ptx.to_string()
    }
}

/// The largest block a kernel is launched with, where ptxas must know it: rustc has no
/// `__launch_bounds__`, so the directive is added to the PTX here. Kernels named `*_v4_*` and
/// `*_v8_*` (and `*_u4_*`, over rows of any length) are register-resident row kernels with four or eight vectors per thread
/// (kernels-gpu/src/rows.rs) that hold the longest rows in blocks of up to 1024 threads, which
/// leaves 64 registers a thread. Without `.maxntid`, ptxas may give them more (the bf16 softmax
/// backward took 92 after an unrelated change) and the 1024-thread launch is then refused, which
/// sends those rows to the slower streaming kernel. The norms' backward is the exception: it
/// keeps column sums in registers, needs far more than 64, and is launched with what it has.
pub fn launch_bound(kernel: &str) -> Option<u32> {
    let wide = ["_v4_", "_v8_", "_u4_"].iter().any(|v| kernel.contains(v));
    (wide && !kernel.contains("norm_bwd")).then_some(1024)
}

/// Block size and minimum resident blocks per SM of a GEMM tile kernel, from its name
/// `gemm_<ops>_<BM>x<BN>` (kernels-gpu/src/gemm.rs): `BM * BN / 64` threads (an 8 x 8 block of
/// C each). This is CUDA's `__launch_bounds__(threads, blocks)`. The 256-thread tile gets two
/// blocks an SM, i.e. 128 registers, where its 64 accumulators, two 8-value fragments and one
/// staged chunk per operand fit without spilling; given a free hand ptxas takes more and only one
/// block fits. A tile of fewer threads gets no minimum (a 64 x 64 tile of 64 threads, tried,
/// stages two chunks per operand and spilled at 128; unbounded it took 144: docs/worklog.md).
pub fn gemm_launch_bounds(kernel: &str) -> Option<(u32, Option<u32>)> {
    // The 3xTF32 and plain TF32 kernels (kernels-gpu/src/gemm_tf32x3.rs): 256 threads, one block
    // an SM (its 120 KB ring and 64 + 64 accumulators a thread), so no minimum: ptxas takes
    // 214-224 for 3xTF32.
    if kernel.starts_with("gemm_tf32x3_") || kernel.starts_with("gemm_tf32_") {
        return Some((256, None));
    }
    // The bf16/f16 tensor-core kernels (kernels-gpu/src/gemm_tc.rs): 256 threads, two blocks an
    // SM (two 80 KiB rings fit), i.e. 128 registers; their split-K reduction has no bound.
    if kernel.starts_with("gemm_tc_") {
        return (!kernel.contains("splitk")).then_some((256, Some(2)));
    }
    let tile = kernel.strip_prefix("gemm_")?.rsplit('_').next()?;
    let (bm, bn) = tile.split_once('x')?;
    let threads = bm.parse::<u32>().ok()? * bn.parse::<u32>().ok()? / 64;
    Some((threads, (threads >= 256).then(|| 65536 / (threads * 128))))
}

/// Blocks per cluster of a cluster kernel, from its name `<family>_c<C>_...` (sm_90 only, e.g.
/// `layer_norm_bwd_c4_v2_f32`, kernels-gpu/src/norm.rs). The PTX directive
/// `.reqnctapercluster C, 1, 1` fixes the cluster shape at compile time, CUDA's
/// `__cluster_dims__`, so an ordinary launch (grid a multiple of C) runs in clusters. Such a
/// kernel holds a row's share of 1024 threads in registers: `.maxntid 1024` as well.
pub fn cluster_size(kernel: &str) -> Option<u32> {
    kernel.split('_').find_map(|part| part.strip_prefix('c')?.parse::<u32>().ok()).filter(|&c| c > 1)
}

/// Blocks of a kernel whose whole grid is one cluster, from its name `<family>_k<K>_...` (sm_90
/// only, e.g. `rms_norm_bwd_slices_k8_v2_bf16`): `.reqnctapercluster K, 1, 1` as [`cluster_size`], with
/// `.maxntid 512` (blocks of up to 512 threads, 128 registers).
pub fn one_cluster_size(kernel: &str) -> Option<u32> {
    kernel.split('_').find_map(|part| part.strip_prefix('k')?.parse::<u32>().ok()).filter(|&c| c > 1)
}

/// Inserts `.maxntid N, 1, 1` after the parameter list of every entry with a [`launch_bound`],
/// `.maxntid` with `.minnctapersm` after every GEMM tile kernel's ([`gemm_launch_bounds`]),
/// `.maxntid 1024` with `.reqnctapercluster` after every cluster kernel's ([`cluster_size`]), and
/// `.maxntid 512` with it after every single-cluster kernel's ([`one_cluster_size`]).
pub fn add_launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut pending: Option<String> = None;
    for line in ptx.lines() {
        // Directives added by an earlier pass (cargo leaves the `.s` file alone when the crate is
        // fresh, so the same file may come through here twice): replaced, not doubled.
        let t = line.trim_start();
        if [".maxntid", ".minnctapersm", ".reqnctapercluster"].iter().any(|d| t.starts_with(d)) {
            continue;
        }
        if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ") {
            let name = rest.split('(').next().unwrap_or(rest).trim();
            // The wgmma GEMMs (kernels-gpu/src/gemm_wgmma.rs): clusters of 2 (their `CLUSTER`).
            if name.starts_with("gemm_wgmma") {
                pending = Some(".maxntid 384, 1, 1\n.minnctapersm 1\n.reqnctapercluster 2, 1, 1\n".to_string());
                out.push_str(line);
                out.push('\n');
                continue;
            }
            // The Hopper attention kernels (kernels-gpu/src/attention/hopper.rs, hopper_bwd.rs):
            // `setmaxnreg` needs the register cap at entry.
            if name.starts_with("attention_fwd_wgmma") || name.starts_with("attention_bwd_wgmma") {
                pending = Some(".maxntid 384, 1, 1\n.minnctapersm 1\n".to_string());
                out.push_str(line);
                out.push('\n');
                continue;
            }
            pending = cluster_size(name)
                .map(|c| format!(".maxntid 1024, 1, 1\n.reqnctapercluster {c}, 1, 1\n"))
                .or_else(|| {
                    one_cluster_size(name).map(|k| format!(".maxntid 512, 1, 1\n.reqnctapercluster {k}, 1, 1\n"))
                })
                .or_else(|| launch_bound(name).map(|n| format!(".maxntid {n}, 1, 1\n")))
                .or_else(|| {
                    gemm_launch_bounds(name).map(|(t, b)| match b {
                        Some(b) => format!(".maxntid {t}, 1, 1\n.minnctapersm {b}\n"),
                        None => format!(".maxntid {t}, 1, 1\n"),
                    })
                });
        }
        out.push_str(line);
        out.push('\n');
        if line.trim() == ")"
            && let Some(d) = pending.take()
        {
            out.push_str(&d);
        }
    }
    out
}

#[allow(dead_code)]
pub fn default_ptx_target_dir(workspace: &Path) -> PathBuf {
    workspace.join("target").join("ptx")
}

#[cfg(test)]
mod tests {
    use super::toolchain_channel;

    #[test]
    fn channel_of_the_toolchain_file() {
        let file = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../rust-toolchain.toml")).unwrap();
        let channel = toolchain_channel(&file).unwrap();
        assert!(channel.starts_with("nightly-"), "{channel}");
        let toml = "[other]\nchannel = \"x\"\n[toolchain] # pinned\n  channel= \"nightly-2026-01-02\" # note\n";
        assert_eq!(toolchain_channel(toml).as_deref(), Some("nightly-2026-01-02"));
        assert_eq!(toolchain_channel("[toolchain]\ncomponents = []\n"), None);
        assert_eq!(toolchain_channel("[toolchain]\nchannel = \"\"\n"), None);
    }
}
