//! Compiles the device crate `kernels-gpu` to PTX and hands it to the library, which embeds it
//! (`include_bytes!`) deflate-compressed: the PTX of every kernel is several MB of text, and every
//! binary that links the library carries it. Needs only the pinned nightly with `rust-src` (rust-toolchain.toml): no
//! CUDA toolkit. The device build has its own target directory (`target/ptx`), so it is cached
//! and rebuilt only when a kernel source changes.
//!
//! `KERNELS_PTX_ARCH` picks the target (default `sm_80`: the driver compiles the PTX for any
//! newer GPU at load time, the H100 included).

include!("kernels-gpu/build_ptx.rs");

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let arch = std::env::var("KERNELS_PTX_ARCH").unwrap_or_else(|_| "sm_80".to_string());
    println!("cargo:rerun-if-env-changed=KERNELS_PTX_ARCH");
    println!("cargo:rerun-if-changed=kernels-gpu/src");
    println!("cargo:rerun-if-changed=kernels-gpu/Cargo.toml");
    println!("cargo:rerun-if-changed=kernels-gpu/build_ptx.rs");
    println!("cargo:rerun-if-changed=rust-toolchain.toml");
    let out = out_dir.join("kernels.ptx");
    match build_ptx(&root.join("kernels-gpu"), &default_ptx_target_dir(&root), &arch, &out) {
        Ok(warnings) => {
            for w in warnings {
                println!("cargo:warning=kernels-gpu (nvptx64): {w}");
            }
        }
        Err(e) => panic!("{e}"),
    }
    let ptx = std::fs::read(&out).expect("the PTX was just written");
    let packed = miniz_oxide::deflate::compress_to_vec(&ptx, 9);
    std::fs::write(out_dir.join("kernels.ptx.deflate"), packed).expect("OUT_DIR is writable");
    println!("cargo:rustc-env=KERNELS_PTX_ARCH={arch}");
}
