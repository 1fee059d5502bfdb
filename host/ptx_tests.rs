//! The embedded PTX against the host's kernel names and launch signatures (CPU only): every
//! kernel the host launches is there with the parameters it passes, and nothing else; the
//! modules it loads per op partition the entries. Unit tests: the PTX is the crate's own.

use crate::device::{PTX_ARCHES, ptx, ptx_arch_for, ptx_for};
use std::collections::BTreeMap;

/// Every `.entry` of the PTX for `arch` with its number of parameters.
fn ptx_kernels(arch: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    let mut lines = ptx_for(arch).expect("an embedded architecture").lines();
    while let Some(l) = lines.next() {
        let Some(rest) = l.trim_start().strip_prefix(".visible .entry ") else { continue };
        let name = rest.split('(').next().unwrap().trim().to_string();
        let mut params = rest.matches(".param").count();
        if !rest.contains(')') {
            for l in lines.by_ref() {
                params += l.matches(".param").count();
                if l.contains(')') {
                    break;
                }
            }
        }
        out.insert(name, params);
    }
    out
}

/// Every kernel the host can launch, with the arity of the signature it launches it with: each
/// family lists its own, from its declarations (`ops::all_kernels`).
fn host_kernels() -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for (name, n) in crate::ops::all_kernels() {
        assert!(m.insert(name.clone(), n).is_none(), "`{name}` listed twice");
    }
    m
}

/// Kernels that only the sm_90 module has: thread-block cluster kernels, `<stem>_c<C>_...`.
fn sm90_only(name: &str) -> bool {
    cluster_of(name).is_some()
}

/// Kernels that only the sm_90a module has: the `wgmma` GEMMs and attention kernels, and the
/// writer of their tensor maps.
fn sm90a_only(name: &str) -> bool {
    name.starts_with("gemm_wgmma_")
        || name.starts_with("attention_fwd_wgmma_")
        || name.starts_with("attention_bwd_wgmma_")
        || name == "store_tensor_maps"
}

/// Blocks per cluster and `.maxntid` of a cluster kernel, from its name: `_c<C>_` (a row split
/// over the cluster, 1024 threads) or `_k<K>_` (the grid one cluster, 512 threads).
fn cluster_of(name: &str) -> Option<(u32, u32)> {
    name.split('_').find_map(|p| {
        let (n, threads) = match p.as_bytes().first() {
            Some(b'c') => (&p[1..], 1024),
            Some(b'k') => (&p[1..], 512),
            _ => return None,
        };
        n.parse::<u32>().ok().filter(|&c| c > 1).map(|c| (c, threads))
    })
}

#[test]
fn ptx_has_exactly_the_kernels_the_host_launches_with_their_arity() {
    let host = host_kernels();
    assert!(host.keys().any(|k| sm90_only(k)), "no cluster kernels listed");
    assert!(host.keys().any(|k| sm90a_only(k)), "no wgmma kernels listed");
    for arch in PTX_ARCHES {
        let ptx = ptx_kernels(arch);
        for (name, n) in &host {
            if arch == "sm_80" && sm90_only(name) {
                assert!(!ptx.contains_key(name), "`{name}` needs sm_90 but is in the sm_80 PTX");
                continue;
            }
            if arch != "sm_90a" && sm90a_only(name) {
                assert!(!ptx.contains_key(name), "`{name}` needs sm_90a but is in the {arch} PTX");
                continue;
            }
            match ptx.get(name) {
                None => panic!("the host launches `{name}`, which the {arch} PTX does not have"),
                Some(p) => assert_eq!(p, n, "`{name}`: {p} parameters in the {arch} PTX, {n} in the host's signature"),
            }
        }
        for name in ptx.keys() {
            assert!(host.contains_key(name), "{arch} PTX kernel `{name}` is never launched by the host");
        }
        assert!(ptx.len() > 250, "only {} kernels", ptx.len());
    }
}

/// Each cluster kernel carries its cluster shape and 1024-thread bound, and the sm_90 module is
/// PTX ISA 8.1 (`st.async`, the cluster barrier's `.release`/`.acquire`).
#[test]
fn cluster_kernels_declare_their_cluster_size() {
    let ptx = ptx_for("sm_90").unwrap();
    assert!(ptx.contains("\n.version 8.1\n"), "the sm_90 PTX is not ISA 8.1");
    let mut seen = 0;
    let mut lines = ptx.lines();
    while let Some(l) = lines.next() {
        let Some(rest) = l.trim_start().strip_prefix(".visible .entry ") else { continue };
        let name = rest.split('(').next().unwrap().trim();
        if !sm90_only(name) {
            continue;
        }
        let (c, threads) = cluster_of(name).unwrap();
        let after: Vec<&str> = lines.by_ref().skip_while(|l| l.trim() != ")").take(3).collect();
        assert_eq!(after.get(1).map(|l| l.trim()).unwrap_or(""), format!(".maxntid {threads}, 1, 1"), "`{name}`");
        assert_eq!(after.get(2).map(|l| l.trim()).unwrap_or(""), format!(".reqnctapercluster {c}, 1, 1"), "`{name}`");
        seen += 1;
    }
    assert!(seen >= 12, "found {seen} cluster kernels");
}

/// The modules the host loads per op (`kernels_gpu::ptx_modules`) hold every entry of the PTX
/// exactly once, each with the PTX's header and the functions its entries call. (That each
/// assembles on its own is checked by `cargo xtask build-ptx` with ptxas.)
#[test]
fn ptx_modules_partition_the_entries() {
    use kernels_gpu::ptx_modules::{module_key, split};
    for arch in PTX_ARCHES {
        let ptx = ptx_for(arch).unwrap();
        let t = std::time::Instant::now();
        let modules = split(ptx);
        let took = t.elapsed();
        let header: String = ptx.lines().take_while(|l| !l.starts_with(".extern") && !l.starts_with(".func")).collect();
        let mut seen = BTreeMap::new();
        for m in &modules {
            assert!(m.text.lines().collect::<String>().starts_with(&header), "{arch} {}: no header", m.key);
            let own: Vec<&str> = kernels_gpu::ptx_entries(&m.text).collect();
            assert_eq!(own, m.entries, "{arch} {}", m.key);
            for e in &m.entries {
                assert_eq!(module_key(e), m.key);
                assert!(seen.insert(e.clone(), m.key.clone()).is_none(), "{arch}: {e} in two modules");
            }
            // Every function called is declared there (ptxas, in xtask, checks the rest).
            for call in m.text.lines().filter_map(|l| l.trim_start().strip_prefix("call.uni")) {
                let callee = call.split([',', ';']).map(str::trim).find(|p| !p.is_empty() && !p.starts_with('('));
                let callee = callee.unwrap_or_else(|| panic!("{arch} {}: cannot read `{call}`", m.key));
                assert!(
                    m.text.lines().any(|l| l.starts_with(".func") && l.contains(callee)),
                    "{arch} {}: calls {callee}, not declared there",
                    m.key
                );
            }
        }
        let all: Vec<String> = kernels_gpu::ptx_entries(ptx).map(str::to_string).collect();
        assert_eq!(seen.len(), all.len(), "{arch}");
        assert!(all.iter().all(|e| seen.contains_key(e)));
        assert!(modules.len() >= 60, "{arch}: {} modules", modules.len());
        println!("{arch}: {} kernels in {} modules, split in {took:?}", all.len(), modules.len());
    }
}

#[test]
fn ptx_is_for_the_configured_architecture() {
    for arch in PTX_ARCHES {
        let ptx = ptx_for(arch).unwrap();
        let target = ptx.lines().find(|l| l.starts_with(".target")).expect("a .target line");
        assert!(target.contains(arch), "{target} vs {arch}");
        // No kernel may call an unresolved function (e.g. an `expf` LLVM could not lower).
        assert!(!ptx.contains(".extern .func"), "the {arch} PTX calls an external function");
    }
    assert_eq!(ptx_arch_for((8, 0)), "sm_80");
    assert_eq!(ptx_arch_for((8, 9)), "sm_80");
    assert_eq!(ptx_arch_for((9, 0)), "sm_90a");
    assert_eq!(ptx_arch_for((9, 1)), "sm_90");
    assert_eq!(ptx_arch_for((10, 0)), "sm_90");
    assert_eq!(ptx_arch_for((12, 0)), "sm_90");
}

/// Kernels launched with 1024-thread blocks carry `.maxntid` (rustc has no `__launch_bounds__`;
/// the build adds it), so that ptxas fits them in 64 registers.
#[test]
fn register_resident_row_kernels_have_launch_bounds() {
    let ptx = ptx();
    let mut seen = 0;
    let mut lines = ptx.lines();
    while let Some(l) = lines.next() {
        let Some(rest) = l.trim_start().strip_prefix(".visible .entry ") else { continue };
        let name = rest.split('(').next().unwrap().trim();
        // The rule of kernels-gpu/build_ptx.rs's `launch_bound`.
        let wide = name.contains("_v4_") || name.contains("_v8_");
        if !wide || name.contains("norm_bwd") {
            continue;
        }
        let after: Vec<&str> = lines.by_ref().skip_while(|l| l.trim() != ")").take(2).collect();
        assert_eq!(after.get(1).map(|l| l.trim()), Some(".maxntid 1024, 1, 1"), "`{name}` has no .maxntid");
        seen += 1;
    }
    assert!(seen >= 20, "expected the row kernels with four and eight vectors per thread, found {seen}");
}

/// The tensor-core GEMM's tile kernels carry `.maxntid 256` and `.minnctapersm 2` (two blocks an
/// SM, so ptxas keeps them within 128 registers), the block their launch uses.
#[test]
fn tensor_core_gemm_kernels_have_launch_bounds() {
    let ptx = ptx();
    let mut seen = 0;
    let mut lines = ptx.lines();
    while let Some(l) = lines.next() {
        let Some(rest) = l.trim_start().strip_prefix(".visible .entry ") else { continue };
        let name = rest.split('(').next().unwrap().trim();
        if !name.starts_with("gemm_tc_") || name.contains("splitk") {
            continue;
        }
        let after: Vec<&str> = lines.by_ref().skip_while(|l| l.trim() != ")").take(3).map(str::trim).collect();
        assert_eq!(after[1..], [".maxntid 256, 1, 1", ".minnctapersm 2"], "`{name}`");
        seen += 1;
    }
    assert_eq!(seen, 24, "expected 2 input x 3 output dtypes x 4 layouts");
    assert_eq!(kernels_gpu::gemm_tc::THREADS, 256);
}
