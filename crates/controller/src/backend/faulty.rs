//! The environment's faults, injected at the backend door: every device
//! of the volume is a [`FaultyDevice`] around its [`FileDevice`], so a test,
//! a bench or an operator can make device N return `EIO` or `ENOSPC` on
//! read, write or sync, tear a write (its first sectors land, then `EIO`),
//! answer late, or lose power.
//!
//! Disarmed (the normal state) the layer costs one relaxed atomic load per
//! device I/O ([`FaultPlan::armed`]); `rebound bench controller` measures
//! it. A plan belongs to a device *number*, not to a file: a replacement
//! rebuilt for a lost device N meets the same plan (a bad slot in a
//! chassis stays bad).
//!
//! # Power loss
//!
//! SIGKILL leaves the page cache intact, so it cannot show what a power cut
//! does to writes not yet covered by an `fdatasync`. With power-loss
//! tracking on (`--power-loss-tracking`, for tests and benches: it costs a
//! read per device write), each device keeps a [`Shadow`]: the contents of
//! every 4 KiB block as they were at the last completed sync, saved before
//! the first write to the block after it. A sync that completes drops the
//! pre-images it covered (those saved before it started); one that fails
//! keeps them. [`FaultyDevice::power_cut`] freezes the device (every later
//! I/O waits forever: the process is about to end) and, for each block
//! written since its last sync, puts the pre-image back or keeps the new
//! data, at random (a real disk may have written back any part of its
//! cache), then syncs. Blocks are 4 KiB, the track size, so no track is
//! torn by the cut itself; tearing is [`DeviceFault::Error`]'s `torn`.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::device::{Device, FileDevice};
pub use crate::faults::{DeviceFault, DeviceOp, Errno};
use crate::limits::TRACK_BYTES;

/// Sectors of a track: a torn write lands a prefix of them.
const SECTOR: usize = 512;

/// What one I/O meets.
enum Verdict {
    Fail(io::Error, bool),
    Delay(Duration),
}

/// The faults armed on one device number, and what they did.
#[derive(Debug, Default)]
pub struct FaultPlan {
    /// Whether any fault is armed (the only cost when none is).
    armed: AtomicBool,
    faults: Mutex<Vec<DeviceFault>>,
    rng: AtomicU64,
    /// Errors injected, by operation.
    pub injected: [AtomicU64; 3],
    /// Power is cut: every I/O waits for the end of the process.
    cut: AtomicBool,
}

impl FaultPlan {
    /// Arm `fault` (next to those armed).
    pub fn arm(&self, fault: DeviceFault) {
        self.faults.lock().push(fault);
        self.rng.fetch_or(1, Ordering::Relaxed);
        self.armed.store(true, Ordering::Release);
    }

    /// Disarm every fault.
    pub fn clear(&self) {
        let mut f = self.faults.lock();
        f.clear();
        self.armed.store(false, Ordering::Release);
    }

    /// The faults armed now.
    pub fn armed(&self) -> Vec<DeviceFault> {
        if !self.armed.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.faults.lock().clone()
    }

    fn coin(&self, p: f64) -> bool {
        if p >= 1.0 {
            return true;
        }
        // xorshift64; a lost update between threads only repeats a draw.
        let mut x = self.rng.load(Ordering::Relaxed) | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        (x >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// What an I/O of `op` on device `device` meets now.
    #[inline]
    fn check(&self, device: usize, op: DeviceOp) -> Option<Verdict> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        self.check_armed(device, op)
    }

    #[cold]
    fn check_armed(&self, device: usize, op: DeviceOp) -> Option<Verdict> {
        if self.cut.load(Ordering::Acquire) {
            loop {
                std::thread::park();
            }
        }
        let mut faults = self.faults.lock();
        let mut verdict = None;
        let mut spent = None;
        for (i, f) in faults.iter_mut().enumerate() {
            match f {
                DeviceFault::Latency { op: o, delay, rate } => {
                    if o.is_none_or(|o| o == op) && verdict.is_none() && self.coin(*rate) {
                        verdict = Some(Verdict::Delay(*delay));
                    }
                }
                DeviceFault::Error {
                    op: o,
                    errno,
                    rate,
                    count,
                    torn,
                } => {
                    if *o != op || !self.coin(*rate) {
                        continue;
                    }
                    if let Some(n) = count {
                        *n -= 1;
                        if *n == 0 {
                            spent = Some(i);
                        }
                    }
                    self.injected[op as usize].fetch_add(1, Ordering::Relaxed);
                    verdict = Some(Verdict::Fail(errno.error(device, op), *torn));
                    break;
                }
            }
        }
        if let Some(i) = spent {
            faults.remove(i);
            if faults.is_empty() {
                self.armed.store(false, Ordering::Release);
            }
        }
        verdict
    }
}

/// What a power cut would undo on one device: the pre-image of every block
/// written since the last completed sync (module doc).
#[derive(Debug, Default)]
pub struct Shadow {
    pre: Mutex<HashMap<u64, Box<[u8]>>>,
}

impl Shadow {
    /// Save the pre-images of the blocks `[offset, offset + len)` not
    /// saved since the last sync.
    fn before_write(&self, dev: &FileDevice, offset: u64, len: u64) -> io::Result<()> {
        let t = TRACK_BYTES as u64;
        let mut pre = self.pre.lock();
        let mut block = offset / t * t;
        while block < offset + len {
            if let std::collections::hash_map::Entry::Vacant(v) = pre.entry(block) {
                let mut old = vec![0u8; TRACK_BYTES];
                dev.read_at(&mut old, block)?;
                v.insert(old.into_boxed_slice());
            }
            block += t;
        }
        Ok(())
    }

    /// Blocks written since the last sync.
    pub fn pending(&self) -> usize {
        self.pre.lock().len()
    }
}

/// A backend device with the fault-injecting layer in front (module doc).
#[derive(Debug)]
pub struct FaultyDevice {
    inner: FileDevice,
    device: usize,
    plan: std::sync::Arc<FaultPlan>,
    shadow: Option<Shadow>,
}

impl FaultyDevice {
    /// Device number `device` behind `plan`; `track_power` keeps a shadow
    /// for [`FaultyDevice::power_cut`].
    pub fn new(
        inner: FileDevice,
        device: usize,
        plan: std::sync::Arc<FaultPlan>,
        track_power: bool,
    ) -> Self {
        Self {
            inner,
            device,
            plan,
            shadow: track_power.then(Shadow::default),
        }
    }

    /// The faults of its device number.
    pub fn plan(&self) -> &std::sync::Arc<FaultPlan> {
        &self.plan
    }

    /// What the shadow holds (`None` without power-loss tracking).
    pub fn shadow(&self) -> Option<&Shadow> {
        self.shadow.as_ref()
    }

    fn meet(&self, op: DeviceOp) -> io::Result<bool> {
        match self.plan.check(self.device, op) {
            None => Ok(false),
            Some(Verdict::Delay(d)) => {
                crate::blocking::about_to_block();
                std::thread::sleep(d);
                Ok(false)
            }
            Some(Verdict::Fail(_, true)) if op == DeviceOp::Write => Ok(true),
            Some(Verdict::Fail(e, _)) => Err(e),
        }
    }

    /// Cut the power: from now on every I/O of this device waits for the
    /// end of the process; undo at random what no sync covered (module
    /// doc). Returns (blocks put back, blocks kept). Without a shadow
    /// nothing is undone: the caller must refuse before.
    pub fn power_cut(&self, seed: u64) -> io::Result<(u64, u64)> {
        self.plan.cut.store(true, Ordering::Release);
        self.plan.armed.store(true, Ordering::Release);
        let Some(shadow) = &self.shadow else {
            return Ok((0, 0));
        };
        let pre = std::mem::take(&mut *shadow.pre.lock());
        let (mut back, mut kept) = (0, 0);
        let mut x = seed | 1;
        for (block, old) in pre {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x & 1 == 0 {
                self.inner.write_at(&old, block)?;
                back += 1;
            } else {
                kept += 1;
            }
        }
        self.inner.sync()?;
        Ok((back, kept))
    }
}

impl Device for FaultyDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.meet(DeviceOp::Read)?;
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let torn = self.meet(DeviceOp::Write)?;
        if let Some(s) = &self.shadow {
            s.before_write(&self.inner, offset, buf.len() as u64)?;
        }
        if torn {
            // The first half of the sectors land, whole 4 KiB blocks
            // through the page cache: the rest of the first block keeps
            // its old bytes.
            let t = TRACK_BYTES;
            let land = (buf.len() / SECTOR).div_ceil(2) * SECTOR;
            let whole = land / t * t;
            self.inner.write_at(&buf[..whole], offset)?;
            if land > whole {
                let mut block = vec![0u8; t];
                self.inner.read_at(&mut block, offset + whole as u64)?;
                block[..land - whole].copy_from_slice(&buf[whole..land]);
                self.inner.write_at(&block, offset + whole as u64)?;
            }
            return Err(Errno::Eio.error(self.device, DeviceOp::Write));
        }
        self.inner.write_at(buf, offset)
    }

    fn zero_range(&self, offset: u64, len: u64, keep_allocated: bool) -> io::Result<()> {
        self.meet(DeviceOp::Write)?;
        if let Some(s) = &self.shadow {
            s.before_write(&self.inner, offset, len)?;
        }
        self.inner.zero_range(offset, len, keep_allocated)
    }

    fn sync(&self) -> io::Result<()> {
        self.meet(DeviceOp::Sync)?;
        let Some(s) = &self.shadow else {
            return self.inner.sync();
        };
        // Pre-images saved before the sync starts are covered by it.
        let covered = std::mem::take(&mut *s.pre.lock());
        let synced = self.inner.sync();
        if synced.is_err() {
            // Not covered after all: the older pre-image of a block wins.
            let mut pre = s.pre.lock();
            for (block, old) in covered {
                pre.insert(block, old);
            }
        }
        synced
    }

    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    fn path(&self) -> &Path {
        self.inner.path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn device(dir: &Path, track_power: bool) -> (FaultyDevice, Arc<FaultPlan>) {
        let inner = FileDevice::open_or_create(&dir.join("d"), 16 * 4096, false).unwrap();
        let plan = Arc::new(FaultPlan::default());
        (
            FaultyDevice::new(inner, 3, Arc::clone(&plan), track_power),
            plan,
        )
    }

    #[test]
    fn an_armed_error_fails_its_op_count_times_then_disarms() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, plan) = device(dir.path(), false);
        plan.arm(DeviceFault::Error {
            op: DeviceOp::Write,
            errno: Errno::Enospc,
            rate: 1.0,
            count: Some(2),
            torn: false,
        });
        let buf = vec![7u8; 4096];
        let mut back = vec![0u8; 4096];
        dev.read_at(&mut back, 0).expect("reads are not armed");
        for _ in 0..2 {
            let e = dev.write_at(&buf, 0).unwrap_err();
            assert_eq!(e.raw_os_error(), None, "wrapped with the device number");
            assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{e}");
            assert!(e.to_string().contains("device 3"), "{e}");
        }
        dev.write_at(&buf, 0).expect("the count is spent");
        assert!(plan.armed().is_empty());
        assert_eq!(
            plan.injected[DeviceOp::Write as usize].load(Ordering::Relaxed),
            2
        );
    }

    #[test]
    fn a_torn_write_lands_the_first_half_of_its_sectors_and_fails() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, plan) = device(dir.path(), false);
        dev.write_at(&vec![1u8; 3 * 4096], 0).unwrap();
        plan.arm(DeviceFault::Error {
            op: DeviceOp::Write,
            errno: Errno::Eio,
            rate: 1.0,
            count: Some(1),
            torn: true,
        });
        let e = dev.write_at(&vec![2u8; 3 * 4096], 0).unwrap_err();
        assert!(e.to_string().contains("Input/output error"), "{e}");
        let mut back = vec![0u8; 3 * 4096];
        dev.read_at(&mut back, 0).unwrap();
        let land = 12 * SECTOR;
        assert!(back[..land].iter().all(|&b| b == 2));
        assert!(back[land..].iter().all(|&b| b == 1));
    }

    #[test]
    fn a_power_cut_undoes_only_writes_no_completed_sync_covered() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, plan) = device(dir.path(), true);
        dev.write_at(&vec![1u8; 16 * 4096], 0).unwrap();
        dev.sync().unwrap();
        // A sync that fails covers nothing.
        dev.write_at(&vec![2u8; 8 * 4096], 0).unwrap();
        plan.arm(DeviceFault::Error {
            op: DeviceOp::Sync,
            errno: Errno::Eio,
            rate: 1.0,
            count: Some(1),
            torn: false,
        });
        dev.sync().unwrap_err();
        dev.write_at(&vec![3u8; 4 * 4096], 0).unwrap();
        assert_eq!(dev.shadow().unwrap().pending(), 8);
        let (back, kept) = dev.power_cut(42).unwrap();
        assert_eq!(back + kept, 8);
        assert!(
            back > 0 && kept > 0,
            "seed 42 puts back some and keeps some"
        );
        let file = std::fs::read(dir.path().join("d")).unwrap();
        for (i, block) in file.chunks(4096).enumerate() {
            let b = block[0];
            assert!(block.iter().all(|&x| x == b), "block {i} torn by the cut");
            let allowed: &[u8] = match i {
                0..4 => &[1, 3],
                4..8 => &[1, 2],
                _ => &[1],
            };
            assert!(allowed.contains(&b), "block {i} holds {b}");
        }
    }

    #[test]
    fn latency_delays_only_its_op() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, plan) = device(dir.path(), false);
        plan.arm(DeviceFault::Latency {
            op: Some(DeviceOp::Sync),
            delay: Duration::from_millis(30),
            rate: 1.0,
        });
        let started = std::time::Instant::now();
        dev.sync().unwrap();
        assert!(started.elapsed() >= Duration::from_millis(30));
        plan.clear();
        assert!(plan.armed().is_empty());
    }
}
