//! Compiles the device crate `kernels-gpu` to PTX and hands it to the library, which embeds it
//! (`include_bytes!`) deflate-compressed: the PTX of every kernel is several MB of text, and every
//! binary that links the library carries it. Needs only the nightly pinned in rust-toolchain.toml,
//! with `rust-src`, and no CUDA toolkit. A build by another toolchain (a dependent on stable) runs
//! the device build with that nightly's cargo, found through rustup, which installs it first if
//! it is missing. The device builds have their own target directories, under OUT_DIR (so a git or
//! registry dependency writes nothing into its sources), where they are cached and rebuilt only
//! when a kernel source changes.
//!
//! Three modules are built, in parallel: `sm_80`, which the driver compiles for any GPU from
//! Ampere on; `sm_90`, the same kernels plus those that need Hopper (thread-block clusters,
//! `#[cfg(target_feature = "sm_90")]` in kernels-gpu), for any GPU from Hopper on; and `sm_90a`,
//! those plus the kernels of Hopper's architecture-specific instructions (`wgmma`,
//! `setmaxnreg`; `#[cfg(target_feature = "sm_90a")]`), which only compute capability 9.0 runs.
//! A device loads the newest one it can run (`device::ptx_arch_for`).

include!("kernels-gpu/build_ptx.rs");

/// The architectures embedded, oldest first; `host/device.rs` names the same.
const ARCHES: [&str; 3] = ["sm_80", "sm_90", "sm_90a"];

fn main() {
    println!("cargo::rerun-if-changed=kernels-gpu/src");
    println!("cargo::rerun-if-changed=kernels-gpu/Cargo.toml");
    println!("cargo::rerun-if-changed=kernels-gpu/build_ptx.rs");
    println!("cargo::rerun-if-changed=rust-toolchain.toml");
    if let Err(e) = run() {
        // One line is a sentence for the user (say, a toolchain to install): cargo shows it as
        // its own error. A failed device build comes with rustc's output, shown as the script's.
        if e.contains('\n') {
            eprintln!("{e}");
            std::process::exit(1);
        }
        println!("cargo::error={e}");
    }
}

fn run() -> Result<(), String> {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?);
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let cargo = std::sync::Arc::new(device_cargo(&root)?);
    let builds: Vec<_> = ARCHES
        .iter()
        .map(|&arch| {
            let (root, out_dir, cargo) = (root.clone(), out_dir.clone(), cargo.clone());
            std::thread::spawn(move || {
                let out = out_dir.join(format!("kernels-{arch}.ptx"));
                let target = out_dir.join("ptx-target").join(arch);
                build_ptx(&cargo, &root.join("kernels-gpu"), &target, arch, &out).map(|w| (arch, out, w))
            })
        })
        .collect();
    for b in builds {
        let (arch, out, warnings) = b.join().map_err(|_| "the PTX build thread panicked")??;
        for w in warnings {
            println!("cargo::warning=kernels-gpu (nvptx64, {arch}): {w}");
        }
        let ptx = std::fs::read(&out).map_err(|e| format!("cannot read {}: {e}", out.display()))?;
        let packed = miniz_oxide::deflate::compress_to_vec(&ptx, 9);
        let path = out_dir.join(format!("kernels-{arch}.ptx.deflate"));
        std::fs::write(&path, packed).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}
