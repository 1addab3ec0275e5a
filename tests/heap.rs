//! The allocator's counts, alone in a test binary of their own: any other
//! test's allocations, or its reading of the peak (a training run's phases
//! read it), would move them.

use rloo::heap;

#[test]
fn the_peak_keeps_what_was_held_after_it_is_freed_and_starts_again_when_read() {
    heap::take_peak();
    let before = heap::in_use();
    let big = vec![1u8; 64 << 20];
    assert_eq!(heap::in_use(), before + (64 << 20));
    let small = vec![1u8; heap::COUNTED - 1];
    assert_eq!(heap::in_use(), before + (64 << 20), "blocks under COUNTED are not counted");
    drop((big, small));
    assert_eq!(heap::in_use(), before);
    assert!(heap::take_peak() >= before + (64 << 20), "the peak keeps the 64 MiB once they are freed");
    assert!(heap::take_peak() < before + (64 << 20), "and starts again from what is held");
}
