//! Group commit of device syncs, with `fdatasync`'s error semantics kept.
//!
//! A destage frees a track's NVS record only once a sync *that started
//! after its device write* succeeded (the record is the only other copy:
//! freeing it earlier is PostgreSQL's "fsyncgate", where a failed writeback
//! is reported once and the next sync succeeds with the data gone). Many
//! destage tasks and FLUSHes ask for such a sync at once; [`SyncGate`] runs
//! one at a time and lets every caller that arrived before a sync started
//! share it (group commit), so the number of `fdatasync` calls follows the
//! device, not the request rate.
//!
//! Syncs are numbered in the order they start. A caller is covered by the
//! first sync that starts after it calls. Linux reports a writeback error
//! to the first sync of the file that follows it, so a sync that overlapped
//! the caller's write may have consumed that write's error: the caller
//! takes a [`SyncGate::ticket`] before writing (the first sync that may
//! overlap the write), and its answer is an error if any sync from its
//! ticket to the one covering it failed. A spurious error only makes the
//! destage write the track again.

use std::collections::VecDeque;
use std::io;

use parking_lot::{Condvar, Mutex};

/// Failed syncs remembered (a caller looks back to its ticket, taken just
/// before its write).
const FAILURES_KEPT: usize = 1024;

#[derive(Debug, Default)]
struct State {
    /// The number the next sync to start gets.
    next: u64,
    /// Whether a sync runs now.
    running: bool,
    /// Every sync numbered below this has completed.
    completed: u64,
    /// Recent failed syncs: number, error kind, message.
    failed: VecDeque<(u64, io::ErrorKind, String)>,
    /// The newest failed sync dropped from `failed` (more than
    /// [`FAILURES_KEPT`] failed since): a caller looking back to it or
    /// before cannot tell whether its syncs failed, and is answered an
    /// error.
    forgotten: Option<u64>,
}

/// Serialises syncs and shares each among the callers it covers.
#[derive(Debug, Default)]
pub struct SyncGate {
    state: Mutex<State>,
    done: Condvar,
}

impl SyncGate {
    /// Take before a device write: the first sync that may overlap it.
    pub fn ticket(&self) -> u64 {
        let st = self.state.lock();
        if st.running { st.next - 1 } else { st.next }
    }

    /// Wait for a sync that started after this call (running `sync` if
    /// none is running); an error if it, or any sync since `ticket` (taken
    /// before the write it must cover), failed: such a sync may have
    /// consumed the write's error.
    pub fn sync(&self, ticket: u64, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        self.sync_from(None, ticket, sync)
    }

    /// A mark for [`SyncGate::sync_after`]: the number the next sync to
    /// start gets.
    pub fn mark(&self) -> u64 {
        self.state.lock().next
    }

    /// Wait for a sync that started after `mark` was taken
    /// ([`SyncGate::mark`]), running one only if none has: a FLUSH whose
    /// own destage writes were synced after it arrived needs no second
    /// sync. An error if any sync since `mark` failed.
    pub fn sync_after(&self, mark: u64, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        self.sync_from(Some(mark), mark, sync)
    }

    fn sync_from(
        &self,
        mark: Option<u64>,
        ticket: u64,
        sync: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        crate::blocking::about_to_block();
        let mut sync = Some(sync);
        let mut st = self.state.lock();
        let mine = mark.map_or(st.next, |m| m.min(st.next));
        loop {
            if st.completed > mine {
                return Self::answer(&st, ticket.min(mine), mine);
            }
            if !st.running {
                let number = st.next;
                st.next += 1;
                st.running = true;
                drop(st);
                // The closures of all callers sync the same devices: the
                // one that runs covers every caller waiting for `number`.
                let result = match sync.take() {
                    Some(f) => f(),
                    None => unreachable!("a caller runs at most one sync"),
                };
                st = self.state.lock();
                st.running = false;
                st.completed = number + 1;
                if let Err(e) = result {
                    st.failed.push_back((number, e.kind(), e.to_string()));
                    if st.failed.len() > FAILURES_KEPT {
                        st.forgotten = st.failed.pop_front().map(|(n, ..)| n);
                    }
                }
                self.done.notify_all();
                continue;
            }
            self.done.wait(&mut st);
        }
    }

    fn answer(st: &State, from: u64, to: u64) -> io::Result<()> {
        if let Some(n) = st.forgotten
            && n >= from
        {
            return Err(io::Error::other(format!(
                "device syncs failed since sync {from} (sync {n} and more than {FAILURES_KEPT} after it)"
            )));
        }
        match st
            .failed
            .iter()
            .rev()
            .find(|(n, ..)| (from..=to).contains(n))
        {
            None => Ok(()),
            Some((n, kind, message)) => Err(io::Error::new(
                *kind,
                format!("device sync {n} failed: {message}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    #[test]
    fn a_sync_after_a_mark_is_covered_by_any_sync_that_started_after_it() {
        let gate = SyncGate::default();
        let runs = AtomicU32::new(0);
        let run = || {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        let mark = gate.mark();
        gate.sync(gate.ticket(), run).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        gate.sync_after(mark, run).unwrap();
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the sync after the mark covers it: no second sync"
        );
        let mark = gate.mark();
        gate.sync_after(mark, run).unwrap();
        assert_eq!(
            runs.load(Ordering::SeqCst),
            2,
            "no sync started after this mark: one runs"
        );
        let mark = gate.mark();
        gate.sync(gate.ticket(), || Err(io::Error::other("writeback lost")))
            .unwrap_err();
        let err = gate.sync_after(mark, run).unwrap_err();
        assert!(
            err.to_string().contains("writeback lost"),
            "a failed sync since the mark is the answer: {err}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_failure_forgotten_behind_many_later_ones_still_answers_an_error() {
        let gate = SyncGate::default();
        let mark = gate.mark();
        for _ in 0..=FAILURES_KEPT {
            gate.sync(gate.ticket(), || Err(io::Error::other("writeback lost")))
                .unwrap_err();
        }
        let err = gate.sync_after(mark, || Ok(())).unwrap_err();
        assert!(
            err.to_string().contains("more than"),
            "the mark's own failed sync was dropped from the list: {err}"
        );
        let mark = gate.mark();
        gate.sync_after(mark, || Ok(()))
            .expect("a mark after every failure");
    }

    #[test]
    fn callers_arriving_during_a_sync_share_the_next_one() {
        let gate = Arc::new(SyncGate::default());
        let runs = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (gate, runs) = (Arc::clone(&gate), Arc::clone(&runs));
                std::thread::spawn(move || {
                    gate.sync(gate.ticket(), || {
                        runs.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(30));
                        Ok(())
                    })
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap().unwrap();
        }
        let runs = runs.load(Ordering::SeqCst);
        assert!((1..8).contains(&runs), "8 callers, {runs} syncs");
    }

    #[test]
    fn a_failed_sync_fails_every_caller_whose_write_it_may_have_overlapped() {
        let gate = SyncGate::default();
        gate.sync(gate.ticket(), || Ok(())).unwrap();
        let before_failure = gate.ticket();
        let e = gate
            .sync(gate.ticket(), || Err(io::Error::other("EIO")))
            .unwrap_err();
        assert!(e.to_string().contains("EIO"), "{e}");
        // A write made before the failed sync, covered by a later sync
        // that succeeds: the failed one may have consumed its error.
        let e = gate.sync(before_failure, || Ok(())).unwrap_err();
        assert!(e.to_string().contains("EIO"), "{e}");
        // A write made after the failure: the next sync covers it.
        gate.sync(gate.ticket(), || Ok(()))
            .expect("a write after the failed sync is covered by the next");
    }
}
