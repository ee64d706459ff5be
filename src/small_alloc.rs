//! The wasm build's allocator: small blocks are kept on free lists by size
//! class and handed out again, in front of wasi-libc's dlmalloc, which
//! gets everything else. A request's work is mostly small, short-lived
//! allocations (keys, header values, a reply's items); through dlmalloc
//! each one's malloc and free cost about a fifth of an admitted request's
//! instructions in the filter (envoy/cost_gate, measured in
//! docs/src/performance/cost-gate.md). A list's pop or push is a few
//! instructions.
//!
//! Memory: a freed small block stays in its class's list, up to
//! [`KEEP`] blocks a class; past that it goes back to dlmalloc. So at most
//! KEEP x (16 + 32 + ... + 256) bytes (2.2 MiB) sit in the lists, whatever
//! the traffic, and a block in a list is reused by the next allocation of
//! its class. The wasm VM runs one thread (a proxy-wasm VM is one worker's):
//! the lists need no lock.
//!
//! Why our own and not a crate: the maintained wasm allocator tried, talc
//! 4.4.3 (`TalckWasm`) in place of dlmalloc, cost more than dlmalloc itself:
//! cost gate (f) 57,240 fuel a request against dlmalloc's 53,076 and these
//! lists' 42,752 (every scenario +9 to +47% over these lists; 2026-12-08,
//! on 0f59280). wee_alloc is unmaintained. What is here is only a cache of
//! freed blocks in front of dlmalloc, which still does all the real work.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

/// Classes are multiples of this many bytes, up to [`CLASSES`] of them.
const STEP: usize = 16;
const CLASSES: usize = 16;
/// Blocks kept per class before they go back to dlmalloc.
const KEEP: u32 = 1024;
/// The alignment every class block has (dlmalloc's own minimum on wasm32,
/// so its plain malloc path serves them; larger alignments go to it).
const ALIGN: usize = 8;

struct Lists {
    /// Each class's first free block; a free block's first word points to
    /// the next.
    heads: [*mut u8; CLASSES],
    counts: [u32; CLASSES],
}

pub struct Classes(UnsafeCell<Lists>);

// One thread: a proxy-wasm VM (and this wasm32-wasip1 build) has no others.
unsafe impl Sync for Classes {}

impl Classes {
    pub const fn new() -> Classes {
        Classes(UnsafeCell::new(Lists {
            heads: [ptr::null_mut(); CLASSES],
            counts: [0; CLASSES],
        }))
    }
}

impl Default for Classes {
    fn default() -> Classes {
        Classes::new()
    }
}

/// The class of a layout this allocator keeps, if it keeps it.
fn class(layout: &Layout) -> Option<usize> {
    if layout.align() > ALIGN || layout.size() > STEP * CLASSES {
        return None;
    }
    // size 0 is class 0 like 1 to 16: a block is never smaller than a word.
    Some(layout.size().saturating_sub(1) / STEP)
}

/// The layout dlmalloc gives and takes a class's blocks with.
fn block(class: usize) -> Layout {
    // (class + 1) * 16 <= 256 with ALIGN 8: always a valid layout.
    unsafe { Layout::from_size_align_unchecked((class + 1) * STEP, ALIGN) }
}

unsafe impl GlobalAlloc for Classes {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class(&layout) else {
            return System.alloc(layout);
        };
        let lists = &mut *self.0.get();
        let head = lists.heads[c];
        if head.is_null() {
            return System.alloc(block(c));
        }
        lists.heads[c] = *(head as *mut *mut u8);
        lists.counts[c] -= 1;
        head
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        let Some(c) = class(&layout) else {
            return System.dealloc(p, layout);
        };
        let lists = &mut *self.0.get();
        if lists.counts[c] >= KEEP {
            return System.dealloc(p, block(c));
        }
        *(p as *mut *mut u8) = lists.heads[c];
        lists.heads[c] = p;
        lists.counts[c] += 1;
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = Layout::from_size_align_unchecked(new_size, layout.align());
        match (class(&layout), class(&new)) {
            // Both large: dlmalloc may grow the block in place.
            (None, None) => System.realloc(p, layout, new_size),
            (Some(a), Some(b)) if a == b => p,
            _ => {
                let q = self.alloc(new);
                if !q.is_null() {
                    ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                    self.dealloc(p, layout);
                }
                q
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize) -> Layout {
        Layout::from_size_align(size, 1).unwrap()
    }

    #[test]
    fn a_freed_small_block_is_the_next_one_of_its_class_and_only_of_its_class() {
        let a = Classes::new();
        unsafe {
            let p = a.alloc(layout(20));
            a.dealloc(p, layout(20));
            // 17 to 32 bytes: the same class gets the same block back.
            assert_eq!(a.alloc(layout(32)), p);
            // Another class does not.
            let q = a.alloc(layout(33));
            assert_ne!(q, p);
            a.dealloc(p, layout(32));
            a.dealloc(q, layout(33));
            assert_eq!((*a.0.get()).counts[1], 1);
            assert_eq!((*a.0.get()).counts[2], 1);
        }
    }

    #[test]
    fn a_class_keeps_at_most_keep_blocks_and_returns_the_rest() {
        let a = Classes::new();
        let n = KEEP as usize + 10;
        unsafe {
            let blocks: Vec<*mut u8> = (0..n).map(|_| a.alloc(layout(100))).collect();
            for p in &blocks {
                a.dealloc(*p, layout(100));
            }
            assert_eq!((*a.0.get()).counts[6], KEEP);
            // The kept ones come back last freed first, each once.
            let again: Vec<*mut u8> = (0..KEEP).map(|_| a.alloc(layout(100))).collect();
            let mut distinct = again.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), KEEP as usize);
            assert_eq!((*a.0.get()).counts[6], 0);
            for p in again {
                a.dealloc(p, layout(100));
            }
        }
    }

    #[test]
    fn large_and_over_aligned_blocks_are_dlmallocs_and_never_kept() {
        let a = Classes::new();
        unsafe {
            let big = a.alloc(layout(257));
            a.dealloc(big, layout(257));
            let wide = Layout::from_size_align(64, 16).unwrap();
            let p = a.alloc(wide);
            assert_eq!(p as usize % 16, 0);
            a.dealloc(p, wide);
            assert!((*a.0.get()).counts.iter().all(|c| *c == 0));
        }
    }

    #[test]
    fn realloc_keeps_the_contents_across_classes_and_into_dlmalloc() {
        let a = Classes::new();
        unsafe {
            let mut p = a.alloc(layout(10));
            for i in 0..10 {
                *p.add(i) = i as u8;
            }
            // Same class: the block itself.
            assert_eq!(a.realloc(p, layout(10), 16), p);
            let mut size = 16;
            for new in [40, 250, 300, 5000, 200, 12] {
                p = a.realloc(p, layout(size), new);
                size = new;
                for i in 0..10 {
                    assert_eq!(*p.add(i), i as u8, "after a realloc to {new}");
                }
            }
            a.dealloc(p, layout(size));
        }
    }
}
