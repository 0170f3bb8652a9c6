//! NVTX ranges, so Nsight tools can find a captured step and its dispatches.
//!
//! NVTX v3 is a header-only C library. Its functions call through
//! function-pointer slots that start empty; on first use the header loads
//! the profiling tool named by `NVTX_INJECTION64_PATH` (Nsight Systems and
//! Nsight Compute set it in the processes they launch), and calls the tool's
//! `InitializeInjectionNvtx2` export with a function that hands out export
//! tables. Through the callbacks table the tool asks for each module's
//! function table and writes its own implementations into the slots. This
//! file is that loader in Rust: the same ids, struct layouts and tables as
//! the headers of NVIDIA/NVTX (`c/include/nvtx3/nvtxDetail/nvtxTypes.h` for
//! the types and ids, `nvtxImpl.h` for the tables, `nvtxInit.h` for the load
//! sequence, `nvtxImplCore.h` for how calls read the slots), so a tool
//! attaches to Encore as it does to a C program.
//!
//! Without the variable, an installed NVTX v2 library (`libnvToolsExt.so.1`,
//! which toolkits before CUDA 13 ship) is used through its exports when it
//! loads. It runs the same injection loader itself, so this only matters for
//! tools that hook that library directly.
//!
//! Why not the `nvtx` crate: it compiles the NVTX C sources with `cc` and
//! generates its bindings with `bindgen` at build time, so it needs a C
//! compiler and libclang, while Encore builds from Rust alone and loads
//! everything CUDA at run time. The part of the protocol needed for ranges
//! is small and binary-stable (tools attach to programs built with any NVTX
//! v3 header), and `libloading` is already here through cudarc.
//!
//! Everything is best effort: no tool, a library that does not load, a
//! missing entry point or a tool that declines leave every call a no-op;
//! nothing here panics or reports an error. The variable is read here, not
//! in `Config`, because it is the tool's, part of the NVTX protocol, not an
//! Encore setting. Ranges go to the domain "encore" when the tool supports
//! domains, else to the default domain. They are thread ranges: each
//! [`Range`] is closed on the thread that opened it.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString, OsStr};
use std::marker::PhantomData;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

use libloading::Library;

/// The variable through which a tool names its injection library.
#[cfg(target_pointer_width = "64")]
const INJECTION_PATH_VAR: &str = "NVTX_INJECTION64_PATH";
#[cfg(not(target_pointer_width = "64"))]
const INJECTION_PATH_VAR: &str = "NVTX_INJECTION32_PATH";

/// The NVTX v2 library of older CUDA toolkits.
const LEGACY_LIBRARY: &str = "libnvToolsExt.so.1";

/// The domain Encore's ranges belong to.
const DOMAIN_NAME: &CStr = c"encore";

/// `NVTX_VERSION`: the API version reported to tools and set in event attributes.
const NVTX_VERSION: u16 = 3;

/// `NvtxExportTableID` values.
const ETID_CALLBACKS: u32 = 1;
const ETID_VERSIONINFO: u32 = 3;

/// `NvtxCallbackModule` values.
const MODULE_CORE: c_int = 1;
const MODULE_CUDA: c_int = 2;
const MODULE_OPENCL: c_int = 3;
const MODULE_CUDART: c_int = 4;
const MODULE_CORE2: c_int = 5;
const MODULE_SYNC: c_int = 6;

/// `NVTX_CBID_<module>_SIZE`: callback ids per module, the invalid id 0 included.
const CORE_SIZE: usize = 16;
const CUDA_SIZE: usize = 9;
const OPENCL_SIZE: usize = 15;
const CUDART_SIZE: usize = 7;
const CORE2_SIZE: usize = 16;
const SYNC_SIZE: usize = 7;

/// The callback ids (slot indices) Encore calls: `NvtxCallbackIdCore` and
/// `NvtxCallbackIdCore2`.
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;
const CORE2_DOMAIN_RANGE_PUSH_EX: usize = 4;
const CORE2_DOMAIN_RANGE_POP: usize = 5;
const CORE2_DOMAIN_CREATE_A: usize = 12;

/// `NVTX_MESSAGE_TYPE_ASCII`.
const MESSAGE_TYPE_ASCII: i32 = 1;

type RangePushA = unsafe extern "C" fn(*const c_char) -> c_int;
type RangePop = unsafe extern "C" fn() -> c_int;
type DomainCreateA = unsafe extern "C" fn(*const c_char) -> *mut c_void;
type DomainRangePushEx = unsafe extern "C" fn(*mut c_void, *const EventAttributes) -> c_int;
type DomainRangePop = unsafe extern "C" fn(*mut c_void) -> c_int;
/// `NvtxGetExportTableFunc_t`.
type GetExportTable = extern "C" fn(u32) -> *const c_void;
/// `NvtxInitializeInjectionNvtxFunc_t`: the tool's entry point; nonzero on success.
type InitializeInjection = unsafe extern "C" fn(GetExportTable) -> c_int;

/// One function pointer a tool may fill (`NvtxFunctionPointer`); null
/// means the function is a no-op.
type Slot = AtomicPtr<c_void>;

/// The slots of one module, indexed by callback id. Index 0 (the invalid
/// id) and the last one are never handed to a tool.
struct Slots<const L: usize>([Slot; L]);

impl<const L: usize> Slots<L> {
    const fn new() -> Slots<L> {
        Slots([const { AtomicPtr::new(ptr::null_mut()) }; L])
    }

    fn clear(&self) {
        for slot in &self.0 {
            slot.store(ptr::null_mut(), Ordering::Release);
        }
    }
}

/// A module's function table as a tool receives it (`NvtxFunctionTable`):
/// entry `id` points at slot `id`; entry 0 and the entry after the last id
/// are null, so a tool that reads past the end finds null, as in the headers.
struct Table<const L: usize>([*const Slot; L]);

// SAFETY: the entries are written once, in the constant initializer, and
// point at statics; tools write through them into atomics.
unsafe impl<const L: usize> Sync for Table<L> {}

impl<const L: usize> Table<L> {
    const fn of(slots: &'static Slots<L>) -> Table<L> {
        let mut table = [ptr::null::<Slot>(); L];
        let mut id = 1;
        while id + 1 < L {
            table[id] = &slots.0[id];
            id += 1;
        }
        Table(table)
    }
}

static CORE: Slots<{ CORE_SIZE + 1 }> = Slots::new();
static CUDA: Slots<{ CUDA_SIZE + 1 }> = Slots::new();
static OPENCL: Slots<{ OPENCL_SIZE + 1 }> = Slots::new();
static CUDART: Slots<{ CUDART_SIZE + 1 }> = Slots::new();
static CORE2: Slots<{ CORE2_SIZE + 1 }> = Slots::new();
static SYNC: Slots<{ SYNC_SIZE + 1 }> = Slots::new();

static CORE_TABLE: Table<{ CORE_SIZE + 1 }> = Table::of(&CORE);
static CUDA_TABLE: Table<{ CUDA_SIZE + 1 }> = Table::of(&CUDA);
static OPENCL_TABLE: Table<{ OPENCL_SIZE + 1 }> = Table::of(&OPENCL);
static CUDART_TABLE: Table<{ CUDART_SIZE + 1 }> = Table::of(&CUDART);
static CORE2_TABLE: Table<{ CORE2_SIZE + 1 }> = Table::of(&CORE2);
static SYNC_TABLE: Table<{ SYNC_SIZE + 1 }> = Table::of(&SYNC);

/// Empties every slot, as the header does when a tool's init fails.
fn clear_slots() {
    CORE.clear();
    CUDA.clear();
    OPENCL.clear();
    CUDART.clear();
    CORE2.clear();
    SYNC.clear();
}

/// `NvtxExportTableCallbacks`.
#[repr(C)]
struct CallbacksTable {
    struct_size: usize,
    get_module_function_table:
        unsafe extern "C" fn(c_int, *mut *const *const Slot, *mut c_uint) -> c_int,
}

/// `NvtxExportTableVersionInfo`.
#[repr(C)]
struct VersionInfoTable {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: extern "C" fn(u32),
}

static CALLBACKS: CallbacksTable = CallbacksTable {
    struct_size: std::mem::size_of::<CallbacksTable>(),
    get_module_function_table: module_function_table,
};

static VERSION_INFO: VersionInfoTable = VersionInfoTable {
    struct_size: std::mem::size_of::<VersionInfoTable>(),
    version: NVTX_VERSION as u32,
    reserved0: 0,
    set_injection_nvtx_version,
};

/// `nvtxGetExportTable`: what the tool's init function receives.
extern "C" fn export_table(id: u32) -> *const c_void {
    match id {
        ETID_CALLBACKS => (&CALLBACKS as *const CallbacksTable).cast(),
        ETID_VERSIONINFO => (&VERSION_INFO as *const VersionInfoTable).cast(),
        _ => ptr::null(),
    }
}

/// `GetModuleFunctionTable`: hands out a module's table and its size in
/// callback ids; 0 for a module this loader does not know.
///
/// # Safety
///
/// Each output pointer is null or valid for one write.
unsafe extern "C" fn module_function_table(
    module: c_int,
    out_table: *mut *const *const Slot,
    out_size: *mut c_uint,
) -> c_int {
    let (table, size) = match module {
        MODULE_CORE => (CORE_TABLE.0.as_ptr(), CORE_SIZE),
        MODULE_CUDA => (CUDA_TABLE.0.as_ptr(), CUDA_SIZE),
        MODULE_OPENCL => (OPENCL_TABLE.0.as_ptr(), OPENCL_SIZE),
        MODULE_CUDART => (CUDART_TABLE.0.as_ptr(), CUDART_SIZE),
        MODULE_CORE2 => (CORE2_TABLE.0.as_ptr(), CORE2_SIZE),
        MODULE_SYNC => (SYNC_TABLE.0.as_ptr(), SYNC_SIZE),
        _ => return 0,
    };
    if !out_size.is_null() {
        // SAFETY: the caller passes a valid or null pointer; it is not null.
        unsafe { *out_size = size as c_uint };
    }
    if !out_table.is_null() {
        // SAFETY: as above.
        unsafe { *out_table = table };
    }
    1
}

/// `SetInjectionNvtxVersion`: reserved; the headers ignore it too.
extern "C" fn set_injection_nvtx_version(_version: u32) {}

/// `nvtxEventAttributes_t` (version 2 of the struct, NVTX v3).
#[repr(C)]
struct EventAttributes {
    version: u16,
    size: u16,
    category: u32,
    color_type: i32,
    color: u32,
    payload_type: i32,
    reserved0: i32,
    payload: u64,
    message_type: i32,
    message: *const c_char,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<EventAttributes>() == 48);

impl EventAttributes {
    /// Attributes carrying only a message; every other field is unset (0).
    fn message(message: &CStr) -> EventAttributes {
        EventAttributes {
            version: NVTX_VERSION,
            size: std::mem::size_of::<EventAttributes>() as u16,
            category: 0,
            color_type: 0,
            color: 0,
            payload_type: 0,
            reserved0: 0,
            payload: 0,
            message_type: MESSAGE_TYPE_ASCII,
            message: message.as_ptr(),
        }
    }
}

/// Reads a slot as a function pointer of type `F`; `None` when empty.
///
/// # Safety
///
/// `F` must be the function pointer type NVTX defines for the slot.
unsafe fn read_slot<F: Copy>(slot: &Slot) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    let pointer = slot.load(Ordering::Acquire);
    // SAFETY: a non-null slot holds a function of type `F` (caller's
    // contract), and `F` is pointer-sized.
    (!pointer.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&pointer) })
}

/// The NVTX functions of a tool or library; `None` where it has none.
#[derive(Clone, Copy)]
struct Functions {
    range_push_a: Option<RangePushA>,
    range_pop: Option<RangePop>,
    domain_create_a: Option<DomainCreateA>,
    domain_range_push_ex: Option<DomainRangePushEx>,
    domain_range_pop: Option<DomainRangePop>,
}

impl Functions {
    /// What an injected tool has written into the slots.
    fn from_slots() -> Functions {
        // SAFETY: each slot is read as the type the headers give its callback id.
        unsafe {
            Functions {
                range_push_a: read_slot(&CORE.0[CORE_RANGE_PUSH_A]),
                range_pop: read_slot(&CORE.0[CORE_RANGE_POP]),
                domain_create_a: read_slot(&CORE2.0[CORE2_DOMAIN_CREATE_A]),
                domain_range_push_ex: read_slot(&CORE2.0[CORE2_DOMAIN_RANGE_PUSH_EX]),
                domain_range_pop: read_slot(&CORE2.0[CORE2_DOMAIN_RANGE_POP]),
            }
        }
    }

    /// The exports of an NVTX v2 library; `None` without the two range functions.
    fn from_library(library: &Library) -> Option<Functions> {
        // SAFETY: each symbol is looked up by its NVTX name and given the
        // type nvToolsExt.h declares for it.
        unsafe {
            Some(Functions {
                range_push_a: Some(symbol(library, b"nvtxRangePushA\0")?),
                range_pop: Some(symbol(library, b"nvtxRangePop\0")?),
                domain_create_a: symbol(library, b"nvtxDomainCreateA\0"),
                domain_range_push_ex: symbol(library, b"nvtxDomainRangePushEx\0"),
                domain_range_pop: symbol(library, b"nvtxDomainRangePop\0"),
            })
        }
    }
}

/// The function `name` (NUL-terminated) exported by `library`; `None` when
/// it is missing or its address is null.
///
/// # Safety
///
/// `F` must be the function pointer type of the symbol.
unsafe fn symbol<F: Copy>(library: &Library, name: &[u8]) -> Option<F> {
    const { assert!(std::mem::size_of::<Option<F>>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: reads the symbol as `Option<F>`, a nullable function pointer
    // (caller's contract), so a null address reads as `None`.
    unsafe { library.get::<Option<F>>(name) }
        .ok()
        .and_then(|found| *found)
}

/// A domain handle (`nvtxDomainHandle_t`); null is the default domain.
struct Domain(*mut c_void);

// SAFETY: domain handles are process-wide; NVTX functions accept them from
// any thread.
unsafe impl Send for Domain {}
// SAFETY: as above.
unsafe impl Sync for Domain {}

/// An attached tool or loaded NVTX library.
struct Nvtx {
    /// Kept loaded for the rest of the process: the slots point into it.
    _library: Option<Library>,
    /// A library's exports; `None` for an injected tool, whose slots are
    /// read at each call, as the header's functions do.
    exports: Option<Functions>,
    domain: Domain,
}

impl Nvtx {
    /// Loads the tool at `path` and lets it attach; `None` when it does not
    /// load, lacks `InitializeInjectionNvtx2` or declines.
    fn inject(path: &OsStr) -> Option<Nvtx> {
        // SAFETY: loading runs the library's initializers; the library is
        // the injection a profiler named for this process, built to be
        // loaded into it.
        let library = unsafe { Library::new(path) }.ok()?;
        // SAFETY: NVTX defines the export's type as
        // `NvtxInitializeInjectionNvtxFunc_t`.
        let init: InitializeInjection = unsafe { symbol(&library, b"InitializeInjectionNvtx2\0") }?;
        Nvtx::attach(init, Some(library))
    }

    /// Calls a tool's entry point with the export tables. A tool that
    /// returns 0 declined: the slots are emptied again and its library
    /// unloaded.
    fn attach(init: InitializeInjection, library: Option<Library>) -> Option<Nvtx> {
        // SAFETY: `init` follows `NvtxInitializeInjectionNvtxFunc_t`; the
        // export tables it reaches through `export_table` are statics.
        if unsafe { init(export_table) } == 0 {
            clear_slots();
            return None;
        }
        Some(Nvtx::with_domain(library, None))
    }

    /// Uses an NVTX v2 library's exports; `None` when it does not load.
    fn legacy(name: &str) -> Option<Nvtx> {
        // SAFETY: loading runs the library's initializers; it is NVIDIA's
        // NVTX library, which expects to be loaded into CUDA programs.
        let library = unsafe { Library::new(name) }.ok()?;
        let exports = Functions::from_library(&library)?;
        Some(Nvtx::with_domain(Some(library), Some(exports)))
    }

    /// Creates the "encore" domain when the tool can push and pop ranges in it.
    fn with_domain(library: Option<Library>, exports: Option<Functions>) -> Nvtx {
        let functions = exports.unwrap_or_else(Functions::from_slots);
        let domain = match functions {
            Functions {
                domain_create_a: Some(create),
                domain_range_push_ex: Some(_),
                domain_range_pop: Some(_),
                ..
            } => {
                // SAFETY: creates a domain named by a NUL-terminated string;
                // the tool copies the name.
                unsafe { create(DOMAIN_NAME.as_ptr()) }
            }
            _ => ptr::null_mut(),
        };
        Nvtx {
            _library: library,
            exports,
            domain: Domain(domain),
        }
    }

    fn functions(&self) -> Functions {
        self.exports.unwrap_or_else(Functions::from_slots)
    }

    fn push(&self, message: &CStr) {
        let functions = self.functions();
        if !self.domain.0.is_null() {
            if let Some(push) = functions.domain_range_push_ex {
                let attributes = EventAttributes::message(message);
                // SAFETY: the domain came from this tool; the attributes and
                // the message outlive the call, and the tool copies them.
                unsafe { push(self.domain.0, &attributes) };
                return;
            }
        }
        if let Some(push) = functions.range_push_a {
            // SAFETY: a NUL-terminated message that outlives the call.
            unsafe { push(message.as_ptr()) };
        }
    }

    fn pop(&self) {
        let functions = self.functions();
        if !self.domain.0.is_null() {
            if let Some(pop) = functions.domain_range_pop {
                // SAFETY: the domain came from this tool.
                unsafe { pop(self.domain.0) };
                return;
            }
        }
        if let Some(pop) = functions.range_pop {
            // SAFETY: no arguments; closes this thread's innermost range.
            unsafe { pop() };
        }
    }
}

static NVTX: OnceLock<Option<Nvtx>> = OnceLock::new();

/// The process's tool, loaded on first use.
fn nvtx() -> Option<&'static Nvtx> {
    NVTX.get_or_init(|| match std::env::var_os(INJECTION_PATH_VAR) {
        Some(path) => Nvtx::inject(&path),
        None => Nvtx::legacy(LEGACY_LIBRARY),
    })
    .as_ref()
}

/// Loads the tool now, if there is one, rather than at the first range.
pub(super) fn initialize() {
    nvtx();
}

/// Whether a tool or library receives ranges; without one every call is a no-op.
pub(super) fn enabled() -> bool {
    nvtx().is_some()
}

/// `name` as a C string; interior NULs, which C cannot carry, are dropped.
fn c_string(name: &str) -> CString {
    CString::new(name).unwrap_or_else(|e| {
        let mut bytes = e.into_vec();
        bytes.retain(|&b| b != 0);
        CString::new(bytes).unwrap_or_default()
    })
}

/// Opens a thread range named `name` (`nvtxDomainRangePushEx`, or
/// `nvtxRangePushA` without domains). Close it with [`range_pop`] on the
/// same thread.
pub(super) fn range_push(name: &str) {
    if let Some(nvtx) = nvtx() {
        nvtx.push(&c_string(name));
    }
}

/// Closes this thread's innermost range opened by [`range_push`].
pub(super) fn range_pop() {
    if let Some(nvtx) = nvtx() {
        nvtx.pop();
    }
}

/// A thread range, open until dropped. Not `Send`: NVTX nests ranges per
/// thread, so it is closed on the thread that opened it.
pub(super) struct Range {
    _thread_bound: PhantomData<*const ()>,
}

impl Range {
    pub(super) fn push(name: &str) -> Range {
        range_push(name);
        Range {
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        range_pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn ranges_without_a_tool_are_safe_no_ops() {
        initialize();
        range_push("encore graph replay 1");
        {
            let _dispatch = Range::push("matmul\0 attn_q");
        }
        range_pop();
        if !enabled() {
            // Unbalanced pops reach no tool.
            range_pop();
        }
    }

    #[test]
    fn a_missing_or_foreign_library_leaves_nvtx_off() {
        assert!(Nvtx::inject(OsStr::new("/nonexistent/libNvtxInjection64.so")).is_none());
        assert!(Nvtx::inject(OsStr::new("")).is_none());
        assert!(Nvtx::legacy("libencore-no-such-nvtx.so.1").is_none());
        // Libraries that load but are no NVTX tool or library.
        #[cfg(target_os = "linux")]
        {
            assert!(Nvtx::inject(OsStr::new("libc.so.6")).is_none());
            assert!(Nvtx::legacy("libc.so.6").is_none());
        }
    }

    #[test]
    fn interior_nuls_are_dropped() {
        assert_eq!(c_string("matmul attn_q").as_bytes(), b"matmul attn_q");
        assert_eq!(c_string("a\0b").as_bytes(), b"ab");
    }

    /// A module's table, as a tool gets it through the callbacks table.
    fn module_table(module: c_int) -> Option<(*const *const Slot, usize)> {
        // SAFETY: the export table is a static `CallbacksTable`.
        let callbacks = unsafe { &*export_table(ETID_CALLBACKS).cast::<CallbacksTable>() };
        let (mut table, mut size) = (ptr::null(), 0);
        // SAFETY: both outputs are valid for a write.
        let found = unsafe { (callbacks.get_module_function_table)(module, &mut table, &mut size) };
        (found == 1).then_some((table, size as usize))
    }

    #[test]
    fn export_tables_follow_the_headers() {
        // SAFETY: the ids name the static tables of these types.
        let (callbacks, version) = unsafe {
            (
                &*export_table(ETID_CALLBACKS).cast::<CallbacksTable>(),
                &*export_table(ETID_VERSIONINFO).cast::<VersionInfoTable>(),
            )
        };
        assert_eq!(callbacks.struct_size, 16);
        assert_eq!((version.struct_size, version.version), (24, 3));
        (version.set_injection_nvtx_version)(3);
        assert!(export_table(0).is_null() && export_table(2).is_null());

        let slots: [(c_int, usize, &[Slot]); 6] = [
            (MODULE_CORE, 16, &CORE.0),
            (MODULE_CUDA, 9, &CUDA.0),
            (MODULE_OPENCL, 15, &OPENCL.0),
            (MODULE_CUDART, 7, &CUDART.0),
            (MODULE_CORE2, 16, &CORE2.0),
            (MODULE_SYNC, 7, &SYNC.0),
        ];
        for (module, expected, slots) in slots {
            let (table, size) = module_table(module).unwrap();
            assert_eq!(size, expected, "module {module}");
            // SAFETY: the table has `size + 1` entries.
            let entries = unsafe { std::slice::from_raw_parts(table, size + 1) };
            assert!(entries[0].is_null() && entries[size].is_null());
            for id in 1..size {
                assert!(ptr::eq(entries[id], &slots[id]), "module {module} id {id}");
            }
        }
        assert!(module_table(0).is_none() && module_table(7).is_none());
        // A tool may ask for the size alone.
        let mut size = 0;
        // SAFETY: a null table pointer is allowed; `size` is valid for a write.
        let found = unsafe {
            (callbacks.get_module_function_table)(MODULE_CORE, ptr::null_mut(), &mut size)
        };
        assert_eq!((found, size), (1, 16));
    }

    /// What the fake tools below recorded.
    static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());
    /// The handle the fake tool gives the domain it creates.
    const FAKE_DOMAIN: usize = 0x5eed;

    fn log(entry: String) {
        LOG.lock().unwrap().push(entry);
    }

    fn take_log() -> Vec<String> {
        std::mem::take(&mut *LOG.lock().unwrap())
    }

    unsafe extern "C" fn fake_push_a(message: *const c_char) -> c_int {
        log(format!(
            "push {}",
            CStr::from_ptr(message).to_string_lossy()
        ));
        0
    }

    unsafe extern "C" fn fake_pop() -> c_int {
        log("pop".into());
        0
    }

    unsafe extern "C" fn fake_domain_create(name: *const c_char) -> *mut c_void {
        log(format!("domain {}", CStr::from_ptr(name).to_string_lossy()));
        FAKE_DOMAIN as *mut c_void
    }

    unsafe extern "C" fn fake_domain_push(
        domain: *mut c_void,
        attributes: *const EventAttributes,
    ) -> c_int {
        let a = &*attributes;
        log(format!(
            "domain {:#x} push {} (version {}, size {}, message type {})",
            domain as usize,
            CStr::from_ptr(a.message).to_string_lossy(),
            a.version,
            a.size,
            a.message_type
        ));
        0
    }

    unsafe extern "C" fn fake_domain_pop(domain: *mut c_void) -> c_int {
        log(format!("domain {:#x} pop", domain as usize));
        0
    }

    /// Does what a tool's `InitializeInjectionNvtx2` does: takes the
    /// callbacks table from `get`, asks it for module tables and writes its
    /// functions through them.
    unsafe fn fill_slots(get: GetExportTable, with_domains: bool) {
        let callbacks = &*get(ETID_CALLBACKS).cast::<CallbacksTable>();
        let fill = |module, entries: &[(usize, *mut c_void)]| {
            let (mut table, mut size) = (ptr::null(), 0);
            if (callbacks.get_module_function_table)(module, &mut table, &mut size) == 1 {
                for &(id, function) in entries {
                    if id < size as usize {
                        (**table.add(id)).store(function, Ordering::Release);
                    }
                }
            }
        };
        fill(
            MODULE_CORE,
            &[
                (CORE_RANGE_PUSH_A, fake_push_a as *mut c_void),
                (CORE_RANGE_POP, fake_pop as *mut c_void),
            ],
        );
        if with_domains {
            fill(
                MODULE_CORE2,
                &[
                    (CORE2_DOMAIN_CREATE_A, fake_domain_create as *mut c_void),
                    (CORE2_DOMAIN_RANGE_PUSH_EX, fake_domain_push as *mut c_void),
                    (CORE2_DOMAIN_RANGE_POP, fake_domain_pop as *mut c_void),
                ],
            );
        }
    }

    unsafe extern "C" fn declining_tool(get: GetExportTable) -> c_int {
        fill_slots(get, true);
        0
    }

    unsafe extern "C" fn tool_without_domains(get: GetExportTable) -> c_int {
        fill_slots(get, false);
        1
    }

    unsafe extern "C" fn tool_with_domains(get: GetExportTable) -> c_int {
        fill_slots(get, true);
        1
    }

    /// The injection protocol end to end, with tools linked into the test
    /// instead of loaded from a file. One test, because tools share the
    /// process's slots.
    #[test]
    fn an_injected_tool_receives_ranges_through_the_slots() {
        assert!(Nvtx::attach(declining_tool, None).is_none());
        let empty = Functions::from_slots();
        assert!(empty.range_push_a.is_none() && empty.domain_range_push_ex.is_none());

        let plain = Nvtx::attach(tool_without_domains, None).unwrap();
        assert!(plain.domain.0.is_null());
        plain.push(c"encore graph replay 3");
        plain.pop();
        assert_eq!(take_log(), ["push encore graph replay 3", "pop"]);

        let tool = Nvtx::attach(tool_with_domains, None).unwrap();
        tool.push(c"matmul attn_q");
        tool.pop();
        assert_eq!(
            take_log(),
            [
                "domain encore",
                "domain 0x5eed push matmul attn_q (version 3, size 48, message type 1)",
                "domain 0x5eed pop"
            ]
        );
        clear_slots();
    }
}
