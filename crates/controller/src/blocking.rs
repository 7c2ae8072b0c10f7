//! "This thread is about to block": how a connection's reading thread lets
//! the read side go only when it has to.
//!
//! A connection's threads take its socket's read side in turns
//! ([`crate::host::connection`]). The thread holding it (the *leader*) frames
//! a request and runs it to completion itself, then reads the next: on the
//! good path one thread does recv, the request and the reply, with no
//! hand-off between threads (a hand-off is a futex wake-up and a context
//! switch on each side, more than the request's own work). It lets the read
//! side go to a waiting thread only when the request is about to wait for
//! something slow: a device read that misses the page cache, a device
//! sync, NVS space, a track lock, a read-modify-write's old data, the
//! admission gate during a system recovery. Those places call
//! [`about_to_block`]; on any other thread (rcs workers, destage, recovery)
//! it does nothing.
//!
//! The leader registers what letting go means with [`lead`]; the first
//! [`about_to_block`] runs it once and forgets it, and [`leading`] tells the
//! leader afterwards whether it still holds the read side.

use std::cell::RefCell;
use std::sync::Arc;

/// What letting the read side go does (wake the next reader).
pub(crate) type LetGo = Arc<dyn Fn() + Send + Sync>;

thread_local! {
    static LEAD: RefCell<Option<LetGo>> = const { RefCell::new(None) };
}

/// This thread now leads: `let_go` runs at its first [`about_to_block`].
pub(crate) fn lead(let_go: LetGo) {
    LEAD.with(|l| *l.borrow_mut() = Some(let_go));
}

/// Whether this thread still leads (no [`about_to_block`] since [`lead`]).
pub(crate) fn leading() -> bool {
    LEAD.with(|l| l.borrow().is_some())
}

/// Stop leading without running the hand-off (the caller lets go itself).
pub(crate) fn resign() -> Option<LetGo> {
    LEAD.with(|l| l.borrow_mut().take())
}

/// This thread is about to wait for something slow: if it leads a
/// connection's read side, let it go now so that another thread reads on.
#[inline]
pub fn about_to_block() {
    if let Some(let_go) = resign() {
        let_go();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn the_hand_off_runs_once_at_the_first_block_and_only_on_the_leading_thread() {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        about_to_block(); // nothing registered: nothing happens
        lead(Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(leading());
        std::thread::spawn(about_to_block).join().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 0, "another thread's block");
        about_to_block();
        about_to_block();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(!leading());
    }

    #[test]
    fn resigning_forgets_the_hand_off_without_running_it() {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&runs);
        lead(Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(resign().is_some());
        about_to_block();
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert!(!leading());
    }
}
