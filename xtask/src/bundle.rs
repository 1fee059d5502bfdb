//! `gpu-bundle`: the release test, bench and example binaries, the PTX and the scripts that run
//! them, in one folder for a GPU machine that has no Rust.

use crate::{BundleOpts, workspace_root};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Marks a folder as made by `gpu-bundle`, so a later run may replace it.
const MARKER: &str = ".kernels-gpu-bundle";
pub const SUITE_SCRIPT: &str = include_str!("../scripts/run-gpu-suite.sh");
pub const SANITIZER_SCRIPT: &str = include_str!("../scripts/run-sanitizer.sh");
pub const PYTHON_SCRIPT: &str = include_str!("../scripts/run-python-tests.sh");
/// The copy folder handed to the GPU machine may hold 64 MiB in all.
const MAX_BYTES: u64 = 64 << 20;
const WARN_BYTES: u64 = 48 << 20;

/// A binary built by cargo.
#[derive(Debug, Clone, PartialEq)]
pub struct Artifact {
    /// `test`, `bench` or `example`.
    pub kind: String,
    /// The target's name (the file name without cargo's `-hash` suffix).
    pub name: String,
    pub path: PathBuf,
}

impl Artifact {
    fn subdir(&self) -> &'static str {
        match self.kind.as_str() {
            "test" => "tests",
            "bench" => "benches",
            _ => "examples",
        }
    }
}

pub fn gpu_bundle(o: &BundleOpts) -> Result<(), String> {
    let root = workspace_root();
    let dir = if o.out.is_absolute() {
        o.out.clone()
    } else {
        std::env::current_dir().map_err(|e| format!("no current folder: {e}"))?.join(&o.out)
    };
    check_out_dir(&dir)?;

    let manifest = root.join("Cargo.toml");
    let mut arts = Vec::new();
    arts.extend(cargo_artifacts(&root, &["test", "--release", "--no-run"], &manifest, "test")?);
    arts.extend(cargo_artifacts(&root, &["bench", "--no-run"], &manifest, "bench")?);
    arts.extend(cargo_artifacts(&root, &["build", "--release", "--examples"], &manifest, "example")?);
    println!("building the PTX for sm_90 ...");
    arts.sort_by(|a, b| (a.subdir(), &a.name).cmp(&(b.subdir(), &b.name)));
    let ptx = crate::ptx::build(&root, "sm_90")?;
    let wheel = if o.python { python_wheel(&root)? } else { None };

    // Everything is built: now replace the folder.
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("cannot remove the old bundle {}: {e}", dir.display()))?;
    }
    mkdir(&dir)?;
    write(&dir.join(MARKER), "made by `cargo xtask gpu-bundle`; the whole folder is replaced by the next run\n")?;

    let strip = Command::new("strip").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    let strip = strip.is_ok_and(|s| s.success());
    if !strip {
        println!("note: no `strip` on PATH; the binaries keep their symbols");
    }
    let mut manifest_txt = String::from("# made by `cargo xtask gpu-bundle`\n");
    manifest_txt +=
        "# the binaries embed the PTX built for sm_80 and sm_90 (build.rs); a GPU loads the newest it runs\n";
    for a in &arts {
        let sub = dir.join("bin").join(a.subdir());
        mkdir(&sub)?;
        let dest = sub.join(&a.name);
        std::fs::copy(&a.path, &dest).map_err(|e| format!("cannot copy {}: {e}", a.path.display()))?;
        if strip {
            let ok = Command::new("strip").arg(&dest).status().is_ok_and(|s| s.success());
            if !ok {
                println!("warning: strip failed on {}", dest.display());
            }
        }
        let size = std::fs::metadata(&dest).map(|m| m.len()).unwrap_or(0);
        println!("  bin/{}/{} ({:.1} MiB)", a.subdir(), a.name, mib(size));
        manifest_txt += &format!("bin/{}/{}\t{size}\n", a.subdir(), a.name);
    }
    if !arts.iter().any(|a| a.kind == "test") {
        println!("warning: the `kernels` package has no test binaries yet");
    }

    // For inspection only (the binaries embed their own): packed with them, since as text it is
    // a third of the bundle (17 of 52 MiB), near the 64 MiB a GPU machine receives.
    mkdir(&dir.join("bin"))?;
    std::fs::copy(&ptx, dir.join("bin").join("kernels-sm_90.ptx")).map_err(|e| format!("cannot copy the PTX: {e}"))?;
    manifest_txt += "bin/kernels-sm_90.ptx\n";
    for sub in ["benches", "scripts"] {
        let Ok(rd) = std::fs::read_dir(root.join(sub)) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "py"))
            .collect();
        pys.sort();
        for p in pys {
            let name = p.file_name().unwrap_or_default();
            let dest = dir.join(name);
            if dest.exists() {
                println!("warning: {} is in both benches/ and scripts/; keeping the one from benches/", p.display());
                continue;
            }
            std::fs::copy(&p, &dest).map_err(|e| format!("cannot copy {}: {e}", p.display()))?;
            manifest_txt += &format!("{}\t(from {sub}/)\n", name.to_string_lossy());
        }
    }
    if let Some(wheel) = &wheel {
        manifest_txt += &python_files(&root, &dir, wheel)?;
    }
    write_script(&dir.join("run-gpu-suite.sh"), SUITE_SCRIPT)?;
    write_script(&dir.join("run-sanitizer.sh"), SANITIZER_SCRIPT)?;
    manifest_txt += "run-gpu-suite.sh\nrun-sanitizer.sh\n";
    pack_binaries(&dir)?;
    manifest_txt += "bin.tar.xz\t(bin/, unpacked by the scripts on first use)\n";
    // The commit the binaries were built from, for the results the suite writes (the GPU
    // machine's copy of the tree may carry another git state, or none).
    write(&dir.join("COMMIT"), &format!("{}\n", source_commit(&root)))?;
    manifest_txt += "COMMIT\t(the commit built, `-dirty` with uncommitted changes)\n";
    write(&dir.join("MANIFEST.txt"), &manifest_txt)?;

    let (files, bytes) = folder_size(&dir);
    let shown = dir.strip_prefix(&root).map(Path::to_path_buf).unwrap_or_else(|_| dir.clone());
    println!(
        "bundle: {} ({} tests, {} benches, {} examples; {files} files, {:.1} MiB)",
        dir.display(),
        arts.iter().filter(|a| a.kind == "test").count(),
        arts.iter().filter(|a| a.kind == "bench").count(),
        arts.iter().filter(|a| a.kind == "example").count(),
        mib(bytes)
    );
    if bytes > MAX_BYTES {
        return Err(format!("the bundle is {:.1} MiB, over the 64 MiB limit", mib(bytes)));
    }
    if bytes > WARN_BYTES {
        println!("warning: the bundle is over {} MiB; the limit is 64 MiB", WARN_BYTES >> 20);
    }
    println!(
        "on the GPU machine, from the repository root: bash {0}/run-gpu-suite.sh [--tests-only], \
         bash {0}/run-sanitizer.sh",
        shown.display()
    );
    Ok(())
}

/// Replaces `bin/` by `bin.tar.xz`, which the scripts unpack on first use. The binaries share
/// most of their bytes (each embeds the same compressed PTX, about 19 MB, and the same runtime),
/// which xz finds only with a window longer than a binary: one stream (no threads, which would
/// cut it into independent blocks) with a 192 MiB dictionary (about 2 GB of memory to pack).
fn pack_binaries(dir: &Path) -> Result<(), String> {
    let status = Command::new("tar")
        .current_dir(dir)
        .args(["-cJf", "bin.tar.xz", "bin"])
        .env("XZ_OPT", "--lzma2=preset=6,dict=192MiB -T1")
        .status()
        .map_err(|e| format!("cannot run tar (with xz) to pack the binaries: {e}"))?;
    if !status.success() {
        return Err(format!("tar -cJf bin.tar.xz bin failed ({status}); is xz installed?"));
    }
    std::fs::remove_dir_all(dir.join("bin")).map_err(|e| format!("cannot remove the packed bin/: {e}"))
}

/// Builds the PyTorch package's wheel (`python/`, release, stripped) with maturin, in its own
/// target folder; `None`, with a note, when maturin is not installed.
fn python_wheel(root: &Path) -> Result<Option<PathBuf>, String> {
    let py = root.join("python");
    if !py.join("pyproject.toml").is_file() {
        return Ok(None);
    }
    let has = |cmd: &str, args: &[&str]| {
        Command::new(cmd).args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    let maturin: Vec<&str> = if has("maturin", &["--version"]) {
        vec!["maturin"]
    } else if has("python3", &["-m", "maturin", "--version"]) {
        vec!["python3", "-m", "maturin"]
    } else {
        // An error, not a note: a bundle without the package runs a suite ~130 tests short
        // whose summary still reads as a pass (it happened: 414 of 546).
        return Err("no maturin (pip install maturin) to build the PyTorch package for the bundle; \
                    pass --no-python to leave it out"
            .into());
    };
    let out = py.join("target").join("bundle-wheel");
    let _ = std::fs::remove_dir_all(&out);
    println!("{} build --release (python/) ...", maturin.join(" "));
    let ok = Command::new(maturin[0])
        .args(&maturin[1..])
        .args(["build", "--release", "--strip", "--out"])
        .arg(&out)
        .current_dir(&py)
        .env("CARGO_TARGET_DIR", py.join("target"))
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        return Err("maturin build of python/ failed".into());
    }
    let rd = std::fs::read_dir(&out).map_err(|e| format!("cannot read {}: {e}", out.display()))?;
    let wheel = rd.flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|x| x == "whl"));
    wheel.map(Some).ok_or_else(|| format!("maturin wrote no wheel into {}", out.display()))
}

/// Copies the wheel, the package's tests, its bench scripts and its example into `dir/python`, and
/// the script that runs them; returns the manifest lines.
fn python_files(root: &Path, dir: &Path, wheel: &Path) -> Result<String, String> {
    let py = dir.join("python");
    mkdir(&py.join("tests"))?;
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).map(|_| ()).map_err(|e| format!("cannot copy {}: {e}", from.display()))
    };
    let name = wheel.file_name().unwrap_or_default();
    copy(wheel, &py.join(name))?;
    let mut lines = format!(
        "python/{}
",
        name.to_string_lossy()
    );
    mkdir(&py.join("examples"))?;
    for bench in ["bench.py", "bench_attention.py", "bench_conv.py", "examples/resnet18.py"] {
        copy(&root.join("python").join(bench), &py.join(bench))?;
        lines += &format!(
            "python/{bench}
"
        );
    }
    let mut tests: Vec<PathBuf> = std::fs::read_dir(root.join("python").join("tests"))
        .map_err(|e| format!("cannot read python/tests: {e}"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    tests.sort();
    for t in tests {
        let name = t.file_name().unwrap_or_default();
        copy(&t, &py.join("tests").join(name))?;
        lines += &format!(
            "python/tests/{}
",
            name.to_string_lossy()
        );
    }
    write_script(&dir.join("run-python-tests.sh"), PYTHON_SCRIPT)?;
    Ok(lines
        + "run-python-tests.sh
")
}

/// Refuses an output folder that exists and holds something other than an earlier bundle.
fn check_out_dir(dir: &Path) -> Result<(), String> {
    if !dir.exists() {
        return Ok(());
    }
    if !dir.is_dir() {
        return Err(format!("{} exists and is not a folder", dir.display()));
    }
    let empty = std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?.next().is_none();
    if empty || dir.join(MARKER).is_file() {
        Ok(())
    } else {
        Err(format!(
            "{} exists and was not made by gpu-bundle (no {MARKER}); choose another --out or remove it",
            dir.display()
        ))
    }
}

/// Runs `cargo ARGS -p kernels --message-format=json-render-diagnostics` in the workspace and
/// returns the executables of `kind` it built.
fn cargo_artifacts(root: &Path, args: &[&str], manifest: &Path, kind: &str) -> Result<Vec<Artifact>, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    println!("cargo {} -p kernels", args.join(" "));
    let out = Command::new(cargo)
        .current_dir(root)
        .args(args)
        .args(["-p", "kernels", "--message-format=json-render-diagnostics"])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("`cargo {} -p kernels` failed ({})", args.join(" "), out.status));
    }
    parse_artifacts(&String::from_utf8_lossy(&out.stdout), manifest, kind)
}

/// The executables of `kind` (`test`, `bench`, `example`) of the package at `manifest`, from
/// cargo's JSON messages (one object a line), each target once.
pub fn parse_artifacts(json_lines: &str, manifest: &Path, kind: &str) -> Result<Vec<Artifact>, String> {
    let same_file =
        |a: &Path, b: &Path| a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y);
    let mut arts: Vec<Artifact> = Vec::new();
    for line in json_lines.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("cannot read cargo's JSON message ({e}): {line}"))?;
        if v["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = v["executable"].as_str() else {
            continue;
        };
        let kinds = v["target"]["kind"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        if !kinds.iter().any(|k| k == kind) {
            continue;
        }
        if !v["manifest_path"].as_str().is_some_and(|m| same_file(Path::new(m), manifest)) {
            continue;
        }
        let Some(name) = v["target"]["name"].as_str() else {
            continue;
        };
        let a = Artifact { kind: kind.to_string(), name: name.to_string(), path: PathBuf::from(exe) };
        match arts.iter_mut().find(|x| x.name == a.name) {
            Some(x) => *x = a,
            None => arts.push(a),
        }
    }
    Ok(arts)
}

fn mkdir(d: &Path) -> Result<(), String> {
    std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))
}

fn write(p: &Path, text: &str) -> Result<(), String> {
    std::fs::write(p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))
}

fn write_script(p: &Path, text: &str) -> Result<(), String> {
    write(p, text)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("cannot make {} executable: {e}", p.display()))?;
    }
    Ok(())
}

/// Number of files and bytes under `dir`.
fn folder_size(dir: &Path) -> (u64, u64) {
    let (mut files, mut bytes) = (0, 0);
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                let (f, b) = folder_size(&e.path());
                files += f;
                bytes += b;
            } else {
                files += 1;
                bytes += meta.len();
            }
        }
    }
    (files, bytes)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// `git rev-parse --short HEAD` of the tree at `root`, with `-dirty` where it has uncommitted
/// changes; `unknown` without git.
fn source_commit(root: &Path) -> String {
    let git =
        |args: &[&str]| Command::new("git").args(args).current_dir(root).output().ok().filter(|o| o.status.success());
    let Some(head) = git(&["rev-parse", "--short", "HEAD"]) else { return "unknown".into() };
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|o| !o.stdout.is_empty());
    if dirty { format!("{head}-dirty") } else { head }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cargo_messages() {
        let m = "/w/Cargo.toml";
        let lines = r#"{"reason":"compiler-artifact","package_id":"registry+https://github.com/rust-lang/crates.io-index#libm@0.2.15","manifest_path":"/r/libm/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"libm"},"executable":null,"fresh":true}
{"reason":"build-script-executed","package_id":"path+file:///w#kernels@0.1.0","out_dir":"/w/target/release/build/kernels-1/out"}
{"reason":"compiler-artifact","package_id":"path+file:///w#kernels@0.1.0","manifest_path":"/w/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"kernels","test":true},"profile":{"test":true},"executable":"/w/target/release/deps/kernels-0a1b","fresh":false}
{"reason":"compiler-artifact","package_id":"path+file:///w#kernels@0.1.0","manifest_path":"/w/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"elementwise"},"profile":{"test":true},"executable":"/w/target/release/deps/elementwise-9f8e7d","fresh":false}
{"reason":"compiler-artifact","package_id":"path+file:///w/kernels-gpu#0.1.0","manifest_path":"/w/kernels-gpu/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"math"},"executable":"/w/target/release/deps/math-1234","fresh":false}
{"reason":"compiler-artifact","package_id":"path+file:///w#kernels@0.1.0","manifest_path":"/w/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"init"},"executable":"/w/target/release/deps/init-5678","fresh":true}
{"reason":"compiler-artifact","package_id":"path+file:///w#kernels@0.1.0","manifest_path":"/w/Cargo.toml","target":{"kind":["bench"],"crate_types":["bin"],"name":"elementwise"},"executable":"/w/target/release/deps/elementwise-abcd","fresh":true}
{"reason":"build-finished","success":true}"#;
        let tests = parse_artifacts(lines, Path::new(m), "test").unwrap();
        assert_eq!(
            tests,
            vec![
                Artifact {
                    kind: "test".into(),
                    name: "elementwise".into(),
                    path: "/w/target/release/deps/elementwise-9f8e7d".into()
                },
                Artifact { kind: "test".into(), name: "init".into(), path: "/w/target/release/deps/init-5678".into() },
            ]
        );
        let benches = parse_artifacts(lines, Path::new(m), "bench").unwrap();
        assert_eq!(benches.len(), 1);
        assert_eq!(benches[0].name, "elementwise");
        assert_eq!(benches[0].subdir(), "benches");
        assert!(parse_artifacts(lines, Path::new(m), "example").unwrap().is_empty());
        assert!(parse_artifacts("{not json", Path::new(m), "test").is_err());
        assert!(parse_artifacts("   Compiling x\n", Path::new(m), "test").unwrap().is_empty());
    }

    /// A fresh scratch folder under the system temp folder.
    fn scratch(tag: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let d = std::env::temp_dir().join(format!("xtask-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn fake_bin(dir: &Path, name: &str, body: &str) {
        std::fs::create_dir_all(dir).unwrap();
        write_script(&dir.join(name), &format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
    }

    fn have_bash() -> bool {
        Command::new("bash").arg("-c").arg("true").status().is_ok_and(|s| s.success())
    }

    /// Runs the suite script on fake test binaries and checks its summary and exit status.
    #[test]
    fn suite_script_counts_tests() {
        if !have_bash() {
            eprintln!("no bash: skipped");
            return;
        }
        let b = scratch("suite");
        write_script(&b.join("run-gpu-suite.sh"), SUITE_SCRIPT).unwrap();
        let tests = b.join("bin").join("tests");
        // Checks the flags and env the script must pass.
        fake_bin(
            &tests,
            "a",
            r#"[ "${KERNELS_REQUIRE_GPU:-}" = 1 ] || exit 7
echo "test x ... ok"
echo "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s""#,
        );
        fake_bin(
            &tests,
            "b",
            r#"echo "test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s""#,
        );
        let run = |out: &Path, flags: &[&str]| {
            let o = Command::new("bash")
                .arg(b.join("run-gpu-suite.sh"))
                .args(flags)
                .env("OUT", out)
                .current_dir(&b)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
            (o.status.code(), stdout.lines().last().unwrap_or("").to_string(), stdout)
        };
        let (code, last, all) = run(&b.join("out1"), &["--tests-only", "--jobs", "1"]);
        assert_eq!((code, last.as_str()), (Some(0), "5 passed, 0 failed, 1 skipped"), "{all}");
        assert!(std::fs::read_to_string(b.join("out1").join("tests.log")).unwrap().contains("test x ... ok"));

        // Benches get --bench and KERNELS_BENCH_JSON; a failing example fails the run.
        fake_bin(&b.join("bin").join("benches"), "e", r#"[ "$1" = --bench ] && echo '[]' > "$KERNELS_BENCH_JSON""#);
        let (code, last, all) = run(&b.join("out3"), &["--skip-tests"]);
        assert_eq!(code, Some(0), "{all}");
        assert!(last.starts_with("0 passed, 0 failed, 0 skipped"), "{all}");
        assert!(all.contains("bench e: ok") && b.join("out3").join("bench-e.json").is_file(), "{all}");
        fake_bin(&b.join("bin").join("examples"), "x", "exit 3");
        let (code, _, all) = run(&b.join("out4"), &["--skip-tests"]);
        assert_eq!(code, Some(1), "{all}");
        assert!(all.contains("example x: FAILED (exit status 3)"), "{all}");

        // A failing binary, and one that crashes before its result line.
        fake_bin(
            &tests,
            "c",
            r#"echo "test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s"; exit 101"#,
        );
        fake_bin(&tests, "d", "echo starting; kill -SEGV $$");
        let (code, last, all) = run(&b.join("out2"), &["--tests-only"]);
        assert_eq!((code, last.as_str()), (Some(1), "6 passed, 3 failed, 1 skipped"), "{all}");
        assert!(all.contains("d: 0 passed, 1 failed, 0 skipped") && all.contains("no test result line"), "{all}");

        // The same binaries three at a time: the same counts, each output whole and in order.
        let (code, last, all) = run(&b.join("out5"), &["--tests-only", "--jobs", "3"]);
        assert_eq!((code, last.as_str()), (Some(1), "6 passed, 3 failed, 1 skipped"), "{all}");
        let log = std::fs::read_to_string(b.join("out5").join("tests.log")).unwrap();
        let at = |s: &str| log.find(s).unwrap_or_else(|| panic!("{s:?} not in {log}"));
        assert!(at("== test a") < at("test x ... ok") && at("test x ... ok") < at("== test b"), "{log}");
        assert!(at("== test c") < at("== test d") && at("== test d") < at("starting"), "{log}");
        assert!(all.contains("d: 0 passed, 1 failed, 0 skipped") && all.contains("up to 3 at once"), "{all}");
        let (code, _, all) = run(&b.join("out6"), &["--tests-only", "--jobs", "0"]);
        assert_eq!(code, Some(2), "{all}");

        // pytest counted with the binaries, one after another and as a job of its own.
        fake_bin(
            &b,
            "run-python-tests.sh",
            r#"[ "$1" = --tests-only ] || exit 9; echo "python: 4 passed, 0 failed, 2 skipped""#,
        );
        for (out, flags) in [("out7", &["--tests-only", "--jobs=1"][..]), ("out8", &["--tests-only"][..])] {
            let (code, last, all) = run(&b.join(out), flags);
            assert_eq!((code, last.as_str()), (Some(1), "10 passed, 3 failed, 3 skipped"), "{all}");
            assert!(all.contains("python (pytest): 4 passed, 0 failed, 2 skipped"), "{all}");
        }

        // gemm_tc runs twice, the second time on the sm_80 PTX.
        let _ = std::fs::remove_file(b.join("run-python-tests.sh"));
        fake_bin(
            &tests,
            "gemm_tc",
            r#"[ "${KERNELS_PTX_ARCH:-}" = sm_80 ] && n=7 || n=5
echo "test result: ok. $n passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s""#,
        );
        for (out, jobs) in [("out9", "1"), ("out10", "3")] {
            let (code, last, all) = run(&b.join(out), &["--tests-only", "--jobs", jobs]);
            assert_eq!((code, last.as_str()), (Some(1), "18 passed, 3 failed, 1 skipped"), "{all}");
            assert!(all.contains("gemm_tc: 5 passed") && all.contains("gemm_tc (sm_80 PTX): 7 passed"), "{all}");
        }
        let _ = std::fs::remove_dir_all(&b);
    }

    /// Runs the sanitizer script with a fake compute-sanitizer.
    #[test]
    fn sanitizer_script_reports_errors() {
        if !have_bash() {
            eprintln!("no bash: skipped");
            return;
        }
        let b = scratch("sanitizer");
        write_script(&b.join("run-sanitizer.sh"), SANITIZER_SCRIPT).unwrap();
        let tests = b.join("bin").join("tests");
        fake_bin(
            &tests,
            "a",
            r#"[ "${KERNELS_SANITIZER:-}" = 1 ] || exit 7
echo "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s""#,
        );
        // Reports one error under racecheck, none otherwise.
        fake_bin(
            &b,
            "cs",
            r#"[ "$1" = --version ] && { echo "Version 2025.1"; exit 0; }
tool=$2; shift 4; "$@"; rc=$?
if [ "$tool" = racecheck ]; then echo "========= ERROR SUMMARY: 1 error"; exit 1; fi
echo "========= ERROR SUMMARY: 0 errors"; exit $rc"#,
        );
        let run = |tools: &[&str]| {
            let mut c = Command::new("bash");
            c.arg(b.join("run-sanitizer.sh")).env("COMPUTE_SANITIZER", b.join("cs")).env_remove("OUT");
            for t in tools {
                c.args(["--tool", t]);
            }
            let o = c.output().unwrap();
            (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned())
        };
        let (code, out) = run(&["memcheck", "synccheck"]);
        assert_eq!(code, Some(0), "{out}");
        assert!(out.contains("memcheck a: 0 errors; tests: ok. 1 passed; 0 failed; 0 ignored;"), "{out}");
        let (code, out) = run(&[]);
        assert_eq!(code, Some(1), "{out}");
        assert!(out.contains("racecheck a: 1 errors") && out.contains("FAILED"), "{out}");
        let (code, _) = run(&["bogus"]);
        assert_eq!(code, Some(2));
        let _ = std::fs::remove_dir_all(&b);
    }
}
