//! Project chores, run as `cargo xtask <command>` (alias in `.cargo/config.toml`).
//!
//! - `build-ptx`: compiles `kernels-gpu` to PTX for one architecture and, when `ptxas` can be
//!   found, assembles it and reports registers, shared memory, stack frames and spills per kernel,
//!   and assembles each per-op module the host loads (`kernels_gpu::ptx_modules`) on its own.
//! - `gpu-bundle`: builds the test, bench and example binaries in release and packs them, with
//!   the PTX and two shell scripts, into one folder that runs on a GPU machine without Rust.

// Shared with the root build.rs (which `include!`s it).
#[path = "../../kernels-gpu/build_ptx.rs"]
mod build_ptx;
mod bundle;
mod ptx;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const HELP: &str = "\
cargo xtask: project chores

USAGE:
    cargo xtask <COMMAND> [OPTIONS]

COMMANDS:
    build-ptx     Build the PTX for one architecture and check it with ptxas
    gpu-bundle    Build the GPU test/bench/example binaries into a folder for the GPU machine
    help          Print this message (also: <COMMAND> --help)
";

const BUILD_PTX_HELP: &str = "\
cargo xtask build-ptx: build the kernels' PTX and check it with ptxas

USAGE:
    cargo xtask build-ptx [OPTIONS]

OPTIONS:
    --arch <ARCH>       Target architecture: sm_80, sm_90 or sm_90a [default: sm_90]
    --out <DIR>         Output folder [default: target/ptx-out in the workspace]
    --allow-spills      Do not fail when a kernel spills registers or has a stack frame
    --require-ptxas     Fail when ptxas cannot be found (instead of only building the PTX)
    -h, --help          Print this message

Writes DIR/kernels-<ARCH>.ptx. ptxas is looked for in $PTXAS, then on PATH, then in the pip
wheel nvidia-cuda-nvcc-cu12 (`pip install nvidia-cuda-nvcc-cu12`). When found, it assembles
the PTX to DIR/kernels-<ARCH>.cubin and prints, per kernel, registers, shared memory, stack
frame, spill stores/loads and barriers. It also assembles each of the per-op modules the library
loads on first use (DIR/modules-<ARCH>/<op>.ptx) on its own. Fails if ptxas fails on the PTX or
on a module, or if any kernel spills or has a stack frame (unless --allow-spills).
";

const GPU_BUNDLE_HELP: &str = "\
cargo xtask gpu-bundle: pack the GPU test suite for a machine without Rust

USAGE:
    cargo xtask gpu-bundle [OPTIONS]

OPTIONS:
    --out <DIR>     Bundle folder [default: .bundle in the workspace]; it is replaced if it
                    holds an earlier bundle, and refused if it holds anything else
    --no-python     Leave out the PyTorch package (python/); without this flag a missing
                    maturin is an error, so that the suite cannot lose its pytest tests
                    (about 130 of them) without anyone noticing
    -h, --help      Print this message

Builds in release the test binaries, benches and examples of the `kernels` package and writes:
    DIR/bin/tests/<name>, DIR/bin/benches/<name>, DIR/bin/examples/<name>   (stripped)
    DIR/bin/kernels-sm_90.ptx    the PTX for sm_90, for inspection (the binaries embed their own)
                                 (bin/ goes packed, as DIR/bin.tar.xz: the scripts unpack it)
    DIR/*.py                     benches/*.py and scripts/*.py, if any
    DIR/python/, DIR/run-python-tests.sh
                                 the PyTorch package's wheel, tests and bench, and their runner
    DIR/run-gpu-suite.sh         the tests, then the examples, benches, torch_NAME.py and
                                 compare.py; run it from the repository root; --tests-only,
                                 --skip-tests, --jobs N
                                 (N test binaries at once); results and logs under $OUT if
                                 set (see its --help)
    DIR/run-sanitizer.sh         the tests under compute-sanitizer memcheck, racecheck and
                                 synccheck; --tool T, --bin NAME (see its --help)
    DIR/MANIFEST.txt             what the bundle holds
";

#[cfg(unix)]
unsafe extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`cargo xtask build-ptx | head`) instead of panicking in
    // `println!`: restore the default action of SIGPIPE (13; SIG_DFL = 0), which Rust ignores.
    #[cfg(unix)]
    // SAFETY: called before any other thread exists; `signal` has no other preconditions.
    unsafe {
        signal(13, 0);
    }
    // Lossy, so that an argument that is not UTF-8 is reported as unexpected, not a panic.
    let args: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprint!("{HELP}");
        return ExitCode::from(2);
    };
    let result = match cmd.as_str() {
        "build-ptx" => parse_build_ptx(rest).and_then(|o| o.map_or(Ok(()), |o| ptx::build_ptx_cmd(&o))),
        "gpu-bundle" => parse_gpu_bundle(rest).and_then(|o| o.map_or(Ok(()), |o| bundle::gpu_bundle(&o))),
        "help" | "-h" | "--help" => {
            print!("{HELP}");
            Ok(())
        }
        other => {
            eprintln!("error: unknown command `{other}`\n");
            eprint!("{HELP}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of this package).
pub fn workspace_root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_path_buf()
}

/// Options of `build-ptx`.
#[derive(Debug, Clone, PartialEq)]
pub struct BuildPtxOpts {
    pub arch: String,
    pub out: PathBuf,
    pub allow_spills: bool,
    pub require_ptxas: bool,
}

/// Options of `gpu-bundle`.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleOpts {
    pub out: PathBuf,
    /// Leave out the PyTorch package (`--no-python`); without it a missing maturin is an error.
    pub python: bool,
}

pub const ARCHES: [&str; 3] = ["sm_80", "sm_90", "sm_90a"];

/// Splits `--flag value` / `--flag=value`: returns the value of `flag` at `args[*i]`, advancing
/// `i` past it, or `None` if `args[*i]` is another argument.
fn flag_value(args: &[String], i: &mut usize, flag: &str) -> Result<Option<String>, String> {
    let a = &args[*i];
    if a == flag {
        *i += 1;
        match args.get(*i) {
            Some(v) if !v.starts_with("--") => Ok(Some(v.clone())),
            _ => Err(format!("`{flag}` needs a value")),
        }
    } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
        if v.is_empty() { Err(format!("`{flag}` needs a value")) } else { Ok(Some(v.to_string())) }
    } else {
        Ok(None)
    }
}

/// `Ok(None)` when help was asked for (and printed).
fn parse_build_ptx(args: &[String]) -> Result<Option<BuildPtxOpts>, String> {
    let mut o = BuildPtxOpts {
        arch: "sm_90".into(),
        out: workspace_root().join("target").join("ptx-out"),
        allow_spills: false,
        require_ptxas: false,
    };
    let mut i = 0;
    while i < args.len() {
        if let Some(v) = flag_value(args, &mut i, "--arch")? {
            if !ARCHES.contains(&v.as_str()) {
                return Err(format!("unsupported --arch `{v}` (expected one of {})", ARCHES.join(", ")));
            }
            o.arch = v;
        } else if let Some(v) = flag_value(args, &mut i, "--out")? {
            o.out = PathBuf::from(v);
        } else {
            match args[i].as_str() {
                "--allow-spills" => o.allow_spills = true,
                "--require-ptxas" => o.require_ptxas = true,
                "-h" | "--help" => {
                    print!("{BUILD_PTX_HELP}");
                    return Ok(None);
                }
                other => {
                    return Err(format!("build-ptx: unexpected argument `{other}` (see --help)"));
                }
            }
        }
        i += 1;
    }
    Ok(Some(o))
}

fn parse_gpu_bundle(args: &[String]) -> Result<Option<BundleOpts>, String> {
    let mut o = BundleOpts { out: workspace_root().join(".bundle"), python: true };
    let mut i = 0;
    while i < args.len() {
        if let Some(v) = flag_value(args, &mut i, "--out")? {
            o.out = PathBuf::from(v);
        } else {
            match args[i].as_str() {
                "--no-python" => o.python = false,
                "-h" | "--help" => {
                    print!("{GPU_BUNDLE_HELP}");
                    return Ok(None);
                }
                other => {
                    return Err(format!("gpu-bundle: unexpected argument `{other}` (see --help)"));
                }
            }
        }
        i += 1;
    }
    Ok(Some(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn build_ptx_args() {
        let o = parse_build_ptx(&s(&[])).unwrap().unwrap();
        assert_eq!(o.arch, "sm_90");
        assert!(o.out.ends_with("target/ptx-out"));
        let o =
            parse_build_ptx(&s(&["--arch", "sm_80", "--out=x", "--allow-spills", "--require-ptxas"])).unwrap().unwrap();
        assert_eq!(o, BuildPtxOpts { arch: "sm_80".into(), out: "x".into(), allow_spills: true, require_ptxas: true });
        assert_eq!(parse_build_ptx(&s(&["--arch=sm_90a"])).unwrap().unwrap().arch, "sm_90a");
        assert!(parse_build_ptx(&s(&["--arch", "sm_70"])).is_err());
        assert!(parse_build_ptx(&s(&["--arch"])).is_err());
        assert!(parse_build_ptx(&s(&["--arch", "--out", "x"])).is_err());
        assert!(parse_build_ptx(&s(&["--out="])).is_err());
        assert!(parse_build_ptx(&s(&["--bogus"])).is_err());
        assert!(parse_build_ptx(&s(&["--help"])).unwrap().is_none());
    }

    #[test]
    fn gpu_bundle_args() {
        let o = parse_gpu_bundle(&s(&[])).unwrap().unwrap();
        assert!(o.out.ends_with(".bundle") && o.python);
        assert!(!parse_gpu_bundle(&s(&["--no-python"])).unwrap().unwrap().python);
        assert_eq!(parse_gpu_bundle(&s(&["--out", "b"])).unwrap().unwrap().out, PathBuf::from("b"));
        assert!(parse_gpu_bundle(&s(&["b"])).is_err());
        assert!(parse_gpu_bundle(&s(&["--out"])).is_err());
    }
}
