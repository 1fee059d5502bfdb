//! Row launch planning, the host side of `kernels-gpu/src/rows.rs`: how the row kernels
//! (softmax, the norms, cross-entropy, the row reductions) spread a row over a group of
//! threads, and which of a family's instances (register-resident `_v<V>`, streaming, cluster
//! `_c<C>`) a launch runs. The geometry is pure and tested on the CPU; the plans ask the device
//! for the kernels' limits.

use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use kernels_gpu::DType;
use kernels_gpu::kernel::{Kernel, Params};
use kernels_gpu::rows::{MAX_GROUP, ROW_BLOCK, RowKernels, RowVariant, reduce_smem_bytes};

/// Elements of `dt` in a 16-byte vector (`kernels_gpu::Elem::VEC`).
fn vec_len(dt: DType) -> u64 {
    (16 / dt.size()) as u64
}

/// Threads per row (a *group*, see `kernels-gpu/src/rows.rs`) to cover `units` (vectors or
/// elements) at `per_thread` each: a power of two up to 32, a multiple of 32 up to 1024.
pub fn group_size(units: u64, per_thread: u64) -> u32 {
    let want = units.div_ceil(per_thread.max(1)).max(1);
    // Capped before rounding up (MAX_GROUP is a multiple of 32): no overflow.
    if want <= 32 { want.next_power_of_two() as u32 } else { want.min(MAX_GROUP as u64).next_multiple_of(32) as u32 }
}

/// Launch of a row kernel over `rows` rows with groups of `g` threads: blocks of `(g, R)` with
/// `g * R` = 256 threads where the group is smaller (several rows per block), one group per
/// block otherwise, one block per `R` rows, and the shared memory of the group reductions.
/// The grid is capped at 2^31 - 1 blocks; the streaming kernels loop over the rows beyond it,
/// and the register-resident ones are only chosen when no cap applies (see
/// [`rows_fit_grid`]). `None` when `rows` is 0, or `g` is not a group size (1 to
/// [`MAX_GROUP`]).
pub fn grid(rows: u64, g: u32) -> Option<LaunchConfig> {
    if rows == 0 || !(1..=MAX_GROUP).contains(&g) {
        return None;
    }
    let r = (ROW_BLOCK / g).max(1);
    let blocks = rows.div_ceil(r as u64).min(i32::MAX as u64) as u32;
    Some(LaunchConfig { grid: (blocks, 1, 1), block: (g, r, 1), shared_bytes: reduce_smem_bytes(g * r) })
}

/// Whether [`grid`] gives every row its own group (no grid cap); false where it gives no launch.
pub fn rows_fit_grid(rows: u64, g: u32) -> bool {
    (1..=MAX_GROUP).contains(&g) && rows.div_ceil((ROW_BLOCK / g).max(1) as u64) <= i32::MAX as u64
}

/// How [`reg_vectors`] spreads a row over the threads of its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// The fewest vectors that keep a group at 128 threads or fewer (many rows per SM), else at
    /// 256, 512, 1024. For launches of few rows, whose rows then spread over more blocks.
    Narrow,
    /// As `Narrow`, but at least four vectors a thread where the row has them: four loads in
    /// flight per thread, and a group reduction (a butterfly of shuffles, and for groups over
    /// 32 a round through shared memory) amortised over 16-32 values; with one vector per
    /// thread a row of 128 f32 spent more time reducing than loading (docs/worklog.md,
    /// 2026-11-23b). (Not for kernels whose
    /// registers grow fastest with the vectors, like the norms' backward, where four vectors of
    /// f32 take 160 registers: their `available` stops below four.)
    Wide,
    /// As `Wide`, with at least two vectors a thread instead of four: only rows of up to 256
    /// vectors differ (two vectors then fit a group of 128 threads). The forwards of softmax,
    /// log-softmax and f16/bf16 RMS norm: a reduction's fixed cost over half the elements, for
    /// more warps in flight (softmax bf16: 32 registers against 44, eight 256-thread blocks an SM
    /// against five). On the H100, against four vectors in the same run, the rows of up to 256 vectors
    /// gained and those of 1024 columns and more stayed level, except f32 log-softmax at 8192 x 512,
    /// which lost beyond the noise (docs/worklog.md, 2026-11-26g).
    Two,
    /// The fewest vectors a thread (the largest group, up to 1024 threads). Softmax's backward:
    /// two loads a vector (y and its gradient), one reduction and a multiply-add an element, so
    /// what pays is threads, i.e. warps in flight, more than loads per thread: on the H100 it beat
    /// four or two vectors a thread at every shape measured (docs/worklog.md, 2026-11-25).
    Fewest,
}

/// Vectors per thread for a register-resident row kernel over rows of `nvec` vectors, from the
/// instantiated `available` ones (ascending), spread as `spread` says, or `None` when the row
/// is too long for them.
pub fn reg_vectors(nvec: u64, available: &[usize], spread: Spread) -> Option<usize> {
    if nvec == 0 {
        return None;
    }
    let holds = |v: usize, threads: u64| nvec <= (v as u64).saturating_mul(threads);
    if spread == Spread::Fewest {
        return available.iter().copied().find(|&v| holds(v, MAX_GROUP as u64));
    }
    let most = available.iter().copied().max()?;
    // Capped before rounding up to a power of two (`min` of powers of two): no overflow.
    let floor = match spread {
        Spread::Wide => (nvec.min(4).next_power_of_two() as usize).min(most),
        Spread::Two => (nvec.min(2).next_power_of_two() as usize).min(most),
        _ => 1,
    };
    let fits = |limit: u64| available.iter().copied().filter(|&v| v >= floor).find(|&v| holds(v, limit));
    [128, 256, 512, MAX_GROUP as u64].into_iter().find_map(fits)
}

/// A row held by a thread-block cluster (sm_90; `kernels-gpu/src/rows.rs`): the first cluster
/// size of `sizes` (ascending) whose blocks, at `v` vectors a thread and at most `max_threads`
/// threads (at most 1024), hold a row of `nvec` vectors, with the threads per block (a
/// multiple of 32: the group reductions' shape). `None` when no size is enough.
pub fn cluster_split(nvec: u64, v: u64, sizes: &[u32], max_threads: u32) -> Option<(u32, u32)> {
    if nvec == 0 {
        return None;
    }
    let most = max_threads.min(MAX_GROUP) as u64;
    sizes.iter().filter(|&&c| c > 0).find_map(|&c| {
        let g = nvec.div_ceil(c as u64).div_ceil(v.max(1));
        // Rounded up to a warp only once within `most` (at most 1024): no overflow.
        let g = (g <= most).then(|| g.next_multiple_of(32)).filter(|&g| g <= most)?;
        Some((c, g as u32))
    })
}

/// Whether a register-resident forward (softmax, the norms) may hold rows of `cols` elements of
/// `dt` at eight vectors a thread: f32 always; f16/bf16 only for rows over 16384, which four
/// would hold only in blocks over 512 threads (one an SM), while eight hold rows of 32768 in 512
/// threads, two blocks an SM. Below, eight were slower than four (bf16 layer norm at 8192 x 8192:
/// docs/worklog.md, 2026-11-23c).
pub(crate) fn eight_vectors_fwd(dt: DType, cols: u64) -> bool {
    dt == DType::F32 || cols > 16384
}

/// Where a row plan gets its kernels: a family's typed table ([`RowKernels`], whose plans
/// launch through typed handles).
pub(crate) trait RowSource {
    /// What a plan launches.
    type Kernel: KernelName;
    /// The instance `v`, if the family declares it.
    fn instance(&self, v: RowVariant) -> Option<Self::Kernel>;
}

/// A kernel's name, for the device's queries about it.
pub(crate) trait KernelName: Clone {
    /// The entry's name.
    fn name(&self) -> &str;
}

impl<A: Params> KernelName for Kernel<A> {
    fn name(&self) -> &str {
        Kernel::name(self)
    }
}

impl<A: Params> RowSource for RowKernels<A> {
    type Kernel = Kernel<A>;
    fn instance(&self, v: RowVariant) -> Option<Kernel<A>> {
        self.get(v)
    }
}

/// The instance `v` of `src`, or an error naming what is missing (a family's table lacks it).
pub(crate) fn instance<S: RowSource>(src: &S, v: RowVariant) -> Result<S::Kernel> {
    src.instance(v).ok_or_else(|| Error::KernelNotFound { name: format!("a row kernel's {v:?} instance") })
}

/// The register-resident instances' vectors a row of `cols` elements of `dt` takes, and whether
/// they are the aligned ones: `cols / VEC` (`Reg`) for rows of whole vectors, else the aligned
/// run around a row (`RegU`, `kernels-gpu/src/rows.rs`), at most `(cols + VEC - 1) / VEC`
/// vectors rounded up (a row starting `VEC - 1` elements into a vector). `None` for no columns.
pub fn reg_span(dt: DType, cols: u64) -> Option<(u64, bool)> {
    let vec = vec_len(dt);
    match cols {
        0 => None,
        _ if cols.is_multiple_of(vec) => Some((cols / vec, true)),
        // `ceil((cols + VEC - 1) / VEC)` without overflow: q vectors and r > 0 elements take
        // q + 1 vectors, or q + 2 where r > 1 and the row starts late enough in its first.
        _ => Some((cols / vec + 1 + u64::from(cols % vec > 1), false)),
    }
}

/// Of `avail`, the vectors a thread with an instance for rows of whole vectors (`aligned`: all
/// of them) or of any length (those the family declares `RegU` for: none, fewer vectors).
fn reg_available<S: RowSource>(src: &S, avail: &[usize], aligned: bool) -> Vec<usize> {
    avail.iter().copied().filter(|&v| aligned || src.instance(RowVariant::RegU(v)).is_some()).collect()
}

/// The register-resident instance `v` for rows of whole vectors (`aligned`: an error where the
/// family lacks it) or of any length (`None` where the family has none: those rows stream).
fn reg_instance<S: RowSource>(src: &S, v: usize, aligned: bool) -> Result<Option<S::Kernel>> {
    if aligned { instance(src, RowVariant::Reg(v)).map(Some) } else { Ok(src.instance(RowVariant::RegU(v))) }
}

/// How a row kernel runs: its kernel and launch.
pub(crate) struct RowPlan<K> {
    pub kernel: K,
    pub cfg: LaunchConfig,
    /// Vectors per thread of the register-resident kernel, `None` for the streaming one.
    pub v: Option<usize>,
}

/// Chooses between the register-resident instances of a row kernel (`src`'s `Reg(V)`, `V` from
/// `avail`, or `RegU(V)` for rows that are not whole vectors where the family has those) and its
/// streaming one for `rows` rows of `cols` elements of `dt`: registers when the rows are short
/// enough ([`reg_span`]) and the kernel's registers allow the block (see
/// `kernels-gpu/src/rows.rs`); the row spread over a
/// group as `spread` says ([`Spread`]; `Narrow` for launches of few rows).
/// `None` if `rows` is 0.
pub(crate) fn row_plan<S: RowSource>(
    dev: &Device,
    src: &S,
    dt: DType,
    rows: u64,
    cols: u64,
    avail: &[usize],
    spread: Spread,
) -> Result<Option<RowPlan<S::Kernel>>> {
    let vec = vec_len(dt);
    if rows == 0 {
        return Ok(None);
    }
    // Few rows: narrow groups, so that the rows spread over more blocks and SMs (64 rows of
    // 1024 f32 in four-vector groups, half the blocks, ran behind PyTorch; in two-vector groups
    // ahead: docs/worklog.md, 2026-11-23-rows). The forwards go further: `fwd_row_plan`.
    let spread = if rows >= 4 * dev.sm_count() as u64 { spread } else { Spread::Narrow };
    if let Some((nvec, aligned)) = reg_span(dt, cols)
        && let Some(v) = reg_vectors(nvec, &reg_available(src, avail, aligned), spread)
        && let Some(kernel) = reg_instance(src, v, aligned)?
    {
        let g = group_size(nvec, v as u64);
        if rows_fit_grid(rows, g)
            && let Some(cfg) = grid(rows, g)
            && cfg.block.0 * cfg.block.1 <= dev.max_threads(kernel.name())?
        {
            return Ok(Some(RowPlan { kernel, cfg, v: Some(v) }));
        }
    }
    // Streaming: about four vectors per thread per pass, up to 1024 threads per row. (Sixteen,
    // i.e. 512 threads and two rows per SM, measured slower on the H100 for the f32 softmax
    // backward and layer norm at 4096 x 32768: docs/worklog.md, 2026-11-25.)
    let kernel = instance(src, RowVariant::Stream)?;
    let max = dev.max_threads(kernel.name())? / 32 * 32;
    let g = group_size(cols.div_ceil(vec), 4).min(max.max(32));
    let cfg = grid(rows, g).expect("rows > 0");
    Ok(Some(RowPlan { kernel, cfg, v: None }))
}

/// The plan of a register-resident forward (softmax, log-softmax, layer and RMS norm) over
/// `avail` vectors a thread (ascending): [`row_plan`] with `spread` (`Wide` or `Two`), except
/// where that grid needs more than one wave of resident blocks and `Wide`'s needs one (`Two`'s
/// more, lighter blocks then wait for a second wave: RMS norm bf16 at 8192 x 512, 8 MiB, lost
/// with a two-vector kernel, two waves where four vectors made one: docs/worklog.md, 2026-11-26g),
/// and except for launches of fewer rows than four an SM. Those take the fewest vectors a thread
/// (the most threads a row, up to 1024) whose grid still fits one wave of resident blocks: their
/// time is the latency of one pass over each row, which more threads a row shorten, until a
/// second wave would double it. On the H100 this beat `Spread::Narrow` (the fewest vectors that
/// keep a group at 128 threads) at every few-row shape measured, and one vector a thread where it
/// would take two waves lost to four vectors in one (docs/worklog.md, 2026-11-25e).
pub(crate) fn fwd_row_plan<S: RowSource>(
    dev: &Device,
    src: &S,
    dt: DType,
    rows: u64,
    cols: u64,
    avail: &[usize],
    spread: Spread,
) -> Result<Option<RowPlan<S::Kernel>>> {
    let few = rows > 0 && rows < 4 * dev.sm_count() as u64;
    if few && let Some((nvec, aligned)) = reg_span(dt, cols) {
        for &v in reg_available(src, avail, aligned).iter().filter(|&&v| nvec <= v as u64 * MAX_GROUP as u64) {
            let Some(kernel) = reg_instance(src, v, aligned)? else { break };
            let g = group_size(nvec, v as u64);
            let Some(cfg) = grid(rows, g) else { continue };
            let threads = cfg.block.0 * cfg.block.1;
            if !rows_fit_grid(rows, g) || threads > dev.max_threads(kernel.name())? {
                continue;
            }
            let resident = dev.sm_count() as u64 * dev.blocks_per_sm(kernel.name(), threads, cfg.shared_bytes)? as u64;
            if cfg.grid.0 as u64 <= resident {
                return Ok(Some(RowPlan { kernel, cfg, v: Some(v) }));
            }
        }
    }
    let plan = row_plan(dev, src, dt, rows, cols, avail, spread)?;
    if spread == Spread::Wide {
        return Ok(plan);
    }
    let wide = row_plan(dev, src, dt, rows, cols, avail, Spread::Wide)?;
    let waves = |p: &RowPlan<S::Kernel>| -> Result<u64> {
        let threads = p.cfg.block.0 * p.cfg.block.1;
        let resident = dev.sm_count() as u64 * dev.blocks_per_sm(p.kernel.name(), threads, p.cfg.shared_bytes)? as u64;
        Ok((p.cfg.grid.0 as u64).div_ceil(resident.max(1)))
    };
    match (plan, wide) {
        (Some(p), Some(w)) if p.v.is_some() && w.v.is_some() && waves(&w)? == 1 && waves(&p)? > 1 => Ok(Some(w)),
        (plan, _) => Ok(plan),
    }
}

/// A row cut into runs over a thread-block cluster (sm_90; `kernels-gpu/src/rows.rs`): the
/// instance `Cluster(C, V)`, `C` blocks of `threads` threads, and the block's dynamic shared
/// memory (the reductions', the cluster exchange's and the caller's `extra`).
pub(crate) struct ClusterSplit<K> {
    pub kernel: K,
    pub blocks: u32,
    pub threads: u32,
    pub shared_bytes: u32,
}

/// The smallest cluster of `sizes` whose blocks of at most `max_threads` threads hold a row of
/// `cols` at `v` vectors a thread, where the device's module has that kernel (sm_90), the rows
/// are whole vectors, and the shared memory fits; `extra(run_cols)` is what the caller's kernel
/// keeps per block for a run of `run_cols` columns. `None` otherwise.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cluster_kernel<S: RowSource>(
    dev: &Device,
    src: &S,
    dt: DType,
    cols: u64,
    v: u64,
    sizes: &[u32],
    max_threads: u32,
    extra: impl Fn(u64) -> u64,
) -> Result<Option<ClusterSplit<S::Kernel>>> {
    use kernels_gpu::rows::cluster_slots;
    let vec = vec_len(dt);
    if !cols.is_multiple_of(vec) {
        return Ok(None);
    }
    let Some((c, g)) = cluster_split(cols / vec, v, sizes, max_threads) else { return Ok(None) };
    let Some(kernel) = src.instance(RowVariant::Cluster(c, v as usize)) else { return Ok(None) };
    if !dev.has_kernel(kernel.name()) || g > dev.max_threads(kernel.name())? {
        return Ok(None);
    }
    let run_cols = (cols / vec).div_ceil(c as u64) * vec;
    let smem = reduce_smem_bytes(g) as u64 + cluster_slots(c) as u64 * 4 + extra(run_cols);
    if smem > dev.max_shared_bytes() as u64 {
        return Ok(None);
    }
    Ok(Some(ClusterSplit { kernel, blocks: c, threads: g, shared_bytes: smem as u32 }))
}

/// A launch of `src`'s `Cluster(C, 4)` (`C` from `sizes`, ascending) with one cluster of `C` blocks of at most `max_threads`
/// threads per row ([`cluster_kernel`]); `None` where there is no such kernel or split.
pub(crate) fn cluster_row_plan<S: RowSource>(
    dev: &Device,
    src: &S,
    dt: DType,
    rows: u64,
    cols: u64,
    sizes: &[u32],
    max_threads: u32,
) -> Result<Option<RowPlan<S::Kernel>>> {
    let Some(cs) = cluster_kernel(dev, src, dt, cols, 4, sizes, max_threads, |_| 0)? else {
        return Ok(None);
    };
    let blocks = rows * cs.blocks as u64;
    if rows == 0 || blocks > i32::MAX as u64 {
        return Ok(None);
    }
    let cfg = LaunchConfig { grid: (blocks as u32, 1, 1), block: (cs.threads, 1, 1), shared_bytes: cs.shared_bytes };
    Ok(Some(RowPlan { kernel: cs.kernel, cfg, v: Some(4) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::tests::{any_u32, any_u64};
    use proptest::prelude::*;

    proptest! {
        /// The row geometry is total: no input overflows or divides by zero (the tests build
        /// with overflow checks), and what comes back is a valid choice.
        #[test]
        fn no_input_panics(
            n in any_u64(),
            a in any_u64(),
            s in any_u32(),
            t in any_u32(),
            sizes in proptest::collection::vec(any_u32(), 0..4),
            avail in proptest::collection::vec(any_u64(), 0..4),
        ) {
            prop_assert!((1..=MAX_GROUP).contains(&group_size(n, a)));
            let r = grid(n, s);
            prop_assert_eq!(r.is_some(), n > 0 && (1..=MAX_GROUP).contains(&s));
            let _ = rows_fit_grid(n, s);
            let avail: Vec<usize> = avail.into_iter().map(|v| v as usize).collect();
            for spread in [Spread::Narrow, Spread::Wide, Spread::Two, Spread::Fewest] {
                if let Some(v) = reg_vectors(n, &avail, spread) {
                    prop_assert!(avail.contains(&v));
                }
            }
            for dt in DType::ALL {
                if let Some((nvec, aligned)) = reg_span(dt, n) {
                    // Every start a row may have, vec - 1 elements into a vector at most.
                    let vec = vec_len(dt) as u128;
                    let most = if aligned { n as u128 / vec } else { (n as u128 + vec - 1).div_ceil(vec) };
                    prop_assert_eq!(nvec as u128, most);
                }
            }
            if let Some((c, g)) = cluster_split(n, a, &sizes, t) {
                prop_assert!(sizes.contains(&c) && g.is_multiple_of(32) && g <= t.min(MAX_GROUP));
            }
        }
    }

    #[test]
    fn row_spans() {
        assert_eq!(reg_span(DType::BF16, 0), None);
        assert_eq!(reg_span(DType::BF16, 4096), Some((512, true)));
        assert_eq!(reg_span(DType::BF16, 1), Some((1, false)));
        assert_eq!(reg_span(DType::BF16, 9), Some((2, false))); // at offset 7: 1 + 8
        assert_eq!(reg_span(DType::BF16, 10), Some((3, false))); // at offset 7: 1 + 8 + 1
        assert_eq!(reg_span(DType::BF16, 5123), Some((642, false)));
        assert_eq!(reg_span(DType::F32, 7), Some((3, false))); // at offset 3: 1 + 4 + 2
        assert_eq!(reg_span(DType::F32, u64::MAX), Some((u64::MAX / 4 + 2, false)));
    }

    #[test]
    fn degenerate_inputs_are_no_launch() {
        assert_eq!(grid(1, 0), None);
        assert_eq!(grid(1, MAX_GROUP + 1), None);
        assert!(!rows_fit_grid(1, 0));
        assert_eq!(cluster_split(8, 1, &[0], 1024), None);
        assert_eq!(cluster_split(u64::MAX, 1, &[1], u32::MAX), None);
        assert_eq!(reg_vectors(u64::MAX, &[usize::MAX], Spread::Wide), Some(usize::MAX));
        assert_eq!(group_size(u64::MAX, 1), MAX_GROUP);
    }

    #[test]
    fn row_groups() {
        assert_eq!(group_size(1, 4), 1);
        assert_eq!(group_size(5, 1), 8);
        assert_eq!(group_size(32, 1), 32);
        assert_eq!(group_size(33, 1), 64);
        assert_eq!(group_size(100, 1), 128);
        assert_eq!(group_size(1 << 20, 1), 1024);
        assert_eq!(grid(0, 32), None);
        let c = grid(1000, 16).unwrap();
        assert_eq!((c.block, c.grid.0), ((16, 16, 1), 63));
        let c = grid(7, 1024).unwrap();
        assert_eq!((c.block, c.grid.0, c.shared_bytes), ((1024, 1, 1), 7, 32 * 16));
        assert!(rows_fit_grid(1 << 38, 1));
        assert!(!rows_fit_grid(1 << 38, 1024));
        let all = [1, 2, 4, 8];
        assert_eq!(reg_vectors(0, &all, Spread::Wide), None);
        assert_eq!(reg_vectors(1, &all, Spread::Wide), Some(1));
        assert_eq!(reg_vectors(3, &all, Spread::Wide), Some(4)); // a thread per row
        assert_eq!(reg_vectors(32, &all, Spread::Wide), Some(4)); // 128 f32 columns: 8 threads x 4
        assert_eq!(reg_vectors(32, &[1, 2], Spread::Wide), Some(2)); // without v4: 16 x 2
        assert_eq!(reg_vectors(256, &all, Spread::Wide), Some(4)); // 1024 f32: 64 threads x 4
        assert_eq!(reg_vectors(1024, &all, Spread::Wide), Some(8)); // 4096 f32: 128 threads x 8
        assert_eq!(reg_vectors(1024, &[1, 2, 4], Spread::Wide), Some(4)); // ... 256 x 4 without v8
        assert_eq!(reg_vectors(8192, &all, Spread::Wide), Some(8)); // 32768 f32: 1024 x 8
        assert_eq!(reg_vectors(8193, &all, Spread::Wide), None);
        assert_eq!(reg_vectors(8192, &[1, 2, 4], Spread::Wide), None);
        assert_eq!(reg_vectors(32, &all, Spread::Narrow), Some(1)); // narrow: a warp per row of 128 f32
        assert_eq!(reg_vectors(1, &all, Spread::Two), Some(1));
        assert_eq!(reg_vectors(3, &all, Spread::Two), Some(2)); // two threads, the second one vector
        assert_eq!(reg_vectors(16, &all, Spread::Two), Some(2)); // 128 bf16: 8 threads x 2
        assert_eq!(reg_vectors(256, &all, Spread::Two), Some(2)); // 1024 f32: 128 threads x 2
        assert_eq!(reg_vectors(257, &all, Spread::Two), Some(4)); // past 128 threads: as Wide
        assert_eq!(reg_vectors(1024, &all, Spread::Two), Some(8));
        let bwd = [1, 2, 4];
        assert_eq!(reg_vectors(0, &bwd, Spread::Fewest), None);
        assert_eq!(reg_vectors(32, &bwd, Spread::Fewest), Some(1)); // 128 f32: a warp a row
        assert_eq!(reg_vectors(1024, &bwd, Spread::Fewest), Some(1)); // 4096 f32: 1024 x 1
        assert_eq!(reg_vectors(1025, &bwd, Spread::Fewest), Some(2));
        assert_eq!(reg_vectors(2048, &bwd, Spread::Fewest), Some(2)); // 8192 f32: 1024 x 2
        assert_eq!(reg_vectors(4096, &bwd, Spread::Fewest), Some(4)); // 32768 bf16: 1024 x 4
        assert_eq!(reg_vectors(4097, &bwd, Spread::Fewest), None);
    }

    #[test]
    fn cluster_splits() {
        // 32768 f32 = 8192 vectors at two a thread: four blocks of 1024 threads.
        assert_eq!(cluster_split(8192, 2, &[4, 8], 1024), Some((4, 1024)));
        // One vector more needs the cluster of eight (513 threads, rounded up to a warp).
        assert_eq!(cluster_split(8193, 2, &[4, 8], 1024), Some((8, 544)));
        assert_eq!(cluster_split(16384, 2, &[4, 8], 1024), Some((8, 1024)));
        assert_eq!(cluster_split(16385, 2, &[4, 8], 1024), None);
        // At most 512 threads (two blocks an SM): 32768 f32 at four vectors needs four blocks.
        assert_eq!(cluster_split(8192, 4, &[2, 4, 8], 512), Some((4, 512)));
        assert_eq!(cluster_split(8192, 4, &[2, 4, 8], 2048), Some((2, 1024)));
        // A short row still gets whole warps.
        assert_eq!(cluster_split(5, 1, &[4, 8], 1024), Some((4, 32)));
        assert_eq!(cluster_split(0, 1, &[4, 8], 1024), None);
        assert_eq!(cluster_split(100, 1, &[], 1024), None);
    }

    #[test]
    fn vector_lengths() {
        use kernels_gpu::Elem;
        assert_eq!(vec_len(DType::F32), <f32 as Elem>::VEC as u64);
        assert_eq!(vec_len(DType::BF16), <kernels_gpu::BF16 as Elem>::VEC as u64);
        assert_eq!(vec_len(DType::F16), <kernels_gpu::F16 as Elem>::VEC as u64);
    }
}
