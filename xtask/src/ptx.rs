//! `build-ptx`: the PTX build (shared with the root `build.rs`), finding `ptxas`, and reading
//! its `-v` report.

use crate::build_ptx::{build_ptx, default_ptx_target_dir, device_cargo};
use crate::{BuildPtxOpts, workspace_root};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Builds the PTX for `arch`; returns the path of the file (in the PTX target directory).
///
/// The build writes into a fixed file per architecture, `target/ptx/xtask/kernels-<arch>.ptx`,
/// so that repeating it with unchanged sources is a no-op for cargo. Cargo does not know that
/// file: should it be deleted while cargo still considers the build fresh, the fingerprint is
/// dropped and the build run again.
pub fn build(root: &Path, arch: &str) -> Result<PathBuf, String> {
    let target_dir = default_ptx_target_dir(root);
    let scratch_dir = target_dir.join("xtask");
    std::fs::create_dir_all(&scratch_dir).map_err(|e| format!("cannot create {}: {e}", scratch_dir.display()))?;
    let scratch = scratch_dir.join(format!("kernels-{arch}.ptx"));
    let crate_dir = root.join("kernels-gpu");
    let cargo = device_cargo(root)?;
    let warnings = match build_ptx(&cargo, &crate_dir, &target_dir, arch, &scratch) {
        Ok(w) => w,
        Err(e) => {
            if scratch.exists() || !e.starts_with("no PTX at") {
                return Err(e);
            }
            forget_fingerprint(&target_dir);
            build_ptx(&cargo, &crate_dir, &target_dir, arch, &scratch)?
        }
    };
    // The host build's warnings fail CI through clippy's -D warnings; the device build's
    // (code only compiled for nvptx64) would otherwise pass unseen.
    if !warnings.is_empty() {
        return Err(format!(
            "the device crate has warnings for nvptx64 (see them with `touch kernels-gpu/src/lib.rs && cargo build`):\n  {}",
            warnings.join("\n  ")
        ));
    }
    Ok(scratch)
}

/// Removes cargo's fingerprints of `kernels-gpu` in the PTX target directory (forces a rebuild).
fn forget_fingerprint(target_dir: &Path) {
    let fp = target_dir.join("nvptx64-nvidia-cuda").join("release").join(".fingerprint");
    if let Ok(dir) = std::fs::read_dir(&fp) {
        for entry in dir.flatten() {
            if entry.file_name().to_string_lossy().starts_with("kernels-gpu-") {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

pub fn build_ptx_cmd(o: &BuildPtxOpts) -> Result<(), String> {
    let root = workspace_root();
    let ptx_path = o.out.join(format!("kernels-{}.ptx", o.arch));
    println!("building the PTX for {} ...", o.arch);
    let t = Instant::now();
    let built = build(&root, &o.arch)?;
    std::fs::create_dir_all(&o.out).map_err(|e| format!("cannot create {}: {e}", o.out.display()))?;
    std::fs::copy(&built, &ptx_path).map_err(|e| format!("cannot write {}: {e}", ptx_path.display()))?;
    let ptx = std::fs::read_to_string(&ptx_path).map_err(|e| format!("cannot read {}: {e}", ptx_path.display()))?;
    let entries: Vec<&str> = kernels_gpu::ptx_entries(&ptx).collect();
    println!(
        "wrote {} ({} kernels, {} KiB) in {:.1} s",
        ptx_path.display(),
        entries.len(),
        ptx.len() / 1024,
        t.elapsed().as_secs_f64()
    );

    let Some((ptxas, source)) = find_ptxas()? else {
        let msg = "ptxas not found ($PTXAS, PATH, or the pip wheel: pip install nvidia-cuda-nvcc-cu12)";
        if o.require_ptxas {
            return Err(format!("{msg}; --require-ptxas was given"));
        }
        println!("{msg}: the PTX was built but not assembled or checked");
        return Ok(());
    };
    println!("ptxas: {} (from {source}; {})", ptxas.display(), ptxas_version(&ptxas));

    let cubin = o.out.join(format!("kernels-{}.cubin", o.arch));
    let output = Command::new(&ptxas)
        .arg(format!("-arch={}", o.arch))
        .arg("-v")
        .arg(&ptx_path)
        .arg("-o")
        .arg(&cubin)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if !output.status.success() {
        let errors: Vec<&str> = text.lines().filter(|l| !l.starts_with("ptxas info")).collect();
        return Err(format!("ptxas failed ({}):\n{}", output.status, errors.join("\n")));
    }
    for w in text.lines().filter(|l| l.contains("warning")) {
        println!("{w}");
    }

    check_modules(&ptxas, &ptx, &o.arch, &o.out)?;

    let funcs = parse_ptxas_verbose(&text);
    let report = Report::new(&entries, &funcs)?;
    print!("{}", report.table());
    println!("wrote {}", cubin.display());
    println!("{}", report.summary(&o.arch));
    let offenders = report.offenders();
    if !offenders.is_empty() {
        let list = offenders.join("\n  ");
        if o.allow_spills {
            println!("allowed by --allow-spills:\n  {list}");
        } else {
            return Err(format!(
                "{} function(s) spill registers or use a stack frame (--allow-spills to accept):\n  {list}",
                offenders.len()
            ));
        }
    }
    Ok(())
}

/// Assembles each of the modules the host loads on first use (`kernels_gpu::ptx_modules`) on its
/// own, so that a reference the split missed fails here and not on a user's GPU. Parallel: about
/// a hundred ptxas runs, most of a second each.
fn check_modules(ptxas: &Path, ptx: &str, arch: &str, out: &Path) -> Result<(), String> {
    let t = Instant::now();
    let modules = kernels_gpu::ptx_modules::split(ptx);
    let dir = out.join(format!("modules-{arch}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut jobs = Vec::new();
    for m in &modules {
        let path = dir.join(format!("{}.ptx", m.key));
        std::fs::write(&path, &m.text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        jobs.push(path);
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(16);
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut failed = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(path) = jobs.get(i) else { break };
                        let run = Command::new(ptxas)
                            .arg(format!("-arch={arch}"))
                            .arg(path)
                            .arg("-o")
                            .arg(path.with_extension("cubin"))
                            .output();
                        match run {
                            Ok(o) if o.status.success() => {}
                            Ok(o) => failed.push(format!(
                                "{}: {}",
                                path.display(),
                                String::from_utf8_lossy(&o.stderr).lines().take(5).collect::<Vec<_>>().join("; ")
                            )),
                            Err(e) => failed.push(format!("{}: cannot run ptxas: {e}", path.display())),
                        }
                    }
                    failed
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|_| vec!["a ptxas worker panicked".into()])).collect()
    });
    if !failures.is_empty() {
        return Err(format!(
            "{} of {} modules do not assemble on their own:\n  {}",
            failures.len(),
            modules.len(),
            failures.join("\n  ")
        ));
    }
    let largest = modules.iter().max_by_key(|m| m.text.len()).expect("the PTX has kernels");
    println!(
        "{} modules (one per op) assemble on their own, in {:.1} s; largest {} ({} KiB); in {}",
        modules.len(),
        t.elapsed().as_secs_f64(),
        largest.key,
        largest.text.len() / 1024,
        dir.display()
    );
    Ok(())
}

/// Spills accepted, by kernel, with the most bytes of stack frame and of spill loads each may
/// have. Each is measured to cost less than what avoiding it costs (the norms' eight-vector
/// forwards, here until 2026-11-26g, no longer spill):
/// - `gemm_{nn,tn,tt}_128x128`, on sm_80 only: a few words in the loop for edge tiles (bounds
///   tests per chunk) under the 128-register cap that fits two blocks an SM; the loop of interior
///   tiles, where large products spend their time, has none (read in the SASS), and sm_90 none.
/// - `gemm_wgmma_*`, on sm_90a: the general epilogue (`store_tile`, bias, activation, residual)
///   is a rolled loop over the 128 accumulators, handed to it in local memory, since registers
///   cannot be indexed. Only that path writes the frame; unrolling it instead costs tens of
///   kilobytes of code per kernel.
///
/// A name ending in `*` is a prefix.
const KNOWN_SPILLS: &[(&str, u64)] =
    &[("gemm_nn_128x128", 84), ("gemm_tn_128x128", 8), ("gemm_tt_128x128", 16), ("gemm_wgmma_*", 584)];

/// Whether `name` is matched by a [`KNOWN_SPILLS`] pattern.
fn spill_pattern_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    }
}

/// `ptxas` from `$PTXAS`, else PATH, else the `nvidia-cuda-nvcc-cu12` pip wheel, with where it
/// came from. An explicit `$PTXAS` that does not exist is an error.
pub fn find_ptxas() -> Result<Option<(PathBuf, &'static str)>, String> {
    if let Some(p) = std::env::var_os("PTXAS").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(Some((p, "$PTXAS"))) } else { Err(format!("PTXAS={} is not a file", p.display())) };
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("ptxas");
            if p.is_file() {
                return Ok(Some((p, "PATH")));
            }
        }
    }
    let py = Command::new("python3")
        .args(["-c", "import nvidia.cuda_nvcc, os; print(nvidia.cuda_nvcc.__path__[0])"])
        .stderr(std::process::Stdio::null())
        .output();
    if let Ok(out) = py
        && out.status.success()
    {
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let p = Path::new(&dir).join("bin").join("ptxas");
        if !dir.is_empty() && p.is_file() {
            return Ok(Some((p, "the nvidia-cuda-nvcc-cu12 wheel")));
        }
    }
    Ok(None)
}

fn ptxas_version(ptxas: &Path) -> String {
    Command::new(ptxas)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let s = String::from_utf8_lossy(&o.stdout).into_owned();
            s.lines().find(|l| l.contains("release")).map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "version unknown".into())
}

/// What `ptxas -v` says about one function.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FnInfo {
    pub name: String,
    /// A kernel (`.entry`), as opposed to a device function it calls.
    pub entry: bool,
    /// `None` for device functions (ptxas gives registers per kernel).
    pub registers: Option<u64>,
    pub barriers: u64,
    pub smem: u64,
    pub stack: u64,
    pub spill_stores: u64,
    pub spill_loads: u64,
}

/// Reads `ptxas -v` output (stdout and stderr together). The format (ptxas 12.x):
///
/// ```text
/// ptxas info    : Compiling entry function 'NAME' for 'sm_90'
/// ptxas info    : Function properties for NAME
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 24 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]
/// ptxas info    : Function properties for CALLEE          (device functions NAME calls)
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ```
///
/// Functions are returned in the order ptxas first names them, each once.
pub fn parse_ptxas_verbose(text: &str) -> Vec<FnInfo> {
    let mut funcs: Vec<FnInfo> = Vec::new();
    let index = |funcs: &mut Vec<FnInfo>, name: &str| -> usize {
        funcs.iter().position(|f| f.name == name).unwrap_or_else(|| {
            funcs.push(FnInfo { name: name.to_string(), ..FnInfo::default() });
            funcs.len() - 1
        })
    };
    let mut current: Option<usize> = None; // the kernel being compiled
    let mut props: Option<usize> = None; // the function whose properties come next
    let mut last_named: Option<usize> = None; // the function whose properties were named last
    for raw in text.lines() {
        let line = match raw.trim_start().strip_prefix("ptxas info") {
            Some(rest) => rest.trim_start().trim_start_matches(':').trim(),
            None => raw.trim(),
        };
        if let Some(rest) = line.strip_prefix("Compiling entry function") {
            let name = rest.trim().split('\'').nth(1).unwrap_or("").to_string();
            if !name.is_empty() {
                let i = index(&mut funcs, &name);
                funcs[i].entry = true;
                current = Some(i);
            }
        } else if let Some(name) = line.strip_prefix("Function properties for") {
            let name = name.trim();
            if !name.is_empty() {
                props = Some(index(&mut funcs, name));
                last_named = props;
            }
        } else if line.contains("bytes stack frame") {
            if let Some(i) = props.take() {
                for (n, what) in line.split(',').filter_map(count) {
                    match what {
                        "bytes stack frame" => funcs[i].stack = n,
                        "bytes spill stores" => funcs[i].spill_stores = n,
                        "bytes spill loads" => funcs[i].spill_loads = n,
                        _ => {}
                    }
                }
            }
        } else if line.starts_with("Used ") {
            // Belongs to the kernel being compiled; without a "Compiling entry function" line,
            // to the function whose properties were named last.
            let Some(i) = current.or(last_named) else {
                continue;
            };
            funcs[i].entry = true;
            for (n, what) in line.split(',').filter_map(count) {
                match what {
                    "registers" => funcs[i].registers = Some(n),
                    "barriers" => funcs[i].barriers = n,
                    "bytes smem" => funcs[i].smem = n,
                    _ => {}
                }
            }
        }
    }
    funcs
}

/// `"Used 24 registers"`, `"used 0 barriers"`, `"16 bytes smem"` -> `(24, "registers")`, ...
fn count(piece: &str) -> Option<(u64, &str)> {
    let p = piece.trim();
    let p = p.strip_prefix("Used ").or_else(|| p.strip_prefix("used ")).unwrap_or(p);
    let (n, what) = p.split_once(' ')?;
    Some((n.parse().ok()?, what.trim()))
}

/// The kernels of a PTX module with what ptxas said about them.
pub struct Report<'a> {
    kernels: Vec<&'a FnInfo>,
    /// Device functions (called by kernels, not inlined).
    others: Vec<&'a FnInfo>,
}

impl<'a> Report<'a> {
    /// Pairs the PTX's entry points with ptxas's report; every entry must be in it.
    pub fn new(entries: &[&str], funcs: &'a [FnInfo]) -> Result<Report<'a>, String> {
        let mut kernels = Vec::new();
        let mut missing = Vec::new();
        for &e in entries {
            match funcs.iter().find(|f| f.name == e && f.registers.is_some()) {
                Some(f) => kernels.push(f),
                None => missing.push(e),
            }
        }
        if !missing.is_empty() {
            return Err(format!(
                "ptxas -v reported nothing (or no register count) for {} of {} kernels, e.g. {} \
                 (has its output format changed?)",
                missing.len(),
                entries.len(),
                missing.iter().take(5).copied().collect::<Vec<_>>().join(", ")
            ));
        }
        let others = funcs.iter().filter(|f| !f.entry && !entries.contains(&f.name.as_str())).collect();
        Ok(Report { kernels, others })
    }

    pub fn table(&self) -> String {
        let w = self.kernels.iter().map(|f| f.name.len()).max().unwrap_or(0).max("kernel".len());
        let mut s = format!(
            "{:<w$}  {:>4}  {:>6}  {:>5}  {:>8}  {:>8}  {:>3}\n",
            "kernel", "regs", "smem B", "stack", "spill st", "spill ld", "bar"
        );
        for f in &self.kernels {
            s += &format!(
                "{:<w$}  {:>4}  {:>6}  {:>5}  {:>8}  {:>8}  {:>3}\n",
                f.name,
                f.registers.unwrap_or(0),
                f.smem,
                f.stack,
                f.spill_stores,
                f.spill_loads,
                f.barriers
            );
        }
        s
    }

    /// One line: kernel count, most registers, spills and stack frames.
    pub fn summary(&self, arch: &str) -> String {
        let max = self.kernels.iter().max_by_key(|f| f.registers.unwrap_or(0));
        let regs = max.map_or("-".to_string(), |f| format!("{} ({})", f.registers.unwrap_or(0), f.name));
        let spilling = self.kernels.iter().filter(|f| f.spill_stores + f.spill_loads > 0).count();
        let stack = self.kernels.iter().filter(|f| f.stack > 0).count();
        let smem = self.kernels.iter().map(|f| f.smem).max().unwrap_or(0);
        let dev_bad = self.others.iter().filter(|f| f.stack + f.spill_stores + f.spill_loads > 0).count();
        let mut s = format!(
            "summary: {} kernels for {arch}; max registers {regs}; max static smem {smem} B; {}; {}",
            self.kernels.len(),
            if spilling == 0 { "no spills".to_string() } else { format!("{spilling} kernel(s) SPILL") },
            if stack == 0 { "no stack frames".to_string() } else { format!("{stack} kernel(s) have a STACK FRAME") },
        );
        if dev_bad > 0 {
            s += &format!("; {dev_bad} device functions spill or have a stack frame");
        }
        s
    }

    /// Every function (kernel or device function) that spills or has a stack frame beyond what
    /// [`KNOWN_SPILLS`] accepts for it.
    pub fn offenders(&self) -> Vec<String> {
        self.kernels
            .iter()
            .chain(self.others.iter())
            .filter(|f| f.stack + f.spill_stores + f.spill_loads > 0)
            .filter(|f| {
                !KNOWN_SPILLS.iter().any(|&(pattern, bytes)| {
                    f.entry && spill_pattern_matches(pattern, &f.name) && f.stack.max(f.spill_loads) <= bytes
                })
            })
            .map(|f| {
                format!(
                    "{}{}: {} B stack frame, {} B spill stores, {} B spill loads",
                    if f.entry { "" } else { "(device function) " },
                    f.name,
                    f.stack,
                    f.spill_stores,
                    f.spill_loads
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real ptxas 12.9 output (sm_90), trimmed, plus a kernel with shared memory and spills.
    const SAMPLE: &str = "\
ptxas info    : 79 bytes gmem
ptxas info    : Compiling entry function 'uniform_f32' for 'sm_90'
ptxas info    : Function properties for uniform_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers
ptxas info    : Compile time = 12.699 ms
ptxas info    : Compiling entry function 'sub_row_fwd_f32' for 'sm_90'
ptxas info    : Function properties for sub_row_fwd_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 38 registers, used 0 barriers
ptxas info    : Function properties for _RNvNtCsbSE61zFgCyu_4core9panicking9panic_fmt
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compile time = 3.5 ms
ptxas info    : Compiling entry function 'softmax_f32' for 'sm_90'
ptxas info    : Function properties for softmax_f32
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]
ptxas info    : Function properties for _RNvNtCsbSE61zFgCyu_4core9panicking9panic_fmt
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compile time = 3.5 ms
";

    #[test]
    fn parses_ptxas_verbose() {
        let f = parse_ptxas_verbose(SAMPLE);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0], FnInfo { name: "uniform_f32".into(), entry: true, registers: Some(24), ..FnInfo::default() });
        assert_eq!(f[1].name, "sub_row_fwd_f32");
        assert_eq!(f[1].registers, Some(38));
        assert!(!f[2].entry);
        assert_eq!(f[2].registers, None);
        assert_eq!(
            f[3],
            FnInfo {
                name: "softmax_f32".into(),
                entry: true,
                registers: Some(255),
                barriers: 1,
                smem: 1024,
                stack: 16,
                spill_stores: 8,
                spill_loads: 4,
            }
        );
    }

    #[test]
    fn parses_older_format_without_barriers_or_compiling_lines() {
        let text = "\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 352 bytes cmem[0]
";
        let f = parse_ptxas_verbose(text);
        assert_eq!(f, vec![FnInfo { name: "k".into(), entry: true, registers: Some(10), ..FnInfo::default() }]);
    }

    #[test]
    fn report_and_checks() {
        let f = parse_ptxas_verbose(SAMPLE);
        let r = Report::new(&["uniform_f32", "sub_row_fwd_f32", "softmax_f32"], &f).unwrap();
        let table = r.table();
        assert_eq!(table.lines().count(), 4);
        assert!(table.lines().nth(3).unwrap().starts_with("softmax_f32"));
        let s = r.summary("sm_90");
        assert!(s.contains("3 kernels for sm_90"), "{s}");
        assert!(s.contains("max registers 255 (softmax_f32)"), "{s}");
        assert!(s.contains("1 kernel(s) SPILL") && s.contains("1 kernel(s) have a STACK FRAME"), "{s}");
        assert_eq!(r.offenders().len(), 1);
        assert!(r.offenders()[0].starts_with("softmax_f32: 16 B stack frame"));

        let clean = Report::new(&["uniform_f32", "sub_row_fwd_f32"], &f).unwrap();
        assert!(clean.offenders().is_empty());
        assert!(spill_pattern_matches("gemm_wgmma_*", "gemm_wgmma_nn_bf16_f32"));
        assert!(!spill_pattern_matches("gemm_wgmma_*", "gemm_tc_nn_bf16_f32"));
        assert!(spill_pattern_matches("gemm_nn_128x128", "gemm_nn_128x128"));
        assert!(!spill_pattern_matches("gemm_nn_128x128", "gemm_nn_128x128_v2"));
        assert!(clean.summary("sm_90").contains("no spills; no stack frames"));

        // A kernel of the PTX that ptxas did not report: the parser has lost track.
        let err = Report::new(&["uniform_f32", "gelu_f32"], &f).err().unwrap();
        assert!(err.contains("gelu_f32"), "{err}");
    }

    #[test]
    fn counts() {
        assert_eq!(count(" Used 24 registers"), Some((24, "registers")));
        assert_eq!(count(" used 0 barriers"), Some((0, "barriers")));
        assert_eq!(count(" 1024 bytes smem"), Some((1024, "bytes smem")));
        assert_eq!(count("Compile time = 1 ms"), None);
        assert_eq!(count(""), None);
    }
}
