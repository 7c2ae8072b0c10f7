//! Fault injection: the paper's per-group emulation (§6.3.3) and named fault
//! points usable from any code.
//!
//! # Per-group injection
//!
//! "We choose a candidate task belonging to recovery group 5 and introduce
//! faults at a fixed rate (1 for each 10000 dispatches). Recovery was emulated
//! and recovery from each fault was set to take approximately 20 ms. [...]
//! During localized recovery, all tasks belonging to the same recovery group
//! that are currently executing in the system and that are dispatched during
//! the recovery process also experience a recovery time of 20 ms each."
//!
//! [`GroupFaults`] holds a group's probability per dispatch and emulated
//! recovery time `d`. An injected fault fails the dispatched task before its
//! body runs (the body is dropped unrun, so whatever it owned is released by
//! `Drop`); the group's recovery then spends `d` on the failing task's worker,
//! and every task of the group running when the recovery began or dispatched
//! during it spends `d` too. Time is spent busy (the recovery occupies its
//! processor, as in the paper), not sleeping.
//!
//! # Named fault points
//!
//! [`fault_point!`](crate::fault_point) marks a place in any code where a fault can be triggered on
//! demand: `rcs::fault_point!("cache.stage")?;`. Disarmed, it costs one relaxed
//! load. [`arm`] gives a point an action (fail with a class, panic, or delay),
//! a probability and an optional count; [`disarm`] removes it. Points register
//! themselves by name the first time they are reached, and a name can be armed
//! before any point with that name has run. The registry is process-wide, like
//! the `fail` crate's; unlike `fail`, a disarmed point takes no lock and does
//! no hash lookup, which matters on paths dispatched millions of times a
//! minute.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::failure::{Failure, FailureClass};

/// Fault injection state of one group (adjustable at run time).
#[derive(Debug, Default)]
pub(crate) struct GroupFaults {
    /// Probability per dispatch, scaled to `0..=2^32`.
    threshold: AtomicU64,
    /// Emulated recovery time `d`, in nanoseconds.
    recovery_time_ns: AtomicU64,
}

impl GroupFaults {
    pub(crate) fn new(probability: f64, recovery_time: Duration) -> Self {
        let faults = Self::default();
        faults.set(probability, recovery_time);
        faults
    }

    pub(crate) fn set(&self, probability: f64, recovery_time: Duration) {
        debug_assert!((0.0..=1.0).contains(&probability));
        let threshold = (probability * 4_294_967_296.0).round() as u64;
        self.threshold.store(threshold, Ordering::Relaxed);
        let ns = u64::try_from(recovery_time.as_nanos()).unwrap_or(u64::MAX);
        self.recovery_time_ns.store(ns, Ordering::Relaxed);
    }

    /// Whether this dispatch fails, given 32 random bits.
    #[inline]
    pub(crate) fn fires(&self, random: u32) -> bool {
        u64::from(random) < self.threshold.load(Ordering::Relaxed)
    }

    /// Whether any injection is configured (one relaxed load on the hot path).
    #[inline]
    pub(crate) fn probability_threshold(&self) -> u64 {
        self.threshold.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn recovery_time(&self) -> Option<Duration> {
        match self.recovery_time_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    pub(crate) fn probability(&self) -> f64 {
        self.threshold.load(Ordering::Relaxed) as f64 / 4_294_967_296.0
    }
}

/// Occupy the current thread for `d` (emulated recovery work).
pub(crate) fn spend(d: Duration) {
    let deadline = std::time::Instant::now() + d;
    while std::time::Instant::now() < deadline {
        std::hint::spin_loop();
    }
}

/// A `Delay` stall sleeps in slices of this, checking its task's deadline.
const DELAY_SLICE: Duration = Duration::from_millis(1);

/// What an armed fault point does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Return `Err(Failure)` of this class.
    Fail(FailureClass),
    /// Panic (a failure of class `Panic` when inside a task).
    Panic,
    /// Sleep, then carry on (a slow operation, a deadline overrun); under a
    /// task deadline the stall ends as a time-out at the deadline.
    Delay(Duration),
    /// Sleep for the whole duration, deaf to the deadline (a call that does
    /// not return and never checks: a hung task), then carry on.
    Hang(Duration),
}

impl std::fmt::Display for FaultAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultAction::Fail(class) => write!(f, "fail({class})"),
            FaultAction::Panic => f.write_str("panic"),
            FaultAction::Delay(d) => write!(f, "delay({d:?})"),
            FaultAction::Hang(d) => write!(f, "hang({d:?})"),
        }
    }
}

/// How an armed fault point fires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultConfig {
    /// The action.
    pub action: FaultAction,
    /// Probability per evaluation, `0..=1`.
    pub probability: f64,
    /// Fire at most this many times, then disarm (`None`: no limit).
    pub count: Option<u64>,
}

impl FaultConfig {
    /// Fire `action` every time the point is reached.
    pub fn always(action: FaultAction) -> Self {
        Self {
            action,
            probability: 1.0,
            count: None,
        }
    }

    /// Fire `action` once, the next time the point is reached.
    pub fn once(action: FaultAction) -> Self {
        Self {
            action,
            probability: 1.0,
            count: Some(1),
        }
    }
}

/// Why a fault point could not be armed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultError {
    /// A probability outside 0..=1.
    #[error("fault probability must be within 0..=1 (got {0})")]
    Probability(f64),
    /// An empty name.
    #[error("fault point name must not be empty")]
    EmptyName,
}

const UNREGISTERED: u8 = 0;
const DISARMED: u8 = 1;
const ARMED: u8 = 2;

/// A named place where a fault can be injected. Use through
/// [`fault_point!`](crate::fault_point), which keeps one in a `static`.
#[derive(Debug)]
pub struct FaultPoint {
    name: &'static str,
    state: AtomicU8,
    hits: AtomicU64,
}

impl FaultPoint {
    /// A fault point named `name` (not registered until first reached).
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            state: AtomicU8::new(UNREGISTERED),
            hits: AtomicU64::new(0),
        }
    }

    /// The point's name (what [`arm`] takes).
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// Evaluate the point: `Ok` unless it is armed and fires a failure
    /// (a `Panic` action panics, a `Delay` sleeps and returns `Ok`).
    #[inline]
    pub fn check(&'static self) -> Result<(), Failure> {
        if self.state.load(Ordering::Relaxed) == DISARMED {
            return Ok(());
        }
        self.check_slow()
    }

    #[cold]
    fn check_slow(&'static self) -> Result<(), Failure> {
        let fired = {
            let mut registry = REGISTRY.lock();
            if self.state.load(Ordering::Relaxed) == UNREGISTERED {
                registry.points.entry(self.name).or_default().push(self);
            }
            let Some(armed) = registry.armed.get_mut(self.name) else {
                self.state.store(DISARMED, Ordering::Relaxed);
                return Ok(());
            };
            self.state.store(ARMED, Ordering::Relaxed);
            self.hits.fetch_add(1, Ordering::Relaxed);
            let fires =
                armed.config.probability >= 1.0 || fastrand::f64() < armed.config.probability;
            if !fires {
                return Ok(());
            }
            armed.triggered += 1;
            let action = armed.config.action;
            if let Some(left) = armed.remaining.as_mut() {
                *left -= 1;
                if *left == 0 {
                    registry.disarm(self.name);
                }
            }
            action
        };
        tracing::debug!(point = self.name, action = %fired, "fault point fired");
        match fired {
            FaultAction::Fail(class) => Err(Failure::new(
                class,
                format!("fault injected at fault point {:?}", self.name),
            )),
            FaultAction::Panic => panic!("fault injected at fault point {:?}", self.name),
            FaultAction::Delay(d) => {
                // A stall: in a task under a deadline it ends when the
                // watchdog declares the task overdue, as a time-out.
                let until = std::time::Instant::now() + d;
                loop {
                    if crate::deadline::current_task_overdue() {
                        return Err(Failure::timeout(format!(
                            "stalled at fault point {:?} past the task's deadline",
                            self.name
                        )));
                    }
                    let left = until.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Ok(());
                    }
                    std::thread::sleep(left.min(DELAY_SLICE));
                }
            }
            FaultAction::Hang(d) => {
                std::thread::sleep(d);
                Ok(())
            }
        }
    }
}

/// Mark a named fault point; evaluates to `Result<(), Failure>`.
///
/// ```
/// fn stage() -> Result<(), rcs::Failure> {
///     rcs::fault_point!("doc.stage")?;
///     Ok(())
/// }
/// assert!(stage().is_ok());
/// rcs::fault::arm("doc.stage", rcs::fault::FaultConfig::once(
///     rcs::fault::FaultAction::Fail(rcs::FailureClass::State))).unwrap();
/// assert!(stage().is_err());
/// assert!(stage().is_ok());
/// ```
#[macro_export]
macro_rules! fault_point {
    ($name:literal) => {{
        static POINT: $crate::fault::FaultPoint = $crate::fault::FaultPoint::new($name);
        POINT.check()
    }};
}

struct Armed {
    config: FaultConfig,
    remaining: Option<u64>,
    triggered: u64,
}

#[derive(Default)]
struct Registry {
    points: HashMap<&'static str, Vec<&'static FaultPoint>>,
    armed: HashMap<String, Armed>,
    /// Triggers of names since disarmed (kept for `fault_points`).
    history: HashMap<String, u64>,
}

impl Registry {
    fn disarm(&mut self, name: &str) -> bool {
        let Some(armed) = self.armed.remove(name) else {
            return false;
        };
        *self.history.entry(name.to_owned()).or_default() += armed.triggered;
        for point in self.points.get(name).into_iter().flatten() {
            point.state.store(DISARMED, Ordering::Relaxed);
        }
        true
    }
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

/// Arm every fault point named `name` (including ones not reached yet).
pub fn arm(name: &str, config: FaultConfig) -> Result<(), FaultError> {
    if name.is_empty() {
        return Err(FaultError::EmptyName);
    }
    if !(0.0..=1.0).contains(&config.probability) {
        return Err(FaultError::Probability(config.probability));
    }
    let mut registry = REGISTRY.lock();
    registry.armed.insert(
        name.to_owned(),
        Armed {
            config,
            remaining: config.count,
            triggered: 0,
        },
    );
    for point in registry.points.get(name).into_iter().flatten() {
        point.state.store(ARMED, Ordering::Relaxed);
    }
    Ok(())
}

/// Disarm every fault point named `name`; whether it was armed.
pub fn disarm(name: &str) -> bool {
    REGISTRY.lock().disarm(name)
}

/// Disarm every fault point.
pub fn disarm_all() {
    let mut registry = REGISTRY.lock();
    let names: Vec<String> = registry.armed.keys().cloned().collect();
    for name in names {
        registry.disarm(&name);
    }
}

/// State of one fault point name.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultPointInfo {
    /// The name.
    pub name: String,
    /// Whether code with this point has run at least once.
    pub registered: bool,
    /// The configuration, when armed.
    pub armed: Option<FaultConfig>,
    /// Evaluations while armed.
    pub hits: u64,
    /// Times it fired.
    pub triggered: u64,
}

/// Every known fault point name (registered or armed), sorted by name.
pub fn fault_points() -> Vec<FaultPointInfo> {
    let registry = REGISTRY.lock();
    let mut names: Vec<&str> = registry.points.keys().copied().collect();
    names.extend(registry.armed.keys().map(String::as_str));
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|name| {
            let points = registry.points.get(name);
            let armed = registry.armed.get(name);
            FaultPointInfo {
                name: name.to_owned(),
                registered: points.is_some(),
                armed: armed.map(|a| a.config),
                hits: points
                    .into_iter()
                    .flatten()
                    .map(|p| p.hits.load(Ordering::Relaxed))
                    .sum(),
                triggered: armed.map_or(0, |a| a.triggered)
                    + registry.history.get(name).copied().unwrap_or(0),
            }
        })
        .collect()
}
