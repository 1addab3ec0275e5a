//! The process's allocator, counting the bytes it holds in blocks of
//! [`COUNTED`] bytes or more, so that a run on the CPU reads its peak memory
//! per phase of a step the way a GPU run reads its allocation pool's
//! high-water mark (tensors on the CPU are heap vectors). Resident memory
//! (`getrusage`) gives one peak for the whole process, allocator slack and
//! code included; this gives what the program held, when it held it.
//! Smaller blocks (an op's shapes and strides, strings) are left out: they
//! are most of the allocations and almost none of the bytes, and counting
//! them cost a decoding loop several percent.
//!
//! It also keeps freed blocks of [`KEPT_FROM`] bytes or more for the next
//! allocation of the same size. The work runs on rayon's threads, whose
//! glibc arenas are heaps of 64 MiB: a larger block (a chunk of logits over
//! a large vocabulary) was mmapped and unmapped every time, whatever
//! `M_MMAP_THRESHOLD` says, so each step faulted its pages in again (43%
//! of a CPU step in bf16 at Qwen3's vocabulary of 151,936 words). One
//! arena for all threads would do as well, at the cost of every thread's
//! small allocations taking one lock. What is kept and what is held
//! together stay within the most ever held, so keeping never raises the
//! peak.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// The system allocator, with the bytes it hands out counted.
pub struct Counting;

/// The smallest block counted.
pub const COUNTED: usize = 16 << 10;

static IN_USE: AtomicU64 = AtomicU64::new(0);
static HIGH: AtomicU64 = AtomicU64::new(0);
/// The most ever held (never started again): what kept blocks may fill.
static MOST: AtomicU64 = AtomicU64::new(0);

fn grew(bytes: usize) {
    if bytes < COUNTED {
        return;
    }
    let now = IN_USE.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    // A read first: most allocations do not raise the mark, and a read
    // leaves the shared line shared between threads.
    if now > HIGH.load(Relaxed) {
        HIGH.fetch_max(now, Relaxed);
        MOST.fetch_max(now, Relaxed);
    }
}

fn shrank(bytes: usize) {
    if bytes < COUNTED {
        return;
    }
    IN_USE.fetch_sub(bytes as u64, Relaxed);
}

/// The smallest freed block kept for reuse: glibc's largest mmap threshold,
/// past which its own heaps may not keep a block.
pub const KEPT_FROM: usize = 32 << 20;
const KEPT_SLOTS: usize = 16;

/// A freed block that the system allocator handed out with `layout`.
#[derive(Clone, Copy)]
struct Block {
    ptr: usize,
    layout: Layout,
}

/// Freed large blocks, oldest first; taking one is taking the lock, which
/// only allocations of [`KEPT_FROM`] bytes or more do.
struct Kept {
    blocks: [Option<Block>; KEPT_SLOTS],
    len: usize,
    bytes: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept { blocks: [None; KEPT_SLOTS], len: 0, bytes: 0 });

impl Kept {
    /// The newest kept block of exactly `layout`, taken out.
    fn take(&mut self, layout: Layout) -> Option<*mut u8> {
        let at = (0..self.len).rev().find(|&i| self.blocks[i].is_some_and(|b| b.layout == layout))?;
        let block = self.remove(at);
        Some(block.ptr as *mut u8)
    }

    /// Keeps `block` (no longer counted as held), handing the oldest back
    /// to the system while the slots would overflow or the kept and held
    /// bytes pass the most ever held; `block` too, if it alone would.
    ///
    /// Safety: `block` was allocated by `System` with its layout and is
    /// no longer used.
    unsafe fn keep(&mut self, block: Block) {
        let size = block.layout.size();
        unsafe { self.make_room(size, KEPT_SLOTS - 1) };
        if self.fits(size) {
            self.blocks[self.len] = Some(block);
            self.len += 1;
            self.bytes += size;
        } else {
            unsafe { System.dealloc(block.ptr as *mut u8, block.layout) };
        }
    }

    /// Hands the oldest kept blocks back to the system until at most
    /// `slots` are kept and `size` more bytes fit beside them.
    unsafe fn make_room(&mut self, size: usize, slots: usize) {
        while self.len > 0 && (self.len > slots || !self.fits(size)) {
            let old = self.remove(0);
            unsafe { System.dealloc(old.ptr as *mut u8, old.layout) };
        }
    }

    /// Whether `size` more bytes, beside those held and kept, stay within
    /// the most ever held.
    fn fits(&self, size: usize) -> bool {
        IN_USE.load(Relaxed) + (self.bytes + size) as u64 <= MOST.load(Relaxed)
    }

    fn remove(&mut self, at: usize) -> Block {
        let block = self.blocks[at].take().expect("a kept block");
        self.blocks.copy_within(at + 1..self.len, at);
        self.len -= 1;
        self.blocks[self.len] = None;
        self.bytes -= block.layout.size();
        block
    }
}

/// A block of [`KEPT_FROM`] bytes or more: a kept one of exactly `layout`
/// (zeroed if asked), else a new one, for which kept blocks are handed back
/// first as far as it would pass the most ever held.
unsafe fn large(layout: Layout, zeroed: bool) -> *mut u8 {
    let mut kept = kept();
    if let Some(p) = kept.take(layout) {
        if zeroed {
            // Zeros over resident pages cost less than faulting in fresh ones.
            unsafe { p.write_bytes(0, layout.size()) };
        }
        return p;
    }
    unsafe { kept.make_room(layout.size(), KEPT_SLOTS) };
    drop(kept);
    match zeroed {
        true => unsafe { System.alloc_zeroed(layout) },
        false => unsafe { System.alloc(layout) },
    }
}

fn kept() -> std::sync::MutexGuard<'static, Kept> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes of freed blocks kept for reuse now.
pub fn kept_bytes() -> u64 {
    kept().bytes as u64
}

/// The most bytes held at once since the start.
pub fn most_held() -> u64 {
    MOST.load(Relaxed)
}

// Safety: every block comes from the system allocator with the layout it
// is freed with (a kept block is reused only for exactly its layout); the
// counters are only read.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = match layout.size() >= KEPT_FROM {
            true => unsafe { large(layout, false) },
            false => unsafe { System.alloc(layout) },
        };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = match layout.size() >= KEPT_FROM {
            true => unsafe { large(layout, true) },
            false => unsafe { System.alloc_zeroed(layout) },
        };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrank(layout.size());
        match layout.size() >= KEPT_FROM {
            true => unsafe { kept().keep(Block { ptr: ptr as usize, layout }) },
            false => unsafe { System.dealloc(ptr, layout) },
        }
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
