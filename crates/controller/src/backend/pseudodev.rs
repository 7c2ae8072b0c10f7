//! The pseudo-device layer of output commit (paper: revive-io-output-commit,
//! §3 "output commit" for disk writes): every destage write of an epoch
//! passes through it, so no device holds data from an epoch that may still
//! be rolled back, or, for `logging`, the data it overwrote can be put back.
//!
//! | scheme | on write (epoch e open) | at commit of e | at rollback of e |
//! |---|---|---|---|
//! | `stall` | hold the data in memory | write it to the target | drop it |
//! | `buffering` | write it to the buffer area (a file beside the devices, in the page cache: the memory copy) | write the buffer area's copy to the target | drop the buffer entry |
//! | `logging` | copy the old data aside, write in place | drop the old copy | write the old data back (newest first) |
//! | `renaming` | write to a fresh slot of the rename area | remap the track there (durably), free its old slot | free the fresh slot |
//!
//! Reads of a track with a held write (stall, buffering, renaming) are
//! served from the held copy, so a read never sees older data than the
//! directory promises; a renamed track is read from its slot
//! ([`crate::backend::renamemap`]).
//! A held write is taken off only after its data is on the target.
//!
//! The write's destage is not finished while its data is held: the cache
//! directory keeps the track *destaging* and the NVS record valid (and the
//! recovery box naming it) until the commit has written the target; the
//! commit then ends the destage ([`Held::destage`]). A crash before that
//! finds the record in the NVS and destages it again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::backend::bufferarea::{BUFFER_MAPPED_SLOTS, BufferArea, BufferFile};
use crate::backend::renamemap::{RenameMap, Renamed};
use crate::backend::volume::Volume;
use crate::limits::TRACK_BYTES;
use crate::store::cache::Dirty;

/// Rung 3's output commit (ReViveI/O): how writes to the devices are kept
/// from escaping an epoch that may still be rolled back. `Off` disables
/// epochs, held replies and rollback (rung 3 then escalates to rung 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputCommit {
    /// No epochs: replies and device writes leave at once.
    #[default]
    Off,
    /// Hold device writes in memory until their epoch commits.
    Stall,
    /// Write to a buffer area at once; copy to the target after commit.
    Buffering,
    /// Save the old data aside, write in place; restore it on rollback.
    Logging,
    /// Write to a fresh location and remap the track there at commit.
    Renaming,
}

impl OutputCommit {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Stall => "stall",
            Self::Buffering => "buffering",
            Self::Logging => "logging",
            Self::Renaming => "renaming",
        }
    }

    /// Parse the flag's spelling.
    pub fn parse(text: &str) -> Result<Self, String> {
        Ok(match text {
            "off" => Self::Off,
            "stall" => Self::Stall,
            "buffering" => Self::Buffering,
            "logging" => Self::Logging,
            "renaming" => Self::Renaming,
            other => {
                return Err(format!(
                    "unknown output commit scheme {other:?} (off, stall, buffering, logging, renaming)"
                ));
            }
        })
    }
}

/// Held writes at which background destage pauses until a commit takes
/// some off ([`PseudoDevice::full`]): the paper's "private memory area
/// for buffering data", sized for the device bandwidth over an interval
/// (16,384 tracks, 64 MiB: 160 ms of 100,000 track writes a second).
/// Destage that runs further ahead of the commits buys nothing (the
/// records' slots come back only at the commits) and costs: under
/// `buffering` the held writes past the buffer area's mapped slots are a
/// `pwrite` when held and a `pread` at the commit, and under `stall` each
/// is a heap copy. Forced destages (FLUSH, FUA, rung 4) do not pause.
pub(crate) const HELD_WRITES_MAX: usize = BUFFER_MAPPED_SLOTS as usize;

/// Where a held write's data is.
#[derive(Debug, Clone)]
enum Data {
    /// In memory (stall).
    Memory(Arc<Vec<u8>>),
    /// In a slot of the buffer area (buffering: the paper's "data written
    /// to the memory and the disk buffer"). The slot is in the page cache
    /// (mapped, for the first [`BUFFER_MAPPED_SLOTS`]): it is the memory
    /// copy too, which serves the commit and reads, so a held write keeps
    /// no heap buffer, and one freed on another thread at the commit cost
    /// glibc's allocator a cross-thread free per write.
    ///
    /// [`BUFFER_MAPPED_SLOTS`]: crate::backend::bufferarea::BUFFER_MAPPED_SLOTS
    Buffer(u32),
    /// In a fresh slot of the rename area (renaming).
    Renamed(Renamed),
}

/// One write held until its epoch commits.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// Epoch it was issued in.
    pub epoch: u64,
    /// The track.
    pub track: u64,
    /// The destage it belongs to (ended by the commit).
    pub destage: Dirty,
    data: Data,
}

/// `logging`: a track and the data its write overwrote.
type Logged = (u64, Box<[u8]>);

#[derive(Debug, Default)]
struct State {
    /// Held writes per track, oldest first (one at most: a track's
    /// destage ends only at the commit; inline, so holding a write
    /// allocates no list).
    by_track: FxHashMap<u64, SmallVec<[Held; 1]>>,
    /// Held writes in issue order, per epoch.
    order: BTreeMap<u64, Vec<u64>>,
    /// `logging`: old data per epoch, in write order.
    undo: BTreeMap<u64, Vec<Logged>>,
    buffer: Option<BufferArea>,
    rename: Option<RenameMap>,
}

/// The pseudo-device.
#[derive(Debug)]
pub struct PseudoDevice {
    scheme: OutputCommit,
    state: Mutex<State>,
    /// Writes held now (`State::by_track`'s, counted under the lock, read
    /// without it by [`PseudoDevice::full`]).
    held: AtomicUsize,
    /// [`HELD_WRITES_MAX`] (tests lower it: [`PseudoDevice::cap_held`]).
    held_max: AtomicUsize,
    /// `buffering`: the buffer area's file (its slots: `State::buffer`).
    buffer_file: Option<BufferFile>,
}

impl PseudoDevice {
    /// A pseudo-device for `scheme` over `volume`; `buffering` and
    /// `renaming` keep their areas in `dir`. Tracks a previous run left
    /// renamed are moved home first when the scheme is not `renaming`.
    pub fn new(scheme: OutputCommit, dir: &Path, volume: &Volume) -> std::io::Result<Self> {
        let mut state = State::default();
        let (map_path, area_path) = RenameMap::paths(dir);
        if scheme == OutputCommit::Renaming {
            state.rename =
                Some(RenameMap::open(dir, volume.tracks()).map_err(std::io::Error::other)?);
        } else if map_path.exists() {
            Self::move_home(dir, volume)?;
            std::fs::remove_file(&map_path)?;
            let _ = std::fs::remove_file(&area_path);
        }
        let mut buffer_file = None;
        if scheme == OutputCommit::Buffering {
            let (file, path) = BufferFile::create(dir)?;
            buffer_file = Some(file);
            state.buffer = Some(BufferArea {
                path,
                free: Vec::new(),
                slots: 0,
            });
        }
        Ok(Self {
            scheme,
            state: Mutex::new(state),
            held: AtomicUsize::new(0),
            held_max: AtomicUsize::new(HELD_WRITES_MAX),
            buffer_file,
        })
    }

    /// The scheme.
    pub fn scheme(&self) -> OutputCommit {
        self.scheme
    }

    /// Whether writes are held until commit (and destages end there).
    pub fn holds_writes(&self) -> bool {
        matches!(
            self.scheme,
            OutputCommit::Stall | OutputCommit::Buffering | OutputCommit::Renaming
        )
    }

    /// Copy every renamed track home and clear the map (a volume last
    /// served with `renaming`, now served without).
    fn move_home(dir: &Path, volume: &Volume) -> std::io::Result<()> {
        let mut map = RenameMap::open(dir, volume.tracks()).map_err(std::io::Error::other)?;
        let renamed: Vec<(u64, Renamed)> = map.live.iter().map(|(&t, &r)| (t, r)).collect();
        if renamed.is_empty() {
            return Ok(());
        }
        tracing::warn!(
            tracks = renamed.len(),
            map = %map.path().display(),
            "moving tracks renamed by output commit back home"
        );
        let mut buf = vec![0u8; TRACK_BYTES];
        for &(track, r) in &renamed {
            map.read_slot(r, &mut buf)?;
            volume.write_track(track, &buf)?;
        }
        volume.sync()?;
        for (track, _) in renamed {
            map.commit(track, None)?;
        }
        map.sync()
    }

    /// Destage write of `track` (record `d`) in epoch `epoch`; a held
    /// write keeps `data` itself (no copy).
    pub(crate) fn write(
        &self,
        volume: &Volume,
        track: u64,
        d: Dirty,
        data: Vec<u8>,
        epoch: u64,
    ) -> std::io::Result<()> {
        debug_assert_eq!(data.len(), TRACK_BYTES);
        // `Volume::write_track` sets the track's allocation bit before its
        // data reaches a device (off, logging); a write held or renamed
        // here reaches one later, or elsewhere, so the door sets it now.
        match self.scheme {
            OutputCommit::Off => volume.write_track(track, &data),
            OutputCommit::Logging => {
                let mut old = vec![0u8; TRACK_BYTES].into_boxed_slice();
                let mut st = self.state.lock();
                volume.read_track(track, &mut old)?;
                st.undo.entry(epoch).or_default().push((track, old));
                volume.write_track(track, &data)
            }
            OutputCommit::Stall | OutputCommit::Buffering | OutputCommit::Renaming => {
                volume.note_written(track);
                // Buffering: the slot's data is written outside the lock.
                // No reader looks for the track's held write meanwhile: the
                // track is destaging, so reads are served from its NVS
                // record until the commit ends the destage.
                let buffered = match &self.buffer_file {
                    Some(file) => {
                        let slot = {
                            let mut st = self.state.lock();
                            st.buffer
                                .as_mut()
                                .expect("buffering has a buffer area")
                                .alloc()
                        };
                        if let Err(e) = file.write(slot, &data) {
                            if let Some(b) = self.state.lock().buffer.as_mut() {
                                b.free.push(slot);
                            }
                            return Err(e);
                        }
                        Some(slot)
                    }
                    None => None,
                };
                let mut st = self.state.lock();
                let data = if let Some(slot) = buffered {
                    Data::Buffer(slot)
                } else if let Some(m) = &mut st.rename {
                    let slot = m.alloc();
                    match m.write_slot(slot, &data) {
                        Ok(data_crc) => Data::Renamed(Renamed { slot, data_crc }),
                        Err(e) => {
                            m.release(slot);
                            return Err(e);
                        }
                    }
                } else {
                    Data::Memory(Arc::new(data))
                };
                let list = st.by_track.entry(track).or_default();
                // One destage per track at a time, and it ends only at the
                // commit: a track never has two held writes.
                debug_assert!(list.is_empty(), "track {track} has a held write already");
                list.push(Held {
                    epoch,
                    track,
                    destage: d,
                    data,
                });
                st.order.entry(epoch).or_default().push(track);
                self.held.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Read `track` into `out`: its newest held write if any, else the
    /// device.
    pub(crate) fn read(&self, volume: &Volume, track: u64, out: &mut [u8]) -> std::io::Result<()> {
        if self.holds_writes() {
            let st = self.state.lock();
            if let Some(h) = st.by_track.get(&track).and_then(|v| v.last()) {
                return self.load(&st, h, out);
            }
            if let Some(m) = &st.rename
                && let Some(&r) = m.live.get(&track)
            {
                return m.read_slot(r, out);
            }
        }
        volume.read_track(track, out)
    }

    fn load(&self, st: &State, h: &Held, out: &mut [u8]) -> std::io::Result<()> {
        match &h.data {
            Data::Memory(m) => {
                out.copy_from_slice(m);
                Ok(())
            }
            Data::Buffer(slot) => self.buffer().read(*slot, out),
            Data::Renamed(r) => st
                .rename
                .as_ref()
                .expect("rename slots exist only with a rename area")
                .read_slot(*r, out),
        }
    }

    /// After `[first, end)` was zeroed at home: renamed tracks there go
    /// home (durably) and their slots are freed. Callers made sure no
    /// write to the range is held.
    pub(crate) fn unmap_range(&self, first: u64, end: u64) -> std::io::Result<()> {
        let mut st = self.state.lock();
        let Some(m) = &mut st.rename else {
            return Ok(());
        };
        let tracks: Vec<u64> = m
            .live
            .keys()
            .copied()
            .filter(|t| (first..end).contains(t))
            .collect();
        for t in tracks {
            if let Some(slot) = m.commit(t, None)? {
                m.release(slot);
            }
        }
        Ok(())
    }

    /// `fdatasync` the rename area and map, if any (at a commit a FUA or
    /// FLUSH waits for).
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        match &self.state.lock().rename {
            Some(m) => m.sync(),
            None => Ok(()),
        }
    }

    /// Held writes now.
    pub fn held(&self) -> usize {
        let st = self.state.lock();
        let held = self.held.load(Ordering::Relaxed);
        debug_assert_eq!(held, st.by_track.values().map(SmallVec::len).sum::<usize>());
        held
    }

    /// Whether [`HELD_WRITES_MAX`] writes are held: background destage
    /// waits for a commit to take some off.
    pub(crate) fn full(&self) -> bool {
        self.held.load(Ordering::Relaxed) >= self.held_max.load(Ordering::Relaxed)
    }

    /// Pause background destage at `max` held writes instead of
    /// [`HELD_WRITES_MAX`].
    #[cfg(test)]
    pub(crate) fn cap_held(&self, max: usize) {
        self.held_max.store(max, Ordering::Relaxed);
    }

    /// Whether no write is held.
    pub fn holds_none(&self) -> bool {
        self.state.lock().by_track.is_empty()
    }

    /// Whether a write to a track in `[first, end)` is held.
    pub fn holds_in(&self, first: u64, end: u64) -> bool {
        let st = self.state.lock();
        st.by_track.keys().any(|t| (first..end).contains(t))
    }

    /// The newest data of each track held up to `epoch`, in issue order,
    /// and how many of its held writes it covers; taken out of the order
    /// (`logging`: the old copies up to `epoch` forgotten).
    fn due(&self, epoch: u64) -> Vec<(u64, usize, Data)> {
        let mut due = Vec::new();
        let mut st = self.state.lock();
        let keep = st.undo.split_off(&(epoch + 1));
        st.undo = keep;
        let later = st.order.split_off(&(epoch + 1));
        let order = std::mem::replace(&mut st.order, later);
        let mut seen = rustc_hash::FxHashSet::default();
        for track in order.into_values().flatten() {
            if !seen.insert(track) {
                continue;
            }
            let Some(list) = st.by_track.get(&track) else {
                continue;
            };
            let n = list.iter().take_while(|h| h.epoch <= epoch).count();
            if n > 0 {
                due.push((track, n, list[n - 1].data.clone()));
            }
        }
        due
    }

    /// Commit epochs up to `epoch`: write each held track's newest data
    /// to its target, then take the held writes off. Returns them (the
    /// caller ends their destages). `logging`: forget the old copies.
    ///
    /// The target writes run outside the lock: reads of those tracks still
    /// find their held writes (taken off only once written), and destage
    /// writes of other tracks go on. One commit runs at a time (the
    /// output gate's `behind_serial`), no rollback runs meanwhile, and a
    /// track with a held write gets no other until its destage ends, after
    /// this returns: so the held writes found here are still there after.
    ///
    /// `stop` is asked before each track: once it says so, the tracks not
    /// yet written stay held, in the order, as after a failed write (a
    /// rollback drops them; a later commit writes them).
    pub(crate) fn commit(
        &self,
        volume: &Volume,
        epoch: u64,
        stop: impl Fn() -> bool,
    ) -> (Vec<Held>, std::io::Result<()>) {
        let due = self.due(epoch);
        let mut result = Ok(());
        let mut written = Vec::with_capacity(due.len());
        let mut due = due.into_iter();
        while let Some((track, n, data)) = due.next() {
            if stop() {
                let mut st = self.state.lock();
                let order = st.order.entry(epoch).or_default();
                order.push(track);
                order.extend(due.map(|(t, _, _)| t));
                break;
            }
            let outcome = match data {
                Data::Renamed(r) => {
                    let mut st = self.state.lock();
                    let m = st.rename.as_mut().expect("renamed data has a rename area");
                    m.commit(track, Some(r)).map(|old| {
                        if let Some(old) = old {
                            m.release(old);
                        }
                    })
                }
                Data::Memory(m) => volume.write_track(track, &m),
                Data::Buffer(slot) => self
                    .buffer()
                    .with_slot(slot, |data| volume.write_track(track, data))
                    .and_then(|written| written),
            };
            match outcome {
                Ok(()) => written.push((track, n)),
                Err(e) => {
                    // Left held, and back in the order: the next commit
                    // tries again (its destage stays in flight until then).
                    tracing::error!(track, error = %e, "output commit: writing a held track failed");
                    self.state
                        .lock()
                        .order
                        .entry(epoch)
                        .or_default()
                        .push(track);
                    result = Err(e);
                }
            }
        }
        let mut taken = Vec::with_capacity(written.len());
        let mut freed = Vec::new();
        let mut st = self.state.lock();
        for (track, n) in written {
            let list = st
                .by_track
                .get_mut(&track)
                .expect("a held write stays until its commit takes it off");
            assert!(
                list.len() >= n,
                "track {track}: held writes taken off by another commit"
            );
            for h in list.drain(..n) {
                if let Data::Buffer(slot) = &h.data {
                    freed.push(*slot);
                }
                taken.push(h);
            }
            if list.is_empty() {
                st.by_track.remove(&track);
            }
        }
        if let Some(b) = st.buffer.as_mut() {
            b.free.extend(freed);
        }
        self.held.fetch_sub(taken.len(), Ordering::Relaxed);
        (taken, result)
    }

    /// Roll back epochs from `epoch` on: drop their held writes (returned:
    /// their destages end unwritten), or, for `logging`, write the old data
    /// back, newest first.
    pub(crate) fn rollback(&self, volume: &Volume, epoch: u64) -> (Vec<Held>, std::io::Result<()>) {
        let mut st = self.state.lock();
        let undo = st.undo.split_off(&epoch);
        let mut result = Ok(());
        for (track, old) in undo.into_values().flatten().rev() {
            if let Err(e) = volume.write_track(track, &old) {
                tracing::error!(track, error = %e, "rollback: restoring a logged track failed");
                result = Err(e);
            }
        }
        st.order.split_off(&epoch);
        let mut dropped = Vec::new();
        let mut freed = Vec::new();
        let mut unrenamed = Vec::new();
        st.by_track.retain(|_, list| {
            let keep = list.iter().take_while(|h| h.epoch < epoch).count();
            for h in list.drain(keep..) {
                match &h.data {
                    Data::Buffer(slot) => freed.push(*slot),
                    Data::Renamed(r) => unrenamed.push(r.slot),
                    Data::Memory(_) => {}
                }
                dropped.push(h);
            }
            !list.is_empty()
        });
        if let Some(b) = st.buffer.as_mut() {
            b.free.extend(freed);
        }
        self.held.fetch_sub(dropped.len(), Ordering::Relaxed);
        if let Some(m) = st.rename.as_mut() {
            for slot in unrenamed {
                m.release(slot);
            }
        }
        (dropped, result)
    }

    /// The buffer area's file (buffering only).
    fn buffer(&self) -> &BufferFile {
        self.buffer_file
            .as_ref()
            .expect("a write held in the buffer area has a buffer area")
    }

    /// The buffer area's file, if any.
    pub fn buffer_path(&self) -> Option<PathBuf> {
        self.state.lock().buffer.as_ref().map(|b| b.path.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::backend::raid::Raid;

    const TRACKS: u64 = 64;

    fn track_of(fill: u8) -> Vec<u8> {
        vec![fill; TRACK_BYTES]
    }

    /// Every track on the volume holds `old`, and buffering holds a write
    /// of `new` to each in epoch 1.
    /// A volume of [`TRACKS`] tracks in `dir` and a buffering
    /// pseudo-device over it.
    fn buffering_over(dir: &Path) -> (Volume, PseudoDevice) {
        let volume = Volume::open_or_create(
            &dir.join("vol"),
            TRACKS * TRACK_BYTES as u64,
            1,
            Raid::None,
            false,
        )
        .unwrap();
        let device = PseudoDevice::new(OutputCommit::Buffering, dir, &volume).unwrap();
        (volume, device)
    }

    fn held_over_old(dir: &Path, old: u8, new: u8) -> (Volume, PseudoDevice) {
        let (volume, device) = buffering_over(dir);
        for t in 0..TRACKS {
            volume.write_track(t, &track_of(old)).unwrap();
        }
        for t in 0..TRACKS {
            let d = Dirty {
                slot: t as u32,
                seq: 1,
            };
            device.write(&volume, t, d, track_of(new), 1).unwrap();
        }
        assert_eq!(device.held(), TRACKS as usize);
        (volume, device)
    }

    #[test]
    fn a_read_during_a_commit_never_sees_the_data_a_held_write_replaces() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..20u8 {
            let (old, new) = (round.wrapping_mul(2), round.wrapping_mul(2) + 1);
            let sub = dir.path().join(format!("r{round}"));
            std::fs::create_dir_all(&sub).unwrap();
            let (volume, device) = held_over_old(&sub, old, new);
            let done = AtomicBool::new(false);
            let started = AtomicBool::new(false);
            std::thread::scope(|s| {
                let reader = s.spawn(|| {
                    let mut out = track_of(0);
                    let mut reads = 0u64;
                    // From before the commit starts until it is over.
                    loop {
                        let over = done.load(Ordering::Acquire);
                        for t in 0..TRACKS {
                            device.read(&volume, t, &mut out).unwrap();
                            assert!(
                                out.iter().all(|&b| b == new),
                                "round {round}: track {t} read {} during the commit, not the held {new}",
                                out[0]
                            );
                            reads += 1;
                            started.store(true, Ordering::Release);
                        }
                        if over {
                            return reads;
                        }
                    }
                });
                // Set on every way out (a panicking commit too), so the
                // reader never loops on and the scope never hangs.
                struct Over<'a>(&'a AtomicBool);
                impl Drop for Over<'_> {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::Release);
                    }
                }
                let over = Over(&done);
                while !started.load(Ordering::Acquire) && !reader.is_finished() {
                    std::hint::spin_loop();
                }
                let (taken, written) = device.commit(&volume, 1, || false);
                drop(over);
                let reads = reader.join();
                written.unwrap();
                assert_eq!(taken.len(), TRACKS as usize);
                assert!(reads.unwrap() >= TRACKS);
            });
            assert!(device.holds_none(), "the commit took every held write off");
            let mut out = track_of(0);
            for t in 0..TRACKS {
                volume.read_track(t, &mut out).unwrap();
                assert!(
                    out.iter().all(|&b| b == new),
                    "track {t} on the device after the commit"
                );
            }
        }
    }

    #[test]
    fn a_commit_takes_off_only_the_epochs_it_commits_and_frees_their_buffer_slots() {
        let dir = tempfile::tempdir().unwrap();
        let (volume, device) = buffering_over(dir.path());
        // The first half of the tracks written in epoch 1, the rest in 2.
        for t in 0..TRACKS {
            let epoch = if t < TRACKS / 2 { 1 } else { 2 };
            let d = Dirty {
                slot: t as u32,
                seq: 1,
            };
            device
                .write(&volume, t, d, track_of(epoch as u8), epoch)
                .unwrap();
        }
        let (taken, written) = device.commit(&volume, 1, || false);
        written.unwrap();
        assert_eq!(taken.len(), TRACKS as usize / 2);
        assert!(taken.iter().all(|h| h.epoch == 1 && h.track < TRACKS / 2));
        assert_eq!(
            device.held(),
            TRACKS as usize / 2,
            "epoch 2's writes stay held"
        );
        assert!(device.holds_in(TRACKS / 2, TRACKS) && !device.holds_in(0, TRACKS / 2));
        assert_eq!(
            device.state.lock().buffer.as_ref().unwrap().free.len(),
            TRACKS as usize / 2,
            "epoch 1's buffer slots are free again"
        );
        let (taken, written) = device.commit(&volume, 2, || false);
        written.unwrap();
        assert_eq!(taken.len(), TRACKS as usize / 2);
        assert!(device.holds_none());
        let mut out = track_of(0);
        for t in 0..TRACKS {
            volume.read_track(t, &mut out).unwrap();
            let want = if t < TRACKS / 2 { 1 } else { 2 };
            assert!(out.iter().all(|&b| b == want), "track {t}");
        }
    }

    #[test]
    fn a_stopped_commit_leaves_the_tracks_it_did_not_write_held_for_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let (volume, device) = buffering_over(dir.path());
        for t in 0..TRACKS {
            let d = Dirty {
                slot: t as u32,
                seq: 1,
            };
            device.write(&volume, t, d, track_of(7), 1).unwrap();
        }
        // Stop once four tracks are written.
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let (taken, written) =
            device.commit(&volume, 1, || asked.fetch_add(1, Ordering::Relaxed) >= 4);
        written.unwrap();
        assert_eq!(taken.len(), 4, "the commit went on past its stop");
        assert_eq!(device.held(), TRACKS as usize - 4);
        let mut out = track_of(0);
        let on_device = (0..TRACKS)
            .filter(|&t| {
                volume.read_track(t, &mut out).unwrap();
                out.iter().all(|&b| b == 7)
            })
            .count();
        assert_eq!(on_device, 4, "tracks written without being taken off");
        // The next commit writes the rest: they stayed in the order.
        let (taken, written) = device.commit(&volume, 2, || false);
        written.unwrap();
        assert_eq!(taken.len(), TRACKS as usize - 4);
        assert!(device.holds_none());
        for t in 0..TRACKS {
            volume.read_track(t, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == 7), "track {t}");
        }
    }

    #[test]
    fn buffered_writes_are_held_in_the_buffer_file_slots_read_and_committed_from_them() {
        use crate::backend::bufferarea::{BUFFER_MAPPED_SLOTS, FILE_NAME};
        let dir = tempfile::tempdir().unwrap();
        let (volume, device) = buffering_over(dir.path());
        let path = dir.path().join(FILE_NAME);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            BufferArea::offset(BUFFER_MAPPED_SLOTS),
            "the mapped slots' space is the file's from the start"
        );
        // The next slot handed out is the last mapped one, then one past
        // the mapping (written with pwrite).
        device.state.lock().buffer.as_mut().unwrap().slots = BUFFER_MAPPED_SLOTS - 1;
        for t in 0..2u64 {
            let d = Dirty {
                slot: t as u32,
                seq: 1,
            };
            device
                .write(&volume, t, d, track_of(0x60 + t as u8), 1)
                .unwrap();
        }
        let file = std::fs::read(&path).unwrap();
        for (slot, byte) in [(BUFFER_MAPPED_SLOTS - 1, 0x60), (BUFFER_MAPPED_SLOTS, 0x61)] {
            let at = BufferArea::offset(slot) as usize;
            assert!(
                file[at..at + TRACK_BYTES].iter().all(|&b| b == byte),
                "slot {slot} holds its write"
            );
        }
        // The slot is the held write's only copy: reads of the track are
        // served from it, in the mapping and past it.
        let mut held = track_of(0);
        for t in 0..2u64 {
            device.read(&volume, t, &mut held).unwrap();
            assert!(held.iter().all(|&b| b == 0x60 + t as u8), "held track {t}");
        }
        let (taken, written) = device.commit(&volume, 1, || false);
        written.unwrap();
        assert_eq!(taken.len(), 2);
        let mut out = track_of(0);
        for t in 0..2u64 {
            volume.read_track(t, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == 0x60 + t as u8), "track {t}");
        }
    }
}
