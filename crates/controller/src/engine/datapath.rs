//! The I/O path: one request, moving through tasks of the component groups.
//!
//! ```text
//! READ:   host: validate ─► cache: hits (frames, NVS records) ─► [device: stage misses] ─► host: reply
//! WRITE:  host: validate ─► nvs: write records ─► cache: apply ─► [device: FUA destage+sync] ─► host: reply
//! FLUSH:  host: validate ─► device: destage all dirty, sync ─► host: reply
//! TRIM, WRITE_ZEROES: host: validate ─► device: fence destage, zero devices, drop older records ─► host: reply
//! ```
//!
//! A request is owned by exactly one task at a time (`Box<Request>` moves
//! from stage to stage). Its `Drop` is the request's clean-up block.
//!
//! # Rung 1: a failed stage's request is redriven
//!
//! Every stage has a named fault point at its entry (`host.receive`,
//! `cache.read`, `device.read`, `nvs.write`, `cache.apply`, `device.fua`,
//! `device.flush`, `device.zero`, `host.reply`; armed with `rebound
//! inject`), and runs inside an rcs recovery point whose strategy is to end
//! the task: a stage that fails (an error, a panic, an injected fault, or
//! its task dropped unrun by a group recovery) drops its request without a
//! reply. The clean-up block then decides, from where the request stands,
//! whether running the stage again is safe:
//!
//! - failed before the stage body began (at the fault point, or dropped
//!   unrun): the request's state is exactly the stage's input, redrive that
//!   stage;
//! - a READ: reads change nothing but the cache (installs are idempotent),
//!   redrive from `cache.read` with the data recomputed;
//! - a WRITE whose records are not yet in the cache directory
//!   (slots reserved or written): redrive from `nvs.write`, which writes
//!   fresh records into the same slots;
//! - FLUSH and FUA: idempotent, redrive the stage;
//! - anything else (a failure in the middle of `cache.apply`, TRIM or
//!   WRITE_ZEROES): not provably safe, the request is answered `EIO` (the
//!   next rungs own that case).
//!
//! Redrives are bounded ([`MAX_REDRIVES`]); past that, and when the runtime
//! is shutting down, the request is answered `EIO` and its NVS slots given
//! back, so a client is never left waiting and no slot leaks. Every redrive
//! is logged as a rung-1 recovery.

// Every stage has the `Stage` signature: requests move between tasks boxed,
// so a stage that finishes the request still takes a `Box`.
#![allow(clippy::boxed_local)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rcs::{Failure, Priority, RecoveryPoint, Strategy, TaskCtx};
use smallvec::{SmallVec, smallvec};

use crate::config::FlushPolicy;
use crate::engine::Engine;
use crate::faults;
use crate::limits::{MAX_PAYLOAD_BYTES, TRACK_BYTES};

use crate::engine::request::{QUEUE_WAITS_MAX, Request, SlotState};
use crate::nbd::proto::{NbdError, RequestHeader, cflags, cmd};
use crate::recovery::Rung;

/// A stage with its group and fault point.
#[derive(Clone, Copy)]
pub(crate) struct StageRef {
    pub(super) group: rcs::GroupId,
    pub(super) priority: Priority,
    pub(super) stage: Stage,
    pub(super) name: &'static str,
    pub(super) point: &'static rcs::fault::FaultPoint,
}

/// A [`StageRef`] entered through the fault point `$point` (one of
/// [`crate::faults`]), named after it.
macro_rules! stage {
    ($group:expr, $priority:expr, $stage:expr, $point:expr) => {{
        let point: &'static rcs::fault::FaultPoint = &$point;
        StageRef {
            group: $group,
            priority: $priority,
            stage: $stage,
            name: point.name(),
            point,
        }
    }};
}

/// The macro, for the request's clean-up block (`request.rs`).
pub(crate) use stage;

type Stage = fn(&mut TaskCtx<'_>, Box<Request>) -> Result<(), Failure>;

/// The recovery point every stage runs in: a failure ends the task (no
/// group recovery); the request's clean-up block does the rest.
static STAGE_POINT: RecoveryPoint = RecoveryPoint::new("stage", Strategy::Abort);

/// Run a stage inside [`STAGE_POINT`]: its fault point, then its body.
fn run_stage(ctx: &mut TaskCtx<'_>, req: Box<Request>, at: StageRef) -> Result<(), Failure> {
    let mut req = Some(req);
    ctx.recovery_point(&STAGE_POINT, |ctx| {
        let Some(mut req) = req.take() else {
            return Ok(());
        };
        req.at = Some(at);
        req.in_body = false;
        if req.ctl().system.is_quiescing() {
            // Rung 4 is rebuilding the state this stage would use.
            let ctl = Arc::clone(req.ctl());
            ctl.system.park(req);
            return Ok(());
        }
        if let Err(f) = at.point.check() {
            // The recovery record says what failed (a time-out from the
            // deadline watchdog, an injected fault, ...).
            req.note = Some(format!("{}: {}", f.class(), f.message()));
            return Err(f);
        }
        req.in_body = true;
        (at.stage)(ctx, req)
    })
    .map(|_| ())
}

/// Hand `req` to the stage `at` as a task of its group.
fn next(ctx: &mut TaskCtx<'_>, req: Box<Request>, at: StageRef) {
    let result = ctx.submit_named(at.group, at.priority, at.name, move |ctx| {
        run_stage(ctx, req, at)
    });
    if let Err(e) = result {
        // The task (and the request in it) was dropped: its clean-up block
        // has replied. Nothing more to do here.
        tracing::error!(error = %e, "could not submit the next stage of a request");
    }
}

/// Count a received request in the pipeline (called by a connection
/// thread inside the admission gate; see [`crate::engine::system`]).
pub(crate) fn enter(req: &mut Request) {
    req.ctl().system.entered();
    req.counted = true;
}

/// Start an [entered](enter) request at `host.receive`. With the
/// connection thread's affiliate slot, its host, cache, NVS and device
/// stages run on that thread when their admission allows (see
/// `rcs::affiliate`); the rest are queued for the workers. If the runtime refuses it (shutting down), the dropped
/// request's clean-up block answers the client.
pub(crate) fn start(req: Box<Request>, affiliate: Option<&mut rcs::Affiliate>) {
    debug_assert!(
        req.counted,
        "a request starts after it entered the pipeline"
    );
    let ctl = Arc::clone(req.ctl());
    let at = stage!(
        ctl.groups.host,
        Priority::High,
        receive,
        faults::HOST_RECEIVE
    );
    match affiliate {
        Some(a) => {
            let run = a.run_named(at.group, at.priority, at.name, move |ctx| {
                run_stage(ctx, req, at)
            });
            if let Err(e) = run {
                tracing::warn!(error = %e, "a request was refused by the task runtime");
            }
        }
        None => submit_stage(&ctl.rt, req, at, "a request"),
    }
}

/// Submit a parked request at the stage it was parked for (rung 4).
pub(crate) fn resume(mut req: Box<Request>) {
    let ctl = Arc::clone(req.ctl());
    let Some(at) = req.at else {
        req.give_up();
        return;
    };
    ctl.system.entered();
    req.counted = true;
    submit_stage(&ctl.rt, req, at, "a parked request");
}

/// Submit `req` as a task of `at`'s group from outside a task. If the
/// runtime refuses (it is shutting down), the task and the request in it
/// are dropped and the request's clean-up block answers; `what` names the
/// submission in the log.
pub(super) fn submit_stage(rt: &rcs::Handle, req: Box<Request>, at: StageRef, what: &str) {
    let submitted = rt.submit_named(at.group, at.priority, at.name, move |ctx| {
        run_stage(ctx, req, at)
    });
    if let Err(e) = submitted {
        tracing::warn!(error = %e, "{what} was refused by the task runtime");
    }
}

/// host: validate and route.
pub(super) fn receive(ctx: &mut TaskCtx<'_>, req: Box<Request>) -> Result<(), Failure> {
    if let Some((e, msg)) = req.early_error {
        req.reply(Err((e, msg)));
        return Ok(());
    }
    let h = req.header;
    let slack = if req.expanded {
        2 * TRACK_BYTES as u32
    } else {
        0
    };
    let checked = validate(&h, &req.ctl().export, req.conn.structured(), slack)
        .and_then(|()| check_whole_tracks(&h))
        .and_then(|()| {
            if h.kind == cmd::BLOCK_STATUS && !req.conn.allocation() {
                Err((
                    NbdError::Inval,
                    "BLOCK_STATUS needs the base:allocation context (NBD_OPT_SET_META_CONTEXT)",
                ))
            } else {
                Ok(())
            }
        });
    if let Err((e, msg)) = checked {
        req.reply(Err((e, msg)));
        return Ok(());
    }
    let mut req = req;
    req.gated = true;
    let g = req.ctl().groups;
    let no_data = h.length == 0 && h.kind != cmd::FLUSH;
    if no_data {
        req.reply(Ok(()));
        return Ok(());
    }
    match h.kind {
        // CACHE stages the range into the read cache like a READ; its
        // reply carries no data.
        cmd::READ | cmd::CACHE => next(
            ctx,
            req,
            stage!(g.cache, Priority::High, cache_read, faults::CACHE_READ),
        ),
        cmd::WRITE => next(
            ctx,
            req,
            stage!(g.nvs, Priority::High, nvs_write, faults::NVS_WRITE),
        ),
        cmd::FLUSH => next(
            ctx,
            req,
            stage!(g.device, Priority::Medium, flush, faults::DEVICE_FLUSH),
        ),
        cmd::TRIM | cmd::WRITE_ZEROES => next(
            ctx,
            req,
            stage!(g.device, Priority::Medium, zero, faults::DEVICE_ZERO),
        ),
        cmd::BLOCK_STATUS => next(
            ctx,
            req,
            stage!(
                g.cache,
                Priority::High,
                crate::engine::blockstatus::block_status,
                faults::CACHE_STATUS
            ),
        ),
        _ => unreachable!("validate refuses other commands"),
    }
    Ok(())
}

/// Whether `h` is a READ, WRITE, TRIM, WRITE_ZEROES or CACHE whose
/// offset and length are whole tracks (the only kind the stages take; the
/// host layer turns the others into whole-track requests).
pub(crate) fn whole_tracks(h: &RequestHeader) -> bool {
    let track = TRACK_BYTES as u64;
    !matches!(
        h.kind,
        cmd::READ | cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES | cmd::CACHE
    ) || (h.offset.is_multiple_of(track) && u64::from(h.length).is_multiple_of(track))
}

fn check_whole_tracks(h: &RequestHeader) -> Result<(), (NbdError, &'static str)> {
    if whole_tracks(h) {
        Ok(())
    } else {
        Err((
            NbdError::Inval,
            "a partial-track request reached the stages (the host layer expands them)",
        ))
    }
}

/// Check a request against the protocol and the export, at any alignment
/// (requests need not cover whole tracks: see [`crate::host::partial`]).
/// `slack`: bytes a READ may exceed the maximum payload by (a partial read
/// expanded to whole tracks).
pub(crate) fn validate(
    h: &RequestHeader,
    export: &crate::nbd::handshake::ExportInfo,
    structured: bool,
    slack: u32,
) -> Result<(), (NbdError, &'static str)> {
    let allowed = match h.kind {
        cmd::READ if structured => cflags::FUA | cflags::DF,
        cmd::READ | cmd::WRITE | cmd::TRIM | cmd::FLUSH => cflags::FUA,
        cmd::WRITE_ZEROES => cflags::FUA | cflags::NO_HOLE | cflags::FAST_ZERO,
        cmd::CACHE => 0,
        cmd::BLOCK_STATUS => cflags::REQ_ONE,
        _ => return Err((NbdError::Inval, "unknown command")),
    };
    if h.flags & !allowed != 0 {
        return Err((NbdError::Inval, "command flag not valid for this command"));
    }
    if h.kind == cmd::FLUSH {
        return if h.offset == 0 && h.length == 0 {
            Ok(())
        } else {
            Err((NbdError::Inval, "FLUSH needs offset and length 0"))
        };
    }
    if export.read_only && matches!(h.kind, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES) {
        return Err((NbdError::Perm, "the export is read-only"));
    }
    if h.kind == cmd::BLOCK_STATUS && (!structured || h.length == 0) {
        return Err((
            NbdError::Inval,
            "BLOCK_STATUS needs structured replies and a length",
        ));
    }
    let past_end = h
        .offset
        .checked_add(u64::from(h.length))
        .is_none_or(|end| end > export.size_bytes);
    if past_end {
        return Err(if h.kind == cmd::WRITE {
            (NbdError::NoSpc, "write past the end of the export")
        } else {
            (NbdError::Inval, "request past the end of the export")
        });
    }
    if h.kind == cmd::READ && h.length > MAX_PAYLOAD_BYTES.saturating_add(slack) {
        return Err((NbdError::Overflow, "read larger than the maximum payload"));
    }
    Ok(())
}

/// cache: serve hits from frames and NVS records; collect misses.
pub(super) fn cache_read(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    req.data = vec![0u8; req.header.length as usize];
    let first = req.first_track();
    let mut misses = SmallVec::new();
    for (i, chunk) in req.data.chunks_mut(TRACK_BYTES).enumerate() {
        match ctl.cache.read(first + i as u64, chunk, &ctl.nvs) {
            Ok(crate::store::cache::ReadOutcome::Miss { epoch }) => misses.push((i, epoch)),
            Ok(_) => {}
            Err(crate::store::nvs::NvsError::Damaged { slot, seq, .. }) => {
                // The NVS memory holding the track's newest data is damaged
                // and no cached copy exists: no rollback or rebuild brings
                // it back, and older data must not be returned in its place.
                let track = first + i as u64;
                let _ = crate::engine::destage::note_lost(&ctl, track, slot, seq, "a read");
                req.reply(Err((
                    NbdError::Io,
                    "the track's data is lost (its NVS record is damaged)",
                )));
                return Ok(());
            }
            Err(e) => {
                let track = first + i as u64;
                if ctl.epochs.enabled() && !req.escalated {
                    // The directory may be what is wrong: roll back to the
                    // checkpoint (rung 3), which restores this entry, and
                    // read again. If the record itself is bad, the read
                    // fails again and is answered EIO.
                    tracing::error!(track, error = %e, "a directory entry names a record the NVS does not hold; rung 3");
                    ctl.epochs.suspect(track);
                    req.corrupt_state = true;
                    req.note = Some(format!(
                        "the directory entry of track {track} names a record the NVS does not hold ({e})"
                    ));
                    return Err(Failure::internal_logic(format!(
                        "inconsistent directory entry of track {track}"
                    )));
                }
                tracing::error!(error = %e, "reading a dirty track from the NVS");
                req.reply(Err((NbdError::Io, "NVS record failed its checksum")));
                return Ok(());
            }
        }
    }
    if misses.is_empty() {
        next(
            ctx,
            req,
            stage!(
                ctl.groups.host,
                Priority::High,
                reply_ok,
                faults::HOST_REPLY
            ),
        );
    } else {
        req.misses = misses;
        next(ctx, req, device_read(&ctl));
    }
    Ok(())
}

/// The stage that stages a read's misses from the devices.
fn device_read(ctl: &Engine) -> StageRef {
    stage!(
        ctl.groups.device,
        Priority::High,
        device_stage,
        faults::DEVICE_READ
    )
}

/// device: read missing tracks from the devices, install them in the cache.
fn device_stage(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    let first = req.first_track();
    let misses = std::mem::take(&mut req.misses);
    let mut modelled = std::time::Duration::ZERO;
    for (k, &(i, epoch)) in misses.iter().enumerate() {
        let track = first + i as u64;
        let (queue_index, queue) = ctl.queue(track);
        let tag = match queue.submit() {
            Ok(tag) => tag,
            Err(full) => {
                // Rung 1: back off and retry the remaining misses later,
                // without holding the worker; past the bound, fail the
                // stage (its redrive, or rung 4, takes over).
                if req.queue_waits >= QUEUE_WAITS_MAX {
                    return Err(Failure::timeout(format!(
                        "device {queue_index}: {full} through {QUEUE_WAITS_MAX} back-offs"
                    )));
                }
                let wait = crate::backend::devqueue::backoff(req.queue_waits);
                if req.queue_waits == 0 {
                    // One record per request that backed off (the device
                    // queue counts every refusal).
                    ctl.recoveries.record(
                        Rung::Task,
                        format!(
                            "device {queue_index} {full}: staging read of track {track} backed off"
                        ),
                        wait,
                        1,
                    );
                }
                req.queue_waits += 1;
                req.misses = SmallVec::from_slice(&misses[k..]);
                continue_after(ctx, &ctl, modelled + wait, req, device_read(&ctl));
                return Ok(());
            }
        };
        let chunk = &mut req.data[i * TRACK_BYTES..(i + 1) * TRACK_BYTES];
        let read = ctl.epochs.device.read(&ctl.volume, track, chunk);
        queue.complete(tag);
        if let Err(e) = read {
            tracing::error!(error = %e, track, "device read failed");
            req.reply(Err((NbdError::Io, "device read failed")));
            return Ok(());
        }
        ctl.cache.install_staged(track, chunk, epoch);
        modelled += ctl.config.device_latency.service_time(TRACK_BYTES);
    }
    continue_after(
        ctx,
        &ctl,
        modelled,
        req,
        stage!(
            ctl.groups.host,
            Priority::High,
            reply_ok,
            faults::HOST_REPLY
        ),
    );
    Ok(())
}

/// Continue with `at` now, or when a modelled device service time has
/// passed (without holding the worker).
fn continue_after(
    ctx: &mut TaskCtx<'_>,
    ctl: &Arc<Engine>,
    modelled: std::time::Duration,
    req: Box<Request>,
    at: StageRef,
) {
    if modelled.is_zero() {
        next(ctx, req, at);
        return;
    }
    let handle = ctx.handle();
    ctl.timer.after(modelled, move || {
        submit_stage(&handle, req, at, "a request after its modelled wait");
    });
}

/// nvs: write one record per track into the reserved slots.
pub(super) fn nvs_write(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    let tracks = req.tracks();
    debug_assert_eq!(req.slots.len() as u64, tracks);
    let first_seq = ctl.nvs.next_seqs(tracks);
    ctl.journal.cover_seq(first_seq + tracks);
    let first = req.first_track();
    req.slot_state = SlotState::Written;
    for (i, chunk) in req.payload.chunks(TRACK_BYTES).enumerate() {
        ctl.nvs
            .write_record(req.slots[i], first_seq + i as u64, first + i as u64, chunk);
    }
    req.misses = smallvec![(0, first_seq)];
    next(
        ctx,
        req,
        stage!(
            ctl.groups.cache,
            Priority::High,
            cache_apply,
            faults::CACHE_APPLY
        ),
    );
    Ok(())
}

/// A panic inside `cache.apply` as the task's failure, with its message.
fn apply_panic(panic: &(dyn std::any::Any + Send)) -> Failure {
    Failure::new(
        rcs::FailureClass::Panic,
        panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic inside cache.apply".to_owned()),
    )
}

/// Log(Lock) actor ids for `cache.apply` tasks (unique among live actors).
static NEXT_ACTOR: AtomicU64 = AtomicU64::new(1);

/// cache: put the written tracks in the directory (and cache), free
/// superseded records, queue destage.
///
/// The task is a Log(Lock) actor (paper §4) while it changes the
/// directory: it tracks each cache shard it writes from its first write,
/// under the shard lock, and keeps the entries as they were. If it fails
/// part-way ([`recover_apply`]), the protocols decide from the restoration
/// level whether it may roll back alone.
pub(super) fn cache_apply(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    let first_seq = req.misses[0].1;
    let first = req.first_track();
    let mut free = Vec::new();
    let mut undo = Vec::new();
    // Tracks to hand to destage once the whole write is in the directory:
    // a destage of a partly applied write would read (and write to the
    // device) what a rollback must take back.
    let mut to_destage = Vec::new();
    // A commit never cuts through a write's application (rung 3).
    let changing = ctl.epochs.changing();
    let actor = loglock::Actor::begin(NEXT_ACTOR.fetch_add(1, Ordering::Relaxed));
    let point = actor
        .recovery_point(loglock::RecoveryCriterion::ISOLATED_ROLLBACK)
        .map_err(|e| Failure::internal_logic(format!("Log(Lock): {e}")))?;
    let applied =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), Failure> {
            for (i, chunk) in req.payload.chunks(TRACK_BYTES).enumerate() {
                let track = first + i as u64;
                let applied = ctl
                    .cache
                    .apply_write_tracked(
                        &ctl.nvs,
                        track,
                        (req.slots[i], first_seq + i as u64),
                        chunk,
                        &actor,
                        &mut undo,
                    )
                    .map_err(|e| Failure::internal_logic(format!("Log(Lock): {e}")))?;
                free.extend(applied.free);
                if applied.queue {
                    to_destage.push(track);
                }
                // A fault here leaves the write partly in the directory.
                faults::CACHE_APPLY_TRACK.check()?;
            }
            Ok(())
        }));
    let failure = match applied {
        Ok(Ok(())) => None,
        Ok(Err(f)) => Some(f),
        Err(panic) => Some(apply_panic(&*panic)),
    };
    if let Some(failure) = failure {
        recover_apply(&ctl, &mut req, &actor, &point, &undo);
        // The superseded records stay: after a rollback the directory names
        // them again; after an escalation rung 4 decides (and queues every
        // dirty track of the rebuilt directory for destage).
        return Err(failure);
    }
    drop(actor);
    drop(changing);
    for track in to_destage {
        ctl.destage.push(track);
    }
    req.slot_state = SlotState::Applied;
    req.slots.clear();
    // Invalidated by the apply, under the lock; given back now, or at the
    // epoch's commit under output commit.
    ctl.epochs.retire(&ctl, &free);
    crate::engine::destage::kick_batch(&ctl);
    if req.header.flags & cflags::FUA != 0 {
        next(
            ctx,
            req,
            stage!(ctl.groups.device, Priority::High, fua, faults::DEVICE_FUA),
        );
    } else {
        if !ctl.epochs.enabled() {
            // Under output commit the payload is kept until the reply
            // leaves: a rollback runs the write again.
            req.payload = Vec::new();
        }
        next(
            ctx,
            req,
            stage!(
                ctl.groups.host,
                Priority::High,
                reply_ok,
                faults::HOST_REPLY
            ),
        );
    }
    Ok(())
}

/// Rung 1 through Log(Lock) for a write that failed inside `cache.apply`
/// (the paper's "panic inside cache processing"). The resource recovery
/// protocol has nothing to release (the shard locks are released; the NVS
/// slots are the request's). The state recovery protocol, on the merged
/// restoration level of the shards the write changed since the recovery
/// point, with the criterion DR, LU and RR forbidden:
///
/// - rule 1 (criterion met: no other actor read or overwrote a changed
///   shard): single-actor rollback. With the shards locked, Log(Lock)
///   re-checks and the directory entries are put back; the write is then
///   exactly "records written, not in the directory", and its clean-up
///   block redrives it from `nvs.write` (still rung 1).
/// - rules 2 and 3 (a dirty read or a lost update): rolling back alone
///   would lose or contradict what the other actor did; multi-actor
///   rollback and error compensation are not implemented for the cache,
///   so the system-level strategy is taken: the clean-up block escalates
///   to rung 4, which rebuilds the directory from the recovery box.
fn recover_apply(
    ctl: &Arc<Engine>,
    req: &mut Request,
    actor: &loglock::Actor,
    point: &loglock::RecoveryPoint,
    undo: &[crate::store::cache::ApplyUndo],
) {
    if undo.is_empty() {
        // Nothing of the write entered the directory.
        req.rolled_back = true;
        return;
    }
    let locks = ctl.cache.undo_locks(undo);
    let why = match actor.decide(point, &locks) {
        Ok(d) if d.single_actor_rollback() => {
            if ctl
                .cache
                .undo_apply(&ctl.nvs, undo, || actor.rollback(point).is_ok())
            {
                req.rolled_back = true;
                ctl.metrics.apply_rollbacks.fetch_add(1, Ordering::Relaxed);
                req.note = Some(format!(
                    "Log(Lock): no dirty read or lost update on {} shards since the recovery point, {} tracks rolled back alone",
                    locks.len(),
                    undo.len()
                ));
                return;
            }
            "Log(Lock): another actor interfered between the decision and the rollback".to_owned()
        }
        Ok(d) => format!(
            "Log(Lock) restoration level DR={} LU={} UR={} CD={} on {} shards: {:?} allowed, system level taken",
            d.level.dr,
            d.level.lu,
            d.level.ur,
            d.level.cd,
            locks.len(),
            d.strategies
        ),
        Err(e) => format!("Log(Lock) could not decide: {e}"),
    };
    tracing::warn!(cookie = req.header.cookie, %why, "a write failed inside cache.apply");
    ctl.metrics
        .apply_escalations
        .fetch_add(1, Ordering::Relaxed);
    req.note = Some(why);
}

/// device: make a FUA write durable before its reply.
pub(super) fn fua(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    match ctl.config.flush {
        FlushPolicy::Devices => {
            let first = req.first_track();
            let tracks = req
                .durable_left
                .take()
                .unwrap_or_else(|| (first..first + req.tracks()).collect());
            durable(
                ctx,
                &ctl,
                req,
                tracks,
                stage!(ctl.groups.device, Priority::High, fua, faults::DEVICE_FUA),
            );
        }
        FlushPolicy::Nvs => finish_io(req, ctl.nvs.sync().map_err(std::io::Error::other)),
    }
    Ok(())
}

/// device: FLUSH: every track dirty when it arrived is destaged, then the
/// devices (or the NVS) synced.
pub(super) fn flush(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    let tracks = req
        .durable_left
        .take()
        .unwrap_or_else(|| ctl.cache.dirty_snapshot());
    durable(
        ctx,
        &ctl,
        req,
        tracks,
        stage!(
            ctl.groups.device,
            Priority::Medium,
            flush,
            faults::DEVICE_FLUSH
        ),
    );
    Ok(())
}

/// Tracks one round of a FUA or FLUSH destages before it yields its worker.
const DURABLE_ROUND_TRACKS: usize = 256;

/// One round of making `tracks` durable for a FUA or FLUSH: destage each
/// of the first [`DURABLE_ROUND_TRACKS`] that can be now; if more remain,
/// run `again` at once (a FLUSH of many dirty tracks does not hold a
/// worker for all of them); if some must wait (a destage of it in flight,
/// a full device queue, a degraded volume holding it), run `again` after
/// a back-off instead of waiting on the worker, so a long wait holds no
/// worker and a system recovery finds the request parked at its next
/// stage entry. Then sync; past [`crate::engine::destage::FORCE_WAIT`], `EIO`.
fn durable(
    ctx: &mut TaskCtx<'_>,
    ctl: &Arc<Engine>,
    mut req: Box<Request>,
    mut tracks: Vec<u64>,
    again: StageRef,
) {
    use crate::engine::destage::{FORCE_WAIT, Forced, settle, try_force};
    let deadline = *req
        .durable_deadline
        .get_or_insert_with(|| Instant::now() + FORCE_WAIT);
    // Every device write done before this request began (background
    // destages settled, zeroings) is covered by a sync that starts after
    // this mark: the settle below of this round's own writes is one, so
    // the final sync is often done already.
    let mark = *req
        .durable_mark
        .get_or_insert_with(|| ctl.volume.sync_mark());
    // Not tried this round: first in the next one.
    let mut left = if tracks.len() > DURABLE_ROUND_TRACKS {
        tracks.split_off(DURABLE_ROUND_TRACKS)
    } else {
        Vec::new()
    };
    let untried = !left.is_empty();
    let mut backed_off = None;
    let mut written = Vec::new();
    let mut failed = None;
    for track in tracks {
        match try_force(ctl, track) {
            Ok(Forced::Done) => {}
            Ok(Forced::Written(u)) => written.push(u),
            Ok(Forced::InFlight) => left.push(track),
            Ok(Forced::BackedOff(e)) => {
                backed_off.get_or_insert((track, e));
                left.push(track);
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    // One sync for the round's writes; a failure answers EIO (the tracks
    // stay dirty: a FLUSH is never answered success while they are).
    let settled = settle(ctl, written);
    if let Some(e) = failed.or(settled.err()) {
        finish_io(req, Err(e));
        return;
    }
    if left.is_empty() {
        finish_io(req, ctl.sync_durable_after(mark));
        return;
    }
    // A track it waits for may be written and waiting for the syncer.
    ctl.destage.hurry();
    if let Some((kind, why)) = ctl.destage.failing() {
        // What it waits for is failing on the devices: never wait for
        // success that may not come, answer EIO now (the tracks stay
        // dirty; a later FLUSH tries again).
        finish_io(req, Err(std::io::Error::new(kind, why)));
        return;
    }
    if Instant::now() >= deadline {
        finish_io(
            req,
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "{} tracks (track {} first) stayed dirty for {FORCE_WAIT:?}",
                    left.len(),
                    left[0]
                ),
            )),
        );
        return;
    }
    if untried && backed_off.is_none() {
        req.durable_left = Some(left);
        continue_after(ctx, ctl, std::time::Duration::ZERO, req, again);
        return;
    }
    let wait = crate::backend::devqueue::backoff(req.durable_waits);
    if let (Some((track, e)), 0) = (backed_off, req.durable_waits) {
        // Rung 1, once per request: the I/O backs off.
        ctl.recoveries.record(
            Rung::Task,
            format!("{e}: forced destage of track {track} backed off"),
            wait,
            1,
        );
    }
    req.durable_waits += 1;
    req.durable_left = Some(left);
    continue_after(ctx, ctl, wait, req, again);
}

/// Longest a TRIM or WRITE_ZEROES waits for its range (a held destage
/// write in it, an edge track whose stripe waits for a replacement device)
/// before it answers `EIO` (as long as a FLUSH waits for a destage).
const ZERO_WAIT: std::time::Duration = crate::engine::destage::FORCE_WAIT;

/// device: TRIM and WRITE_ZEROES (both leave the range reading as zeroes).
///
/// The range is fenced against destage first. Whatever it must wait for
/// (under output commit, a destage write in the range held until its
/// epoch commits, which would undo the zeroing if it landed after it; on a
/// degraded volume, an edge track whose stripe waits for a replacement)
/// it waits for as FLUSH does: the stage runs again after a back-off,
/// holding no worker in between, keeping its fence, up to [`ZERO_WAIT`].
///
/// The devices keep the range's space allocated unless the configuration
/// says `discard = "unmap"` ([`crate::config::Discard`]).
pub(super) fn zero(ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let ctl = Arc::clone(req.ctl());
    let again = stage!(
        ctl.groups.device,
        Priority::Medium,
        zero,
        faults::DEVICE_ZERO
    );
    let (first, end) = (req.first_track(), req.first_track() + req.tracks());
    let no_hole = req.header.kind == cmd::WRITE_ZEROES && req.header.flags & cflags::NO_HOLE != 0;
    let keep = ctl.config.discard.keeps_allocation(no_hole);
    let deadline = *req
        .durable_deadline
        .get_or_insert_with(|| Instant::now() + ZERO_WAIT);
    let (fence, seq) = match req.zero_fence {
        // A rung 3 or 4 rebuild since the last try dropped every fence.
        Some((fence, seq)) if ctl.cache.holds_zeroing(fence) => (fence, seq),
        _ => {
            let seq = ctl.nvs.next_seqs(1);
            let fence = ctl.cache.begin_zeroing(first, end);
            req.zero_fence = Some((fence, seq));
            (fence, seq)
        }
    };
    // A destage in flight in the range is routine (under output commit
    // it lasts until its epoch commits); a degraded volume holding an
    // edge track is a fault's consequence, recorded once as rung 1.
    let destaging = ctl.cache.destaging_in(first, end);
    let zeroed = if destaging {
        Err(std::io::Error::new(
            std::io::ErrorKind::ResourceBusy,
            format!("a destage of a track in {first}..{end} is in flight"),
        ))
    } else {
        // Renamed tracks (output commit's renaming) go home once home is
        // zero.
        ctl.volume
            .zero_tracks(first, end, keep)
            .and_then(|()| ctl.epochs.device.unmap_range(first, end))
    };
    match zeroed {
        Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy && Instant::now() < deadline => {
            let wait = crate::backend::devqueue::backoff(req.durable_waits);
            if !destaging && !std::mem::replace(&mut req.zero_held_recorded, true) {
                ctl.recoveries
                    .record(Rung::Task, format!("{e}: zeroing backed off"), wait, 1);
            }
            req.durable_waits += 1;
            continue_after(ctx, &ctl, wait, req, again);
            return Ok(());
        }
        _ => {}
    }
    req.zero_fence = None;
    // Even if the devices failed, lift the fence: records stay dirty and
    // the old data is still what reads return.
    let freed = {
        let _changing = ctl.epochs.changing();
        let below = if zeroed.is_ok() { seq } else { 0 };
        ctl.cache.end_zeroing(&ctl.nvs, first, end, below, fence)
    };
    // Invalidated by end_zeroing, under the lock.
    ctl.epochs.retire(&ctl, &freed);
    let synced = zeroed.and_then(|()| {
        if req.header.flags & cflags::FUA != 0 {
            ctl.volume.sync()
        } else {
            Ok(())
        }
    });
    finish_io(req, synced);
    Ok(())
}

fn finish_io(req: Box<Request>, result: std::io::Result<()>) {
    match result {
        Ok(()) => req.reply(Ok(())),
        Err(e) if e.kind() == std::io::ErrorKind::StorageFull => {
            tracing::error!(error = %e, "device operation failed: a device is full");
            req.reply(Err((NbdError::NoSpc, "a device is full")));
        }
        Err(e) => {
            tracing::error!(error = %e, "device operation failed");
            req.reply(Err((NbdError::Io, "device I/O failed")));
        }
    }
}

/// host: a successful reply.
#[allow(
    clippy::boxed_local,
    reason = "a Stage: requests move between tasks boxed"
)]
pub(super) fn reply_ok(_ctx: &mut TaskCtx<'_>, req: Box<Request>) -> Result<(), Failure> {
    req.reply(Ok(()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(kind: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            kind,
            cookie: 1,
            offset,
            length,
        }
    }

    fn export(size: u64, read_only: bool) -> crate::nbd::handshake::ExportInfo {
        crate::nbd::handshake::ExportInfo {
            name: "rebound".into(),
            description: String::new(),
            size_bytes: size,
            min_block_bytes: 1,
            preferred_block_bytes: 4096,
            max_payload_bytes: MAX_PAYLOAD_BYTES,
            read_only,
        }
    }

    #[test]
    fn validation_refuses_bad_ranges_flags_and_commands_at_any_alignment() {
        let size = 1 << 20;
        let ex = export(size, false);
        let v = |h: RequestHeader, structured: bool| validate(&h, &ex, structured, 0);
        let e = |r: Result<(), (NbdError, &str)>| r.unwrap_err().0;
        assert!(v(h(cmd::READ, 0, 0, 4096), false).is_ok());
        assert!(v(h(cmd::WRITE, cflags::FUA, size - 4096, 4096), false).is_ok());
        // Any byte offset and length inside the export is valid.
        assert!(v(h(cmd::READ, 0, 512, 4096), false).is_ok());
        assert!(v(h(cmd::WRITE, 0, 1, 100), false).is_ok());
        assert!(!whole_tracks(&h(cmd::WRITE, 0, 1, 100)));
        assert!(whole_tracks(&h(cmd::WRITE, 0, 8192, 4096)));
        assert!(whole_tracks(&h(cmd::BLOCK_STATUS, 0, 7, 3)));
        assert_eq!(e(v(h(cmd::WRITE, 0, size, 4096), false)), NbdError::NoSpc);
        assert_eq!(e(v(h(cmd::READ, 0, size, 4096), false)), NbdError::Inval);
        assert_eq!(e(v(h(cmd::READ, 0, size - 1, 2), false)), NbdError::Inval);
        assert_eq!(
            e(v(h(cmd::READ, 0, u64::MAX - 4095, 4096), false)),
            NbdError::Inval
        );
        assert_eq!(
            e(v(h(cmd::WRITE, 0, u64::MAX - 4095, 8192), false)),
            NbdError::NoSpc
        );
        assert_eq!(
            e(v(h(cmd::READ, cflags::DF, 0, 4096), false)),
            NbdError::Inval
        );
        assert!(v(h(cmd::READ, cflags::DF, 0, 4096), true).is_ok());
        assert!(v(h(cmd::WRITE_ZEROES, cflags::FAST_ZERO, 0, 4096), false).is_ok());
        assert_eq!(
            e(v(h(cmd::WRITE, cflags::FAST_ZERO, 0, 4096), false)),
            NbdError::Inval
        );
        assert_eq!(e(v(h(cmd::FLUSH, 0, 4096, 0), false)), NbdError::Inval);
        assert_eq!(e(v(h(42, 0, 0, 0), false)), NbdError::Inval);
        assert!(v(h(cmd::CACHE, 0, 0, 4096), false).is_ok());
        assert_eq!(
            e(v(h(cmd::CACHE, cflags::FUA, 0, 4096), false)),
            NbdError::Inval
        );
        assert_eq!(
            e(v(h(cmd::BLOCK_STATUS, 0, 0, 4096), false)),
            NbdError::Inval
        );
        assert!(v(h(cmd::BLOCK_STATUS, cflags::REQ_ONE, 0, 4096), true).is_ok());
        assert_eq!(e(v(h(cmd::BLOCK_STATUS, 0, 0, 0), true)), NbdError::Inval);
        let big = export(1 << 40, false);
        let over = h(cmd::READ, 0, 0, MAX_PAYLOAD_BYTES + 4096);
        assert_eq!(e(validate(&over, &big, false, 0)), NbdError::Overflow);
        assert!(
            validate(&over, &big, false, 8192).is_ok(),
            "an expanded read"
        );
    }

    #[test]
    fn a_read_only_export_refuses_every_change_with_eperm() {
        let ex = export(1 << 20, true);
        for kind in [cmd::WRITE, cmd::TRIM, cmd::WRITE_ZEROES] {
            assert_eq!(
                validate(&h(kind, 0, 0, 4096), &ex, true, 0).unwrap_err().0,
                NbdError::Perm
            );
        }
        assert!(validate(&h(cmd::READ, 0, 0, 4096), &ex, true, 0).is_ok());
        assert!(validate(&h(cmd::FLUSH, 0, 0, 0), &ex, true, 0).is_ok());
    }
}
