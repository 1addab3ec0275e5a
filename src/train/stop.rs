//! Ctrl-C and SIGTERM during training. The first signal asks the loop to
//! finish its current step, write a checkpoint and exit; a second one ends
//! the process at once. The handler only counts and writes one line, both
//! safe inside a signal handler.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();

/// Exit status of a run stopped by a signal (128 + SIGINT, as shells report Ctrl-C).
pub const EXIT_INTERRUPTED: u8 = 130;

extern "C" fn on_signal(_: libc::c_int) {
    if RECEIVED.fetch_add(1, Ordering::SeqCst) > 0 {
        // Safety: _exit is async-signal-safe.
        unsafe { libc::_exit(EXIT_INTERRUPTED as libc::c_int) };
    }
    let msg = b"\nstopping once the work in progress is saved; signal again to stop at once\n";
    // Safety: write(2) is async-signal-safe; the buffer outlives the call.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Routes SIGINT and SIGTERM to the handler (once per process).
pub fn install() {
    INSTALL.call_once(|| {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // Safety: installs a handler that only touches an atomic and calls
        // async-signal-safe functions. glibc's signal() keeps it installed
        // and restarts interrupted system calls.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
    });
}

/// Whether a stop was asked for since the process started.
pub fn requested() -> bool {
    RECEIVED.load(Ordering::SeqCst) > 0
}
