//! Giving freed memory back to the operating system.
//!
//! glibc's malloc keeps what a burst freed (a Redis pause's backlog, a
//! reload's parser) in per-thread arenas and returns it lazily, only from
//! the top of each heap. A service's RSS then wanders 10–15% above what it
//! holds for minutes after each fault (RELIABILITY.md, the soak), which
//! looks like a leak to whoever watches it. Envoy releases its allocator's
//! free memory on a timer for the same reason; [`release`] does that with
//! `malloc_trim(0)`, which hands back every whole free page of every arena
//! (`madvise(MADV_DONTNEED)`), every [`RELEASE_EVERY`]. It holds each
//! arena's lock for the walk: tens of microseconds on a heap of tens of
//! megabytes. Elsewhere than glibc Linux it does nothing.

use std::time::Duration;

/// How often [`release`] runs in `serve` and `proxy`.
pub const RELEASE_EVERY: Duration = Duration::from_secs(5);

/// Return free heap pages to the operating system (glibc: `malloc_trim`).
pub fn release() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers and is thread-safe (it locks
    // each arena it walks); 0 keeps no padding at the top of the heap.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn release_is_safe_while_other_threads_allocate() {
        let workers: Vec<_> = (0..4)
            .map(|i| {
                std::thread::spawn(move || {
                    for n in 0..2_000 {
                        let v = vec![i as u8; 1 + (n * 37) % 70_000];
                        std::hint::black_box(&v);
                    }
                })
            })
            .collect();
        for _ in 0..50 {
            super::release();
        }
        for w in workers {
            w.join().unwrap();
        }
    }
}
