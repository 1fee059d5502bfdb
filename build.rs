//! Compiles the device crate `kernels-gpu` to PTX and hands it to the library, which embeds it
//! (`include_bytes!`) deflate-compressed: the PTX of every kernel is several MB of text, and every
//! binary that links the library carries it. Needs only the pinned nightly with `rust-src` (rust-toolchain.toml): no
//! CUDA toolkit. The device builds have their own target directories (`target/ptx/<arch>`), so
//! they are cached and rebuilt only when a kernel source changes.
//!
//! Two modules are built, in parallel: `sm_80`, which the driver compiles for any GPU from
//! Ampere on, and `sm_90`, the same kernels plus those that need Hopper (thread-block clusters,
//! `#[cfg(target_feature = "sm_90")]` in kernels-gpu). A device loads the newest one it can run
//! (`device::ptx_arch_for`).

include!("kernels-gpu/build_ptx.rs");

/// The architectures embedded, oldest first; `host/device.rs` names the same.
const ARCHES: [&str; 2] = ["sm_80", "sm_90"];

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=kernels-gpu/src");
    println!("cargo:rerun-if-changed=kernels-gpu/Cargo.toml");
    println!("cargo:rerun-if-changed=kernels-gpu/build_ptx.rs");
    println!("cargo:rerun-if-changed=rust-toolchain.toml");
    let builds: Vec<_> = ARCHES
        .iter()
        .map(|&arch| {
            let (root, out_dir) = (root.clone(), out_dir.clone());
            std::thread::spawn(move || {
                let out = out_dir.join(format!("kernels-{arch}.ptx"));
                let target = default_ptx_target_dir(&root).join(arch);
                build_ptx(&root.join("kernels-gpu"), &target, arch, &out).map(|w| (arch, out, w))
            })
        })
        .collect();
    for b in builds {
        match b.join().expect("the PTX build thread panicked") {
            Ok((arch, out, warnings)) => {
                for w in warnings {
                    println!("cargo:warning=kernels-gpu (nvptx64, {arch}): {w}");
                }
                let ptx = std::fs::read(&out).expect("the PTX was just written");
                let packed = miniz_oxide::deflate::compress_to_vec(&ptx, 9);
                std::fs::write(out_dir.join(format!("kernels-{arch}.ptx.deflate")), packed)
                    .expect("OUT_DIR is writable");
            }
            Err(e) => panic!("{e}"),
        }
    }
}
