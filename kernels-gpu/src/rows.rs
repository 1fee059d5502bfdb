//! How the row kernels (softmax, the norms, row reductions, cross-entropy) spread a row over
//! threads, and how those threads reduce. Not a kernel family: the machinery those share.
//!
//! A launch is a grid of blocks `(G, R)`: `G` threads per row (a *group*), `R` rows per block.
//! `G` is a power of two up to 32 (several rows per warp, for short rows) or a multiple of 32 up
//! to 1024. Thread `t` of a group owns the row's 16-byte vectors `t, t + G, t + 2G, ...`, so a
//! warp's loads are contiguous and every byte of a row is read by exactly one thread.
//!
//! Two ways to run a row:
//! - *Register-resident* (`V` vectors per thread, `V` in 1, 2, 4, 8, instantiated per family as
//!   its registers allow): the whole row is loaded once into registers, reduced, and written
//!   from registers: one pass over memory, the minimum. Needs rows of whole vectors
//!   (`cols % VEC == 0`, so every row starts 16-byte aligned) and `cols <= G * V * VEC` with
//!   `G <= 1024`. Kernels named `*_v4_*` and `*_v8_*` carry `.maxntid 1024` (build_ptx.rs).
//! - *Register-resident, unaligned* (`_u<V>` instances, the same kernel bodies with `U = true`):
//!   rows of any length (`cols % VEC != 0`, so rows start at every alignment). A row is held as
//!   the 16-byte vectors of the aligned run around it (`RowSpan`): one or two more than its
//!   length needs at most, the lanes outside the row loaded but replaced by a value that leaves
//!   the reductions as they are, and never stored (the first and last vectors are stored lane by
//!   lane). Still one pass over memory; `cols + VEC - 1 <= G * V * VEC`.
//! - *Streaming*: any row, of any length or alignment. The row is read once to reduce and read
//!   again to write; the second read of a row mostly hits L2, since the group has just read it.
//!   Unaligned rows are split into a scalar head, whole aligned vectors and a scalar tail.
//!
//! Group reductions have a fixed shape (a butterfly within a warp, then a butterfly over the
//! warps' results through shared memory), so every result is bit-for-bit reproducible, and every
//! thread of the group receives the same value.

use crate::kernel::{Kernel, KernelEntry, Params};

/// Most threads in a group (a block).
pub const MAX_GROUP: u32 = 1024;
/// Threads per block the host aims for when a group is smaller than a block.
pub const ROW_BLOCK: u32 = 256;
/// Floats of shared memory a group reduction needs per warp of the block (up to four values).
pub const REDUCE_SLOTS: u32 = 4;

/// Dynamic shared memory, in bytes, that a block of `threads` threads needs for group
/// reductions of up to [`REDUCE_SLOTS`] values.
pub const fn reduce_smem_bytes(threads: u32) -> u32 {
    threads.div_ceil(32) * REDUCE_SLOTS * 4
}

/// Floats of shared memory, after the group-reduction slots, that a cluster exchange
/// (`ClusterExchange`) needs in a cluster of `c` blocks (none for `c = 1`): two mbarriers (four
/// floats' worth) and two buffers of `c` partials of up to [`REDUCE_SLOTS`] values.
pub const fn cluster_slots(c: u32) -> u32 {
    if c > 1 { 4 + 2 * c * REDUCE_SLOTS } else { 0 }
}

/// An instance of a row kernel, as its name says: `_v<V>` (register-resident, `V` vectors a
/// thread), `_stream`, or `_c<C>_v<V>` (a row held by a cluster of `C` blocks, sm_90 only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowVariant {
    /// Register-resident, this many vectors a thread.
    Reg(usize),
    /// Register-resident over rows of any length (`_u<V>`), this many vectors a thread.
    RegU(usize),
    /// Streaming: any row.
    Stream,
    /// A row over a cluster of this many blocks, at this many vectors a thread (sm_90).
    Cluster(u32, usize),
}

/// The instances of one row kernel for one dtype, typed by their parameter tuple `A`: the one
/// list from which the host both picks a launch's kernel and lists the family's kernels.
pub struct RowKernels<A: 'static> {
    kernels: &'static [(RowVariant, Kernel<A>)],
}

impl<A: Params> RowKernels<A> {
    /// The instances, register-resident ones in ascending vectors.
    pub const fn new(kernels: &'static [(RowVariant, Kernel<A>)]) -> Self {
        RowKernels { kernels }
    }
    /// The instance `v`, if the family has it.
    pub fn get(&self, v: RowVariant) -> Option<Kernel<A>> {
        self.kernels.iter().find(|(w, _)| *w == v).map(|&(_, k)| k)
    }
    /// The register-resident instance of `v` vectors a thread.
    pub fn reg(&self, v: usize) -> Option<Kernel<A>> {
        self.get(RowVariant::Reg(v))
    }
    /// The streaming instance.
    pub fn stream(&self) -> Option<Kernel<A>> {
        self.get(RowVariant::Stream)
    }
    /// The instance over a cluster of `c` blocks at `v` vectors a thread.
    pub fn cluster(&self, c: u32, v: usize) -> Option<Kernel<A>> {
        self.get(RowVariant::Cluster(c, v))
    }
    /// The register-resident instance for rows of any length, `v` vectors a thread.
    pub fn reg_unaligned(&self, v: usize) -> Option<Kernel<A>> {
        self.get(RowVariant::RegU(v))
    }
    /// The vectors a thread of the register-resident instances, ascending.
    pub fn reg_vectors(&self) -> impl Iterator<Item = usize> + '_ {
        self.kernels.iter().filter_map(|(w, _)| match w {
            RowVariant::Reg(v) => Some(*v),
            _ => None,
        })
    }
    /// The cluster sizes of the instances at `v` vectors a thread, ascending.
    pub fn cluster_sizes(&self, v: usize) -> impl Iterator<Item = u32> + '_ {
        self.kernels.iter().filter_map(move |(w, _)| match *w {
            RowVariant::Cluster(c, w) if w == v => Some(c),
            _ => None,
        })
    }
    /// Every instance's name and arity.
    pub fn entries(&self) -> impl Iterator<Item = KernelEntry> + '_ {
        self.kernels.iter().map(|(_, k)| k.entry())
    }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// This thread's place in a row launch.
    #[derive(Clone, Copy)]
    pub struct Group {
        /// Thread index within the group.
        pub t: u32,
        /// Threads per group (`blockDim.x`).
        pub size: u32,
        /// Group index within the block.
        pub ty: u32,
        /// Groups per block (`blockDim.y`).
        pub per_block: u32,
    }

    impl Group {
        #[inline(always)]
        pub fn this() -> Group {
            Group { t: thread_idx_x(), size: block_dim_x(), ty: thread_idx_y(), per_block: block_dim_y() }
        }
        /// This group's row in a launch of one group per row.
        #[inline(always)]
        pub fn first_row(&self) -> u64 {
            block_idx_x() as u64 * self.per_block as u64 + self.ty as u64
        }

        /// Calls `f(row)` for this group's rows of `rows`, from [`Group::first_row`] with the
        /// grid's stride (for persistent launches, and for grids capped below one group per row).
        ///
        /// Every thread of a block runs the same number of iterations: the bound is `rows`
        /// rounded up to whole blocks of rows, so `f` may contain group reductions (barriers);
        /// it must check `row < rows` itself before touching memory.
        #[inline(always)]
        pub fn for_each_row(&self, rows: u64, f: impl FnMut(u64)) {
            self.for_each_row_from(rows, self.first_row(), grid_dim_x() as u64 * self.per_block as u64, f)
        }

        /// As [`Group::for_each_row`], from row `first` with stride `step` (a cluster's rows:
        /// the same for each of its blocks, so they meet at the same cluster barriers).
        #[inline(always)]
        pub fn for_each_row_from(&self, rows: u64, first: u64, step: u64, mut f: impl FnMut(u64)) {
            let per_block = self.per_block as u64;
            let block_rows = rows.div_ceil(per_block) * per_block;
            let mut row = first;
            while row < block_rows {
                f(row);
                row += step;
            }
        }
    }

    /// Combines `K` values over the threads of each group with `combine`, in a fixed order;
    /// every thread of the group gets the same result. `identity` must combine exactly
    /// (`combine(v, identity) == v`): it fills the lanes that hold no warp's partial.
    ///
    /// Every thread of the block must call it, the same number of times (it may contain
    /// barriers): threads whose row is past the end pass the identity instead of returning early.
    /// `combine` must treat its arguments' bits as values only (an index stored in an f32's bits
    /// survives: shuffles and shared memory move bits).
    ///
    /// Shape: a butterfly over the group's lanes of a warp; for groups of more than one warp,
    /// each warp's result through shared memory, and a second butterfly over those (at most 32)
    /// in every warp. Ten shuffle steps at most, whatever the group size: a combine that costs
    /// something (softmax's merge has two `exp`) is paid ten times, not once per warp.
    #[inline(always)]
    pub fn group_reduce<const K: usize>(
        g: &Group,
        v: [f32; K],
        identity: [f32; K],
        combine: impl Fn([f32; K], [f32; K]) -> [f32; K],
    ) -> [f32; K] {
        const { assert!(K as u32 <= REDUCE_SLOTS) };
        let lane = (g.ty * g.size + g.t) % 32;
        let width = if g.size < 32 { g.size } else { 32 };
        let v = butterfly(v, width, lane, &combine);
        if g.size <= 32 {
            return v;
        }
        // Warps of a group, in order, through shared memory: [ty][warp][K].
        let warps = g.size / 32;
        let smem = dyn_smem::<f32>();
        let base = (g.ty * warps * REDUCE_SLOTS) as usize;
        // The barrier before the write protects the previous reduction's reads.
        sync_threads();
        if lane == 0 {
            let w = (g.t / 32) as usize;
            let mut k = 0;
            while k < K {
                // SAFETY: the host launches with `reduce_smem_bytes(G * R)` of shared memory.
                unsafe { *smem.add(base + w * REDUCE_SLOTS as usize + k) = v[k] };
                k += 1;
            }
        }
        sync_threads();
        let mut r = identity;
        if lane < warps {
            let mut k = 0;
            while k < K {
                // SAFETY: as above; lane < warps.
                r[k] = unsafe { *smem.add(base + lane as usize * REDUCE_SLOTS as usize + k) };
                k += 1;
            }
        }
        butterfly(r, 32, lane, &combine)
    }

    /// The run of a row that block `cluster_rank()` of a cluster of `C` blocks holds: its first
    /// column and its whole vectors (the row's `nvec` vectors cut into `C` nearly equal runs,
    /// rank r owning vectors `r * nvec / C ..`). `(0, nvec)` for `C = 1`.
    #[inline(always)]
    pub fn cluster_run<T: Elem, const C: u32>(cols: u64) -> (u64, u64) {
        let nvec = cols / T::VEC as u64;
        if C == 1 {
            return (0, nvec);
        }
        let (r, c) = (cluster_rank() as u64, C as u64);
        let (v0, v1) = (r * nvec / c, (r + 1) * nvec / c);
        (v0 * T::VEC as u64, v1 - v0)
    }

    /// The row reductions of a register-resident row kernel that holds a row in one group
    /// (`C = 1`: [`group_reduce`]) or in a cluster of `C` blocks (sm_90: the block's
    /// [`group_reduce`], then a [`ClusterExchange`]), so that one kernel body serves both.
    pub struct RowReducer<const C: u32> {
        xch: Option<ClusterExchange<C>>,
    }

    impl<const C: u32> RowReducer<C> {
        /// Every thread of the block (cluster) must call it, at the start of the kernel. With
        /// `C > 1` the launch carries [`cluster_slots`]`(C)` floats of shared memory after the
        /// group reduction's [`reduce_smem_bytes`].
        #[inline(always)]
        pub fn new(g: &Group) -> Self {
            let slots = dyn_smem_addr() + reduce_smem_bytes(g.size * g.per_block);
            RowReducer { xch: if C > 1 { Some(ClusterExchange::<C>::new(g, slots)) } else { None } }
        }

        /// `v` combined over the row's threads: the group's, then the cluster's (rank order).
        #[inline(always)]
        pub fn reduce<const K: usize>(
            &mut self,
            g: &Group,
            v: [f32; K],
            identity: [f32; K],
            combine: impl Fn([f32; K], [f32; K]) -> [f32; K],
        ) -> [f32; K] {
            let r = group_reduce(g, v, identity, &combine);
            match self.xch.as_mut() {
                Some(x) => x.reduce(g, r, combine),
                None => r,
            }
        }

        /// Ends the exchange (see [`ClusterExchange::finish`]); every thread must call it.
        #[inline(always)]
        pub fn finish(self) {
            if let Some(x) = self.xch {
                x.finish();
            }
        }
    }

    /// The row of a one-row-per-group launch (`C = 1`) or of a one-row-per-cluster launch.
    #[inline(always)]
    pub fn launch_row<const C: u32>(g: &Group) -> u64 {
        if C == 1 { g.first_row() } else { cluster_idx_x() as u64 }
    }

    /// Combines values over the `C` blocks of a thread-block cluster (sm_90), each block holding
    /// its part of a row. Each call takes `K` values already reduced over the block (a
    /// [`group_reduce`] with one group per block) and returns their combination in rank order,
    /// the same bits in every thread of the cluster.
    ///
    /// How: the first `C` threads of each block `st.async` the block's values into slot
    /// `[buffer][rank]` of every block's shared memory, each store counting its bytes against
    /// the receiver's mbarrier for that buffer; each block waits on its own mbarrier until all
    /// `C * K * 4` bytes have landed, then reads its copy. No cluster barrier per call: a
    /// release barrier fences at GPU scope (`MEMBAR.ALL.GPU`, which waits for the thread's
    /// outstanding global stores), and with it the backward's rows of 32768 ran far slower
    /// (docs/worklog.md, 2026-11-23b).
    ///
    /// Two buffers, alternating: a block can be at most one call ahead of another (call `n + 1`
    /// needs every block's values of call `n + 1`, sent after that block's `group_reduce` of
    /// call `n + 1`, whose barrier, or for a one-warp block whose full-warp shuffles, all its
    /// threads pass only after reading their slots of call `n`), so the slots of call `n` are
    /// free again at call `n + 2`.
    pub struct ClusterExchange<const C: u32> {
        /// Shared-window address of the two mbarriers, then the buffers.
        base: u32,
        calls: u32,
    }

    impl<const C: u32> ClusterExchange<C> {
        /// Sets up the exchange at shared-window address `base` ([`cluster_slots`]`(C)` floats,
        /// 8-byte aligned). Every thread of the cluster must call it, at the start of the kernel:
        /// it ends with a cluster barrier, after which every block runs and has its mbarriers.
        #[inline(always)]
        pub fn new(g: &Group, base: u32) -> Self {
            if g.t == 0 && g.ty == 0 {
                // SAFETY: two 8-byte barriers at base (host-sized); nobody uses them before the
                // cluster barrier below.
                unsafe {
                    mbarrier_init(base, 1);
                    mbarrier_init(base + 8, 1);
                }
                fence_mbarrier_init();
            }
            cluster_sync();
            ClusterExchange { base, calls: 0 }
        }

        /// One combination (see the type). Every thread of the cluster must call it, the same
        /// number of times.
        #[inline(always)]
        pub fn reduce<const K: usize>(
            &mut self,
            g: &Group,
            v: [f32; K],
            combine: impl Fn([f32; K], [f32; K]) -> [f32; K],
        ) -> [f32; K] {
            const { assert!(K as u32 <= REDUCE_SLOTS) };
            let which = self.calls & 1;
            // Each barrier completes one phase every other call.
            let phase = (self.calls >> 1) & 1;
            self.calls += 1;
            let bar = self.base + which * 8;
            let buf = self.base + 16 + which * C * REDUCE_SLOTS * 4;
            if g.t == 0 {
                // SAFETY: this block's initialised barrier; arrival count 1 (this thread).
                unsafe { mbarrier_arrive_expect_tx(bar, C * K as u32 * 4) };
            }
            let me = cluster_rank();
            if g.t < C {
                let mut k = 0;
                while k < K {
                    // SAFETY: inside the buffers; block g.t < C runs and expects these bytes
                    // in this phase (see the type's comment on why it cannot be a phase behind).
                    unsafe { st_async_cluster_f32(buf + (me * REDUCE_SLOTS + k as u32) * 4, bar, g.t, v[k]) };
                    k += 1;
                }
            }
            // SAFETY: this block's initialised barrier.
            unsafe { mbarrier_wait_parity(bar, phase) };
            let read = |q: u32| {
                let mut r = [0.0f32; K];
                let mut k = 0;
                while k < K {
                    // SAFETY: inside the buffers; landed before the barrier's phase completed.
                    r[k] = unsafe { ld_shared_f32(buf + (q * REDUCE_SLOTS + k as u32) * 4) };
                    k += 1;
                }
                r
            };
            let mut r = read(0);
            let mut q = 1;
            while q < C {
                r = combine(r, read(q));
                q += 1;
            }
            r
        }

        /// Ends the exchange: a cluster barrier, so that no block exits while another may still
        /// be storing into its shared memory. Every thread of the cluster must call it.
        #[inline(always)]
        pub fn finish(self) {
            cluster_sync();
        }
    }

    /// Butterfly over aligned groups of `width` lanes (a power of two up to 32), then every
    /// lane takes its group's first lane's result: the butterfly may leave lanes with results
    /// that differ in the last bit (`combine` need not be commutative in floating point).
    ///
    /// The steps run from `width / 2` down, so a group of 4 takes two steps and no test of the
    /// three it has no lanes for; the first lane is a mask, `width` being a power of two (a
    /// remainder here was a call to a 16-bit division routine, twice a row in layer norm).
    #[inline(always)]
    fn butterfly<const K: usize>(
        mut v: [f32; K],
        width: u32,
        lane: u32,
        combine: &impl Fn([f32; K], [f32; K]) -> [f32; K],
    ) -> [f32; K] {
        let mut m = width >> 1;
        while m > 0 {
            let mut o = [0.0f32; K];
            let mut k = 0;
            while k < K {
                o[k] = shfl_xor_f32(v[k], m);
                k += 1;
            }
            v = combine(v, o);
            m >>= 1;
        }
        let first = lane & !(width - 1);
        let mut k = 0;
        while k < K {
            v[k] = shfl_idx_f32(v[k], first);
            k += 1;
        }
        v
    }

    /// Calls `f(s)` for each slot `s < V`, written out so that every index is a constant (see
    /// `dtype::for_lanes` for why a plain loop is not enough).
    #[inline(always)]
    pub fn for_slots<const V: usize>(mut f: impl FnMut(usize)) {
        macro_rules! slots {
            ($($s:literal)*) => { $( if $s < V { f($s); } )* };
        }
        slots!(0 1 2 3 4 5 6 7);
    }

    /// Loads this thread's vectors of a row into registers (raw, unpacked on use): slot `s` is
    /// the row's vector `t + s * G`, present when below `nvec` and `ok`; absent slots are zero.
    ///
    /// # Safety
    /// `row` must be 16-byte aligned and hold `nvec` whole vectors not written by this launch.
    #[inline(always)]
    pub unsafe fn load_row<T: Elem, const V: usize>(row: *const T, nvec: u64, g: &Group, ok: bool) -> [[u32; 4]; V] {
        // SAFETY: called on the row's vectors only, whose contract is this function's.
        let ld = |p| unsafe { ld_global_nc_v4(p) };
        // SAFETY: the contract.
        unsafe { load_row_with::<T, V>(row, nvec, g, ok, ld) }
    }

    /// [`load_row`] with coherent loads, for a row that the launch also writes: a fused op's
    /// output written in place over this input, each element by the thread that read it.
    ///
    /// # Safety
    /// `row` must be 16-byte aligned and hold `nvec` whole vectors; any write to them by this
    /// launch comes after this load, from the same thread.
    #[inline(always)]
    pub unsafe fn load_row_coherent<T: Elem, const V: usize>(
        row: *const T,
        nvec: u64,
        g: &Group,
        ok: bool,
    ) -> [[u32; 4]; V] {
        // SAFETY: called on the row's vectors only, whose contract is this function's.
        let ld = |p| unsafe { ld_global_v4(p) };
        // SAFETY: the contract.
        unsafe { load_row_with::<T, V>(row, nvec, g, ok, ld) }
    }

    /// [`load_row`]'s slots, each loaded by `ld`.
    ///
    /// # Safety
    /// `row` must be 16-byte aligned and hold `nvec` whole vectors that `ld` may read.
    #[inline(always)]
    unsafe fn load_row_with<T: Elem, const V: usize>(
        row: *const T,
        nvec: u64,
        g: &Group,
        ok: bool,
        ld: impl Fn(*const u32) -> [u32; 4],
    ) -> [[u32; 4]; V] {
        let mut raw = [[0u32; 4]; V];
        for_slots::<V>(
            #[inline(always)]
            |s| {
                let j = g.t as u64 + (s as u64) * g.size as u64;
                if ok && j < nvec {
                    // SAFETY: j < nvec, per the contract.
                    raw[s] = ld(unsafe { row.add((j * T::VEC as u64) as usize) } as *const u32);
                }
            },
        );
        raw
    }

    /// A row as a register-resident kernel holds it: `nvec` 16-byte vectors from `lead`
    /// elements before the row's start (its start rounded down to 16 bytes); element `i` of
    /// them is column `i - lead`, in the row for `lead <= i < end`. With `U = false` (rows of
    /// whole vectors, so 16-byte aligned) `lead` is 0 and `end` is `cols`, both known to the
    /// compiler as such: the aligned kernels are what they were without it.
    #[derive(Clone, Copy)]
    pub struct RowSpan<const U: bool> {
        pub lead: u64,
        pub end: u64,
        pub nvec: u64,
    }

    impl<const U: bool> RowSpan<U> {
        /// The span of the row at `row` of `cols` elements; empty when not `ok`. With `U`, the
        /// tensor's other rows' pointers must have `row`'s alignment (every tensor starts
        /// 16-byte aligned, so a row's alignment depends only on its index).
        #[inline(always)]
        pub fn of<T: Elem>(row: *const T, cols: u64, ok: bool) -> Self {
            if !ok {
                return RowSpan { lead: 0, end: 0, nvec: 0 };
            }
            let lead = if U { (row as u64 % 16) / core::mem::size_of::<T>() as u64 } else { 0 };
            let end = lead + cols;
            RowSpan { lead, end, nvec: if U { end.div_ceil(T::VEC as u64) } else { cols / T::VEC as u64 } }
        }

        /// Whether vector `j` lies wholly inside the row (always, without `U`).
        #[inline(always)]
        pub fn whole<T: Elem>(&self, j: u64) -> bool {
            !U || ((j > 0 || self.lead == 0) && (j + 1) * T::VEC as u64 <= self.end)
        }

        /// Whether lane `k` of vector `j` is in the row (for a vector that is not whole).
        #[inline(always)]
        pub fn lane_in<T: Elem>(&self, j: u64, k: usize) -> bool {
            let i = j * T::VEC as u64 + k as u64;
            i >= self.lead && i < self.end
        }
    }

    /// The bits of lane `k` within its 32-bit word of a packed vector of `T` (the lower address
    /// in the lower bits).
    #[inline(always)]
    fn lane_bits<T: Elem>(k: usize) -> (usize, u32) {
        let per_word = T::VEC / 4;
        if per_word == 1 { (k, u32::MAX) } else { (k / per_word, 0xffff << ((k % per_word) * 16)) }
    }

    /// Loads this thread's vectors of a row held as `span` from `base` (the row's start less
    /// `span.lead` elements) into registers, as [`load_row`]; with `U`, the lanes of a vector
    /// outside the row are replaced by `fill`'s (a word of `T`'s packed values, e.g. `-inf`
    /// for a max, 0 for a sum), so the reductions see only the row.
    ///
    /// # Safety
    /// `base` must be 16-byte aligned; each of the row's elements must be readable and not
    /// written by this launch. The lanes outside the row are read from the same aligned 16
    /// bytes as a row element: never beyond a page that holds the tensor, and only ever masked.
    #[inline(always)]
    pub unsafe fn load_span<T: Elem, const V: usize, const U: bool>(
        base: *const T,
        span: RowSpan<U>,
        g: &Group,
        fill: u32,
    ) -> [[u32; 4]; V] {
        // SAFETY: as load_row, on whole aligned 16 bytes that hold a row element.
        let ld = |p| unsafe { ld_global_nc_v4(p) };
        // SAFETY: the contract.
        unsafe { load_span_with::<T, V, U>(base, span, g, fill, ld) }
    }

    /// [`load_span`] with coherent loads (see [`load_row_coherent`]).
    ///
    /// # Safety
    /// As [`load_span`], except that the row may be written by this launch: each element
    /// only after this load, by the thread that read it. (The lanes outside the row may be
    /// written by other threads meanwhile: their values are discarded.)
    #[inline(always)]
    pub unsafe fn load_span_coherent<T: Elem, const V: usize, const U: bool>(
        base: *const T,
        span: RowSpan<U>,
        g: &Group,
        fill: u32,
    ) -> [[u32; 4]; V] {
        // SAFETY: as load_row_coherent, on whole aligned 16 bytes that hold a row element.
        let ld = |p| unsafe { ld_global_v4(p) };
        // SAFETY: the contract.
        unsafe { load_span_with::<T, V, U>(base, span, g, fill, ld) }
    }

    /// [`load_span`]'s slots, each loaded by `ld`.
    ///
    /// # Safety
    /// As [`load_span`].
    #[inline(always)]
    unsafe fn load_span_with<T: Elem, const V: usize, const U: bool>(
        base: *const T,
        span: RowSpan<U>,
        g: &Group,
        fill: u32,
        ld: impl Fn(*const u32) -> [u32; 4],
    ) -> [[u32; 4]; V] {
        // SAFETY: span.nvec vectors from base, per the contract.
        let mut raw = unsafe { load_row_with::<T, V>(base, span.nvec, g, true, ld) };
        if U {
            for_slots::<V>(
                #[inline(always)]
                |s| {
                    let j = g.t as u64 + (s as u64) * g.size as u64;
                    if j < span.nvec && !span.whole::<T>(j) {
                        let mut out = [0u32; 4];
                        crate::dtype::for_lanes::<T>(
                            #[inline(always)]
                            |k| {
                                let (w, bits) = lane_bits::<T>(k);
                                if !span.lane_in::<T>(j, k) {
                                    out[w] |= bits;
                                }
                            },
                        );
                        let mut w = 0;
                        while w < 4 {
                            raw[s][w] = (raw[s][w] & !out[w]) | (fill & out[w]);
                            w += 1;
                        }
                    }
                },
            );
        }
        raw
    }

    /// Stores vector `j` of a row held as `span` (`packed`) at `p` (the vector's address in
    /// the output): whole, or (with `U`) lane by lane, the lanes inside the row only.
    ///
    /// # Safety
    /// `p` must be 16-byte aligned and the row's elements among its lanes writable by this
    /// thread alone.
    #[inline(always)]
    pub unsafe fn store_span<T: Elem, const U: bool>(p: *mut T, span: RowSpan<U>, j: u64, packed: [u32; 4]) {
        if span.whole::<T>(j) {
            // SAFETY: the contract; the whole vector is the row's.
            unsafe { st_global_v4(p as *mut u32, packed) };
            return;
        }
        crate::dtype::for_lanes::<T>(
            #[inline(always)]
            |k| {
                if span.lane_in::<T>(j, k) {
                    let (w, _) = lane_bits::<T>(k);
                    // SAFETY: lane k is inside the row, per the contract.
                    unsafe {
                        if T::VEC == 4 {
                            *(p as *mut u32).add(k) = packed[w];
                        } else {
                            *(p as *mut u16).add(k) = (packed[w] >> ((k % 2) * 16)) as u16;
                        }
                    }
                }
            },
        );
    }

    /// Whether slot `s` of this thread holds a vector of the row.
    #[inline(always)]
    pub fn slot_present(g: &Group, s: usize, nvec: u64, ok: bool) -> bool {
        ok && (g.t as u64 + s as u64 * g.size as u64) < nvec
    }

    /// Column of the first element of slot `s`.
    #[inline(always)]
    pub fn slot_col<T: Elem>(g: &Group, s: usize) -> u64 {
        (g.t as u64 + s as u64 * g.size as u64) * T::VEC as u64
    }

    /// The parts of a row at `row` (any alignment) of `cols` elements: `head` scalars up to the
    /// first 16-byte boundary, `nvec` whole vectors, then the scalar tail.
    #[derive(Clone, Copy)]
    pub struct RowSplit {
        pub head: u64,
        pub nvec: u64,
        pub cols: u64,
    }

    impl RowSplit {
        #[inline(always)]
        pub fn of<T: Elem>(row: *const T, cols: u64) -> RowSplit {
            let size = core::mem::size_of::<T>() as u64;
            let mis = (row as u64 % 16) / size;
            let head = if mis == 0 { 0 } else { (T::VEC as u64 - mis).min(cols) };
            RowSplit { head, nvec: (cols - head) / T::VEC as u64, cols }
        }
    }

    /// Folds over a row in the streaming pattern: `vector(acc, c, data)` for each whole vector
    /// this thread owns (`c` = the column of its first element; two loads in flight per thread:
    /// `load` both, then fold both), and `scalar(acc, c)` for this thread's head and tail elements.
    /// The accumulator is threaded through explicitly so both callbacks may update it.
    #[inline(always)]
    pub fn fold_row<L: Copy, A>(
        sp: RowSplit,
        vec_w: u64,
        g: &Group,
        mut acc: A,
        load: impl Fn(u64) -> L,
        vector: impl Fn(A, u64, L) -> A,
        scalar: impl Fn(A, u64) -> A,
    ) -> A {
        let t = g.t as u64;
        let step = g.size as u64;
        // Head and tail are each up to VEC - 1 elements, more than a small group has threads.
        let mut h = t;
        while h < sp.head {
            acc = scalar(acc, h);
            h += step;
        }
        let mut j = t;
        while j + step < sp.nvec {
            let (c0, c1) = (sp.head + j * vec_w, sp.head + (j + step) * vec_w);
            let (a, b) = (load(c0), load(c1));
            acc = vector(acc, c0, a);
            acc = vector(acc, c1, b);
            j += 2 * step;
        }
        if j < sp.nvec {
            let c = sp.head + j * vec_w;
            acc = vector(acc, c, load(c));
        }
        let mut tail = sp.head + sp.nvec * vec_w + t;
        while tail < sp.cols {
            acc = scalar(acc, tail);
            tail += step;
        }
        acc
    }

    /// `max` that propagates NaN, as PyTorch's reductions do.
    #[inline(always)]
    pub fn nan_max(a: f32, b: f32) -> f32 {
        max_nan(a, b)
    }

    /// `min` that propagates NaN.
    #[inline(always)]
    pub fn nan_min(a: f32, b: f32) -> f32 {
        min_nan(a, b)
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;
