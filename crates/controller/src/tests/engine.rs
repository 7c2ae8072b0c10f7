//! The engine driven in-process: a controller opened on files in a temp
//! dir, requests admitted as a connection would admit them, replies
//! watched through a test [`ReplySink`]. No socket, no binary: the data
//! path, destage, epochs with rollback (rung 3) and system recovery
//! (rung 4) are exercised directly.
//!
//! Fault points are process-wide (rcs's registry), so the tests that run
//! requests take [`SERIAL`] and never overlap.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use proptest::prelude::*;

use crate::config::{Config, OutputCommit, OutputCommitSetting};
use crate::controller::Controller;
use crate::engine::request::Request;
use crate::engine::{Engine, ReplySink, admission};
use crate::faults::Fault;
use crate::limits::TRACK_BYTES;
use crate::nbd::proto::{NbdError, RequestHeader, cmd};

/// One engine test at a time (fault points are global).
static SERIAL: Mutex<()> = Mutex::new(());

/// A reply as a client would see it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reply {
    result: Result<(), NbdError>,
    data: Vec<u8>,
}

/// A [`ReplySink`] that keeps every reply by cookie.
#[derive(Debug, Default)]
struct Recorder {
    replies: Mutex<HashMap<u64, Reply>>,
    arrived: Condvar,
    unfinished: Mutex<i64>,
}

impl ReplySink for Recorder {
    fn structured(&self) -> bool {
        true
    }

    fn send_reply(
        &self,
        header: &RequestHeader,
        result: Result<(), (NbdError, &str)>,
        data: Vec<u8>,
    ) {
        let reply = Reply {
            result: result.map_err(|(e, _)| e),
            data,
        };
        let previous = self.replies.lock().insert(header.cookie, reply);
        assert!(
            previous.is_none(),
            "two replies to cookie {}",
            header.cookie
        );
        self.arrived.notify_all();
    }

    fn finish_request(&self) {
        *self.unfinished.lock() -= 1;
    }

    fn cork(&self) -> bool {
        false
    }

    fn uncork(&self) {
        unreachable!("never corked");
    }
}

/// A controller on a temp dir, and a client of it.
struct Bench {
    ctl: Arc<Controller>,
    sink: Arc<Recorder>,
    next_cookie: u64,
    _dir: tempfile::TempDir,
}

impl Bench {
    fn open(output_commit: OutputCommit) -> Self {
        Self::open_with(|c| c.output_commit = OutputCommitSetting(output_commit))
    }

    /// A controller on a temp dir with small sizes, changed by `tune`.
    fn open_with(tune: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = super::temp_config(dir.path());
        tune(&mut config);
        let ctl = Controller::open(config).expect("opening the controller");
        Self {
            ctl,
            sink: Arc::default(),
            next_cookie: 1,
            _dir: dir,
        }
    }

    fn engine(&self) -> &Arc<Engine> {
        self.ctl.engine()
    }

    /// Admit one request as a connection would, and wait for its reply.
    fn run(&mut self, kind: u16, track: u64, tracks: u32, payload: Vec<u8>) -> Reply {
        let cookie = self.submit(kind, track, tracks, payload);
        self.reply(cookie)
    }

    /// Admit one request as a connection would; its cookie.
    fn submit(&mut self, kind: u16, track: u64, tracks: u32, payload: Vec<u8>) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = RequestHeader {
            flags: 0,
            kind,
            cookie,
            offset: track * TRACK_BYTES as u64,
            length: tracks * TRACK_BYTES as u32,
        };
        let sink: Arc<dyn ReplySink> = Arc::clone(&self.sink) as Arc<dyn ReplySink>;
        let mut req = Box::new(Request::new(Arc::clone(self.engine()), sink, header));
        let slots = if kind == cmd::WRITE { tracks } else { 0 };
        req.payload = payload;
        *self.sink.unfinished.lock() += 1;
        admission::admit(self.engine(), req, slots, None);
        cookie
    }

    /// Wait for the reply to `cookie`.
    fn reply(&self, cookie: u64) -> Reply {
        let mut replies = self.sink.replies.lock();
        loop {
            if let Some(r) = replies.remove(&cookie) {
                return r;
            }
            let waited = self
                .sink
                .arrived
                .wait_for(&mut replies, Duration::from_secs(30));
            assert!(!waited.timed_out(), "no reply to cookie {cookie} in 30 s");
        }
    }

    /// Wait until every admitted request has finished (a request ends
    /// just after its reply leaves).
    fn all_finished(&self) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while *self.sink.unfinished.lock() != 0 {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    fn write(&mut self, track: u64, byte: u8) -> Reply {
        self.run(cmd::WRITE, track, 1, vec![byte; TRACK_BYTES])
    }

    fn read(&mut self, track: u64) -> Reply {
        self.run(cmd::READ, track, 1, Vec::new())
    }

    fn flush(&mut self) -> Reply {
        self.run(cmd::FLUSH, 0, 0, Vec::new())
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        let flushed = self.ctl.shutdown();
        if !std::thread::panicking() {
            flushed.expect("shutdown flushes");
        }
    }
}

/// Wait up to 20 s for `done`.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 20 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn ok_with(byte: u8) -> Reply {
    Reply {
        result: Ok(()),
        data: vec![byte; TRACK_BYTES],
    }
}

#[test]
fn a_write_is_read_back_and_a_flush_puts_it_on_the_devices() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Off);
    assert_eq!(b.write(3, 0xab).result, Ok(()));
    assert_eq!(b.read(3), ok_with(0xab));
    assert_eq!(
        b.read(4),
        ok_with(0),
        "a track never written reads as zeroes"
    );
    assert_eq!(b.flush().result, Ok(()));
    assert_eq!(b.engine().dirty_tracks(), 0, "FLUSH destages everything");
    let mut on_device = vec![0u8; TRACK_BYTES];
    b.engine().volume.read_track(3, &mut on_device).unwrap();
    assert_eq!(on_device, vec![0xab; TRACK_BYTES]);
    assert!(b.all_finished(), "every request finishes once");
}

#[test]
fn requests_out_of_range_are_refused_and_change_nothing() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Off);
    let tracks = b.engine().volume.tracks();
    assert_eq!(
        b.write(tracks, 1).result,
        Err(NbdError::NoSpc),
        "a write past the end"
    );
    assert_eq!(
        b.read(tracks).result,
        Err(NbdError::Inval),
        "a read past the end"
    );
    assert_eq!(b.engine().dirty_tracks(), 0);
    assert_eq!(
        b.engine().nvs.free_slots(),
        b.engine().nvs.slot_count(),
        "no NVS slot kept"
    );
    assert!(b.all_finished());
}

#[test]
fn a_cache_larger_than_the_volume_gets_one_frame_per_track_and_keeps_them_all() {
    use std::sync::atomic::Ordering::Relaxed;
    let _serial = SERIAL.lock();
    {
        let b = Bench::open_with(|c| c.cache_size = 1 << 20);
        assert_eq!(
            b.engine().cache.frames(),
            (1 << 20) / TRACK_BYTES,
            "a cache smaller than its volume keeps the size asked"
        );
    }
    let mut b = Bench::open_with(|c| {
        c.volume_size = 1 << 20;
        c.cache_size = 64 << 20;
    });
    let tracks = b.engine().volume.tracks();
    assert_eq!(tracks, 256);
    assert_eq!(
        b.engine().cache.frames(),
        tracks as usize,
        "64 MiB of cache over a 1 MiB volume: one frame per track"
    );
    for t in 0..tracks {
        assert_eq!(b.write(t, t as u8 ^ 0x5a).result, Ok(()));
    }
    assert_eq!(b.flush().result, Ok(()));
    let before = b.engine().cache.stats().hits.load(Relaxed);
    for t in 0..tracks {
        assert_eq!(b.read(t), ok_with(t as u8 ^ 0x5a));
    }
    assert_eq!(
        b.engine().cache.stats().hits.load(Relaxed) - before,
        tracks,
        "every track of the volume still has its frame"
    );
}

#[test]
fn a_panicking_stage_is_redriven_and_the_write_is_kept() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Off);
    let fault = Fault::parse(&["panic", "nvs.write", "count=1"]).unwrap();
    crate::engine::inject::arm(b.engine(), &fault).unwrap();
    let before = b.engine().recoveries.count(crate::recovery::Rung::Task);
    assert_eq!(
        b.write(7, 0x5a).result,
        Ok(()),
        "redriven, then acknowledged"
    );
    rcs::fault::disarm_all();
    assert!(b.engine().recoveries.count(crate::recovery::Rung::Task) > before);
    assert_eq!(b.read(7), ok_with(0x5a));
}

#[test]
fn system_recovery_in_process_keeps_every_acknowledged_write() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Off);
    for t in 0..8 {
        assert_eq!(b.write(t, t as u8 + 1).result, Ok(()));
    }
    assert_eq!(b.flush().result, Ok(()));
    for t in 4..8 {
        assert_eq!(b.write(t, 0xf0 + t as u8).result, Ok(()));
    }
    let rung4 = b.engine().recoveries.count(crate::recovery::Rung::System);
    b.engine().system_recover("engine test").expect("rung 4");
    assert_eq!(
        b.engine().recoveries.count(crate::recovery::Rung::System),
        rung4 + 1
    );
    for t in 0..4 {
        assert_eq!(b.read(t), ok_with(t as u8 + 1), "destaged track {t}");
    }
    for t in 4..8 {
        assert_eq!(b.read(t), ok_with(0xf0 + t as u8), "dirty track {t}");
    }
}

#[test]
fn a_rollback_keeps_every_acknowledged_write_under_output_commit() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Buffering);
    assert_eq!(b.write(1, 0x11).result, Ok(()));
    assert_eq!(b.write(2, 0x22).result, Ok(()));
    let rollbacks = b
        .engine()
        .epochs
        .stats()
        .rollbacks
        .load(std::sync::atomic::Ordering::Relaxed);
    b.engine().rollback("engine test").expect("rung 3");
    assert_eq!(
        b.engine()
            .epochs
            .stats()
            .rollbacks
            .load(std::sync::atomic::Ordering::Relaxed),
        rollbacks + 1
    );
    assert_eq!(b.read(1), ok_with(0x11));
    assert_eq!(b.read(2), ok_with(0x22));
    assert_eq!(b.write(2, 0x33).result, Ok(()));
    assert_eq!(b.flush().result, Ok(()));
    assert_eq!(b.read(2), ok_with(0x33));
}

/// Arm `fault` on every device of the volume.
fn slow_every_device(engine: &Engine, fault: crate::faults::DeviceFault) {
    let mut devices = 0;
    while engine.volume.arm_device_fault(devices, fault).is_ok() {
        devices += 1;
    }
    assert!(devices > 0, "no device to slow down");
}

/// Whether every byte of `track` on the devices is `byte`.
fn on_device(engine: &Engine, track: u64, byte: u8) -> bool {
    let mut data = vec![0u8; TRACK_BYTES];
    engine
        .volume
        .read_track(track, &mut data)
        .expect("device read");
    data.iter().all(|&x| x == byte)
}

/// An epoch that a reply makes due is committed by the replying thread:
/// its replies leave at the cut, and its device outputs (held destage
/// writes) are left to the checkpoint thread. Replies do not wait for
/// them. A rollback (rung 3) or a system recovery (rung 4) that comes
/// before they are released releases them first (those epochs are
/// committed): rung 4 puts the held writes on the devices; rung 3 drops
/// them, as no FLUSH or FUA waits for them (their tracks stay dirty).
/// Either way none is left behind and every acknowledged write reads
/// back.
#[test]
fn replies_leave_while_device_outputs_wait_behind_and_a_recovery_releases_those_first() {
    use std::sync::atomic::Ordering::Relaxed;
    for rung in [3, 4] {
        let _serial = SERIAL.lock();
        // A long interval: the checkpoint thread commits only when kicked.
        let mut b = Bench::open_with(|c| {
            c.output_commit = OutputCommitSetting(OutputCommit::Buffering);
            c.checkpoint_interval = Duration::from_secs(10);
        });
        let engine = Arc::clone(b.engine());
        let here = |e: &Engine| e.epochs.stats().here_commits.load(Relaxed);
        let here_before = here(&engine);
        // No device output is released while this is held. The checkpoint
        // thread may then wait for it too, so every request here is spaced
        // past EPOCH_MIN (100 µs): its reply's thread commits the epoch
        // itself instead of leaving it to that thread.
        let behind = engine.epochs.behind_serial.lock();
        for t in 0..4 {
            std::thread::sleep(Duration::from_millis(1));
            assert_eq!(b.write(t, 0x50 + t as u8).result, Ok(()));
        }
        crate::engine::destage::kick(&engine);
        eventually("the four destage writes held by the pseudo-device", || {
            engine.epochs.device.held() == 4
        });
        // Each read's epoch carries the held writes; its reply still leaves.
        for t in 0..4 {
            std::thread::sleep(Duration::from_millis(1));
            assert_eq!(b.read(t), ok_with(0x50 + t as u8), "track {t}");
        }
        assert!(
            engine.epochs.outputs_behind() > 0,
            "no committed epoch left its device outputs behind"
        );
        assert!(
            here(&engine) > here_before,
            "no epoch was committed by the replying thread"
        );
        assert_eq!(
            engine.epochs.device.held(),
            4,
            "a device output was released while they were held back"
        );
        let recovery = std::thread::spawn({
            let engine = Arc::clone(&engine);
            move || match rung {
                3 => engine.rollback("engine test: outputs behind").map(drop),
                _ => engine
                    .system_recover("engine test: outputs behind")
                    .map(drop),
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(behind);
        recovery
            .join()
            .expect("recovery thread")
            .unwrap_or_else(|e| panic!("rung {rung}: {e}"));
        assert_eq!(
            engine.epochs.outputs_behind(),
            0,
            "rung {rung} left device outputs behind"
        );
        // Rung 3 drops them (nothing waited for them), rung 4 writes them.
        for t in 0..4u64 {
            assert_eq!(
                on_device(&engine, t, 0x50 + t as u8),
                rung == 4,
                "rung {rung}, track {t}: the committed epoch's held write"
            );
        }
        assert!(
            rung == 4 || engine.dirty_tracks() == 4,
            "rung 3 lost a dirty track"
        );
        for t in 0..4 {
            assert_eq!(
                b.read(t),
                ok_with(0x50 + t as u8),
                "rung {rung}, track {t} after the recovery"
            );
        }
        assert_eq!(b.flush().result, Ok(()));
        assert!(b.all_finished());
    }
}

/// Output commit holds at most its cap of destage writes: background
/// destage pauses there and leaves the rest of its batch queued (read
/// from the NVS meanwhile), then goes on after each commit takes the
/// held writes off, never holding more than the cap (plus one a second
/// destage task may have begun beside the first). Every write reads back
/// throughout and reaches the devices.
#[test]
fn background_destage_pauses_at_the_held_write_cap_until_a_commit_takes_them_off() {
    const CAP: usize = 8;
    // Fewer than a batch: no write kicks destage (only the tick may).
    const TRACKS: u64 = crate::limits::DESTAGE_BATCH_TRACKS as u64 - 1;
    let most_held = CAP + crate::limits::DESTAGE_TASKS_MAX as usize - 1;
    let _serial = SERIAL.lock();
    // A long interval: commits come from replies and from this test.
    let mut b = Bench::open_with(|c| {
        c.output_commit = OutputCommitSetting(OutputCommit::Buffering);
        c.checkpoint_interval = Duration::from_secs(10);
    });
    let engine = Arc::clone(b.engine());
    engine.epochs.device.cap_held(CAP);
    let byte = |t: u64| 0x20 + t as u8;
    for t in 0..TRACKS {
        assert_eq!(b.write(t, byte(t)).result, Ok(()));
    }
    // No device output is released while this is held. The checkpoint
    // thread may then wait for it too, so every request meanwhile is
    // spaced past EPOCH_MIN: its reply's thread commits the epoch itself.
    let behind = engine.epochs.behind_serial.lock();
    crate::engine::destage::kick(&engine);
    eventually("destage stopped at the cap", || {
        engine.epochs.device.held() >= CAP && engine.destage.inflight() == 0
    });
    let held = engine.epochs.device.held();
    assert!(held <= most_held, "{held} writes held with a cap of {CAP}");
    assert_eq!(
        engine.destage.len() as u64,
        engine.dirty_tracks() - held as u64,
        "the dirty tracks past the cap wait in the destage queue"
    );
    for t in 0..TRACKS {
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(b.read(t), ok_with(byte(t)), "track {t} while held");
    }
    drop(behind);
    let mut most = 0;
    eventually("every track destaged, the cap's writes a commit", || {
        most = most.max(engine.epochs.device.held());
        engine.epochs.commit(&engine);
        engine.dirty_tracks() == 0 && engine.epochs.device.held() == 0
    });
    assert!(
        most <= most_held,
        "{most} writes held at once with a cap of {CAP}"
    );
    for t in 0..TRACKS {
        assert!(on_device(&engine, t, byte(t)), "track {t} on the devices");
        assert_eq!(b.read(t), ok_with(byte(t)), "track {t} after");
    }
    assert!(b.all_finished());
}

#[test]
fn a_commit_that_releases_only_replies_does_not_hurry_the_destage_syncer() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Buffering);
    let commits = |b: &Bench| {
        b.engine()
            .epochs
            .stats()
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = commits(&b);
    // Reads only: their replies are held, and each commit releases them
    // with no device write to hand to the syncer.
    for t in 0..8 {
        assert_eq!(b.read(t), ok_with(0), "track {t} was never written");
    }
    let after = commits(&b);
    assert!(after > before, "no commit released the held read replies");
    assert!(
        !b.engine().destage.hurried(),
        "a commit with no device writes woke the destage syncer"
    );
}

/// A rollback's quiesce does not wait for the destage syncer's device
/// sync: the committed held writes the syncer holds or is syncing end their
/// destages unwritten, their tracks stay dirty and destage again after.
/// Here every device sync takes 4 s; the rollback returns long before the
/// syncer's could end, and every acknowledged write reads back, then
/// destages once the devices are fast again.
#[test]
fn a_rollback_does_not_wait_for_the_destage_syncers_device_sync() {
    use crate::faults::{DeviceFault, DeviceOp};
    let _serial = SERIAL.lock();
    let mut b = Bench::open_with(|c| {
        c.output_commit = OutputCommitSetting(OutputCommit::Stall);
        c.checkpoint_interval = Duration::from_secs(10);
    });
    let engine = Arc::clone(b.engine());
    let sync_time = Duration::from_secs(4);
    let slow = DeviceFault::Latency {
        op: Some(DeviceOp::Sync),
        delay: sync_time,
        rate: 1.0,
    };
    slow_every_device(&engine, slow);
    for t in 0..4 {
        assert_eq!(b.write(t, 0x60 + t as u8).result, Ok(()));
    }
    crate::engine::destage::kick(&engine);
    eventually("the four destage writes held by the pseudo-device", || {
        engine.epochs.device.held() == 4
    });
    // The commit writes them to the devices and hands them to the syncer,
    // which starts a (slow) sync for them.
    engine.epochs.commit(&engine);
    assert_eq!(engine.epochs.device.held(), 0, "the commit wrote them");
    assert!(
        engine.destage.inflight() > 0,
        "the commit did not hand its writes to the syncer"
    );
    let report = engine
        .rollback("engine test: a slow device sync")
        .expect("rung 3");
    assert!(
        report.total < sync_time / 2,
        "the rollback waited for the syncer's device sync: {report}"
    );
    assert_eq!(report.unsynced_revoked, 4, "{report}");
    assert_eq!(
        engine.dirty_tracks(),
        4,
        "a track whose sync was not waited for is not dirty"
    );
    for t in 0..4 {
        assert_eq!(b.read(t), ok_with(0x60 + t as u8), "track {t}");
    }
    engine.volume.clear_device_faults();
    assert_eq!(b.flush().result, Ok(()));
    assert_eq!(engine.dirty_tracks(), 0, "the flush destaged them");
    for t in 0..4 {
        assert_eq!(
            b.read(t),
            ok_with(0x60 + t as u8),
            "track {t} after the flush"
        );
    }
    assert!(b.all_finished());
}

/// A rollback does not wait for a commit to write held writes that no
/// FLUSH or FUA waits for: the commit stops between tracks, the rest stay
/// held and the rollback drops them (their records are still dirty). Here
/// every device write takes 300 ms and a commit has eight to write; the
/// rollback returns after at most the one being written, and every write
/// reads back, then destages once the devices are fast again.
#[test]
fn a_rollback_stops_a_commit_writing_held_writes_no_flush_waits_for() {
    use crate::faults::{DeviceFault, DeviceOp};
    let _serial = SERIAL.lock();
    let mut b = Bench::open_with(|c| {
        c.output_commit = OutputCommitSetting(OutputCommit::Stall);
        c.checkpoint_interval = Duration::from_secs(10);
    });
    let engine = Arc::clone(b.engine());
    for t in 0..8 {
        assert_eq!(b.write(t, 0x40 + t as u8).result, Ok(()));
    }
    crate::engine::destage::kick(&engine);
    eventually("the eight destage writes held by the pseudo-device", || {
        engine.epochs.device.held() == 8
    });
    let write_time = Duration::from_millis(300);
    let slow = DeviceFault::Latency {
        op: Some(DeviceOp::Write),
        delay: write_time,
        rate: 1.0,
    };
    slow_every_device(&engine, slow);
    let commit = std::thread::spawn({
        let engine = Arc::clone(&engine);
        move || engine.epochs.commit(&engine)
    });
    std::thread::sleep(write_time / 2);
    let report = engine
        .rollback("engine test: a slow commit")
        .expect("rung 3");
    commit.join().expect("commit thread");
    assert!(
        report.total < write_time * 4,
        "the rollback waited for the commit's eight device writes: {report}"
    );
    assert!(
        report.dropped_writes >= 4,
        "the commit wrote what nothing waited for: {report}"
    );
    assert_eq!(engine.dirty_tracks(), 8, "{report}");
    for t in 0..8 {
        assert_eq!(b.read(t), ok_with(0x40 + t as u8), "track {t}");
    }
    engine.volume.clear_device_faults();
    assert_eq!(b.flush().result, Ok(()));
    assert_eq!(engine.dirty_tracks(), 0, "the flush destaged them");
    for t in 0..8 {
        assert!(
            on_device(&engine, t, 0x40 + t as u8),
            "track {t} is not on its device after the flush"
        );
    }
    assert!(b.all_finished());
}

/// What a client does, in the properties below.
#[derive(Debug, Clone)]
enum ClientStep {
    Write(u64, u8),
    Read(u64),
    Flush,
}

/// Client steps, weighted `writes : reads : flushes`.
fn client_step(writes: u32, reads: u32, flushes: u32) -> impl Strategy<Value = ClientStep> {
    prop_oneof![
        writes => (0u64..12, any::<u8>()).prop_map(|(t, b)| ClientStep::Write(t, b)),
        reads => (0u64..12).prop_map(ClientStep::Read),
        flushes => Just(ClientStep::Flush),
    ]
}

/// Run `step` against `b`, keeping `model` (track -> last byte written)
/// and checking each reply against it.
fn run_client_step(
    b: &mut Bench,
    model: &mut HashMap<u64, u8>,
    step: ClientStep,
) -> Result<(), TestCaseError> {
    match step {
        ClientStep::Write(t, byte) => {
            prop_assert_eq!(b.write(t, byte).result, Ok(()));
            model.insert(t, byte);
        }
        ClientStep::Read(t) => {
            let want = model.get(&t).copied().unwrap_or(0);
            prop_assert_eq!(b.read(t), ok_with(want));
        }
        ClientStep::Flush => {
            prop_assert_eq!(b.flush().result, Ok(()));
            prop_assert_eq!(b.engine().dirty_tracks(), 0);
        }
    }
    Ok(())
}

/// One step of a client's life, for the property below.
#[derive(Debug, Clone)]
enum Step {
    Client(ClientStep),
    SystemRecovery,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        11 => client_step(6, 4, 1).prop_map(Step::Client),
        1 => Just(Step::SystemRecovery),
    ]
}

/// One step of a client's life under output commit, for the property
/// below: what a client does, and what the controller does on its own
/// (destage, a commit) at any moment.
#[derive(Debug, Clone)]
enum EpochStep {
    Client(ClientStep),
    Destage,
    Commit,
    Rollback,
}

fn epoch_step() -> impl Strategy<Value = EpochStep> {
    prop_oneof![
        10 => client_step(6, 3, 1).prop_map(EpochStep::Client),
        2 => Just(EpochStep::Destage),
        2 => Just(EpochStep::Commit),
        2 => Just(EpochStep::Rollback),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn every_read_returns_the_last_acknowledged_write_through_flushes_and_recoveries(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        let _serial = SERIAL.lock();
        let mut b = Bench::open(OutputCommit::Off);
        let mut model: HashMap<u64, u8> = HashMap::new();
        for s in steps {
            match s {
                Step::Client(step) => run_client_step(&mut b, &mut model, step)?,
                Step::SystemRecovery => {
                    b.engine().system_recover("property test").expect("rung 4");
                }
            }
        }
        for (t, byte) in model {
            prop_assert_eq!(b.read(t), ok_with(byte));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Rollbacks (rung 3) between destages and commits, whose held and
    /// committed-but-unsynced device writes the rollback drops or revokes,
    /// lose no acknowledged write, under every output commit scheme; a
    /// FLUSH still puts everything on the devices.
    #[test]
    fn every_read_returns_the_last_acknowledged_write_through_commits_and_rollbacks(
        scheme in prop_oneof![
            Just(OutputCommit::Stall),
            Just(OutputCommit::Buffering),
            Just(OutputCommit::Logging),
            Just(OutputCommit::Renaming),
        ],
        steps in proptest::collection::vec(epoch_step(), 1..40)
    ) {
        let _serial = SERIAL.lock();
        let mut b = Bench::open(scheme);
        let engine = Arc::clone(b.engine());
        let mut model: HashMap<u64, u8> = HashMap::new();
        for s in steps {
            match s {
                EpochStep::Client(step) => run_client_step(&mut b, &mut model, step)?,
                EpochStep::Destage => crate::engine::destage::kick(&engine),
                EpochStep::Commit => {
                    engine.epochs.commit(&engine);
                }
                EpochStep::Rollback => {
                    engine.rollback("property test").expect("rung 3");
                }
            }
        }
        for (&t, &byte) in &model {
            prop_assert_eq!(b.read(t), ok_with(byte));
        }
        prop_assert_eq!(b.flush().result, Ok(()));
        prop_assert!(engine.epochs.device.holds_none());
        for (&t, &byte) in &model {
            // Through the pseudo-device: a renamed track is read from its
            // slot in the rename area.
            let mut data = vec![0u8; TRACK_BYTES];
            engine.epochs.device.read(&engine.volume, t, &mut data).expect("device read");
            prop_assert!(data.iter().all(|&x| x == byte), "track {} not on its device", t);
        }
        prop_assert!(b.all_finished());
    }
}

#[test]
fn the_scrub_repairs_a_damaged_record_from_its_frame_and_reports_one_without() {
    use std::sync::atomic::Ordering::Relaxed;
    let _serial = SERIAL.lock();
    let mut b = Bench::open_with(|c| c.scrub_interval = Duration::from_millis(100));
    // Destage held: every device submission finds its queue full.
    let hold = Fault::parse(&["fail", "device.queue-full", "count=unlimited"]).unwrap();
    crate::engine::inject::arm(b.engine(), &hold).unwrap();
    assert_eq!(b.write(3, 0x33).result, Ok(()));
    assert_eq!(b.write(4, 0x44).result, Ok(()));
    let e = Arc::clone(b.engine());
    let record = e.cache.newest_record(3).expect("track 3 is dirty");
    e.nvs.damage_slot(record.slot, 64 + 100);
    eventually("the repair", || e.scrub.repaired.load(Relaxed) >= 1);
    assert!(crate::engine::destage::lost_tracks(&e).is_empty());
    // Track 4's record damaged and its frame dropped: nothing to repair
    // from, so the scrub reports the loss before a read meets it.
    crate::engine::inject::arm(&e, &Fault::CorruptRecord(4)).unwrap();
    eventually("the loss", || e.scrub.lost.load(Relaxed) >= 1);
    assert_eq!(crate::engine::destage::lost_tracks(&e), vec![4]);
    rcs::fault::disarm_all();
    assert_eq!(b.read(3), ok_with(0x33), "the repaired record reads back");
    assert_eq!(
        b.read(4).result,
        Err(NbdError::Io),
        "a lost track is never served"
    );
    assert_eq!(
        b.write(4, 0x45).result,
        Ok(()),
        "writing it again ends the loss"
    );
    assert_eq!(b.read(4), ok_with(0x45));
}

#[test]
fn a_write_reaches_the_devices_only_once_its_epoch_commits() {
    use std::sync::atomic::Ordering::Relaxed;
    let _serial = SERIAL.lock();
    let mut b = Bench::open_with(|c| {
        c.output_commit = OutputCommitSetting(OutputCommit::Stall);
        c.checkpoint_interval = Duration::from_millis(50);
    });
    let commits = b.engine().epochs.stats().commits.load(Relaxed);
    // The reply itself waits for the commit (output commit holds it).
    assert_eq!(b.write(9, 0x99).result, Ok(()));
    assert!(b.engine().epochs.stats().commits.load(Relaxed) > commits);
    assert_eq!(b.flush().result, Ok(()));
    let mut on_device = vec![0u8; TRACK_BYTES];
    b.engine().volume.read_track(9, &mut on_device).unwrap();
    assert_eq!(on_device, vec![0x99; TRACK_BYTES]);
    assert_eq!(b.engine().epochs.held_replies(), 0);
}

/// Blocks (of 512 bytes) the file system holds for device 0's file.
fn device_blocks(b: &Bench) -> u64 {
    use std::os::unix::fs::MetadataExt;
    // The volume's name for device 0 (`device<N>.img`).
    let path = b.engine().config.data_dir.join("device0.img");
    std::fs::metadata(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .blocks()
}

/// Whether the file system of `dir` gives space back when a hole is
/// punched: tried once on a scratch device file (a file system without
/// `FALLOC_FL_PUNCH_HOLE` gets zeroes written instead, freeing nothing).
fn punching_frees_space(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;

    use crate::backend::device::{Device, FileDevice};
    let path = dir.join("punch-probe.img");
    let dev = FileDevice::open_or_create(&path, 64 * TRACK_BYTES as u64, false)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    let blocks = || std::fs::metadata(&path).map(|m| m.blocks()).unwrap_or(0);
    let before = blocks();
    dev.zero_range(0, 32 * TRACK_BYTES as u64, false)
        .map_err(|e| format!("cannot zero {}: {e}", path.display()))?;
    let after = blocks();
    drop(dev);
    let _ = std::fs::remove_file(&path);
    if after < before {
        Ok(())
    } else {
        Err(format!(
            "the file system of {} freed nothing when a hole was punched ({before} blocks before, {after} after)",
            dir.display()
        ))
    }
}

/// Tracks 0..RANGE written, destaged, then zeroed by one `kind` request;
/// returns the device file's blocks before and after the zeroing.
fn zero_a_written_range(b: &mut Bench, kind: u16) -> (u64, u64) {
    const RANGE: u32 = 64;
    for t in 0..u64::from(RANGE) {
        assert_eq!(b.write(t, 0xa0 | (t as u8 & 0xf)).result, Ok(()));
    }
    assert_eq!(b.flush().result, Ok(()), "destaged before the zeroing");
    let before = device_blocks(b);
    assert_eq!(b.run(kind, 0, RANGE, Vec::new()).result, Ok(()));
    let after = device_blocks(b);
    for t in [0, 17, u64::from(RANGE) - 1] {
        assert_eq!(b.read(t), ok_with(0), "track {t} reads as zeroes");
        let mut on_device = vec![0xffu8; TRACK_BYTES];
        b.engine().volume.read_track(t, &mut on_device).unwrap();
        assert!(
            on_device.iter().all(|&x| x == 0),
            "track {t} is zero on the device"
        );
    }
    (before, after)
}

#[test]
fn trim_and_write_zeroes_keep_the_device_space_allocated_by_default() {
    let _serial = SERIAL.lock();
    for kind in [cmd::TRIM, cmd::WRITE_ZEROES] {
        let mut b = Bench::open(OutputCommit::Off);
        assert_eq!(b.engine().config.discard, crate::config::Discard::Keep);
        let (before, after) = zero_a_written_range(&mut b, kind);
        // Not exactly equal: marking the range unwritten may cost the
        // file system an extent block, never give space back.
        assert!(
            after >= before,
            "command {kind} gave space back under discard = \"keep\": {before} blocks before, {after} after"
        );
    }
}

#[test]
fn trim_gives_the_device_space_back_under_discard_unmap() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open_with(|c| c.discard = crate::config::Discard::Unmap);
    let punching = punching_frees_space(&b.engine().config.data_dir);
    let (before, after) = zero_a_written_range(&mut b, cmd::TRIM);
    match punching {
        Ok(()) => {
            // 64 tracks of 4 KiB are 512 blocks of 512 bytes; a few may
            // stay as extent blocks.
            let range = 64 * TRACK_BYTES as u64 / 512;
            assert!(
                before.saturating_sub(after) + 16 >= range,
                "a TRIM under discard = \"unmap\" freed {} of its {range} blocks ({before} before, {after} after)",
                before.saturating_sub(after)
            );
        }
        Err(why) => {
            // Only the zeroes can be checked (above).
            eprintln!("not checking that TRIM frees space: {why}");
        }
    }
}

/// Arm `words` (as `rebound inject` would) on every device of `e`.
fn arm_every_device(e: &Arc<Engine>, words: &str) {
    for d in 0..e.volume.health().len() {
        let words = words.replace("DEVICE", &d.to_string());
        let words: Vec<&str> = words.split_whitespace().collect();
        crate::engine::inject::arm(e, &Fault::parse(&words).unwrap()).unwrap();
    }
}

#[test]
fn a_failing_device_sync_keeps_writes_dirty_and_every_flush_fails_until_it_heals() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Off);
    let e = Arc::clone(b.engine());
    arm_every_device(&e, "device-error DEVICE op=sync");
    assert_eq!(b.write(5, 0x55).result, Ok(()), "the NVS takes the write");
    for attempt in 0..3 {
        assert_eq!(
            b.flush().result,
            Err(NbdError::Io),
            "FLUSH {attempt}: never EIO once, then success with the data gone"
        );
    }
    assert!(
        e.cache.is_dirty(5),
        "the record stays until a sync succeeds"
    );
    assert_eq!(b.read(5), ok_with(0x55), "served from the NVS and cache");
    crate::engine::inject::arm(&e, &Fault::Clear).unwrap();
    assert_eq!(b.flush().result, Ok(()));
    assert!(!e.cache.is_dirty(5));
    let mut on_device = vec![0u8; TRACK_BYTES];
    e.volume.read_track(5, &mut on_device).unwrap();
    assert_eq!(on_device, vec![0x55; TRACK_BYTES]);
}

#[test]
fn a_failing_device_write_fills_the_nvs_then_writes_fail_promptly() {
    let _serial = SERIAL.lock();
    // More tracks than NVS slots: distinct writes fill it.
    let mut b = Bench::open_with(|c| c.volume_size = 128 << 20);
    let e = Arc::clone(b.engine());
    arm_every_device(&e, "device-error DEVICE op=write");
    let slots = u64::from(e.nvs.slot_count());
    let started = std::time::Instant::now();
    let mut refused = None;
    for t in 0..slots + 8 {
        let r = b.write(t % e.volume.tracks(), (t % 200) as u8 + 1);
        if r.result.is_err() {
            refused = Some((t, r.result));
            break;
        }
    }
    let (at, result) = refused.expect("a full NVS with failing devices refuses writes");
    assert_eq!(result, Err(NbdError::Io));
    assert!(
        at >= slots / 2,
        "writes were accepted into the NVS first ({at} of {slots})"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "refused promptly, not after hanging"
    );
    let status = crate::control::status::render(&b.ctl);
    assert!(status.contains("errors: read 0, write"), "{status}");
    crate::engine::inject::arm(&e, &Fault::Clear).unwrap();
    assert_eq!(b.flush().result, Ok(()));
    assert_eq!(b.read(0), ok_with(1));
}

#[test]
fn under_output_commit_a_failed_held_write_answers_flush_with_eio() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Stall);
    let e = Arc::clone(b.engine());
    assert_eq!(b.write(7, 0x77).result, Ok(()));
    arm_every_device(&e, "device-error DEVICE op=write");
    assert_eq!(
        b.flush().result,
        Err(NbdError::Io),
        "the epoch's held write failed: its FLUSH is not a success"
    );
    crate::engine::inject::arm(&e, &Fault::Clear).unwrap();
    eventually("the write reaching the device", || {
        b.flush().result == Ok(()) && !e.cache.is_dirty(7)
    });
    let mut on_device = vec![0u8; TRACK_BYTES];
    e.volume.read_track(7, &mut on_device).unwrap();
    assert_eq!(on_device, vec![0x77; TRACK_BYTES]);
}

/// The value of sample `name` (labels included) in an exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
}

#[test]
fn the_request_and_recovery_histograms_count_what_happened() {
    let _serial = SERIAL.lock();
    let mut b = Bench::open(OutputCommit::Off);
    let before = b.ctl.render_metrics();
    for t in 0..5 {
        assert_eq!(b.write(t, 0x11).result, Ok(()));
    }
    for t in 0..3 {
        assert_eq!(b.read(t), ok_with(0x11));
    }
    b.engine().system_recover("metrics test").expect("rung 4");
    assert!(b.all_finished());
    let after = b.ctl.render_metrics();
    let moved = |name: &str| sample(&after, name) - sample(&before, name);
    for (op, n) in [("write", 5.0), ("read", 3.0)] {
        let count = format!("rebound_request_duration_seconds_count{{op=\"{op}\"}}");
        assert_eq!(moved(&count), n, "{count}");
        let inf = format!("rebound_request_duration_seconds_bucket{{le=\"+Inf\",op=\"{op}\"}}");
        assert_eq!(moved(&inf), n, "{inf}");
        assert!(
            moved(&format!(
                "rebound_request_duration_seconds_sum{{op=\"{op}\"}}"
            )) > 0.0
        );
        assert_eq!(moved(&format!("rebound_requests_total{{op=\"{op}\"}}")), n);
    }
    let system = "{rung=\"4\",name=\"system\"}";
    assert_eq!(
        moved(&format!("rebound_recovery_duration_seconds_count{system}")),
        1.0
    );
    assert_eq!(moved(&format!("rebound_recoveries_total{system}")), 1.0);
    // Every rung has its histogram, the ones rcs times (group) included,
    // and so has every recovery group.
    for rung in crate::recovery::Rung::ALL {
        let labels = format!("rung=\"{}\",name=\"{}\"", rung as u8, rung.name());
        sample(
            &after,
            &format!("rebound_recovery_duration_seconds_count{{{labels}}}"),
        );
        sample(
            &after,
            &format!("rebound_recovery_duration_seconds_bucket{{le=\"300.0\",{labels}}}"),
        );
    }
    sample(
        &after,
        "rebound_rcs_recovery_seconds_count{group=\"cache\"}",
    );
    sample(&after, "rebound_build_info{version=\"0.1.0\"}");
}
