//! The XLA FFI's C ABI (`xla/ffi/api/c_api.h`, which jaxlib ships under `jax.ffi.include_dir()`),
//! bound by hand: the structs and the two API functions the handlers use, and a [`Frame`] that
//! reads a call frame after checking every `struct_size` it depends on.
//!
//! Layouts as of XLA FFI API 0.1 (jaxlib 0.4.36 to 0.8); later minor versions only append fields
//! (to `XLA_FFI_Api`, `XLA_FFI_Metadata`, `XLA_FFI_CallFrame`), which the size checks allow.

use std::ffi::{CString, c_char, c_int, c_void};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI32, Ordering};

// Enumerations as the header numbers them.
pub const EXTENSION_METADATA: c_int = 1;
pub const STAGE_EXECUTE: c_int = 3;
pub const ARG_BUFFER: c_int = 1;
pub const RET_BUFFER: c_int = 1;
pub const ATTR_SCALAR: c_int = 3;

pub const DT_PRED: c_int = 1;
pub const DT_S32: c_int = 4;
pub const DT_S64: c_int = 5;
pub const DT_F16: c_int = 10;
pub const DT_F32: c_int = 11;
pub const DT_F64: c_int = 12;
pub const DT_BF16: c_int = 16;

/// `XLA_FFI_Error_Code`s used here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Code {
    InvalidArgument = 3,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
}

#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub kind: c_int,
    pub next: *mut ExtensionBase,
}

#[repr(C)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: c_int,
    pub minor_version: c_int,
}

#[repr(C)]
pub struct Metadata {
    pub struct_size: usize,
    pub api_version: ApiVersion,
    pub traits: u32,
}

#[repr(C)]
pub struct MetadataExtension {
    pub extension_base: ExtensionBase,
    pub metadata: *mut Metadata,
}

#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: c_int,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *const i64,
}

#[repr(C)]
pub struct Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const c_int,
    pub args: *const *mut c_void,
}

#[repr(C)]
pub struct ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct Scalar {
    pub dtype: c_int,
    pub value: *const c_void,
}

#[repr(C)]
pub struct Attrs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const c_int,
    pub names: *const *const ByteSpan,
    pub attrs: *const *const c_void,
}

/// Opaque to the handlers.
pub enum XlaError {}
pub enum ExecutionContext {}

#[repr(C)]
pub struct CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api: *const Api,
    pub ctx: *mut ExecutionContext,
    pub stage: c_int,
    pub args: Args,
    pub rets: Args,
    pub attrs: Attrs,
    pub future: *mut c_void,
}

#[repr(C)]
pub struct ErrorCreateArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub message: *const c_char,
    pub errc: c_int,
}

#[repr(C)]
pub struct StreamGetArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut ExecutionContext,
    pub stream: *mut c_void,
}

type Fn = Option<unsafe extern "C" fn(*mut c_void) -> *mut XlaError>;

/// The head of `XLA_FFI_Api`: the functions up to the stream getter, in the header's order.
#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api_version: ApiVersion,
    pub internal_api: *mut c_void,
    pub error_create: Option<unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut XlaError>,
    pub error_get_message: Fn,
    pub error_destroy: Fn,
    pub handler_register: Fn,
    pub stream_get: Option<unsafe extern "C" fn(*mut StreamGetArgs) -> *mut XlaError>,
}

/// The sizes the header's `XLA_FFI_STRUCT_SIZE` gives (offset of the last field plus its size),
/// the least a caller may pass.
pub const CALL_FRAME_SIZE: usize = offset_of!(CallFrame, attrs) + size_of::<Attrs>();
pub const API_SIZE: usize = offset_of!(Api, stream_get) + size_of::<usize>();
pub const METADATA_SIZE: usize = offset_of!(Metadata, traits) + size_of::<u32>();
pub const METADATA_EXTENSION_SIZE: usize = size_of::<MetadataExtension>();
pub const BUFFER_SIZE: usize = size_of::<Buffer>();
pub const ARGS_SIZE: usize = size_of::<Args>();
pub const ATTRS_SIZE: usize = size_of::<Attrs>();
pub const API_VERSION_SIZE: usize = size_of::<ApiVersion>();

/// The FFI version the handlers report at registration: XLA before API 0.2 requires the
/// framework's own version there and passes no API table to read it from, so the Python layer
/// sets it from the header of the installed jaxlib (`set_api_version`). 0.1 until then.
pub static REPORT_MAJOR: AtomicI32 = AtomicI32::new(0);
pub static REPORT_MINOR: AtomicI32 = AtomicI32::new(1);

/// A failure of a handler: the code and message XLA raises (as `XlaRuntimeError` in Python).
#[derive(Debug)]
pub struct Failure {
    pub code: Code,
    pub message: String,
    /// An error XLA returned to a handler, passed back as the handler's own (0: none).
    pub xla: usize,
}

pub type Res<T> = Result<T, Failure>;

pub fn invalid(message: impl Into<String>) -> Failure {
    Failure { code: Code::InvalidArgument, message: message.into(), xla: 0 }
}

impl From<kernels::Error> for Failure {
    fn from(e: kernels::Error) -> Failure {
        use kernels::Error as E;
        let code = match &e {
            E::ShapeMismatch { .. }
            | E::DeviceMismatch { .. }
            | E::InvalidArgument { .. }
            | E::DTypeMismatch { .. } => Code::InvalidArgument,
            E::OutOfMemory { .. } => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        Failure { code, message: e.to_string(), xla: 0 }
    }
}

/// If `frame` is XLA's metadata query (registration), answers it and returns true.
///
/// # Safety
/// `frame` points to a call frame XLA passed to a handler.
pub unsafe fn answer_metadata(frame: *mut CallFrame) -> Res<bool> {
    // SAFETY: XLA passes a valid frame; its first two fields exist in every version.
    let (size, mut ext) = unsafe { ((*frame).struct_size, (*frame).extension_start) };
    if size < offset_of!(CallFrame, api) {
        return Err(invalid(format!("XLA_FFI_CallFrame of {size} bytes is too small")));
    }
    while !ext.is_null() {
        // SAFETY: a non-null extension starts with an `XLA_FFI_Extension_Base`.
        let base = unsafe { &*ext };
        if base.struct_size < size_of::<ExtensionBase>() {
            return Err(invalid("XLA FFI extension smaller than its base"));
        }
        if base.kind == EXTENSION_METADATA {
            if base.struct_size < METADATA_EXTENSION_SIZE {
                return Err(invalid("XLA_FFI_Metadata_Extension is too small"));
            }
            // SAFETY: the type and size say this is a metadata extension.
            let md = unsafe { (*ext.cast::<MetadataExtension>()).metadata };
            if md.is_null() {
                return Err(invalid("XLA_FFI_Metadata_Extension without metadata"));
            }
            // SAFETY: XLA's writable metadata, whose size is checked before any write.
            let md = unsafe { &mut *md };
            if md.struct_size < METADATA_SIZE {
                return Err(invalid(format!("XLA_FFI_Metadata of {} bytes is too small", md.struct_size)));
            }
            let (mut major, mut minor) = (REPORT_MAJOR.load(Ordering::Relaxed), REPORT_MINOR.load(Ordering::Relaxed));
            // SAFETY: the frame is large enough to hold `api` (checked above).
            let api = unsafe { (*frame).api };
            if size >= offset_of!(CallFrame, ctx) && !api.is_null() {
                // SAFETY: a non-null API table from XLA; its version is read after its size.
                let api = unsafe { &*api };
                if api.struct_size >= offset_of!(Api, internal_api) && api.api_version.struct_size >= API_VERSION_SIZE {
                    (major, minor) = (api.api_version.major_version, api.api_version.minor_version);
                }
            }
            md.api_version.struct_size = API_VERSION_SIZE;
            md.api_version.extension_start = std::ptr::null_mut();
            md.api_version.major_version = major;
            md.api_version.minor_version = minor;
            // Not command-buffer compatible: some ops allocate stream-ordered temporaries.
            md.traits = 0;
            return Ok(true);
        }
        ext = base.next;
    }
    Ok(false)
}

/// A buffer argument or result.
pub struct Buf {
    pub dtype: c_int,
    pub data: u64,
    pub dims: Vec<usize>,
}

impl Buf {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// The dimensions as `[rows, cols]`: the last one, and the product of the others.
    pub fn rows_cols(&self, what: &str) -> Res<(usize, usize)> {
        match self.dims.split_last() {
            Some((&c, rest)) => Ok((rest.iter().product(), c)),
            None => Err(invalid(format!("{what}: a scalar; expected at least one dimension"))),
        }
    }
}

/// A scalar attribute's value.
#[derive(Clone, Copy, Debug)]
pub enum AttrValue {
    Int(i64),
    Float(f64),
}

/// One decoded call: its buffers, scalar attributes, stream.
pub struct Frame {
    pub api: *const Api,
    pub args: Vec<Buf>,
    pub rets: Vec<Buf>,
    pub attrs: Vec<(String, AttrValue)>,
    ctx: *mut ExecutionContext,
}

/// # Safety
/// `b` is an `XLA_FFI_Buffer` from XLA's call frame.
unsafe fn buffer(b: *const c_void, what: &str) -> Res<Buf> {
    if b.is_null() {
        return Err(invalid(format!("{what}: null buffer")));
    }
    // SAFETY: the caller's contract; the size is checked before the other fields are read.
    let b = unsafe { &*b.cast::<Buffer>() };
    if b.struct_size < BUFFER_SIZE {
        return Err(invalid(format!("{what}: XLA_FFI_Buffer of {} bytes is too small", b.struct_size)));
    }
    let rank = usize::try_from(b.rank).map_err(|_| invalid(format!("{what}: negative rank")))?;
    let dims = if rank == 0 {
        Vec::new()
    } else {
        // SAFETY: `dims` holds `rank` entries (the header's contract).
        unsafe { std::slice::from_raw_parts(b.dims, rank) }
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| invalid(format!("{what}: negative dimension {d}"))))
            .collect::<Res<Vec<_>>>()?
    };
    Ok(Buf { dtype: b.dtype, data: b.data as u64, dims })
}

/// # Safety
/// `a` is the args (or rets) of XLA's call frame.
unsafe fn buffers(a: &Args, kind: c_int, what: &str) -> Res<Vec<Buf>> {
    if a.struct_size < ARGS_SIZE {
        return Err(invalid(format!("XLA_FFI_Args/Rets of {} bytes is too small", a.struct_size)));
    }
    let n = usize::try_from(a.size).map_err(|_| invalid("negative argument count"))?;
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `types` and `args` hold `size` entries.
    let (types, ptrs) = unsafe { (std::slice::from_raw_parts(a.types, n), std::slice::from_raw_parts(a.args, n)) };
    (0..n)
        .map(|i| {
            if types[i] != kind {
                return Err(invalid(format!("{what} {i} is not a buffer (type {})", types[i])));
            }
            // SAFETY: an entry of type BUFFER is an `XLA_FFI_Buffer`.
            unsafe { buffer(ptrs[i], &format!("{what} {i}")) }
        })
        .collect()
}

/// # Safety
/// `a` is the attrs of XLA's call frame.
unsafe fn attributes(a: &Attrs) -> Res<Vec<(String, AttrValue)>> {
    if a.struct_size < ATTRS_SIZE {
        return Err(invalid(format!("XLA_FFI_Attrs of {} bytes is too small", a.struct_size)));
    }
    let n = usize::try_from(a.size).map_err(|_| invalid("negative attribute count"))?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: `types`, `names` and `attrs` hold `size` entries; a name is a byte span.
        let (ty, name, attr) = unsafe { (*a.types.add(i), &**a.names.add(i), *a.attrs.add(i)) };
        let name = if name.len == 0 {
            String::new()
        } else {
            // SAFETY: the span's bytes, alive for the call.
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(name.ptr.cast::<u8>(), name.len) }).into_owned()
        };
        if ty != ATTR_SCALAR {
            return Err(invalid(format!("attribute {name}: only scalar attributes are used (type {ty})")));
        }
        // SAFETY: a scalar attribute is an `XLA_FFI_Scalar` whose value has its dtype.
        let v = unsafe {
            let s = &*attr.cast::<Scalar>();
            match s.dtype {
                DT_PRED => AttrValue::Int(i64::from(*s.value.cast::<u8>())),
                DT_S32 => AttrValue::Int(i64::from(*s.value.cast::<i32>())),
                DT_S64 => AttrValue::Int(*s.value.cast::<i64>()),
                DT_F32 => AttrValue::Float(f64::from(*s.value.cast::<f32>())),
                DT_F64 => AttrValue::Float(*s.value.cast::<f64>()),
                d => return Err(invalid(format!("attribute {name}: unsupported scalar type {d}"))),
            }
        };
        out.push((name, v));
    }
    Ok(out)
}

impl Frame {
    /// Decodes an execute-stage call frame and fetches its stream.
    ///
    /// # Safety
    /// `frame` is the call frame XLA passed to a handler, not a metadata query.
    pub unsafe fn decode(frame: *mut CallFrame) -> Res<Frame> {
        // SAFETY: the caller's contract; every size is checked before the fields it covers.
        let f = unsafe { &*frame };
        if f.struct_size < CALL_FRAME_SIZE {
            return Err(invalid(format!("XLA_FFI_CallFrame of {} bytes is too small", f.struct_size)));
        }
        if f.api.is_null() {
            return Err(invalid("the call frame has no XLA_FFI_Api"));
        }
        // SAFETY: XLA's API table, alive for the process.
        let api = unsafe { &*f.api };
        if api.struct_size < API_SIZE {
            return Err(invalid(format!("XLA_FFI_Api of {} bytes is too small", api.struct_size)));
        }
        if f.stage != STAGE_EXECUTE {
            return Err(Failure {
                code: Code::Unimplemented,
                message: format!("stage {} (only execute)", f.stage),
                xla: 0,
            });
        }
        // SAFETY: the frame's own args, rets and attrs.
        let (args, rets, attrs) = unsafe {
            (buffers(&f.args, ARG_BUFFER, "operand")?, buffers(&f.rets, RET_BUFFER, "result")?, attributes(&f.attrs)?)
        };
        Ok(Frame { api: f.api, ctx: f.ctx, args, rets, attrs })
    }

    /// The call's stream (a `CUstream` on CUDA), asked of XLA.
    pub fn stream(&self) -> Res<*mut c_void> {
        // SAFETY: XLA's API table, whose size `decode` checked to cover the stream getter.
        let get = unsafe { (*self.api).stream_get }.ok_or_else(|| invalid("XLA_FFI_Stream_Get is null"))?;
        let mut sa = StreamGetArgs {
            struct_size: size_of::<StreamGetArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: self.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: XLA's function with its argument struct, of the size the header gives.
        let err = unsafe { get(&mut sa) };
        if !err.is_null() {
            return Err(Failure { code: Code::Internal, message: String::new(), xla: err as usize });
        }
        if sa.stream.is_null() {
            return Err(invalid("XLA gave no stream (the kernels run on CUDA devices only)"));
        }
        Ok(sa.stream)
    }

    pub fn attr(&self, name: &str) -> Option<AttrValue> {
        self.attrs.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }

    pub fn int(&self, name: &str) -> Res<i64> {
        match self.attr(name) {
            Some(AttrValue::Int(v)) => Ok(v),
            Some(AttrValue::Float(_)) => Err(invalid(format!("attribute {name}: expected an integer"))),
            None => Err(invalid(format!("missing attribute {name}"))),
        }
    }

    pub fn float(&self, name: &str) -> Res<f32> {
        match self.attr(name) {
            Some(AttrValue::Float(v)) => Ok(v as f32),
            Some(AttrValue::Int(v)) => Ok(v as f32),
            None => Err(invalid(format!("missing attribute {name}"))),
        }
    }

    /// Exactly `n` operands and `m` results.
    pub fn arity(&self, op: &str, n: usize, m: usize) -> Res<()> {
        if self.args.len() != n || self.rets.len() != m {
            return Err(invalid(format!(
                "{op}: {} operands and {} results; expected {n} and {m}",
                self.args.len(),
                self.rets.len()
            )));
        }
        Ok(())
    }
}

/// An error for XLA: `XLA_FFI_Error_Create` with the message (which XLA copies).
///
/// # Safety
/// `api` is XLA's API table or null.
pub unsafe fn make_error(api: *const Api, f: Failure) -> *mut XlaError {
    if f.xla != 0 {
        return f.xla as *mut XlaError;
    }
    // SAFETY: a non-null API table from XLA.
    let Some(api) = (unsafe { api.as_ref() }) else { return std::ptr::null_mut() };
    if api.struct_size < offset_of!(Api, error_create) + size_of::<usize>() {
        return std::ptr::null_mut();
    }
    let Some(create) = api.error_create else { return std::ptr::null_mut() };
    let msg = CString::new(f.message.replace('\0', " ")).unwrap_or_default();
    let mut args = ErrorCreateArgs {
        struct_size: size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: msg.as_ptr(),
        errc: f.code as c_int,
    };
    // SAFETY: XLA's function; the message lives until it returns (XLA copies it).
    unsafe { create(&mut args) }
}

// The header's layout on 64-bit Linux (x86-64, aarch64), checked when the crate compiles.
const _: () = {
    assert!(size_of::<ExtensionBase>() == 24);
    assert!(API_VERSION_SIZE == 24);
    assert!(METADATA_SIZE == 36);
    assert!(METADATA_EXTENSION_SIZE == 32);
    assert!(BUFFER_SIZE == 48);
    assert!(ARGS_SIZE == 40);
    assert!(ATTRS_SIZE == 48);
    assert!(offset_of!(CallFrame, stage) == 32);
    assert!(offset_of!(CallFrame, args) == 40);
    assert!(offset_of!(CallFrame, rets) == 80);
    assert!(offset_of!(CallFrame, attrs) == 120);
    assert!(CALL_FRAME_SIZE == 168);
    assert!(offset_of!(Api, error_create) == 48);
    assert!(offset_of!(Api, stream_get) == 80);
    assert!(size_of::<ErrorCreateArgs>() == 32);
    assert!(size_of::<StreamGetArgs>() == 32);
};
