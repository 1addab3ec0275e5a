//! The process's allocator, counting the bytes it holds in blocks of
//! [`COUNTED`] bytes or more, so that a run on the CPU reads its peak memory
//! per phase of a step the way a GPU run reads its allocation pool's
//! high-water mark (tensors on the CPU are heap vectors). Resident memory
//! (`getrusage`) gives one peak for the whole process, allocator slack and
//! code included; this gives what the program held, when it held it.
//! Smaller blocks (an op's shapes and strides, strings) are left out: they
//! are most of the allocations and almost none of the bytes, and counting
//! them cost a decoding loop several percent.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The system allocator, with the bytes it hands out counted.
pub struct Counting;

/// The smallest block counted.
pub const COUNTED: usize = 16 << 10;

static IN_USE: AtomicU64 = AtomicU64::new(0);
static HIGH: AtomicU64 = AtomicU64::new(0);

fn grew(bytes: usize) {
    if bytes < COUNTED {
        return;
    }
    let now = IN_USE.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    // A read first: most allocations do not raise the mark, and a read
    // leaves the shared line shared between threads.
    if now > HIGH.load(Relaxed) {
        HIGH.fetch_max(now, Relaxed);
    }
}

fn shrank(bytes: usize) {
    if bytes < COUNTED {
        return;
    }
    IN_USE.fetch_sub(bytes as u64, Relaxed);
}

// Safety: every call is the system allocator's, with the same layout; the
// counters are only read.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

/// Bytes the program holds now (in counted blocks).
pub fn in_use() -> u64 {
    IN_USE.load(Relaxed)
}

/// The most bytes held at once since the last call (or the start), the
/// mark then starting again from what is held now.
pub fn take_peak() -> u64 {
    HIGH.swap(in_use(), Relaxed).max(in_use())
}
