//! Timer service: runs a closure after a delay on a dedicated thread.
//!
//! Used to charge a modelled device service time without sleeping on an rcs
//! worker (the continuation task is submitted when the modelled I/O would
//! complete), and for periodic background work. Bounded: at most
//! [`TIMERS_MAX`] pending timers; beyond that the closure runs at once.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Most pending timers.
pub const TIMERS_MAX: usize = 1 << 16;

type Job = Box<dyn FnOnce() + Send>;

struct Pending {
    at: Instant,
    seq: u64,
    job: Job,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct State {
    heap: BinaryHeap<Reverse<Pending>>,
    seq: u64,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
}

/// The timer thread.
pub struct Timer {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Timer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timer")
            .field("pending", &self.shared.state.lock().heap.len())
            .finish()
    }
}

impl Timer {
    /// Start the timer thread.
    pub fn start(name: &str) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                heap: BinaryHeap::new(),
                seq: 0,
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || run(&s))?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Run `job` after `delay` (at once if the delay is zero or the timer is
    /// full or stopped).
    pub fn after(&self, delay: Duration, job: impl FnOnce() + Send + 'static) {
        if delay.is_zero() || self.shared.stop.load(Ordering::SeqCst) {
            job();
            return;
        }
        let mut state = self.shared.state.lock();
        if state.heap.len() >= TIMERS_MAX {
            drop(state);
            job();
            return;
        }
        state.seq += 1;
        let seq = state.seq;
        state.heap.push(Reverse(Pending {
            at: Instant::now() + delay,
            seq,
            job: Box::new(job),
        }));
        drop(state);
        self.shared.wake.notify_one();
    }

    /// Stop the thread; pending jobs run at once.
    pub fn stop(&self) {
        {
            // Under the lock: the thread checks the flag and goes to wait
            // while holding it, so it either sees the flag or is waiting
            // when the notification comes (set without the lock, the
            // notification could fall between its check and its wait, and
            // `join` would wait for ever).
            let _state = self.shared.state.lock();
            self.shared.stop.store(true, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(shared: &Shared) {
    let mut state = shared.state.lock();
    loop {
        let stopping = shared.stop.load(Ordering::SeqCst);
        let now = Instant::now();
        let due = state
            .heap
            .peek()
            .is_some_and(|Reverse(p)| p.at <= now || stopping);
        if due {
            let Reverse(p) = state.heap.pop().expect("peeked");
            drop(state);
            (p.job)();
            state = shared.state.lock();
            continue;
        }
        if stopping {
            return;
        }
        match state.heap.peek() {
            Some(Reverse(p)) => {
                let at = p.at;
                shared.wake.wait_until(&mut state, at);
            }
            None => shared.wake.wait(&mut state),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn jobs_run_in_deadline_order_after_their_delay() {
        let timer = Timer::start("test-timer").unwrap();
        let (tx, rx) = mpsc::channel();
        let t0 = Instant::now();
        for (name, ms) in [("b", 30u64), ("a", 10), ("c", 50)] {
            let tx = tx.clone();
            timer.after(Duration::from_millis(ms), move || {
                tx.send((name, t0.elapsed())).unwrap()
            });
        }
        let got: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(got[0].1 >= Duration::from_millis(10));
        assert!(got[2].1 >= Duration::from_millis(50));
    }

    #[test]
    fn stop_never_misses_a_timer_thread_about_to_wait() {
        // Stop racing the thread's first check of the flag, many times;
        // each stop must return (a lost wake-up made join wait for ever).
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for i in 0..3000u64 {
                let timer = Timer::start("test-timer").unwrap();
                // A job due about now, and a stop a few microseconds later:
                // the thread is often between running the job and waiting
                // again when the stop comes.
                timer.after(Duration::from_micros(i % 40 + 1), || {});
                let until = Instant::now() + Duration::from_micros(i % 60);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                timer.stop();
            }
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(Duration::from_secs(20)).is_ok(),
            "a Timer::stop never returned"
        );
    }

    #[test]
    fn stopping_runs_pending_jobs() {
        let timer = Timer::start("test-timer").unwrap();
        let (tx, rx) = mpsc::channel();
        timer.after(Duration::from_secs(3600), move || tx.send(()).unwrap());
        timer.stop();
        assert!(rx.try_recv().is_ok());
    }
}
