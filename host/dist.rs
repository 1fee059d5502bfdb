//! Collectives across GPUs through NCCL: all-reduce, all-gather, reduce-scatter, broadcast,
//! send and receive on [`Tensor`]s (f32, f16, bf16).
//!
//! ```no_run
//! use kernels::{Device, DType, Tensor, dist::{self, Communicator, ReduceOp}};
//! # fn main() -> kernels::Result<()> {
//! // One process driving two GPUs: one communicator (rank) per device, the calls of every rank
//! // issued inside one `dist::group`.
//! let devs = [Device::cuda(0)?, Device::cuda(1)?];
//! let comms = Communicator::new_group(&devs)?;
//! let mut xs = devs.iter().map(|d| Tensor::full(d, &[1 << 20], DType::BF16, 1.0))
//!     .collect::<kernels::Result<Vec<_>>>()?;
//! dist::group(|| comms.iter().zip(&mut xs).try_for_each(|(c, x)| c.all_reduce_(x, ReduceOp::Sum)))?;
//! // One process per GPU: rank 0 makes the id and hands it to the others (a file, an
//! // environment variable: `UniqueId::to_hex` / `UniqueId::from_hex`).
//! # let (rank, world) = (0, 2);
//! let id = dist::UniqueId::new()?;
//! let comm = Communicator::from_id(&Device::cuda(rank)?, &id, rank, world)?;
//! # let _ = comm; Ok(()) }
//! ```
//!
//! **Loading.** NCCL is loaded at run time, like the driver: the path in `KERNELS_NCCL_LIB` if
//! set, else `libnccl.so.2`, then `libnccl.so`, by the dynamic loader's search (so
//! `LD_LIBRARY_PATH` works). PyTorch's wheels ship it as
//! `site-packages/nvidia/nccl/lib/libnccl.so.2`; the GPU bundle's scripts point
//! `KERNELS_NCCL_LIB` there. Building needs no NCCL; without one, creating a communicator or a
//! [`UniqueId`] returns [`Error::NoNccl`] saying what was tried, and nothing panics. (The
//! library declares NCCL's functions itself, with `cudarc`'s `nccl` types: cudarc's own loader
//! does not look for `libnccl.so.2` and panics when it finds nothing.)
//!
//! **Ordering.** Every collective is enqueued on the stream of the communicator's device (the
//! library's stream, or the one of [`Device::with_stream`]), after the kernels issued before it
//! and before those issued after, with no host synchronisation. Out-of-place forms allocate
//! their result from the device's cache, like every op.
//!
//! **One process, several GPUs.** A thread that drives several ranks must issue their calls
//! inside one [`group`] (NCCL's `ncclGroupStart`/`ncclGroupEnd`): outside one, the first rank's
//! call may wait for the others, which this thread has not issued yet. Inside a group NCCL only
//! records the calls and enqueues them all at its end, so a kernel launched inside the group
//! runs before the collectives; the group keeps every tensor it was given alive until then.
//!
//! **Overlap.** [`Communicator::all_reduce_start`] runs an all-reduce on a second stream of
//! the rank's device while the device's stream goes on, and [`BucketedAllReduce`] uses it to
//! reduce a backward pass's gradients in buckets as they are produced (data-parallel training:
//! `examples/data_parallel.rs`). Events order the two streams; the host never waits.
//!
//! **What is checked.** Locally, before anything is enqueued: dtypes, shapes, devices, ranks,
//! peers and roots, as `Error::ShapeMismatch`, `DTypeMismatch`, `DeviceMismatch` or
//! `InvalidArgument`; and every error NCCL returns, as [`Error::Collective`] (with NCCL's last
//! error message). Across ranks NCCL checks nothing: ranks that call different collectives, or
//! the same one with different counts or dtypes, or a rank that skips one (because its own
//! check failed), leave the others waiting on the GPU, a hang the library cannot tell from a
//! slow peer. [`Communicator::set_cross_rank_checks`] closes that gap for the collectives (not
//! for send and receive): each one first exchanges a small signature with the other ranks
//! (which collective, dtype, element count, reduction or root, and whether this rank's own
//! checks passed) and runs only where every rank's matches; otherwise every rank returns an
//! error and none is left waiting. It costs a small all-gather and a host wait per collective.
//! What stays undetected: a rank that never calls at all (it died, or took another branch that
//! issues no collective), and ranks that turned the checks on and off differently; a rank
//! that died shows as [`Communicator::async_error`] on the others, which then
//! [`Communicator::abort`]. Errors raised on the GPU side (a peer that died, a network failure)
//! come back from [`Communicator::async_error`].

use crate::device::{DeviceBuffer, Mark, SideStream};
use crate::error::{Error, Result};
use crate::{DType, Device, Tensor};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use std::cell::{Cell, RefCell};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The reduction of an all-reduce or a reduce-scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over ranks.
    Sum,
    /// The mean over ranks: NCCL's `ncclAvg` (each value scaled by 1/world, then summed: one
    /// rounding more than a sum where the world is not a power of two).
    Mean,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The product.
    Prod,
}

impl ReduceOp {
    fn nccl(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Mean => ncclRedOp_t::ncclAvg,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
        }
    }
}

fn nccl_dtype(dt: DType) -> ncclDataType_t {
    match dt {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
    }
}

// --- loading -------------------------------------------------------------------------------------

type Res = c_int;
type Stream = *mut c_void;

/// NCCL's entry points, resolved once from the loaded library (which stays loaded).
struct Nccl {
    path: String,
    version: c_int,
    get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Res,
    comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> Res,
    comm_init_all: unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> Res,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Res,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> Res,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut Res) -> Res,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, Stream) -> Res,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, Stream) -> Res,
    reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, Stream) -> Res,
    broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> Res,
    send: unsafe extern "C" fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> Res,
    recv: unsafe extern "C" fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> Res,
    group_start: unsafe extern "C" fn() -> Res,
    group_end: unsafe extern "C" fn() -> Res,
}

/// The names tried, in order: `KERNELS_NCCL_LIB` alone when set, else the usual sonames.
fn candidates() -> Vec<String> {
    match std::env::var("KERNELS_NCCL_LIB") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    }
}

/// NCCL 2.10 brought bf16 and `ncclAvg`; older ones are refused at loading.
const MIN_VERSION: c_int = 21000;

impl Nccl {
    /// Opens the first of `names` that loads and resolves every symbol.
    fn open(names: &[String]) -> Result<Nccl, String> {
        let mut tried = Vec::new();
        for name in names {
            // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
            let lib = match unsafe { libloading::Library::new(name.as_str()) } {
                Ok(l) => l,
                Err(e) => {
                    tried.push(format!("{name}: {e}"));
                    continue;
                }
            };
            match Nccl::resolve(&lib, name) {
                Ok(n) => {
                    // Kept loaded for the process: the function pointers point into it.
                    std::mem::forget(lib);
                    return Ok(n);
                }
                Err(e) => tried.push(e),
            }
        }
        Err(format!(
            "NCCL could not be loaded ({}); install it (PyTorch's wheels ship \
             site-packages/nvidia/nccl/lib/libnccl.so.2) and set KERNELS_NCCL_LIB to its path \
             or add its folder to LD_LIBRARY_PATH",
            tried.join("; ")
        ))
    }

    fn resolve(lib: &libloading::Library, name: &str) -> Result<Nccl, String> {
        /// The function `s` of `lib`, typed `T`.
        ///
        /// # Safety
        /// `T` is the C signature of NCCL's function `s`.
        unsafe fn get<T: Copy>(lib: &libloading::Library, name: &str, s: &str) -> Result<T, String> {
            // SAFETY: the caller's contract.
            unsafe { lib.get::<T>(s) }.map(|f| *f).map_err(|e| format!("{name}: no symbol {s}: {e}"))
        }
        macro_rules! sym {
            ($s:literal) => {
                // SAFETY: the declared type (the field's) is the C signature of NCCL's function
                // of this name (nccl.h, 2.10 and later), the enums passed as their C ints.
                unsafe { get(lib, name, $s) }?
            };
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> Res = sym!("ncclGetVersion");
        let mut version = 0;
        // SAFETY: writes one int.
        let r = unsafe { get_version(&mut version) };
        if r != 0 || version < MIN_VERSION {
            return Err(format!("{name}: NCCL version {version} (need 2.10 or newer for bf16 and mean)"));
        }
        Ok(Nccl {
            path: name.to_string(),
            version,
            get_error_string: sym!("ncclGetErrorString"),
            get_last_error: sym!("ncclGetLastError"),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_init_all: sym!("ncclCommInitAll"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            reduce_scatter: sym!("ncclReduceScatter"),
            broadcast: sym!("ncclBroadcast"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
        })
    }

    /// NCCL's message for `r`, with the communicator's last error where there is one.
    fn message(&self, r: Res, comm: ncclComm_t) -> String {
        let text = |p: *const c_char| {
            // SAFETY: NCCL returns NUL-terminated static or per-thread strings, or null.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // SAFETY: both take any value and return a string.
        let what = text(unsafe { (self.get_error_string)(r) }).unwrap_or_default();
        let last = text(unsafe { (self.get_last_error)(comm) }).filter(|s| !s.is_empty());
        match last {
            Some(l) => format!("NCCL error {r} ({what}): {l}"),
            None => format!("NCCL error {r} ({what})"),
        }
    }

    fn check(&self, op: &'static str, r: Res, comm: ncclComm_t) -> Result<()> {
        if r == 0 { Ok(()) } else { Err(Error::Collective { op, message: self.message(r, comm) }) }
    }
}

/// Loads NCCL on first use. A failure is not kept: a later call tries again (after, say, the
/// caller has set `KERNELS_NCCL_LIB`).
fn nccl() -> Result<&'static Nccl> {
    static LIB: OnceLock<Nccl> = OnceLock::new();
    static LOADING: Mutex<()> = Mutex::new(());
    if let Some(n) = LIB.get() {
        return Ok(n);
    }
    let _g = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = LIB.get() {
        return Ok(n);
    }
    let n = Nccl::open(&candidates()).map_err(|detail| Error::NoNccl { detail })?;
    Ok(LIB.get_or_init(|| n))
}

/// NCCL's version as `major * 10000 + minor * 100 + patch` (e.g. 22703 for 2.27.3) and the
/// library loaded, or [`Error::NoNccl`].
pub fn nccl_version() -> Result<(u32, String)> {
    let n = nccl()?;
    Ok((n.version as u32, n.path.clone()))
}

// --- ids and communicators -----------------------------------------------------------------------

/// The rendezvous of a communicator spanning processes: made once (by rank 0) with
/// [`UniqueId::new`], handed to every rank (as 128 bytes or 256 hex digits, through a file,
/// an environment variable or the network), and given to [`Communicator::from_id`]. Making it
/// starts NCCL's listener in the making process, which must stay alive until every rank joined.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({}…)", &self.to_hex()[..16])
    }
}

impl UniqueId {
    /// Bytes of an id.
    pub const LEN: usize = 128;

    /// A new id (`ncclGetUniqueId`); [`Error::NoNccl`] without NCCL.
    pub fn new() -> Result<UniqueId> {
        let n = nccl()?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        n.check("UniqueId::new", unsafe { (n.get_unique_id)(&mut id) }, std::ptr::null_mut())?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// The id's 128 bytes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0
    }

    /// The id from the 128 bytes of [`UniqueId::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let b: [u8; 128] = bytes.try_into().map_err(|_| Error::InvalidArgument {
            op: "UniqueId::from_bytes",
            message: format!("an id has {} bytes, got {}", Self::LEN, bytes.len()),
        })?;
        Ok(UniqueId(b))
    }

    /// The id as 256 lowercase hex digits (for an environment variable or a text file).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The id from the hex digits of [`UniqueId::to_hex`] (either case; surrounding whitespace,
    /// such as a file's final newline, is ignored).
    pub fn from_hex(hex: &str) -> Result<UniqueId> {
        let op = "UniqueId::from_hex";
        let hex = hex.trim();
        if hex.len() != 2 * Self::LEN || !hex.is_ascii() {
            return Err(Error::InvalidArgument {
                op,
                message: format!("an id is {} hex digits, got {} characters", 2 * Self::LEN, hex.len()),
            });
        }
        let mut b = [0u8; 128];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| Error::InvalidArgument {
                op,
                message: format!("`{}` at {} is not a hex byte", &hex[2 * i..2 * i + 2], 2 * i),
            })?;
        }
        Ok(UniqueId(b))
    }
}

/// Words of a [`Signature`] on the wire.
const WORDS: usize = 5;

/// A collective as the cross-rank check compares it (see
/// [`Communicator::set_cross_rank_checks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signature {
    /// This rank's own checks failed (the rest is then what it could tell).
    failed: bool,
    /// 1 all-reduce, 2 all-gather, 3 reduce-scatter, 4 broadcast.
    kind: u64,
    dtype: u64,
    /// Elements of the input.
    count: u64,
    /// The reduction, or the broadcast's root.
    extra: u64,
}

impl Signature {
    fn new(kind: u64, x: &Tensor, extra: u64) -> Signature {
        let dtype = match x.dtype() {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
        };
        Signature { failed: false, kind, dtype, count: x.numel() as u64, extra }
    }
    fn reduce(kind: u64, x: &Tensor, op: ReduceOp) -> Signature {
        Signature::new(kind, x, op as u64)
    }
    fn words(&self) -> [u64; WORDS] {
        [self.failed as u64, self.kind, self.dtype, self.count, self.extra]
    }
    fn from_words(w: &[u64]) -> Signature {
        Signature { failed: w[0] != 0, kind: w[1], dtype: w[2], count: w[3], extra: w[4] }
    }
}

impl std::fmt::Display for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = ["?", "all_reduce", "all_gather", "reduce_scatter", "broadcast"];
        let dtype = ["?", "f32", "f16", "bf16"];
        let name = |names: &[&'static str], i: u64| names.get(i as usize).copied().unwrap_or("?");
        write!(f, "{} of {} x {}", name(&kind, self.kind), self.count, name(&dtype, self.dtype))?;
        match self.kind {
            1 | 3 => write!(f, " ({})", ["sum", "mean", "max", "min", "prod"].get(self.extra as usize).unwrap_or(&"?")),
            4 => write!(f, " (root {})", self.extra),
            _ => Ok(()),
        }
    }
}

/// One rank of an NCCL communicator, on one device. Made by [`Communicator::new_group`] (every
/// rank in this process) or [`Communicator::from_id`] (one rank per process). Dropping it waits
/// for the device's work and destroys the communicator; [`Communicator::abort`] does not wait.
pub struct Communicator {
    nccl: &'static Nccl,
    /// NCCL's handle; the lock keeps two threads from calling into one communicator at once,
    /// which NCCL does not allow.
    comm: Mutex<ncclComm_t>,
    dev: Device,
    rank: usize,
    world: usize,
    /// The stream of [`Communicator::all_reduce_start`], made at its first call.
    side: OnceLock<SideStream>,
    /// Whether collectives first agree across ranks ([`Communicator::set_cross_rank_checks`]).
    checked: AtomicBool,
}

// SAFETY: the handle is used under the mutex only, with the device's context bound first; NCCL
// allows a communicator to be used from any thread, one at a time.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {} on cuda:{})", self.rank, self.world, self.dev.ordinal())
    }
}

impl Communicator {
    /// One communicator per device, ranks in the order given, all in this process
    /// (`ncclCommInitAll`). The devices must be distinct.
    pub fn new_group(devices: &[Device]) -> Result<CommGroup> {
        let op = "Communicator::new_group";
        let n = nccl()?;
        if devices.is_empty() {
            return Err(Error::InvalidArgument { op, message: "no devices".into() });
        }
        let ordinals: Vec<c_int> = devices.iter().map(|d| d.ordinal() as c_int).collect();
        if let Some(i) = (1..ordinals.len()).find(|&i| ordinals[..i].contains(&ordinals[i])) {
            return Err(Error::InvalidArgument {
                op,
                message: format!("cuda:{} appears twice; NCCL needs one rank per device", ordinals[i]),
            });
        }
        devices[0].bind()?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one handle per ordinal; the ordinals are valid devices.
        let r = unsafe { (n.comm_init_all)(comms.as_mut_ptr(), ordinals.len() as c_int, ordinals.as_ptr()) };
        crate::device::forget_current_context();
        n.check(op, r, std::ptr::null_mut())?;
        let world = devices.len();
        Ok(CommGroup(
            comms
                .into_iter()
                .zip(devices)
                .enumerate()
                .map(|(rank, (comm, dev))| Communicator {
                    nccl: n,
                    comm: Mutex::new(comm),
                    dev: dev.clone(),
                    rank,
                    world,
                    side: OnceLock::new(),
                    checked: AtomicBool::new(false),
                })
                .collect(),
        ))
    }

    /// Rank `rank` of `world`, on `dev`, joining the others that pass the same `id`
    /// (`ncclCommInitRank`): blocks until all `world` ranks have called it.
    pub fn from_id(dev: &Device, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        let op = "Communicator::from_id";
        let n = nccl()?;
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(Error::InvalidArgument { op, message: format!("rank {rank} of a world of {world}") });
        }
        // NCCL takes the device from the thread's current context.
        dev.bind()?;
        let mut comm = std::ptr::null_mut();
        let uid = ncclUniqueId { internal: id.0.map(|b| b as c_char) };
        // SAFETY: writes one handle; the id is passed by value.
        let r = unsafe { (n.comm_init_rank)(&mut comm, world as c_int, uid, rank as c_int) };
        crate::device::forget_current_context();
        n.check(op, r, std::ptr::null_mut())?;
        Ok(Communicator {
            nccl: n,
            comm: Mutex::new(comm),
            dev: dev.clone(),
            rank,
            world,
            side: OnceLock::new(),
            checked: AtomicBool::new(false),
        })
    }

    /// This rank's index, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }
    /// The device of this rank.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// An error NCCL raised while running this communicator's work on the GPU (a peer that
    /// failed, a network error), as [`Error::Collective`]; `Ok` while there is none.
    pub fn async_error(&self) -> Result<()> {
        let comm = self.lock();
        let mut state: Res = 0;
        // SAFETY: a live communicator; writes one int.
        let r = unsafe { (self.nccl.comm_get_async_error)(*comm, &mut state) };
        self.nccl.check("Communicator::async_error", r, *comm)?;
        self.nccl.check("Communicator::async_error", state, *comm)
    }

    /// Turns the cross-rank check of every later collective of this rank on or off (off by
    /// default). On, each collective (all-reduce, all-gather, reduce-scatter, broadcast,
    /// `all_reduce_start`; not send and receive) first all-gathers a signature from every rank:
    /// the collective, the dtype, the element count, the reduction or root, and whether the
    /// rank's own checks passed. Where every signature matches, the collective runs; otherwise
    /// every rank returns an error (a rank whose own check failed, that error; the others
    /// [`Error::Collective`] naming the first rank that differs) and no rank is left waiting.
    /// Every rank must set it alike. Inside a [`group`] (one thread driving several ranks,
    /// whose calls are only recorded) there is nothing to wait on yet, so the exchange is
    /// skipped there. Costs one small all-gather and a host wait per collective.
    pub fn set_cross_rank_checks(&self, on: bool) {
        self.checked.store(on, Ordering::Relaxed);
    }

    /// Whether [`Communicator::set_cross_rank_checks`] is on.
    pub fn cross_rank_checks(&self) -> bool {
        self.checked.load(Ordering::Relaxed)
    }

    /// The cross-rank check of one collective: `local` is the outcome of this rank's own
    /// checks. Off (or inside a group), returns `local`; on, returns it too, but only after the
    /// other ranks have learnt whether it failed, and an error where any rank's signature
    /// differs.
    fn agree<T>(&self, op: &'static str, sig: Signature, local: Result<T>) -> Result<T> {
        if !self.cross_rank_checks() || GROUP_DEPTH.with(Cell::get) > 0 {
            return local;
        }
        let mine = Signature { failed: local.is_err(), ..sig }.words();
        let mut all = vec![0u64; WORDS * self.world];
        all[WORDS * self.rank..WORDS * (self.rank + 1)].copy_from_slice(&mine);
        let mut buf = self.dev.alloc(op, 8 * all.len())?;
        buf.copy_from_host_async(&all)?;
        let (p, nccl) = (buf.ptr() as *mut c_void, self.nccl);
        self.enqueue(op, &[], |c, s| {
            // SAFETY: `buf` holds WORDS u64 for every rank; this rank's block is its input
            // (NCCL's in-place all-gather: send = recv + rank * count).
            let send = unsafe { p.cast::<u64>().add(WORDS * self.rank) }.cast::<c_void>();
            unsafe { (nccl.all_gather)(send, p, WORDS, ncclDataType_t::ncclUint64, c, s) }
        })?;
        buf.copy_to_host(&mut all)?;
        let local = local?;
        let theirs = |r: usize| Signature::from_words(&all[WORDS * r..WORDS * (r + 1)]);
        match (0..self.world).find(|&r| theirs(r) != Signature::from_words(&mine)) {
            None => Ok(local),
            Some(r) if theirs(r).failed => {
                Err(Error::Collective { op, message: format!("rank {r} failed its own checks of this call") })
            }
            Some(r) => Err(Error::Collective {
                op,
                message: format!("rank {r} calls {}, rank {} calls {}", theirs(r), self.rank, sig),
            }),
        }
    }

    /// `err`, raised by this rank before a collective's own checks, once the other ranks know
    /// of it (where the cross-rank check is on).
    fn told(&self, op: &'static str, sig: Signature, err: Error) -> Error {
        match self.agree::<std::convert::Infallible>(op, sig, Err(err)) {
            Err(e) => e,
        }
    }

    /// Ends this rank's part at once (`ncclCommAbort`), without waiting for its work: for a
    /// rank whose peers failed or disagree, to stop waiting on them.
    pub fn abort(self) {
        let comm = std::mem::replace(&mut *self.lock(), std::ptr::null_mut());
        if self.dev.bind().is_ok() {
            // SAFETY: the handle is taken out, so `Drop` leaves it alone.
            let _ = unsafe { (self.nccl.comm_abort)(comm) };
            crate::device::forget_current_context();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ncclComm_t> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one NCCL call `f(comm, stream)` on this rank's device and stream, keeping the
    /// tensors' memory alive until the enclosing group (if any) has enqueued it.
    fn enqueue(&self, op: &'static str, keep: &[&Tensor], f: impl FnOnce(ncclComm_t, Stream) -> Res) -> Result<()> {
        let comm = self.lock();
        self.dev.bind()?;
        let r = f(*comm, self.dev.cu_stream());
        // NCCL may have made another context current (cudaSetDevice): bind again next time.
        crate::device::forget_current_context();
        self.nccl.check(op, r, *comm)?;
        if GROUP_DEPTH.with(Cell::get) > 0 {
            PENDING.with(|p| p.borrow_mut().extend(keep.iter().map(|t| t.buffer())));
        }
        Ok(())
    }

    fn check_tensor(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.device() != &self.dev {
            return Err(Error::DeviceMismatch { op, expected: self.dev.ordinal(), got: t.device().ordinal() });
        }
        Ok(())
    }

    fn check_like(
        &self,
        op: &'static str,
        x: &Tensor,
        out: &Tensor,
        shape: &[usize],
        detail: &'static str,
    ) -> Result<()> {
        self.check_tensor(op, x)?;
        self.check_tensor(op, out)?;
        if out.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch { op, expected: x.dtype(), got: out.dtype() });
        }
        if out.shape() != shape {
            return Err(Error::ShapeMismatch { op, expected: shape.to_vec(), got: out.shape().to_vec(), detail });
        }
        Ok(())
    }

    fn check_peer(&self, op: &'static str, what: &str, peer: usize) -> Result<()> {
        if peer >= self.world {
            return Err(Error::InvalidArgument { op, message: format!("{what} {peer} of a world of {}", self.world) });
        }
        Ok(())
    }

    /// A tensor's memory for writing, refusing one a pending group still reads or writes: the
    /// copy-on-write of a shared tensor would be enqueued before the group's collectives.
    fn out_ptr(op: &'static str, t: &mut Tensor) -> Result<*mut c_void> {
        let addr = t.device_ptr();
        let pending = addr != 0 && PENDING.with(|p| p.borrow().iter().any(|b| b.ptr() == addr));
        if pending {
            return Err(Error::InvalidArgument {
                op,
                message: "the tensor is already used by a collective of this group; write it in another group".into(),
            });
        }
        t.dev_ptr_mut::<c_void>()
    }

    /// The sum (mean, max, min, product) over ranks of `x`, elementwise, into a new tensor.
    pub fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let mut out =
            x.alloc_like("all_reduce").map_err(|e| self.told("all_reduce", Signature::reduce(1, x, op), e))?;
        self.all_reduce_out(x, &mut out, op)?;
        Ok(out)
    }

    /// [`Communicator::all_reduce`] in place: `x` becomes the reduction.
    pub fn all_reduce_(&self, x: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.agree("all_reduce_", Signature::reduce(1, x, op), self.check_tensor("all_reduce_", x))?;
        let (n, dt) = (x.numel(), x.dtype());
        let p = Self::out_ptr("all_reduce_", x)?;
        if n == 0 {
            return Ok(());
        }
        let nccl = self.nccl;
        self.enqueue("all_reduce_", &[&*x], |c, s| {
            // SAFETY: `x` holds n elements of dt on this rank's device; in place is allowed.
            unsafe { (nccl.all_reduce)(p, p, n, nccl_dtype(dt), op.nccl(), c, s) }
        })
    }

    /// [`Communicator::all_reduce`] into `out` (same shape and dtype as `x`).
    pub fn all_reduce_out(&self, x: &Tensor, out: &mut Tensor, op: ReduceOp) -> Result<()> {
        let local = self.check_like("all_reduce", x, out, x.shape(), "out has the shape of x");
        self.agree("all_reduce", Signature::reduce(1, x, op), local)?;
        let (n, dt) = (x.numel(), x.dtype());
        let p = Self::out_ptr("all_reduce", out)?;
        if n == 0 {
            return Ok(());
        }
        let (src, nccl) = (x.device_ptr() as *const c_void, self.nccl);
        self.enqueue("all_reduce", &[x, &*out], |c, s| {
            // SAFETY: both hold n elements of dt on this rank's device.
            unsafe { (nccl.all_reduce)(src, p, n, nccl_dtype(dt), op.nccl(), c, s) }
        })
    }

    /// Every rank's `x` (same shape everywhere) stacked in rank order along a new leading
    /// dimension merged with the first: shape `[world * d0, d1, ...]` (`[world]` for a scalar),
    /// like `torch.distributed.all_gather_into_tensor`.
    pub fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        let shape = self.gathered_shape(x.shape());
        let mut out = Tensor::alloc("all_gather", x.device(), &shape, x.dtype())
            .map_err(|e| self.told("all_gather", Signature::new(2, x, 0), e))?;
        self.all_gather_out(x, &mut out)?;
        Ok(out)
    }

    fn gathered_shape(&self, s: &[usize]) -> Vec<usize> {
        match s.split_first() {
            Some((&d0, rest)) => std::iter::once(d0 * self.world).chain(rest.iter().copied()).collect(),
            None => vec![self.world],
        }
    }

    /// [`Communicator::all_gather`] into `out`, of shape `[world * d0, d1, ...]`.
    pub fn all_gather_out(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        let shape = self.gathered_shape(x.shape());
        let local = self.check_like("all_gather", x, out, &shape, "out is world times x along the first dimension");
        self.agree("all_gather", Signature::new(2, x, 0), local)?;
        let (n, dt) = (x.numel(), x.dtype());
        let p = Self::out_ptr("all_gather", out)?;
        if n == 0 {
            return Ok(());
        }
        let (src, nccl) = (x.device_ptr() as *const c_void, self.nccl);
        self.enqueue("all_gather", &[x, &*out], |c, s| {
            // SAFETY: x holds n elements, out world * n, of dt on this rank's device.
            unsafe { (nccl.all_gather)(src, p, n, nccl_dtype(dt), c, s) }
        })
    }

    /// The reduction over ranks of `x` (shape `[world * d0, d1, ...]`, the same on every
    /// rank), of which this rank keeps block `rank` along the first dimension: shape
    /// `[d0, d1, ...]`, like `torch.distributed.reduce_scatter_tensor`.
    pub fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let mut out = self
            .scattered_shape("reduce_scatter", x.shape())
            .and_then(|shape| Tensor::alloc("reduce_scatter", x.device(), &shape, x.dtype()))
            .map_err(|e| self.told("reduce_scatter", Signature::reduce(3, x, op), e))?;
        self.reduce_scatter_out(x, &mut out, op)?;
        Ok(out)
    }

    fn scattered_shape(&self, op: &'static str, s: &[usize]) -> Result<Vec<usize>> {
        match s.split_first() {
            Some((&d0, rest)) if d0 % self.world == 0 => {
                Ok(std::iter::once(d0 / self.world).chain(rest.iter().copied()).collect())
            }
            _ => Err(Error::ShapeMismatch {
                op,
                expected: vec![self.world],
                got: s.to_vec(),
                detail: "the first dimension of x is a multiple of the world size",
            }),
        }
    }

    /// [`Communicator::reduce_scatter`] into `out`, of shape `[d0 / world, d1, ...]`.
    pub fn reduce_scatter_out(&self, x: &Tensor, out: &mut Tensor, op: ReduceOp) -> Result<()> {
        let local = self.scattered_shape("reduce_scatter", x.shape()).and_then(|shape| {
            self.check_like("reduce_scatter", x, out, &shape, "out is x's first dimension divided by the world size")
        });
        self.agree("reduce_scatter", Signature::reduce(3, x, op), local)?;
        let (n, dt) = (out.numel(), x.dtype());
        let p = Self::out_ptr("reduce_scatter", out)?;
        if n == 0 {
            return Ok(());
        }
        let (src, nccl) = (x.device_ptr() as *const c_void, self.nccl);
        self.enqueue("reduce_scatter", &[x, &*out], |c, s| {
            // SAFETY: x holds world * n elements, out n, of dt on this rank's device.
            unsafe { (nccl.reduce_scatter)(src, p, n, nccl_dtype(dt), op.nccl(), c, s) }
        })
    }

    /// Rank `root`'s `x`, on every rank, in a new tensor. On the other ranks `x` gives only
    /// the shape and dtype (the same as the root's).
    pub fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let op = "broadcast";
        let local = self.check_tensor(op, x).and_then(|()| self.check_peer(op, "root", root));
        let mut out = self.agree(op, Signature::new(4, x, root as u64), local.and_then(|()| x.alloc_like(op)))?;
        let (n, dt) = (x.numel(), x.dtype());
        let p = Self::out_ptr(op, &mut out)?;
        if n == 0 {
            return Ok(out);
        }
        let (src, nccl) = (x.device_ptr() as *const c_void, self.nccl);
        self.enqueue(op, &[x, &out], |c, s| {
            // SAFETY: both hold n elements of dt on this rank's device.
            unsafe { (nccl.broadcast)(src, p, n, nccl_dtype(dt), root as c_int, c, s) }
        })?;
        Ok(out)
    }

    /// [`Communicator::broadcast`] in place: `x` becomes rank `root`'s `x`.
    pub fn broadcast_(&self, x: &mut Tensor, root: usize) -> Result<()> {
        let op = "broadcast_";
        let local = self.check_tensor(op, x).and_then(|()| self.check_peer(op, "root", root));
        self.agree(op, Signature::new(4, x, root as u64), local)?;
        let (n, dt) = (x.numel(), x.dtype());
        let p = Self::out_ptr(op, x)?;
        if n == 0 {
            return Ok(());
        }
        let nccl = self.nccl;
        self.enqueue(op, &[&*x], |c, s| {
            // SAFETY: x holds n elements of dt on this rank's device; in place is allowed.
            unsafe { (nccl.broadcast)(p, p, n, nccl_dtype(dt), root as c_int, c, s) }
        })
    }

    /// Sends `x` to rank `peer`, which receives it with [`Communicator::recv`] into a tensor of
    /// the same element count and dtype. Point-to-point calls between ranks of one process go
    /// inside one [`group`].
    pub fn send(&self, x: &Tensor, peer: usize) -> Result<()> {
        let op = "send";
        self.check_tensor(op, x)?;
        self.check_peer(op, "peer", peer)?;
        if peer == self.rank {
            return Err(Error::InvalidArgument { op, message: format!("rank {peer} sending to itself") });
        }
        let (n, dt) = (x.numel(), x.dtype());
        if n == 0 {
            return Ok(());
        }
        let (src, nccl) = (x.device_ptr() as *const c_void, self.nccl);
        self.enqueue(op, &[x], |c, s| {
            // SAFETY: x holds n elements of dt on this rank's device.
            unsafe { (nccl.send)(src, n, nccl_dtype(dt), peer as c_int, c, s) }
        })
    }

    /// Receives into `out` what rank `peer` sends with [`Communicator::send`].
    pub fn recv(&self, out: &mut Tensor, peer: usize) -> Result<()> {
        let op = "recv";
        self.check_tensor(op, out)?;
        self.check_peer(op, "peer", peer)?;
        if peer == self.rank {
            return Err(Error::InvalidArgument { op, message: format!("rank {peer} receiving from itself") });
        }
        let (n, dt) = (out.numel(), out.dtype());
        let p = Self::out_ptr(op, out)?;
        if n == 0 {
            return Ok(());
        }
        let nccl = self.nccl;
        self.enqueue(op, &[&*out], |c, s| {
            // SAFETY: out holds n elements of dt on this rank's device.
            unsafe { (nccl.recv)(p, n, nccl_dtype(dt), peer as c_int, c, s) }
        })
    }
}

impl Communicator {
    /// Starts reducing `tensors` in place across the ranks (one all-reduce each, fused into one
    /// NCCL group) on a second stream of this rank's device, and returns at once. The
    /// reduction starts after the work issued so far on the device's stream, which goes on with
    /// the next kernels meanwhile: a backward pass computes the next layer's gradients while
    /// this one's travel (data-parallel training's bucketed all-reduce). The tensors are held
    /// by the returned [`PendingReduce`] until [`PendingReduce::wait`] gives them back, reduced.
    ///
    /// One thread per rank: a thread that drives several ranks must issue their collectives
    /// inside one [`group`], and a group enqueues only at its end, after this returns; so this
    /// is refused inside a group. A tensor whose memory is shared with another (a clone) is
    /// copied first, as every in-place op does, so no memory is reduced twice.
    pub fn all_reduce_start(&self, mut tensors: Vec<Tensor>, op: ReduceOp) -> Result<PendingReduce<'_>> {
        let name = "all_reduce_start";
        if GROUP_DEPTH.with(Cell::get) > 0 {
            return Err(Error::InvalidArgument {
                op: name,
                message: "inside dist::group, whose collectives are enqueued only at its end; start it outside \
                          (one thread per rank)"
                    .into(),
            });
        }
        // With the cross-rank check on, one exchange per tensor (a debugging mode: each waits).
        for t in &tensors {
            self.agree(name, Signature::reduce(1, t, op), self.check_tensor(name, t))?;
        }
        // The pointers first: a shared tensor's copy-on-write runs on the device's stream, before
        // the point the reduction waits for.
        let ptrs = tensors.iter_mut().map(|t| Self::out_ptr(name, t)).collect::<Result<Vec<_>>>()?;
        let side = match self.side.get() {
            Some(s) => s,
            None => {
                let s = SideStream::new(&self.dev)?;
                self.side.get_or_init(|| s)
            }
        };
        side.wait_for_device()?;
        let enqueued = {
            let comm = self.lock();
            self.dev.bind().and_then(|()| {
                let n = self.nccl;
                // SAFETY: no arguments; pairs with the group_end below.
                n.check(name, unsafe { (n.group_start)() }, *comm)?;
                let mut r = Ok(());
                for (t, &p) in tensors.iter().zip(&ptrs) {
                    if t.numel() == 0 || r.is_err() {
                        continue;
                    }
                    // SAFETY: p holds t.numel() elements of t's dtype on this rank's device;
                    // the side stream belongs to its context.
                    let res =
                        unsafe { (n.all_reduce)(p, p, t.numel(), nccl_dtype(t.dtype()), op.nccl(), *comm, side.raw()) };
                    r = n.check(name, res, *comm);
                }
                // SAFETY: ends the group started above.
                let end = unsafe { (n.group_end)() };
                crate::device::forget_current_context();
                r.and_then(|()| n.check(name, end, *comm))
            })
        };
        let pending = PendingReduce { tensors, done: Some(side.mark()?), _comm: std::marker::PhantomData };
        // On failure, `pending` drops here: the device's stream waits for what was enqueued
        // before the tensors' memory can be reused.
        enqueued.map(|()| pending)
    }
}

/// An all-reduce running on a rank's second stream (see [`Communicator::all_reduce_start`]).
/// Dropping it without [`PendingReduce::wait`] still orders the device's stream after the
/// reduction before the tensors' memory can be reused.
#[must_use = "wait() gives the reduced tensors back"]
pub struct PendingReduce<'a> {
    tensors: Vec<Tensor>,
    done: Option<Mark>,
    /// The communicator (and its stream) outlive the reduction.
    _comm: std::marker::PhantomData<&'a Communicator>,
}

impl std::fmt::Debug for PendingReduce<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PendingReduce({} tensors)", self.tensors.len())
    }
}

impl PendingReduce<'_> {
    /// Work issued on the device's stream (this thread's) from now on runs after the reduction;
    /// returns the tensors, reduced for that work. The host does not wait.
    pub fn wait(mut self) -> Result<Vec<Tensor>> {
        if let Some(m) = self.done.take() {
            m.device_waits()?;
        }
        Ok(std::mem::take(&mut self.tensors))
    }

    /// Whether the reduction has finished on the GPU (never blocks).
    pub fn is_done(&self) -> bool {
        self.done.as_ref().is_none_or(Mark::is_done)
    }
}

impl Drop for PendingReduce<'_> {
    fn drop(&mut self) {
        let Some(m) = self.done.take() else { return };
        if m.device_waits().is_err() && m.synchronize().is_err() {
            // Neither the stream nor the host could be made to wait: the memory may still be in
            // use, so it is never handed out again.
            std::mem::forget(std::mem::take(&mut self.tensors));
        }
    }
}

/// Gradients all-reduced in buckets while the backward pass goes on, as PyTorch's
/// `DistributedDataParallel` does: [`BucketedAllReduce::push`] each gradient as the backward
/// produces it (last layer first); once the open bucket holds `bucket_bytes` or more, its
/// reduction starts on the rank's second stream ([`Communicator::all_reduce_start`]) while the
/// device computes the next gradients. [`BucketedAllReduce::finish`] starts the last bucket and
/// gives every gradient back, reduced, in the order pushed.
///
/// Every rank must push the same sequence of shapes and dtypes: the buckets, hence the
/// collectives, are then the same on every rank (NCCL cannot tell ranks that disagree).
pub struct BucketedAllReduce<'a> {
    comm: &'a Communicator,
    op: ReduceOp,
    bucket_bytes: usize,
    open: Vec<Tensor>,
    open_bytes: usize,
    started: Vec<PendingReduce<'a>>,
}

impl std::fmt::Debug for BucketedAllReduce<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BucketedAllReduce({} started, {} open)", self.started.len(), self.open.len())
    }
}

impl<'a> BucketedAllReduce<'a> {
    /// Reduces by `op` (`Mean` for the gradient of a mean loss over equal shards) in buckets of
    /// at least `bucket_bytes` (DDP's default is 25 MiB; 0 starts one reduction a tensor).
    pub fn new(comm: &'a Communicator, op: ReduceOp, bucket_bytes: usize) -> Self {
        BucketedAllReduce { comm, op, bucket_bytes, open: Vec::new(), open_bytes: 0, started: Vec::new() }
    }

    /// Adds a gradient (written by work already issued on the device's stream).
    pub fn push(&mut self, grad: Tensor) -> Result<()> {
        self.comm.check_tensor("BucketedAllReduce::push", &grad)?;
        self.open_bytes += grad.size_bytes();
        self.open.push(grad);
        if self.open_bytes >= self.bucket_bytes { self.start_open() } else { Ok(()) }
    }

    fn start_open(&mut self) -> Result<()> {
        let bucket = std::mem::take(&mut self.open);
        self.open_bytes = 0;
        if !bucket.is_empty() {
            self.started.push(self.comm.all_reduce_start(bucket, self.op)?);
        }
        Ok(())
    }

    /// The reductions started so far.
    pub fn buckets_started(&self) -> usize {
        self.started.len()
    }

    /// Starts the open bucket, orders the device's stream after every reduction (the host does
    /// not wait) and returns the gradients in the order they were pushed.
    pub fn finish(mut self) -> Result<Vec<Tensor>> {
        self.start_open()?;
        let mut out = Vec::new();
        for p in std::mem::take(&mut self.started) {
            out.extend(p.wait()?);
        }
        Ok(out)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let comm = *self.comm.get_mut().unwrap_or_else(|p| p.into_inner());
        if comm.is_null() || self.dev.bind().is_err() {
            return;
        }
        // Destroying waits for nothing: the device's work that uses the communicator first.
        let side_done = self.side.get().is_none_or(|s| s.synchronize().is_ok());
        let done = self.dev.synchronize().is_ok() && side_done;
        // SAFETY: nothing uses the handle after this.
        let _ = unsafe { if done { (self.nccl.comm_destroy)(comm) } else { (self.nccl.comm_abort)(comm) } };
        crate::device::forget_current_context();
    }
}

/// The communicators of [`Communicator::new_group`], one per device in rank order (a slice of
/// them through `Deref`). Dropping it destroys them all at once, each on its own thread: NCCL
/// may make the destruction of one rank wait for the other ranks of its node, which one thread
/// destroying them in turn would never reach.
pub struct CommGroup(Vec<Communicator>);

impl std::ops::Deref for CommGroup {
    type Target = [Communicator];
    fn deref(&self) -> &[Communicator] {
        &self.0
    }
}

impl std::fmt::Debug for CommGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.iter()).finish()
    }
}

impl Drop for CommGroup {
    fn drop(&mut self) {
        let comms = std::mem::take(&mut self.0);
        if comms.len() < 2 {
            return;
        }
        std::thread::scope(|s| {
            for c in comms {
                s.spawn(move || drop(c));
            }
        });
    }
}

// --- groups --------------------------------------------------------------------------------------

thread_local! {
    static GROUP_DEPTH: Cell<usize> = const { Cell::new(0) };
    /// The memory of tensors given to collectives of the open group, kept until it has ended.
    static PENDING: RefCell<Vec<Arc<DeviceBuffer>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` inside an NCCL group (`ncclGroupStart` … `ncclGroupEnd`): the collectives that `f`
/// issues on this thread are enqueued together when it returns, which one thread driving several
/// ranks needs (see the module's documentation), and which fuses point-to-point calls. Groups
/// nest. The group ends also when `f` fails; its error comes first.
///
/// Inside `f`, a tensor written by one collective cannot be written by another (an error): the
/// second write would be ordered before the first.
pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let n = nccl()?;
    // SAFETY: no arguments; pairs with the `group_end` below.
    n.check("group", unsafe { (n.group_start)() }, std::ptr::null_mut())?;
    GROUP_DEPTH.with(|d| d.set(d.get() + 1));
    let r = f();
    let depth = GROUP_DEPTH.with(|d| {
        d.set(d.get() - 1);
        d.get()
    });
    // SAFETY: ends the group started above.
    let end = unsafe { (n.group_end)() };
    crate::device::forget_current_context();
    if depth == 0 {
        // Enqueued now (or failed): the stream orders any reuse of the memory after them.
        PENDING.with(|p| p.borrow_mut().clear());
    }
    let r = r?;
    n.check("group", end, std::ptr::null_mut())?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_survive_the_wire_and_read_well() {
        let s = Signature { failed: false, kind: 1, dtype: 3, count: 1001, extra: ReduceOp::Max as u64 };
        assert_eq!(Signature::from_words(&s.words()), s);
        assert_eq!(s.to_string(), "all_reduce of 1001 x bf16 (max)");
        let b = Signature { failed: true, kind: 4, dtype: 1, count: 7, extra: 2 };
        assert_eq!(Signature::from_words(&b.words()), b);
        assert_eq!(b.to_string(), "broadcast of 7 x f32 (root 2)");
        assert_eq!(Signature { kind: 9, dtype: 9, ..b }.to_string(), "? of 7 x ?");
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let Err(e) = Nccl::open(&["/nonexistent/libnccl.so.2".to_string()]) else {
            panic!("a library that does not exist loaded");
        };
        assert!(e.contains("/nonexistent/libnccl.so.2") && e.contains("KERNELS_NCCL_LIB"), "{e}");
    }

    #[test]
    fn a_library_without_the_symbols_is_an_error() {
        // The C library loads but is not NCCL: the missing symbol is named, nothing panics.
        let Err(e) = Nccl::open(&["libc.so.6".to_string()]) else {
            panic!("libc passed for NCCL");
        };
        assert!(e.contains("ncclGetVersion"), "{e}");
    }

    #[test]
    fn unique_id_round_trips_through_hex_and_bytes() {
        let mut b = [0u8; 128];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 + 5) as u8;
        }
        let id = UniqueId(b);
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert_eq!(UniqueId::from_hex(&hex).unwrap(), id);
        assert_eq!(UniqueId::from_hex(&format!("  {}\n", hex.to_uppercase())).unwrap(), id);
        assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
        assert!(matches!(UniqueId::from_hex(&hex[1..]), Err(Error::InvalidArgument { .. })));
        assert!(matches!(UniqueId::from_hex(&format!("zz{}", &hex[2..])), Err(Error::InvalidArgument { .. })));
        assert!(matches!(UniqueId::from_bytes(&b[..127]), Err(Error::InvalidArgument { .. })));
    }
}
