//! A request in flight and its clean-up block (rung 1's redrive).
//!
//! A request is owned by exactly one task at a time (`Box<Request>` moves
//! from stage to stage, see [`crate::engine::datapath`]). Its `Drop` is the
//! request's clean-up block: a request dropped without a reply (its stage
//! failed, panicked, or its task was dropped unrun by a group recovery)
//! decides from where it stands whether running a stage again is safe
//! (the rules are in the data path's module doc), redrives it, escalates
//! to rung 4, or answers `EIO`. Replies leave through the request's
//! [`ReplySink`]; under output commit they wait in the epoch's output gate.

// Stages take and hand on `Box<Request>` (see the data path).
#![allow(clippy::boxed_local)]

use std::sync::Arc;
use std::time::Instant;

use rcs::Priority;
use smallvec::SmallVec;

use crate::engine::datapath::{StageRef, cache_read, flush, nvs_write, stage, submit_stage, zero};
use crate::engine::{Engine, ReplySink};
use crate::faults;
use crate::limits::TRACK_BYTES;
use crate::metrics::Op;
use crate::nbd::proto::{NbdError, RequestHeader, cflags, cmd};
use crate::recovery::Rung;

/// Redrives of one request before it is answered `EIO`.
pub const MAX_REDRIVES: u8 = 3;

/// Back-offs of one staging read on a full device queue before its stage
/// fails (about 5 s at the longest back-off).
pub const QUEUE_WAITS_MAX: u32 = 1000;

/// Where a write's NVS slots stand (for the clean-up on drop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// Reserved, not yet written: give back.
    Reserved,
    /// Records written, not yet in the directory: free.
    Written,
    /// Owned by the cache directory now.
    Applied,
}

/// One NBD request in flight.
pub(crate) struct Request {
    /// The engine that runs it.
    pub(crate) engine: Arc<Engine>,
    /// Where its reply goes.
    pub(crate) conn: Arc<dyn ReplySink>,
    pub(crate) header: RequestHeader,
    pub(crate) payload: Vec<u8>,
    pub(crate) slots: Vec<u32>,
    pub(crate) slot_state: SlotState,
    pub(crate) data: Vec<u8>,
    /// A read's missed tracks (index in the request, cache epoch); a
    /// write's first NVS sequence number (one entry). Inline: no
    /// allocation for the common one-track request.
    pub(crate) misses: SmallVec<[(usize, u64); 2]>,
    pub(crate) received: Instant,
    /// An error decided before validation (payload over the limit).
    pub(crate) early_error: Option<(NbdError, &'static str)>,
    pub(super) replied: bool,
    /// The stage the request is in (or was handed to), for a redrive.
    pub(super) at: Option<StageRef>,
    /// Whether that stage's body has begun.
    pub(super) in_body: bool,
    /// Redrives so far.
    pub(super) redrives: u8,
    /// Counted in the pipeline (see [`crate::engine::system`]).
    pub(super) counted: bool,
    /// Escalated to rung 4 once already.
    pub(super) escalated: bool,
    /// NVS slots to reserve before a parked write runs again.
    pub(super) reserve_on_resume: u32,
    /// Back-offs on a full device queue so far.
    pub(super) queue_waits: u32,
    /// FUA and FLUSH: tracks still to make durable; with TRIM and
    /// WRITE_ZEROES, back-offs so far and when to give up (each try is a
    /// task of its own; see [`durable`] and [`zero`]).
    pub(super) durable_left: Option<Vec<u64>>,
    pub(super) durable_waits: u32,
    pub(super) durable_deadline: Option<Instant>,
    /// FUA and FLUSH: the device sync mark taken when the first round
    /// began; a sync that started after it covers what the request must
    /// make durable besides its own destage writes.
    pub(super) durable_mark: Option<u64>,
    /// TRIM and WRITE_ZEROES: the destage fence this request set on its
    /// range and the sequence number its zeroing supersedes below. Lifted
    /// by the request's clean-up block if the request ends without
    /// finishing the zeroing (a redrive sets a new one).
    pub(super) zero_fence: Option<(u64, u64)>,
    /// The zeroing's wait for a degraded volume is in the recovery log.
    pub(super) zero_held_recorded: bool,
    /// A write that failed inside `cache.apply` was rolled back out of the
    /// directory (Log(Lock)): redriving it from `nvs.write` is safe.
    pub(super) rolled_back: bool,
    /// What the failed stage's handler found (Log(Lock)'s decision), for
    /// the recovery log record of the redrive or escalation.
    pub(super) note: Option<String>,
    /// The request's control block (taken at admission).
    pub(crate) block: Option<crate::engine::ctlblock::Block>,
    /// Alive while the request is (its control block's owner).
    pub(crate) alive: Option<crate::engine::ctlblock::Liveness>,
    /// Its stage found the controller's state inconsistent (a directory
    /// entry naming a record the NVS does not hold): no redrive can help;
    /// escalate (rung 3 with output commit, else 4).
    pub(super) corrupt_state: bool,
    /// Passed validation: under output commit its reply waits in the
    /// output gate for its epoch to commit (rung 3).
    pub(super) gated: bool,
    /// The host layer expanded a partial-track request to whole tracks
    /// ([`crate::host::partial`]): a READ may exceed the maximum payload by
    /// up to two tracks.
    pub(crate) expanded: bool,
    /// The track locks a change holds until the request is finished
    /// ([`crate::engine::tracklock`]); moves with the request through
    /// redrives, parking and rollback.
    pub(crate) track_lock: Option<crate::engine::tracklock::TrackLockGuard>,
}

/// What the clean-up block of a failed request does.
enum Redrive {
    /// Run it again from this stage (rung 1).
    Stage(StageRef),
    /// No task-level redrive is provably safe: rung 4.
    Escalate,
    /// Answer `EIO`.
    Fail,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("header", &self.header)
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Request {
    pub(crate) fn new(
        engine: Arc<Engine>,
        conn: Arc<dyn ReplySink>,
        header: RequestHeader,
    ) -> Self {
        Self {
            engine,
            conn,
            header,
            payload: Vec::new(),
            slots: Vec::new(),
            slot_state: SlotState::Reserved,
            data: Vec::new(),
            misses: SmallVec::new(),
            received: Instant::now(),
            early_error: None,
            replied: false,
            at: None,
            in_body: false,
            redrives: 0,
            counted: false,
            escalated: false,
            reserve_on_resume: 0,
            queue_waits: 0,
            durable_left: None,
            durable_waits: 0,
            durable_deadline: None,
            durable_mark: None,
            zero_fence: None,
            zero_held_recorded: false,
            rolled_back: false,
            note: None,
            block: None,
            alive: Some(Arc::new(())),
            corrupt_state: false,
            gated: false,
            expanded: false,
            track_lock: None,
        }
    }

    /// What the clean-up block does with this failed request.
    fn redrive_from(&self) -> Redrive {
        let Some(at) = self.at else {
            return Redrive::Fail;
        };
        let ctl = self.ctl();
        if self.early_error.is_some() || ctl.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Redrive::Fail;
        }
        if self.corrupt_state {
            return if self.escalated {
                Redrive::Fail
            } else {
                Redrive::Escalate
            };
        }
        let g = ctl.groups;
        let safe = if !self.in_body {
            Some(at)
        } else {
            match self.header.kind {
                // BLOCK_STATUS changes nothing: its stage runs again.
                cmd::BLOCK_STATUS => Some(at),
                cmd::READ | cmd::CACHE => Some(stage!(
                    g.cache,
                    Priority::High,
                    cache_read,
                    faults::CACHE_READ
                )),
                // Failed inside cache.apply, the write may be partly in the
                // directory: rewriting its slots is safe only once Log(Lock)
                // rolled it back out (else rung 4).
                cmd::WRITE
                    if self.slot_state != SlotState::Applied
                        && (at.name != "cache.apply" || self.rolled_back) =>
                {
                    Some(stage!(g.nvs, Priority::High, nvs_write, faults::NVS_WRITE))
                }
                cmd::WRITE if at.name == "device.fua" => Some(at),
                cmd::FLUSH => Some(at),
                _ => None,
            }
        };
        match safe {
            // While a system recovery quiesces, the request is parked (it
            // does not count as a redrive).
            Some(from) if self.redrives < MAX_REDRIVES || ctl.system.is_quiescing() => {
                Redrive::Stage(from)
            }
            _ if !self.escalated => Redrive::Escalate,
            _ => Redrive::Fail,
        }
    }

    /// Move the request's state into a new request that will run from
    /// `from` (the clean-up block cannot move `self`).
    pub(super) fn successor(&mut self, from: StageRef) -> Box<Request> {
        let counted = std::mem::replace(&mut self.counted, false);
        Box::new(Request {
            engine: Arc::clone(&self.engine),
            conn: Arc::clone(&self.conn),
            header: self.header,
            payload: std::mem::take(&mut self.payload),
            slots: std::mem::take(&mut self.slots),
            slot_state: if self.slot_state == SlotState::Written {
                // The records will be written again, with new sequence
                // numbers, into the same slots.
                SlotState::Reserved
            } else {
                self.slot_state
            },
            data: std::mem::take(&mut self.data),
            misses: if from.name == "cache.read" {
                SmallVec::new()
            } else {
                std::mem::take(&mut self.misses)
            },
            received: self.received,
            early_error: None,
            replied: false,
            at: Some(from),
            in_body: false,
            redrives: self.redrives,
            counted,
            escalated: self.escalated,
            reserve_on_resume: 0,
            queue_waits: 0,
            durable_left: None,
            durable_waits: 0,
            durable_deadline: None,
            durable_mark: None,
            zero_fence: None,
            zero_held_recorded: false,
            rolled_back: false,
            note: None,
            block: self.block.take(),
            alive: self.alive.take(),
            corrupt_state: false,
            gated: self.gated,
            expanded: self.expanded,
            track_lock: self.track_lock.take(),
        })
    }

    /// The clean-up block's rung-1 recovery: hand the request's state to a
    /// new task at `from` (or park it, if a system recovery is quiescing).
    pub(super) fn redrive(&mut self, from: StageRef) {
        let ctl = Arc::clone(self.ctl());
        let mut req = self.successor(from);
        if ctl.system.is_quiescing() {
            ctl.system.park(req);
            return;
        }
        req.redrives += 1;
        tracing::info!(
            cookie = self.header.cookie,
            failed_in = self.at.map_or("?", |a| a.name),
            redrive_from = from.name,
            attempt = req.redrives,
            "rung 1: redriving a request whose stage failed"
        );
        ctl.recoveries.record(
            Rung::Task,
            format!(
                "stage {} failed; {}request redriven from {}",
                self.at.map_or("?", |a| a.name),
                self.note.take().map_or(String::new(), |n| n + "; "),
                from.name
            ),
            std::time::Duration::ZERO,
            1,
        );
        submit_stage(&ctl.rt, req, from, "a redrive");
    }

    /// The clean-up block's escalation: no task-level redrive is provably
    /// safe (or the bound is spent), so the request is parked and a system
    /// recovery (rung 4) rebuilds the controller's state before it runs
    /// again.
    pub(super) fn escalate(&mut self) {
        let ctl = Arc::clone(self.ctl());
        let at = self.at.expect("escalated requests have a stage");
        let cause = format!(
            "{} {} failed in {} after {} redrives; {}",
            if self.header.kind == cmd::WRITE {
                "a WRITE"
            } else {
                "a request"
            },
            self.header.cookie,
            at.name,
            self.redrives,
            self.note
                .take()
                .unwrap_or_else(|| "no task-level recovery is provably safe".to_owned())
        );
        // The stage is only a placeholder: parking picks the real one.
        let mut req = self.successor(at);
        req.escalated = true;
        req.slot_state = self.slot_state;
        ctl.system.park(req);
        crate::engine::system::escalate(&ctl, cause);
    }

    /// Before parking (rung 4): decide where the request runs again once
    /// the controller's state is rebuilt, and let go of what the rebuild
    /// decides anew (NVS slots, staged data).
    pub(crate) fn prepare_to_park(&mut self) {
        if std::mem::replace(&mut self.counted, false) {
            self.ctl().system.left();
        }
        let Some(at) = self.at else { return };
        let g = self.ctl().groups;
        let from_start = at.name == "host.receive";
        let resume = match self.header.kind {
            _ if from_start => at,
            cmd::READ | cmd::CACHE => {
                stage!(g.cache, Priority::High, cache_read, faults::CACHE_READ)
            }
            cmd::WRITE if self.slot_state != SlotState::Applied => {
                stage!(g.nvs, Priority::High, nvs_write, faults::NVS_WRITE)
            }
            cmd::FLUSH => stage!(g.device, Priority::Medium, flush, faults::DEVICE_FLUSH),
            cmd::TRIM | cmd::WRITE_ZEROES => {
                stage!(g.device, Priority::Medium, zero, faults::DEVICE_ZERO)
            }
            _ => at,
        };
        if self.header.kind == cmd::WRITE && self.slot_state != SlotState::Applied {
            // The rebuilt NVS free list owns these slots now (a record the
            // box does not name is erased; a scan adopts a valid one as an
            // unacknowledged write). Fresh ones are reserved on resume.
            self.reserve_on_resume = self.slots.len() as u32;
            self.slots.clear();
            self.slot_state = SlotState::Reserved;
        }
        if resume.name == "cache.read" {
            self.misses.clear();
        }
        self.at = Some(resume);
        self.in_body = false;
    }

    /// Rung 3: the request's work since its start may have been rolled
    /// back; run it again from its first stage after validation, with its
    /// kept header and payload (a write gets fresh NVS slots on resume).
    pub(crate) fn rewind(&mut self) {
        if std::mem::replace(&mut self.counted, false) {
            self.ctl().system.left();
        }
        self.replied = false;
        let Some(at) = self.at else { return };
        if at.name == "host.receive" {
            self.in_body = false;
            return;
        }
        let g = self.ctl().groups;
        let from = match self.header.kind {
            cmd::READ | cmd::CACHE => {
                stage!(g.cache, Priority::High, cache_read, faults::CACHE_READ)
            }
            cmd::WRITE => {
                debug_assert_eq!(
                    self.payload.len(),
                    self.header.length as usize,
                    "output commit keeps write payloads"
                );
                // The rollback rebuilt the NVS free list: the old slots
                // are not this request's any more.
                self.reserve_on_resume = self.tracks() as u32;
                self.slots.clear();
                self.slot_state = SlotState::Reserved;
                stage!(g.nvs, Priority::High, nvs_write, faults::NVS_WRITE)
            }
            cmd::FLUSH => stage!(g.device, Priority::Medium, flush, faults::DEVICE_FLUSH),
            cmd::TRIM | cmd::WRITE_ZEROES => {
                stage!(g.device, Priority::Medium, zero, faults::DEVICE_ZERO)
            }
            _ => at,
        };
        self.misses.clear();
        self.data = Vec::new();
        self.at = Some(from);
        self.in_body = false;
    }

    /// NVS slots a parked request needs before it runs again.
    pub(crate) fn slots_to_reserve(&self) -> u32 {
        self.reserve_on_resume
    }

    /// A parked request that cannot run again: answered `EIO` by its
    /// clean-up block.
    pub(crate) fn give_up(mut self: Box<Self>) {
        self.at = None;
    }

    pub(super) fn ctl(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub(super) fn first_track(&self) -> u64 {
        self.header.offset / TRACK_BYTES as u64
    }

    pub(super) fn tracks(&self) -> u64 {
        u64::from(self.header.length) / TRACK_BYTES as u64
    }

    pub(super) fn op(&self) -> Op {
        match self.header.kind {
            cmd::READ => Op::Read,
            cmd::WRITE => Op::Write,
            cmd::FLUSH => Op::Flush,
            cmd::TRIM => Op::Trim,
            cmd::WRITE_ZEROES => Op::WriteZeroes,
            _ => Op::Other,
        }
    }

    /// Send the reply (data for a successful READ) and finish the request;
    /// under output commit, put it in the output gate until its epoch
    /// commits.
    pub(crate) fn reply(mut self: Box<Self>, result: Result<(), (NbdError, &str)>) {
        let ctl = Arc::clone(self.ctl());
        if self.gated && ctl.epochs.enabled() {
            // The request leaves the pipeline only once its reply is in the
            // output gate. A rollback quiesces until the pipeline is empty
            // and then takes the open epoch's held replies to run them
            // again: leaving first let a rollback restore the directory
            // between the two, and the reply, pushed after it, left at the
            // next commit with its write rolled back (an acknowledged write
            // lost; tests/crash_loop.rs found it about once in 40 runs).
            let counted = std::mem::replace(&mut self.counted, false);
            if self.header.kind == cmd::FLUSH || self.header.flags & cflags::FUA != 0 {
                ctl.epochs.need_sync();
            }
            // A stall injected here holds a rollback's quiesce (`host.gate`);
            // a failure or a panic injected here changes nothing.
            let _ = std::panic::catch_unwind(|| crate::faults::HOST_GATE.check());
            let idle = ctl.system.in_pipeline() == i64::from(counted) && ctl.epochs.idle();
            let due = ctl
                .epochs
                .hold_reply(self, result.map_err(|(e, m)| (e, m.to_owned())), idle);
            if counted {
                ctl.system.left();
            }
            // The reply made the epoch due: end it here, out of the
            // pipeline and holding nothing, or have the checkpoint thread
            // end it.
            ctl.epochs.end_due(&ctl, due);
            return;
        }
        (*self).reply_now(result);
    }

    /// The reply of a request held in the output gate, at its epoch's
    /// commit.
    /// Whether its success promises durability: a FLUSH, or a write with
    /// FUA.
    pub(crate) fn promises_durability(&self) -> bool {
        use crate::nbd::proto::{cflags, cmd};
        self.header.kind == cmd::FLUSH || self.header.flags & cflags::FUA != 0
    }

    pub(crate) fn reply_committed(self: Box<Self>, result: Result<(), (NbdError, String)>) {
        (*self).reply_now(
            result
                .as_ref()
                .map(|_| ())
                .map_err(|(e, m)| (*e, m.as_str())),
        );
    }

    pub(super) fn reply_now(mut self, result: Result<(), (NbdError, &str)>) {
        self.replied = true;
        self.give_back_slots();
        self.give_back_block();
        let ok = result.is_ok();
        let op = self.op();
        let bytes = u64::from(self.header.length);
        let data = std::mem::take(&mut self.data);
        self.conn.send_reply(&self.header, result, data);
        self.ctl()
            .metrics
            .record(op, bytes, ok, self.received.elapsed());
    }

    /// Drop the request without any reply (the connection is being closed:
    /// the client went away or broke the protocol).
    pub(crate) fn abandon(mut self) {
        self.replied = true;
        self.give_back_slots();
    }

    /// Release the control block and end the request's liveness, before
    /// the client can see an answer (so its next request never finds the
    /// block still taken, or a lost one still owned).
    pub(super) fn give_back_block(&mut self) {
        if let Some(block) = self.block.take() {
            self.engine.blocks.release(block);
        }
        self.alive = None;
    }

    pub(super) fn give_back_slots(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        match self.slot_state {
            SlotState::Reserved => self.ctl().nvs.release(&slots),
            SlotState::Written => self.ctl().nvs.free(&slots),
            SlotState::Applied => {}
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some((fence, _)) = self.zero_fence.take() {
            // A zeroing left unfinished: destage may go on in its range
            // (what it destages is what reads have been returning).
            self.ctl().cache.lift_zeroing(fence);
        }
        if !self.replied {
            self.replied = true;
            // The clean-up block of a request whose task did not finish.
            match self.redrive_from() {
                // The new request carries the connection's in-flight count
                // and the pipeline count on.
                Redrive::Stage(from) => self.redrive(from),
                Redrive::Escalate => self.escalate(),
                Redrive::Fail => self.fail(),
            }
        } else {
            self.conn.finish_request();
        }
        if self.counted {
            self.ctl().system.left();
        }
        self.give_back_block();
    }
}

impl Request {
    /// Answer `EIO`: no recovery applies.
    pub(super) fn fail(&mut self) {
        self.give_back_slots();
        self.give_back_block();
        tracing::warn!(
            cookie = self.header.cookie,
            kind = self.header.kind,
            "request dropped without a reply; answering EIO"
        );
        let data = std::mem::take(&mut self.data);
        self.conn.send_reply(
            &self.header,
            Err((NbdError::Io, "request failed inside the controller")),
            data,
        );
        self.engine
            .metrics
            .record(self.op(), 0, false, self.received.elapsed());
        self.conn.finish_request();
    }
}
