//! Device primitives: the only place in the crate with `asm!` and `core::arch::nvptx`.
//!
//! Kernels call these instead of writing PTX themselves, so each instruction's constraints
//! (alignment, address space, which threads must participate) are written down once, here.
#![cfg(target_arch = "nvptx64")]

use core::arch::asm;
use core::arch::nvptx;

// ---------------------------------------------------------------------------------------------
// Indices. Products are formed in 64 bits: grids over more than 2^31 elements are routine.

#[inline(always)]
pub fn thread_idx_x() -> u32 {
    // SAFETY: reading a special register has no preconditions.
    unsafe { nvptx::_thread_idx_x() as u32 }
}
#[inline(always)]
pub fn thread_idx_y() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_thread_idx_y() as u32 }
}
#[inline(always)]
pub fn block_idx_x() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_idx_x() as u32 }
}
#[inline(always)]
pub fn block_idx_y() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_idx_y() as u32 }
}
#[inline(always)]
pub fn block_idx_z() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_idx_z() as u32 }
}
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_dim_x() as u32 }
}
#[inline(always)]
pub fn block_dim_y() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_dim_y() as u32 }
}
#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_grid_dim_x() as u32 }
}
#[inline(always)]
pub fn grid_dim_y() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_grid_dim_y() as u32 }
}

/// Global index of this thread in a 1-D launch.
#[inline(always)]
pub fn global_thread_x() -> u64 {
    block_idx_x() as u64 * block_dim_x() as u64 + thread_idx_x() as u64
}

/// Number of threads in a 1-D launch: the step of a grid-stride loop.
#[inline(always)]
pub fn grid_threads_x() -> u64 {
    grid_dim_x() as u64 * block_dim_x() as u64
}

// ---------------------------------------------------------------------------------------------
// Barriers and warp exchange.

/// `bar.sync 0`: every thread of the block must reach it (never call it under a divergent
/// branch).
#[inline(always)]
pub fn sync_threads() {
    // SAFETY: `bar.sync` has no memory preconditions; callers keep it convergent.
    unsafe { nvptx::_syncthreads() }
}

/// Waits at named barrier `id` (1-15; 0 is [`sync_threads`]'s) until `count` threads (a
/// multiple of 32) have reached it by this or [`named_barrier_arrive`] (`bar.sync id, count`).
///
/// # Safety
/// Whole warps call it; exactly `count` threads meet at each use of the barrier.
#[inline(always)]
pub unsafe fn named_barrier_sync<const ID: u32>(count: u32) {
    // SAFETY: per the function contract.
    unsafe { asm!("bar.sync {id}, {n};", id = const ID, n = in(reg32) count, options(nostack, preserves_flags)) };
}

/// Counts this warp at named barrier `id` without waiting (`bar.arrive id, count`): the signal
/// that lets the threads waiting there in [`named_barrier_sync`] go on.
///
/// # Safety
/// As [`named_barrier_sync`].
#[inline(always)]
pub unsafe fn named_barrier_arrive<const ID: u32>(count: u32) {
    // SAFETY: per the function contract.
    unsafe { asm!("bar.arrive {id}, {n};", id = const ID, n = in(reg32) count, options(nostack, preserves_flags)) };
}

/// Butterfly exchange across the full warp: lane `l` gets lane `l ^ lane_mask`'s value. All 32
/// lanes must execute it (mask 0xffffffff).
#[inline(always)]
pub fn shfl_xor_u32(v: u32, lane_mask: u32) -> u32 {
    let out: u32;
    // SAFETY: `shfl.sync` with a full member mask; all callers run it warp-converged.
    unsafe {
        asm!("shfl.sync.bfly.b32 {o}, {v}, {m}, 0x1f, 0xffffffff;",
             o = out(reg32) out, v = in(reg32) v, m = in(reg32) lane_mask,
             options(nomem, nostack, preserves_flags));
    }
    out
}

/// [`shfl_xor_u32`] of an f32's bits (exact: the bits move, no arithmetic).
#[inline(always)]
pub fn shfl_xor_f32(v: f32, lane_mask: u32) -> f32 {
    f32::from_bits(shfl_xor_u32(v.to_bits(), lane_mask))
}

/// Every lane gets lane `src`'s value (a broadcast when `src` is the same for all). All 32 lanes
/// must execute it.
#[inline(always)]
pub fn shfl_idx_f32(v: f32, src: u32) -> f32 {
    let out: u32;
    // SAFETY: as `shfl_xor_u32`.
    unsafe {
        asm!("shfl.sync.idx.b32 {o}, {v}, {s}, 0x1f, 0xffffffff;",
             o = out(reg32) out, v = in(reg32) v.to_bits(), s = in(reg32) src,
             options(nomem, nostack, preserves_flags));
    }
    f32::from_bits(out)
}

/// Sum over the 32 lanes of a warp; every lane gets the result. The order of additions is fixed
/// (butterfly), so the result is bit-for-bit reproducible.
#[inline(always)]
pub fn warp_sum(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v += shfl_xor_f32(v, m);
        m >>= 1;
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Dynamic shared memory. One `extern .shared` array for the whole module; its size is the
// launch's `sharedMemBytes`.

core::arch::global_asm!(".extern .shared .align 16 .b8 DYN_SMEM[];");

/// Generic pointer to the start of the block's dynamic shared memory. The caller must launch
/// with enough `sharedMemBytes` for what it indexes.
#[inline(always)]
pub fn dyn_smem<T>() -> *mut T {
    let p: u64;
    // SAFETY: converts the shared-window address of DYN_SMEM to a generic address; no access.
    unsafe {
        asm!("cvta.shared.u64 {p}, DYN_SMEM;", p = out(reg64) p, options(nomem, nostack, pure));
    }
    p as *mut T
}

/// Shared-window (32-bit) address of the start of the dynamic shared memory, for the explicit
/// `ld.shared`/`st.shared` below. Generic loads and stores of shared memory (through
/// [`dyn_smem`]) are fine for a few accesses per element; the GEMM's inner loop is almost all
/// shared loads, and there the explicit state space keeps each one a single `LDS`.
#[inline(always)]
pub fn dyn_smem_addr() -> u32 {
    let a: u32;
    // SAFETY: reads the address of DYN_SMEM in the shared window; no access.
    unsafe {
        asm!("mov.u32 {a}, DYN_SMEM;", a = out(reg32) a, options(nomem, nostack, pure));
    }
    a
}

/// Loads 16 bytes of shared memory as four f32.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared-window address inside the launch's dynamic shared
/// memory.
#[inline(always)]
pub unsafe fn ld_shared_v4_f32(addr: u32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    // SAFETY: per the function contract.
    unsafe {
        asm!("ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg32) addr, options(pure, readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// Loads 4 bytes of shared memory (an f32's bits).
///
/// # Safety
/// `addr` must be a 4-byte aligned shared-window address inside the launch's dynamic shared
/// memory.
#[inline(always)]
pub unsafe fn ld_shared_b32(addr: u32) -> u32 {
    let v: u32;
    // SAFETY: per the function contract.
    unsafe {
        asm!("ld.shared.b32 {v}, [{p}];", v = out(reg32) v, p = in(reg32) addr,
             options(pure, readonly, nostack, preserves_flags));
    }
    v
}

/// Loads 8 bytes of shared memory (two f32's bits).
///
/// # Safety
/// `addr` must be an 8-byte aligned shared-window address inside the launch's dynamic shared
/// memory.
#[inline(always)]
pub unsafe fn ld_shared_v2_b32(addr: u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: per the function contract.
    unsafe {
        asm!("ld.shared.v2.b32 {{{a}, {b}}}, [{p}];", a = out(reg32) a, b = out(reg32) b, p = in(reg32) addr,
             options(pure, readonly, nostack, preserves_flags));
    }
    [a, b]
}

/// Stores one f32 to shared memory.
///
/// # Safety
/// `addr` must be a 4-byte aligned shared-window address inside the dynamic shared memory.
#[inline(always)]
pub unsafe fn st_shared_f32(addr: u32, v: f32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("st.shared.f32 [{p}], {v};", p = in(reg32) addr, v = in(reg32) v,
             options(nostack, preserves_flags));
    }
}

/// Stores 16 bytes (four f32) to shared memory.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared-window address inside the dynamic shared memory.
#[inline(always)]
pub unsafe fn st_shared_v4_f32(addr: u32, v: [f32; 4]) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("st.shared.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};", p = in(reg32) addr,
             a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
             options(nostack, preserves_flags));
    }
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90: Hopper and later). A kernel whose PTX carries
// `.reqnctapercluster C, 1, 1` (build_ptx.rs adds it to kernels named `*_c<C>_*`) runs in
// groups of C blocks that the hardware co-schedules on one GPC; they can read and write each
// other's shared memory and wait for each other at a cluster barrier. Only kernels compiled for
// sm_90 (`#[cfg(target_feature = "sm_90")]`) may call these: older targets have no such
// instructions and ptxas rejects them.

/// This block's rank in its cluster (`%cluster_ctarank`, 0 to C - 1).
#[inline(always)]
pub fn cluster_rank() -> u32 {
    let r: u32;
    // SAFETY: reading a special register has no preconditions.
    unsafe { asm!("mov.u32 {r}, %cluster_ctarank;", r = out(reg32) r, options(nomem, nostack, pure)) };
    r
}

/// This block's cluster along x (`%clusterid.x`).
#[inline(always)]
pub fn cluster_idx_x() -> u32 {
    let r: u32;
    // SAFETY: as above.
    unsafe { asm!("mov.u32 {r}, %clusterid.x;", r = out(reg32) r, options(nomem, nostack, pure)) };
    r
}

/// Clusters in the grid along x (`%nclusterid.x`).
#[inline(always)]
pub fn cluster_count_x() -> u32 {
    let r: u32;
    // SAFETY: as above.
    unsafe { asm!("mov.u32 {r}, %nclusterid.x;", r = out(reg32) r, options(nomem, nostack, pure)) };
    r
}

/// Waits until the grids this one depends on have completed and their memory operations are
/// visible (`griddepcontrol.wait`, sm_90). A kernel launched as a programmatic dependent launch
/// (the host's `launch_dependent`) may start before the previous kernel on its stream ends, and
/// must call this before it touches global memory. Without such a launch it returns at once;
/// on targets before sm_90 it is nothing (they are never launched so).
#[inline(always)]
pub fn grid_dependency_wait() {
    #[cfg(target_feature = "sm_90")]
    // SAFETY: no preconditions; a memory clobber, so no access moves above it.
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack, preserves_flags))
    };
}

/// Lets the kernel that follows this one on the stream, if launched as a programmatic
/// dependent launch, be scheduled now instead of when this grid's blocks exit
/// (`griddepcontrol.launch_dependents`, sm_90): its blocks then wait in
/// [`grid_dependency_wait`], already resident. Nothing on older targets.
#[inline(always)]
pub fn launch_dependents() {
    #[cfg(target_feature = "sm_90")]
    // SAFETY: no preconditions; it does not order memory.
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack, preserves_flags))
    };
}

/// Barrier over every thread of every block of the cluster. Shared-memory writes to any block
/// of the cluster made before it (release) are visible to every thread after it (acquire). Like
/// [`sync_threads`], all threads of the cluster must reach it, never under a divergent branch.
/// A block must also pass one before its first access to another block's shared memory (that
/// block may not have started yet), and must not exit while others may still access its own.
#[inline(always)]
pub fn cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

/// The first half of [`cluster_sync`], split so that work can run between the two: this
/// thread's shared-memory accesses before it (its own block's and others') are ordered before
/// the matching [`cluster_wait`] of every thread of the cluster returns. Every thread of the
/// cluster must call both, in this order, never under a divergent branch.
#[inline(always)]
pub fn cluster_arrive() {
    // SAFETY: no memory preconditions; callers keep it convergent (`.aligned`). The explicit
    // `.release` (and `cluster_wait`'s `.acquire`; PTX 8.0, build_ptx.rs) are the instructions'
    // default semantics, spelled out. A memory clobber, so no access moves across it.
    unsafe { asm!("barrier.cluster.arrive.release.aligned;", options(nostack, preserves_flags)) };
}

/// The second half of [`cluster_sync`]: returns once every thread of the cluster has passed
/// [`cluster_arrive`].
#[inline(always)]
pub fn cluster_wait() {
    // SAFETY: as `cluster_arrive`.
    unsafe { asm!("barrier.cluster.wait.acquire.aligned;", options(nostack, preserves_flags)) };
}

/// Stores one f32 into the shared memory of block `rank` of this cluster, at the address that
/// `addr` has in this block's shared memory (`mapa`: same layout in every block).
///
/// # Safety
/// `addr` must be a 4-byte aligned shared-window address inside the dynamic shared memory,
/// `rank` below the cluster size, and the target block must be running (see [`cluster_sync`]).
#[inline(always)]
pub unsafe fn st_shared_cluster_f32(addr: u32, rank: u32, v: f32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "{{ .reg .b32 ra; mapa.shared::cluster.u32 ra, {a}, {r}; st.shared::cluster.f32 [ra], {v}; }}",
            a = in(reg32) addr, r = in(reg32) rank, v = in(reg32) v,
            options(nostack, preserves_flags)
        );
    }
}

/// Loads one f32 from the shared memory of block `rank` of this cluster, at the address that
/// `addr` has in this block's shared memory (`mapa`: same layout in every block).
///
/// # Safety
/// `addr` must be a 4-byte aligned shared-window address inside the dynamic shared memory,
/// `rank` below the cluster size, and the target block must be running, its writes to that
/// address ordered before this load by a [`cluster_sync`].
#[inline(always)]
pub unsafe fn ld_shared_cluster_f32(addr: u32, rank: u32) -> f32 {
    let v: f32;
    // SAFETY: per the function contract. Not `readonly`: the cluster barrier before it must
    // order it after the other block's writes.
    unsafe {
        asm!(
            "{{ .reg .b32 ra; mapa.shared::cluster.u32 ra, {a}, {r}; ld.shared::cluster.f32 {v}, [ra]; }}",
            a = in(reg32) addr, r = in(reg32) rank, v = out(reg32) v,
            options(nostack, preserves_flags)
        );
    }
    v
}

/// Initialises the mbarrier (8 bytes, 8-byte aligned) at shared-window address `addr` to expect
/// `count` arrivals per phase.
///
/// # Safety
/// `addr` must be 8-byte aligned inside the dynamic shared memory, and no thread may use the
/// barrier until a barrier after this (and, for other blocks of a cluster, after
/// [`fence_mbarrier_init`] and a [`cluster_sync`]).
#[inline(always)]
pub unsafe fn mbarrier_init(addr: u32, count: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{a}], {n};", a = in(reg32) addr, n = in(reg32) count,
             options(nostack, preserves_flags));
    }
}

/// Makes this thread's [`mbarrier_init`]s visible to the other blocks of the cluster (whose
/// `st.async` will signal them).
#[inline(always)]
pub fn fence_mbarrier_init() {
    // SAFETY: a fence has no preconditions.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack, preserves_flags)) };
}

/// Arrives on the mbarrier at `addr` (this block's), first raising the bytes its current phase
/// waits for by `bytes`: the phase completes once every expected arrival has come and that many
/// bytes of `st.async` have landed (bytes that land before this call count too).
///
/// # Safety
/// `addr` must be an initialised mbarrier in this block's shared memory.
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx(addr: u32, bytes: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "{{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [{a}], {b}; }}",
            a = in(reg32) addr, b = in(reg32) bytes,
            options(nostack, preserves_flags)
        );
    }
}

/// Waits until the phase of parity `parity` (0 or 1) of the mbarrier at `addr` has completed;
/// acquire: what the phase's `st.async` wrote is visible afterwards.
///
/// # Safety
/// `addr` must be an initialised mbarrier in this block's shared memory.
#[inline(always)]
pub unsafe fn mbarrier_wait_parity(addr: u32, parity: u32) {
    loop {
        let done: u32;
        // SAFETY: per the function contract. Not pure: it must be re-executed every iteration.
        unsafe {
            asm!(
                "{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{a}], {ph}; selp.u32 {d}, 1, 0, p; }}",
                a = in(reg32) addr, ph = in(reg32) parity, d = out(reg32) done,
                options(nostack, preserves_flags)
            );
        }
        if done != 0 {
            break;
        }
    }
}

/// Stores one f32 into the shared memory of block `rank` of this cluster, at the address `addr`
/// has in this block, and signals 4 bytes to that block's mbarrier at `bar` (also this block's
/// address; `st.async`, PTX 8.1): no fence, and no cluster barrier, to make it visible: the
/// receiver waits on its mbarrier.
///
/// # Safety
/// `addr` must be 4-byte aligned and `bar` an mbarrier, both in the dynamic shared memory;
/// `rank` below the cluster size; the target block running and its barrier initialised (see
/// [`fence_mbarrier_init`]), expecting these bytes in its current phase.
#[inline(always)]
pub unsafe fn st_async_cluster_f32(addr: u32, bar: u32, rank: u32, v: f32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "{{ .reg .b32 ra, rb; mapa.shared::cluster.u32 ra, {a}, {r}; mapa.shared::cluster.u32 rb, {b}, {r}; \
             st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [ra], {v}, [rb]; }}",
            a = in(reg32) addr, b = in(reg32) bar, r = in(reg32) rank, v = in(reg32) v,
            options(nostack, preserves_flags)
        );
    }
}

/// Loads one f32 from this block's shared memory at a shared-window address (explicit
/// `ld.shared`, for the slots that other blocks of the cluster write: see
/// [`st_shared_cluster_f32`]).
///
/// # Safety
/// `addr` must be a 4-byte aligned shared-window address inside the dynamic shared memory.
#[inline(always)]
pub unsafe fn ld_shared_f32(addr: u32) -> f32 {
    let v: f32;
    // SAFETY: per the function contract. Not `readonly`: other blocks write these slots, and the
    // cluster barrier between their writes and this read must order the two.
    unsafe {
        asm!("ld.shared.f32 {v}, [{p}];", v = out(reg32) v, p = in(reg32) addr, options(nostack, preserves_flags));
    }
    v
}

// ---------------------------------------------------------------------------------------------
// 16-byte global memory access: one instruction moves a whole vector, the widest access a
// thread can make, which is what keeps enough bytes in flight for HBM bandwidth.

/// Loads 16 bytes through the non-coherent (read-only) cache path.
///
/// # Safety
/// `p` must be 16-byte aligned, point to 16 readable bytes of global memory, and the memory must
/// not be written by this kernel launch (the `.nc` path may return stale data otherwise).
#[inline(always)]
pub unsafe fn ld_global_nc_v4(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: per the function contract.
    unsafe {
        asm!("ld.global.nc.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(pure, readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// L1 eviction policy of a load ([`ld_global_nc_v4_l1`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum L1 {
    /// The default (`evict_normal`).
    Normal,
    /// Kept over normal lines: data that the same SM reads again soon.
    EvictLast,
    /// Not kept in L1 once delivered: data read once.
    NoAllocate,
    /// Evicted before normal lines.
    EvictFirst,
}

/// [`ld_global_nc_v4`] with an L1 eviction policy. `policy` should be a constant (it is after
/// inlining): each policy is its own instruction. The hints need PTX ISA 7.4; the sm_80 module
/// is built for an older ISA (older drivers), so there every policy is the plain load.
///
/// # Safety
/// As [`ld_global_nc_v4`].
#[inline(always)]
pub unsafe fn ld_global_nc_v4_l1(p: *const u32, policy: L1) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    macro_rules! ld {
        ($q:literal) => {
            // SAFETY: per the function contract.
            unsafe {
                asm!(concat!("ld.global.nc", $q, ".v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];"),
                     a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                     p = in(reg64) p, options(pure, readonly, nostack, preserves_flags))
            }
        };
    }
    #[cfg(not(target_feature = "sm_90"))]
    let policy = {
        let _ = policy;
        L1::Normal
    };
    match policy {
        L1::Normal => ld!(""),
        L1::EvictLast => ld!(".L1::evict_last"),
        L1::NoAllocate => ld!(".L1::no_allocate"),
        L1::EvictFirst => ld!(".L1::evict_first"),
    }
    [a, b, c, d]
}

/// Loads 16 bytes with an ordinary (coherent) global load, for buffers the same launch may also
/// write (in-place operations).
///
/// # Safety
/// `p` must be 16-byte aligned and point to 16 readable bytes of global memory.
#[inline(always)]
pub unsafe fn ld_global_v4(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: per the function contract.
    unsafe {
        asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg64) p, options(pure, readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// Loads 8 bytes with an ordinary (coherent) global load ([`ld_global_v4`]'s half).
///
/// # Safety
/// `p` must be 8-byte aligned and point to 8 readable bytes of global memory.
#[inline(always)]
pub unsafe fn ld_global_v2(p: *const u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: per the function contract.
    unsafe {
        asm!("ld.global.v2.u32 {{{a}, {b}}}, [{p}];", a = out(reg32) a, b = out(reg32) b,
             p = in(reg64) p, options(pure, readonly, nostack, preserves_flags));
    }
    [a, b]
}

/// Stores 8 bytes.
///
/// # Safety
/// `p` must be 8-byte aligned and point to 8 writable bytes of global memory.
#[inline(always)]
pub unsafe fn st_global_v2(p: *mut u32, v: [u32; 2]) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("st.global.v2.u32 [{p}], {{{a}, {b}}};", p = in(reg64) p, a = in(reg32) v[0],
             b = in(reg32) v[1], options(nostack, preserves_flags));
    }
}

/// Stores 16 bytes.
///
/// # Safety
/// `p` must be 16-byte aligned and point to 16 writable bytes of global memory.
#[inline(always)]
pub unsafe fn st_global_v4(p: *mut u32, v: [u32; 4]) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
             p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2],
             d = in(reg32) v[3], options(nostack, preserves_flags));
    }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies into shared memory (`cp.async`, sm_80 on): the copy runs while the thread
// goes on, so several stages of a GEMM's operands can be in flight without staging registers.
// Each thread's copies are grouped by `cp_async_commit`; `cp_async_wait::<N>` waits until at most
// N of the thread's groups are still pending. A barrier is still needed before other threads
// read what this thread copied.

/// Copies `src_bytes` (0 to 16) bytes from `src` to the 16 bytes at shared-window address `dst`,
/// zero-filling the rest; L2 only (`.cg`), as operands are reused from shared memory, not L1.
///
/// # Safety
/// `dst` must be a 16-byte aligned shared-window address inside the dynamic shared memory, `src`
/// 16-byte aligned with `src_bytes` readable bytes of global memory (any valid address when
/// `src_bytes` is 0), not written during the launch.
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const f32, src_bytes: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("cp.async.cg.shared.global [{d}], [{s}], 16, {n};", d = in(reg32) dst, s = in(reg64) src,
             n = in(reg32) src_bytes, options(nostack, preserves_flags));
    }
}

/// Copies `src_bytes` (0 or 4) bytes from `src` to the 4 bytes at `dst`, zero-filling otherwise.
///
/// # Safety
/// As [`cp_async_16`], with 4-byte alignment.
#[inline(always)]
pub unsafe fn cp_async_4(dst: u32, src: *const f32, src_bytes: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("cp.async.ca.shared.global [{d}], [{s}], 4, {n};", d = in(reg32) dst, s = in(reg64) src,
             n = in(reg32) src_bytes, options(nostack, preserves_flags));
    }
}

/// Closes this thread's current group of `cp.async` copies.
#[inline(always)]
pub fn cp_async_commit() {
    // SAFETY: no operands; only orders this thread's earlier copies into a group.
    unsafe { asm!("cp.async.commit_group;", options(nostack, preserves_flags)) };
}

/// Waits until at most `N` of this thread's committed groups are still in flight.
#[inline(always)]
pub fn cp_async_wait<const N: u32>() {
    // SAFETY: no operands; a wait on this thread's own copies (also a compiler barrier: the
    // shared-memory reads that follow must not move above it, hence no `nomem`).
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack, preserves_flags)) };
}

// ---------------------------------------------------------------------------------------------
// Tensor cores in TF32 (sm_80 on).

/// `d = a @ b + c` for one warp: a 16 x 8 (row) by 8 x 8 (col) product of TF32 values (f32 bits;
/// the low 13 are ignored) with f32 accumulation
/// (`mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`). With `g = lane / 4`,
/// `t = lane % 4`, a lane holds `a = [A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4)]`,
/// `b = [B(t, g), B(t + 4, g)]` and `c`, `d = [C(g, 2t), C(g, 2t + 1), C(g + 8, 2t), C(g + 8,
/// 2t + 1)]`. Every lane of the warp must execute it together.
#[inline(always)]
pub fn mma_tf32_16x8x8(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    let (d0, d1, d2, d3): (f32, f32, f32, f32);
    // SAFETY: registers only; the caller's warp is converged (the kernels call it outside any
    // divergent branch). Not `pure`, as `shfl`: the compiler must not move it into a branch.
    unsafe {
        asm!("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{{d0}, {d1}, {d2}, {d3}}}, \
              {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
             d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
             a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
             b0 = in(reg32) b[0], b1 = in(reg32) b[1],
             c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
             options(nomem, nostack, preserves_flags));
    }
    [d0, d1, d2, d3]
}

// ---------------------------------------------------------------------------------------------
// Hopper's warpgroup tensor cores and bulk tensor copies (sm_90a: `wgmma`, `setmaxnreg`; sm_90:
// TMA). A warpgroup is four consecutive warps starting at a warp index divisible by four; the
// `wgmma` functions must be called by all its 128 threads together.

/// Writes out an `asm!` whose operands are the `N` (32, 64 or 128) f32 accumulators of a `wgmma`
/// (`$d`, a `&mut [f32; N]`), each in and out, so that the compiler keeps them in registers and
/// orders every use of them against the instruction: the template sees them as `{0}`..`{N-1}`,
/// written out as the braced list between the `$pre` and `$post` template pieces.
#[cfg(target_feature = "sm_90a")]
macro_rules! asm_acc {
    ($n:tt, $d:ident; $($pre:literal),*; $($post:literal),*; $($rest:tt)*) => {
        asm_acc!(@list $n; $d; [$($pre),*]; [$($post),*]; [$($rest)*])
    };
    (@list 32; $($x:tt)*) => { asm_acc!(@emit $($x)*; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31) };
    (@list 64; $($x:tt)*) => { asm_acc!(@emit $($x)*; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63) };
    (@list 128; $($x:tt)*) => { asm_acc!(@emit $($x)*; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127) };
    (@emit $d:ident; [$($pre:literal),*]; [$($post:literal),*]; [$($rest:tt)*]; $first:literal $($i:literal)*) => {
        asm!(
            $($pre,)*
            concat!("{{{", $first, "}" $(, ", {", $i, "}")*, "}}"),
            $($post,)*
            inout(reg32) $d[$first], $(inout(reg32) $d[$i],)*
            $($rest)*
        )
    };
}

/// The accumulators of one warpgroup's `wgmma` tile of 64 rows by `N / 2` columns: `[f32; N]`
/// for N = 32, 64, 128 (thread `t` of the warpgroup holds rows `16 (t / 32) + (t % 32) / 4 + 8 h`
/// and columns `8 j + 2 (t % 4) + c` at `[4 j + 2 h + c]`), and the fences that order the
/// registers against the asynchronous products.
#[cfg(target_feature = "sm_90a")]
pub trait WgmmaAcc {
    /// See [`wgmma_fence`].
    ///
    /// # Safety
    /// As [`wgmma_fence`].
    unsafe fn fence(&mut self);
    /// See [`wgmma_wait`].
    ///
    /// # Safety
    /// As [`wgmma_wait`].
    unsafe fn wait<const N: u32>(&mut self);
}

#[cfg(target_feature = "sm_90a")]
macro_rules! wgmma_acc_impls {
    ($($n:tt)*) => { $(
        impl WgmmaAcc for [f32; $n] {
            #[inline(always)]
            unsafe fn fence(&mut self) {
                let d = self;
                // SAFETY: per the function contract.
                unsafe { asm_acc!($n, d; "wgmma.fence.sync.aligned; /*"; "*/"; options(nostack)) };
            }
            #[inline(always)]
            unsafe fn wait<const N: u32>(&mut self) {
                let d = self;
                // SAFETY: per the function contract.
                unsafe { asm_acc!($n, d; "wgmma.wait_group.sync.aligned {n}; /*"; "*/"; n = const N, options(nostack)) };
            }
        }
    )* };
}

#[cfg(target_feature = "sm_90a")]
wgmma_acc_impls!(32 64 128);

/// `d += A @ B` for one warpgroup: a 64 x 256 tile of f32 accumulators `d` (laid out as
/// [`WgmmaAcc`] says), A a 64 x 16 and B a 16 x 256 tile of bf16 (`BF16`) or f16 values in
/// shared memory, each described by a matrix descriptor (`da`, `db`; [`wgmma_desc`]), K-major
/// (`TA`/`TB` = 0) or M/N-major (1) (`wgmma.mma_async.sync.aligned.m64n256k16.f32`). Issued
/// asynchronously: the accumulators are not to be read or written before [`wgmma_wait`], and
/// the operands must stay in place until then.
///
/// # Safety
/// All 128 threads of a warpgroup must call it together with the same descriptors, after
/// [`wgmma_fence`]; the descriptors must describe initialised shared memory that a
/// `fence.proxy.async` or the copy engine made visible to the tensor cores.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn wgmma_m64n256k16<const BF16: bool, const TA: u32, const TB: u32>(d: &mut [f32; 128], da: u64, db: u64) {
    // SAFETY: per the function contract.
    unsafe {
        if BF16 {
            asm_acc!(128, d; "{{ .reg .pred p; setp.ne.u32 p, 1, 0;",
                "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16";
                ", {da}, {db}, p, 1, 1, {ta}, {tb}; }}";
                da = in(reg64) da, db = in(reg64) db, ta = const TA, tb = const TB, options(nostack));
        } else {
            asm_acc!(128, d; "{{ .reg .pred p; setp.ne.u32 p, 1, 0;",
                "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16";
                ", {da}, {db}, p, 1, 1, {ta}, {tb}; }}";
                da = in(reg64) da, db = in(reg64) db, ta = const TA, tb = const TB, options(nostack));
        }
    }
}

/// Declares `d = A @ B` or `d += A @ B` with A and B both K-major in shared memory (`wgmma`
/// "SS"): attention's scores `Q K^T`, Q's rows and K's rows each holding their head dim
/// contiguously.
macro_rules! wgmma_ss {
    ($($name:ident: $n:literal, $acc:tt, $bf16:literal, $f16:literal;)*) => { $(
        #[doc = concat!("[`wgmma_m64n256k16`] for a 64 x ", $n, " tile (`m64n", $n, "k16`), A and B both")]
        /// K-major. `ACC`: `d += A @ B`; without it `d = A @ B` (the accumulators' values are not
        /// read).
        ///
        /// # Safety
        /// As [`wgmma_m64n256k16`].
        #[cfg(target_feature = "sm_90a")]
        #[inline(always)]
        pub unsafe fn $name<const BF16: bool, const ACC: bool>(d: &mut [f32; $acc], da: u64, db: u64) {
            // SAFETY: per the function contract.
            unsafe {
                if BF16 {
                    asm_acc!($acc, d; "{{ .reg .pred p; setp.ne.u32 p, {acc}, 0;",
                        $bf16;
                        ", {da}, {db}, p, 1, 1, 0, 0; }}";
                        da = in(reg64) da, db = in(reg64) db, acc = const ACC as u32, options(nostack));
                } else {
                    asm_acc!($acc, d; "{{ .reg .pred p; setp.ne.u32 p, {acc}, 0;",
                        $f16;
                        ", {da}, {db}, p, 1, 1, 0, 0; }}";
                        da = in(reg64) da, db = in(reg64) db, acc = const ACC as u32, options(nostack));
                }
            }
        }
    )* };
}

wgmma_ss! {
    wgmma_m64n64k16_ss: 64, 32, "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16";
    wgmma_m64n128k16_ss: 128, 64, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16";
}

/// Declares `d += A @ B` with A from registers (`wgmma` "RS"): A a 64 x 16 tile held as an
/// `mma.m16n8k16` A fragment by each warp for its 16 rows (`a`, four words of two values: rows
/// `g`, `g + 8` by columns `2 t`, `2 t + 1`, then the same at columns `8 + 2 t`), B a 16 x N tile
/// in shared memory, N-major (the values of one K row contiguous: attention's V as stored).
macro_rules! wgmma_rs {
    ($($name:ident: $n:literal, $acc:tt, $bf16:literal, $f16:literal;)*) => { $(
        /// `d += A @ B`, A a warpgroup's fragments in registers and B N-major in shared memory,
        #[doc = concat!("for a 64 x ", $n, " tile (`m64n", $n, "k16`).")]
        ///
        /// # Safety
        /// As [`wgmma_m64n256k16`]; the registers of `a` are not to be written before
        /// [`wgmma_wait`].
        #[cfg(target_feature = "sm_90a")]
        #[inline(always)]
        pub unsafe fn $name<const BF16: bool>(d: &mut [f32; $acc], a: [u32; 4], db: u64) {
            // SAFETY: per the function contract.
            unsafe {
                if BF16 {
                    asm_acc!($acc, d; "{{ .reg .pred p; setp.ne.u32 p, 1, 0;",
                        $bf16;
                        ", {{{a0}, {a1}, {a2}, {a3}}}, {db}, p, 1, 1, 1; }}";
                        a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                        db = in(reg64) db, options(nostack));
                } else {
                    asm_acc!($acc, d; "{{ .reg .pred p; setp.ne.u32 p, 1, 0;",
                        $f16;
                        ", {{{a0}, {a1}, {a2}, {a3}}}, {db}, p, 1, 1, 1; }}";
                        a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                        db = in(reg64) db, options(nostack));
                }
            }
        }
    )* };
}

wgmma_rs! {
    wgmma_m64n64k16_rs: 64, 32, "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16";
    wgmma_m64n128k16_rs: 128, 64, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16";
}

/// A shared-memory matrix descriptor for `wgmma` with 128-byte swizzling: start address,
/// leading and stride byte offsets (K-major: LBO unused, SBO between 8-row groups; M/N-major:
/// LBO between 64-element column blocks, SBO between 8-row K groups). The tile's rows are 128
/// bytes, 8-row groups 1024-byte aligned as the copy engine's 128-byte swizzle writes them.
#[inline(always)]
pub fn wgmma_desc(addr: u32, lbo: u32, sbo: u32) -> u64 {
    ((addr & 0x3FFFF) >> 4) as u64 | ((lbo >> 4) as u64) << 16 | ((sbo >> 4) as u64) << 32 | 1 << 62
}

/// Orders this warpgroup's earlier register and shared-memory accesses before its next
/// `wgmma` (`wgmma.fence`); the accumulators `d` pass through it, so the compiler cannot move
/// their initialisation after it.
///
/// # Safety
/// All 128 threads of a warpgroup must call it together.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn wgmma_fence(d: &mut impl WgmmaAcc) {
    // SAFETY: per the function contract.
    unsafe { d.fence() };
}

/// Closes this warpgroup's issued `wgmma`s into a group (`wgmma.commit_group`).
///
/// # Safety
/// All 128 threads of a warpgroup must call it together.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn wgmma_commit() {
    // SAFETY: per the function contract.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// Waits until at most `N` of this warpgroup's committed `wgmma` groups are pending
/// (`wgmma.wait_group`). The accumulators pass through it: the compiler cannot read them before
/// the wait, nor move their next update above it.
///
/// # Safety
/// All 128 threads of a warpgroup must call it together.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn wgmma_wait<const N: u32>(d: &mut impl WgmmaAcc) {
    // SAFETY: per the function contract.
    unsafe { d.wait::<N>() };
}

/// Raises (`INC`) or lowers this warpgroup's register allocation to `R` registers a thread
/// (`setmaxnreg`, sm_90a): the producer warpgroup of a warp-specialised kernel gives registers
/// to its consumers.
///
/// # Safety
/// All 128 threads of a warpgroup must call it together; `R` a multiple of 8 in 24..=256; the
/// kernel must have a register cap at entry (`.maxntid` and `.minnctapersm 1`).
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn setmaxnreg<const INC: bool, const R: u32>() {
    // SAFETY: per the function contract.
    unsafe {
        if INC {
            asm!("setmaxnreg.inc.sync.aligned.u32 {r};", r = const R, options(nostack, nomem));
        } else {
            asm!("setmaxnreg.dec.sync.aligned.u32 {r};", r = const R, options(nostack, nomem));
        }
    }
}

/// Makes the tensor map at `map` (in global memory, written before the launch) visible to the
/// copy engine for this thread's later copies (`fence.proxy.tensormap::generic.acquire`, PTX 8.3):
/// without it a descriptor cached from an earlier launch at the same address could be used.
///
/// # Safety
/// `map` must point at a 128-byte, 64-byte-aligned `CUtensorMap` in global memory.
#[inline(always)]
pub unsafe fn fence_tensormap(map: *const u64) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("fence.proxy.tensormap::generic.acquire.gpu [{m}], 128;", m = in(reg64) map,
             options(nostack, preserves_flags));
    }
}

/// Copies the box at coordinates `(c0, c1, c2)` (innermost first, in elements) of the 3-D tensor
/// described by the tensor map at `map` into shared memory at `dst`, then signals its bytes to
/// the mbarrier at `bar` (`cp.async.bulk.tensor.3d`, TMA). Elements outside the tensor are
/// written as zeros and counted.
///
/// # Safety
/// `map` as in [`fence_tensormap`] (fenced by this thread); `dst` a shared-window address aligned
/// as the map's swizzle requires (1024 bytes for 128-byte swizzling) with room for the box; `bar`
/// an initialised mbarrier in this block's shared memory expecting the bytes.
#[inline(always)]
pub unsafe fn tma_load_3d(dst: u32, map: *const u64, bar: u32, c0: i32, c1: i32, c2: i32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}, {c2}}}], [{b}];",
            d = in(reg32) dst, m = in(reg64) map, b = in(reg32) bar,
            c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2,
            options(nostack, preserves_flags)
        );
    }
}

/// Copies `bytes` of contiguous global memory at `src` into shared memory at `dst`, then
/// signals them to the mbarrier at `bar` (`cp.async.bulk`, the copy engine without a tensor map).
///
/// # Safety
/// `src` and `dst` 16-byte aligned, `bytes` a multiple of 16, both ranges inside their
/// allocations; `bar` an initialised mbarrier in this block's shared memory expecting the bytes.
#[inline(always)]
pub unsafe fn bulk_load(dst: u32, src: *const u8, bytes: u32, bar: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{s}], {n}, [{b}];",
            d = in(reg32) dst, s = in(reg64) src, n = in(reg32) bytes, b = in(reg32) bar,
            options(nostack, preserves_flags)
        );
    }
}

/// [`tma_load_3d`] for a 4-D tensor (`cp.async.bulk.tensor.4d`): attention's `[batch][head][row]
/// [d]` in either layout, as the map's strides say.
///
/// # Safety
/// As [`tma_load_3d`].
#[inline(always)]
pub unsafe fn tma_load_4d(dst: u32, map: *const u64, bar: u32, (c0, c1, c2, c3): (i32, i32, i32, i32)) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}, {c2}, {c3}}}], [{b}];",
            d = in(reg32) dst, m = in(reg64) map, b = in(reg32) bar,
            c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2, c3 = in(reg32) c3,
            options(nostack, preserves_flags)
        );
    }
}

/// [`tma_load_3d`] into the shared memory of every block of the cluster in `mask` (bit `r`:
/// rank `r`), at the address `dst` has in this block, signalled to each one's mbarrier at the
/// address `bar` has in this block (`.multicast::cluster`).
///
/// # Safety
/// As [`tma_load_3d`], for every block in `mask`: each running (past a [`cluster_sync`] after
/// its barrier's initialisation) and its barrier expecting the bytes.
#[inline(always)]
pub unsafe fn tma_load_3d_multicast(dst: u32, map: *const u64, bar: u32, (c0, c1, c2): (i32, i32, i32), mask: u16) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [{d}], [{m}, {{{c0}, {c1}, {c2}}}], [{b}], {k};",
            d = in(reg32) dst, m = in(reg64) map, b = in(reg32) bar,
            c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2, k = in(reg16) mask,
            options(nostack, preserves_flags)
        );
    }
}

/// Arrives once on the mbarrier of block `rank` of this cluster at the address `addr` has in
/// this block (the arrive's default semantics, release at CTA scope, as CUTLASS's cluster
/// barriers: a `.release.cluster` arrive waited for this thread's earlier stores).
///
/// # Safety
/// `addr` must be an initialised mbarrier in the dynamic shared memory of every block, `rank`
/// below the cluster size, and that block running.
#[inline(always)]
pub unsafe fn mbarrier_arrive_cluster(addr: u32, rank: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!(
            "{{ .reg .b32 ra; mapa.shared::cluster.u32 ra, {a}, {r}; mbarrier.arrive.shared::cluster.b64 _, [ra]; }}",
            a = in(reg32) addr, r = in(reg32) rank,
            options(nostack, preserves_flags)
        );
    }
}

/// Arrives on the mbarrier at `addr` (this block's), once.
///
/// # Safety
/// `addr` must be an initialised mbarrier in this block's shared memory.
#[inline(always)]
pub unsafe fn mbarrier_arrive(addr: u32) {
    // SAFETY: per the function contract.
    unsafe {
        asm!("mbarrier.arrive.shared::cta.b64 _, [{a}];", a = in(reg32) addr, options(nostack, preserves_flags));
    }
}
// Tensor cores in bf16 and f16 (sm_80 on), fed by `ldmatrix`.

/// Loads four 8 x 8 matrices of 16-bit elements from shared memory for one warp
/// (`ldmatrix.sync.aligned.m8n8.x4.shared.b16`). Lane `l` names the address of row `l % 8` of
/// matrix `l / 8` (16 contiguous bytes); it receives, of each matrix `i`, row `l / 4`, columns
/// `2 (l % 4)` and `2 (l % 4) + 1`, packed low to high in word `i`: the layout of an `mma`
/// fragment.
///
/// # Safety
/// Every lane's `addr` must be a 16-byte aligned shared-window address of 16 bytes inside the
/// dynamic shared memory, written before a barrier this warp has passed; all 32 lanes must
/// execute it together (warp-converged).
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: per the function contract. Not `pure`: a warp-wide instruction, which the compiler
    // must neither drop nor move into a branch.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg32) addr, options(readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// [`ldmatrix_x4`] transposed (`.trans`): lane `l` receives, of each matrix, column `l / 4`, rows
/// `2 (l % 4)` and `2 (l % 4) + 1`. For operands stored with their K index along rows of shared
/// memory (A read as its transpose, B as stored).
///
/// # Safety
/// As [`ldmatrix_x4`].
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: as `ldmatrix_x4`.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             p = in(reg32) addr, options(readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

macro_rules! mma_16x8x16 {
    ($(#[$doc:meta])* $name:ident, $ty:literal) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
            let (d0, d1, d2, d3): (f32, f32, f32, f32);
            // SAFETY: registers only; the caller's warp is converged (the kernels call it
            // outside any divergent branch). Not `pure`, as `shfl`: the compiler must not move
            // it into a branch.
            unsafe {
                asm!(concat!("mma.sync.aligned.m16n8k16.row.col.f32.", $ty, ".", $ty, ".f32 \
                      {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
                      {{{c0}, {c1}, {c2}, {c3}}};"),
                     d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                     a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                     b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                     c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                     options(nomem, nostack, preserves_flags));
            }
            [d0, d1, d2, d3]
        }
    };
}

mma_16x8x16!(
    /// `d = a @ b + c` for one warp: a 16 x 16 (row) by 16 x 8 (col) product of bf16 values with
    /// f32 accumulation (`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`). The products of
    /// bf16 values are exact in f32. With `g = lane / 4`, `t = lane % 4`, each word holds two
    /// values, the lower K (or column) index in its low half: `a = [A(g, 2t..), A(g + 8, 2t..),
    /// A(g, 2t + 8..), A(g + 8, 2t + 8..)]`, `b = [B(2t.., g), B(2t + 8.., g)]`; `c`, `d = [C(g,
    /// 2t), C(g, 2t + 1), C(g + 8, 2t), C(g + 8, 2t + 1)]`. Every lane of the warp must execute it
    /// together.
    mma_bf16_16x8x16,
    "bf16"
);
mma_16x8x16!(
    /// [`mma_bf16_16x8x16`] on f16 values (`...f32.f16.f16.f32`).
    mma_f16_16x8x16,
    "f16"
);

// ---------------------------------------------------------------------------------------------
// Half-precision conversions: hardware `cvt`, round to nearest even, NaN and infinities kept,
// no flush to zero.

#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let f: f32;
    // SAFETY: pure register conversion.
    unsafe {
        asm!("cvt.f32.f16 {f}, {h};", f = out(reg32) f, h = in(reg16) h,
             options(pure, nomem, nostack, preserves_flags));
    }
    f
}

/// Packs two f32 into f16x2: `lo` in bits 0..16 (the lower address), `hi` in bits 16..32.
#[inline(always)]
pub fn f32x2_to_f16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: pure register conversion (sm_80+). The first source goes to the upper half.
    unsafe {
        asm!("cvt.rn.f16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi,
             lo = in(reg32) lo, options(pure, nomem, nostack, preserves_flags));
    }
    r
}

/// Packs two f32 into bf16x2, like [`f32x2_to_f16x2`].
#[inline(always)]
pub fn f32x2_to_bf16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: pure register conversion (sm_80+).
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi,
             lo = in(reg32) lo, options(pure, nomem, nostack, preserves_flags));
    }
    r
}

#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let h: u16;
    // SAFETY: pure register conversion.
    unsafe {
        asm!("cvt.rn.f16.f32 {h}, {x};", h = out(reg16) h, x = in(reg32) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    h
}

#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let h: u16;
    // SAFETY: pure register conversion (sm_80+).
    unsafe {
        asm!("cvt.rn.bf16.f32 {h}, {x};", h = out(reg16) h, x = in(reg32) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    h
}

/// bf16 is the upper half of an f32: widening is exact and free.
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// 2^x by the special function unit (`ex2.approx.f32`, MUFU.EX2): relative error about 2^-22.
/// Denormals are not flushed (no `.ftz`; below -126 that costs a compare and two predicated
/// multiplies): for `fastmath::exp_for`'s f16/bf16 exp, whose results may be denormal, and the
/// GEMM epilogue's pinned `fastmath::exp_with::<false>`.
#[inline(always)]
pub fn ex2_approx(x: f32) -> f32 {
    let y: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("ex2.approx.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    y
}

/// 1/x by the special function unit with denormal inputs and results flushed to zero
/// (`rcp.approx.ftz.f32`): one MUFU.RCP, within 1 ulp, where the form without `.ftz` adds
/// about six instructions of range checks. For callers that keep `x` and `1/x` normal.
#[inline(always)]
pub fn rcp_approx_ftz(x: f32) -> f32 {
    let y: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("rcp.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    y
}

/// 1/sqrt(x) by the special function unit with denormal inputs flushed to zero
/// (`rsqrt.approx.ftz.f32`, MUFU.RSQ): relative error about 2^-23. `+0`/`-0` give `+inf`/`-inf`,
/// `+inf` gives `+0`, a negative `x` NaN. For `math::rsqrt`, which scales denormals first.
#[inline(always)]
pub fn rsqrt_approx_ftz(x: f32) -> f32 {
    let y: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("rsqrt.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    y
}

/// 2^x by the special function unit with denormal inputs and results flushed to zero
/// (`ex2.approx.ftz.f32`): one MUFU.EX2, where the form without `.ftz` adds a compare and two
/// predicated multiplies to reach the denormal range. For callers whose result cannot usefully
/// be below 2^-126 (or where zero is as good).
#[inline(always)]
pub fn ex2_approx_ftz(x: f32) -> f32 {
    let y: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("ex2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x,
             options(pure, nomem, nostack, preserves_flags));
    }
    y
}

/// `if c { a } else { b }` as one `selp`, with both operands computed first. For a select whose
/// operands are long computations: LLVM turns such a select into a branch around the one it
/// takes, and on the GPU that branch keeps the elements a thread holds from being computed
/// together.
#[inline(always)]
pub fn select_f32(c: bool, a: f32, b: f32) -> f32 {
    let r: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {c}, 0; selp.f32 {r}, {a}, {b}, p; }}",
             r = out(reg32) r, c = in(reg32) c as u32, a = in(reg32) a, b = in(reg32) b,
             options(pure, nomem, nostack, preserves_flags));
    }
    r
}

/// `max(a, b)`, NaN if either is NaN (`max.NaN.f32`, sm_80+: one instruction where a compare
/// and select would take three).
#[inline(always)]
pub fn max_nan(a: f32, b: f32) -> f32 {
    let r: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("max.NaN.f32 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b,
             options(pure, nomem, nostack, preserves_flags));
    }
    r
}

/// `min(a, b)`, NaN if either is NaN (`min.NaN.f32`).
#[inline(always)]
pub fn min_nan(a: f32, b: f32) -> f32 {
    let r: f32;
    // SAFETY: pure register operation.
    unsafe {
        asm!("min.NaN.f32 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b,
             options(pure, nomem, nostack, preserves_flags));
    }
    r
}

/// The same 16 bytes, as values the compiler cannot see through (a `mov` it must keep).
///
/// For register-resident rows read twice, before and after a reduction: LLVM otherwise keeps the
/// first pass's unpacked f32 values alive to reuse them in the second (for bf16, unpacking is a
/// shift it would rather not redo), twice the registers of the packed row, which spilled the
/// bf16 softmax backward under its 64-register bound.
#[inline(always)]
pub fn opaque(v: [u32; 4]) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: register moves only. Not `pure`, so that it is neither merged nor removed.
    unsafe {
        asm!("mov.b32 {a}, {i0}; mov.b32 {b}, {i1}; mov.b32 {c}, {i2}; mov.b32 {d}, {i3};",
             a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             i0 = in(reg32) v[0], i1 = in(reg32) v[1], i2 = in(reg32) v[2], i3 = in(reg32) v[3],
             options(nomem, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// Stops the kernel with an error the host sees as a launch failure. Used by the panic handler
/// (bounds checks and the like), which should be unreachable.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` aborts the kernel; it has no other effect.
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}
