//! The PTX cut into one module per op, for the host to load on first use (host only).
//!
//! Why: the driver compiles PTX to the GPU's machine code when a module is loaded. For the whole
//! `sm_90` PTX (about 16 MB, 480 kernels) that took most of a minute on an H100 with an empty
//! JIT cache, and the driver does not compile two modules at once (sixteen parts loaded from
//! sixteen threads took nearly as long; docs/worklog.md, 2026-11-25c). Loaded per op on first
//! use, a program waits for the ops it calls: a second or two each with an empty cache, the
//! GEMM tiles a few.
//!
//! A module is the PTX's header, the entries of one op ([`module_key`]: every dtype, forward
//! and backward, every variant), and the functions and globals those reference, found by name
//! and followed transitively, in the PTX's order (declarations before use, as in the input).

extern crate alloc;

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::string::String;
use alloc::vec::Vec;

/// One module: its key (see [`module_key`]), its PTX text, and its entries in order.
pub struct PtxModule {
    /// The module's name, from its entries' op.
    pub key: String,
    /// A whole PTX module: the PTX's header, then its entries and the functions and globals they
    /// use, in the PTX's order.
    pub text: String,
    /// The kernels (`.entry`) it holds, in the PTX's order.
    pub entries: Vec<String>,
}

/// The op a kernel entry belongs to: its name without the dtype suffix, and cut before `_fwd` or
/// `_bwd` (`layer_norm_bwd_c4_v2_f32` -> `layer_norm`, `gelu_fwd_bf16` -> `gelu`,
/// `gemm_nn_128x128` -> itself).
pub fn module_key(entry: &str) -> &str {
    let base = ["_f32", "_f16", "_bf16"].iter().find_map(|s| entry.strip_suffix(s)).unwrap_or(entry);
    ["_fwd", "_bwd"].iter().filter_map(|s| base.find(s)).min().map_or(base, |i| &base[..i])
}

/// A top-level item of the PTX: an entry, or something entries may reference (a function's
/// declaration or definition, a global, the dynamic shared memory).
struct Item<'a> {
    entry: bool,
    name: &'a str,
    text: &'a str,
}

/// Whether `line` starts a top-level item. Performance directives (`.maxntid`, `.reqntid`,
/// `.minnctapersm`, `.reqnctapercluster`, `.noreturn`) also sit at the start of a line but belong
/// to the item before them.
fn item_start(line: &str) -> Option<bool> {
    let rest = line.strip_prefix(".visible ").or_else(|| line.strip_prefix(".weak ")).unwrap_or(line);
    if rest.starts_with(".entry ") {
        return Some(true);
    }
    [".func", ".global ", ".const ", ".shared ", ".extern "].iter().any(|k| rest.starts_with(k)).then_some(false)
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b == b'%'
}

/// The identifiers of `text`, in order, with repeats (PTX's: letters, digits, `_`, `$`, `%`).
fn idents(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii() && is_ident_byte(c as u8))).filter(|s| !s.is_empty())
}

/// The name an item defines or declares: an entry's or function's name (after a function's
/// return parameter list, if any), a variable's (the identifier before `[`, `=` or `;`).
fn item_name(first_line: &str, entry: bool) -> &str {
    let line = first_line.trim_end();
    if entry || line.contains(".func") {
        let kw = if entry { ".entry" } else { ".func" };
        let after = line.find(kw).map_or(line, |i| &line[i + kw.len()..]).trim_start();
        // `.func (.param .b32 retval) name(...)`: skip the return list.
        let after = if after.starts_with('(') { after.find(')').map_or(after, |i| &after[i + 1..]) } else { after };
        return idents(after).next().unwrap_or("");
    }
    let head = line.split(['[', '=', ';']).next().unwrap_or(line);
    idents(head).last().unwrap_or("")
}

/// Cuts `ptx` into one module per op (see the module's documentation), in order of their first
/// entry.
pub fn split(ptx: &str) -> Vec<PtxModule> {
    let mut header_end = ptx.len();
    let mut items: Vec<Item> = Vec::new();
    let mut open: Option<(bool, usize)> = None;
    let mut pos = 0;
    for line in ptx.split_inclusive('\n') {
        if let Some(entry) = item_start(line) {
            match open {
                Some((e, start)) => items.push(item(ptx, e, start, pos)),
                None => header_end = pos,
            }
            open = Some((entry, pos));
        }
        pos += line.len();
    }
    if let Some((e, start)) = open {
        items.push(item(ptx, e, start, ptx.len()));
    }
    let header = &ptx[..header_end.min(ptx.len())];

    // Non-entry items by name (a function may be declared, then defined: both are kept).
    let mut named: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, it) in items.iter().enumerate() {
        if !it.entry {
            named.entry(it.name).or_default().push(i);
        }
    }
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    let mut group_of: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, it) in items.iter().enumerate().filter(|(_, it)| it.entry) {
        let key = module_key(it.name);
        let g = *group_of.entry(key).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[g].1.push(i);
    }
    groups
        .into_iter()
        .map(|(key, entries)| {
            // What the entries reference, closed over what the referenced items reference.
            let mut keep: BTreeSet<usize> = BTreeSet::new();
            let mut todo: Vec<usize> = entries.clone();
            while let Some(i) = todo.pop() {
                for id in idents(items[i].text) {
                    for &j in named.get(id).map_or(&[][..], |v| &v[..]) {
                        if keep.insert(j) {
                            todo.push(j);
                        }
                    }
                }
            }
            let mut text = String::with_capacity(
                header.len() + keep.iter().chain(&entries).map(|&i| items[i].text.len()).sum::<usize>(),
            );
            text.push_str(header);
            let mut order: Vec<usize> = keep.into_iter().chain(entries.iter().copied()).collect();
            order.sort_unstable();
            for i in order {
                text.push_str(items[i].text);
            }
            PtxModule { key: key.into(), text, entries: entries.iter().map(|&i| items[i].name.into()).collect() }
        })
        .collect()
}

fn item(ptx: &str, entry: bool, start: usize, end: usize) -> Item<'_> {
    let text = &ptx[start..end];
    Item { entry, name: item_name(text.lines().next().unwrap_or(""), entry), text }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(module_key("layer_norm_bwd_c4_v2_f32"), "layer_norm");
        assert_eq!(module_key("scale_bias_gelu_tanh_fwd_bf16"), "scale_bias_gelu_tanh");
        assert_eq!(module_key("gemm_nn_128x128"), "gemm_nn_128x128");
        assert_eq!(module_key("reduce_sum_final_f16"), "reduce_sum_final");
        assert_eq!(module_key("add_row_bwd_f32"), "add_row");
    }

    #[test]
    fn names() {
        assert_eq!(item_name(".visible .entry relu_fwd_f32(", true), "relu_fwd_f32");
        assert_eq!(item_name(".func _RNvf(", false), "_RNvf");
        assert_eq!(item_name(".func  (.param .b32 func_retval0) _RNvg(", false), "_RNvg");
        assert_eq!(item_name(".extern .shared .align 16 .b8 DYN_SMEM[];", false), "DYN_SMEM");
        assert_eq!(
            item_name(".global .align 8 .u64 anon_$_ab_$_7[3] = {generic(anon_$_ab_$_2), 23};", false),
            "anon_$_ab_$_7"
        );
    }

    const PTX: &str = "//\n.version 8.1\n.target sm_90\n.address_size 64\n\n\
.extern .shared .align 16 .b8 DYN_SMEM[];\n\
.func g_panic\n(\n)\n.noreturn;\n\
.global .align 1 .b8 anon_$_1[2] = {1, 2};\n\
.global .align 1 .b8 anon_$_10[2] = {1, 2};\n\
.func (.param .b32 func_retval0) helper(\n)\n{\n\tmov.u64 %rd1, anon_$_1;\n\tcall.uni g_panic, ();\n}\n\
.func g_panic\n(\n)\n.noreturn\n{\n\ttrap;\n}\n\
.visible .entry a_fwd_f32(\n)\n.maxntid 1024, 1, 1\n{\n\tcall.uni (%r1), helper, ();\n}\n\
.visible .entry b_fwd_f32(\n)\n{\n\tmov.u32 %r1, DYN_SMEM;\n}\n\
.visible .entry a_bwd_bf16(\n)\n{\n\tret;\n}\n";

    #[test]
    fn split_follows_references() {
        let m = split(PTX);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].key, "a");
        assert_eq!(m[0].entries, ["a_fwd_f32", "a_bwd_bf16"]);
        let a = &m[0].text;
        assert!(a.starts_with("//\n.version 8.1\n.target sm_90\n.address_size 64\n"));
        // helper, its global and the panic function's declaration and definition, in order.
        assert!(a.contains("anon_$_1[2]") && !a.contains("anon_$_10") && !a.contains("DYN_SMEM"));
        assert_eq!(a.matches(".func g_panic").count(), 2);
        assert!(a.find("helper(").unwrap() < a.find("a_fwd_f32").unwrap());
        assert!(a.contains(".maxntid 1024, 1, 1\n{\n\tcall.uni (%r1), helper"));
        assert_eq!(m[1].entries, ["b_fwd_f32"]);
        assert!(m[1].text.contains("DYN_SMEM[]") && !m[1].text.contains("helper"));
    }
}
