//! Backend devices: where destaged tracks live. One trait; the file device
//! implements it with `pread`/`pwrite` (optionally `O_DIRECT`, through
//! 4 KiB-aligned blocks) and zeroes ranges with `fallocate`.
//!
//! Device I/O is synchronous and done by device-group tasks; a modelled
//! service time (see [`LatencyConfig`]) is charged by the
//! caller, which defers its continuation instead of sleeping on a worker.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::limits::TRACK_BYTES;

/// A backend device.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// Read `buf.len()` bytes at `offset` (a multiple of the track size).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Write `buf` at `offset` (a multiple of the track size).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Make `[offset, offset + len)` read as zeroes; `keep_allocated` forbids
    /// punching a hole.
    fn zero_range(&self, offset: u64, len: u64, keep_allocated: bool) -> io::Result<()>;
    /// Make completed writes durable (`fdatasync`).
    fn sync(&self) -> io::Result<()>;
    /// Capacity in bytes.
    fn capacity(&self) -> u64;
    /// Where it is (for logs and errors).
    fn path(&self) -> &Path;
}

/// One 4 KiB block aligned for `O_DIRECT`.
#[repr(C, align(4096))]
struct AlignedBlock([u8; TRACK_BYTES]);

const _: () = assert!(std::mem::align_of::<AlignedBlock>() == TRACK_BYTES);
const _: () = assert!(std::mem::size_of::<AlignedBlock>() == TRACK_BYTES);

/// A regular file used as a backend device.
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    capacity: u64,
    direct: bool,
}

impl FileDevice {
    /// Open `path`, creating it with `capacity` bytes if it does not exist
    /// (and syncing its directory, so the new file is durable).
    /// An existing file must have exactly `capacity` bytes. Opened as every
    /// state file is ([`crate::files::open_with`]): mode 0600, a symbolic
    /// link, another user's file or anything but a regular file refused.
    pub fn open_or_create(path: &Path, capacity: u64, direct: bool) -> io::Result<Self> {
        let extra = if direct { libc::O_DIRECT } else { 0 };
        let opts = crate::files::state_options(crate::files::Create::IfMissing, extra);
        let file = crate::files::open_with(path, &opts)?;
        let len = file.metadata()?.len();
        if len == 0 {
            crate::files::reserve(&file, capacity)?;
            // A new file: its name must survive a power loss as its data will.
            crate::files::sync_parent(path)?;
        } else if len != capacity {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "device {} has {len} bytes but the volume needs {capacity}",
                    path.display()
                ),
            ));
        }
        Ok(Self {
            file,
            path: path.to_owned(),
            capacity,
            direct,
        })
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        let end = offset.checked_add(len as u64);
        if !offset.is_multiple_of(TRACK_BYTES as u64)
            || !len.is_multiple_of(TRACK_BYTES)
            || end.is_none_or(|e| e > self.capacity)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "device {}: I/O of {len} bytes at {offset} is unaligned or past {}",
                    self.path.display(),
                    self.capacity
                ),
            ));
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let zeros = vec![0u8; (1 << 20).min(len as usize)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeros.len() as u64) as usize;
            self.write_at(&zeros[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }
}

impl FileDevice {
    /// Read all of `buf` from the page cache without waiting for the
    /// device (`preadv2` with `RWF_NOWAIT`). `false` when any of it is not
    /// cached, or the kernel or filesystem cannot say: `buf` then holds
    /// nothing useful and the caller reads it the ordinary way.
    fn read_cached(&self, buf: &mut [u8], offset: u64) -> bool {
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: `iov` describes `buf`, valid for writes of its whole
        // length and borrowed mutably for the duration of the call; the
        // descriptor is kept open by `self.file`; the kernel writes at most
        // `iov_len` bytes and reads nothing else of ours.
        let n = unsafe {
            libc::preadv2(
                self.file.as_raw_fd(),
                &iov,
                1,
                offset as libc::off_t,
                libc::RWF_NOWAIT,
            )
        };
        usize::try_from(n).is_ok_and(|n| n == buf.len())
    }
}

impl Device for FileDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check(offset, buf.len())?;
        if !self.direct {
            // A connection's reading thread first tries the page cache
            // alone, and lets its read side go only if the device must be
            // read (see `crate::blocking`).
            if crate::blocking::leading() && self.read_cached(buf, offset) {
                return Ok(());
            }
            crate::blocking::about_to_block();
            return self.file.read_exact_at(buf, offset);
        }
        crate::blocking::about_to_block();
        let mut block = Box::new(AlignedBlock([0; TRACK_BYTES]));
        for (i, chunk) in buf.chunks_mut(TRACK_BYTES).enumerate() {
            self.file
                .read_exact_at(&mut block.0, offset + (i * TRACK_BYTES) as u64)?;
            chunk.copy_from_slice(&block.0);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check(offset, buf.len())?;
        if !self.direct {
            return self.file.write_all_at(buf, offset);
        }
        crate::blocking::about_to_block();
        let mut block = Box::new(AlignedBlock([0; TRACK_BYTES]));
        for (i, chunk) in buf.chunks(TRACK_BYTES).enumerate() {
            block.0.copy_from_slice(chunk);
            self.file
                .write_all_at(&block.0, offset + (i * TRACK_BYTES) as u64)?;
        }
        Ok(())
    }

    fn zero_range(&self, offset: u64, len: u64, keep_allocated: bool) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let end = offset.checked_add(len).filter(|&e| e <= self.capacity);
        if end.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero range past the end of the device",
            ));
        }
        crate::blocking::about_to_block();
        let mode = if keep_allocated {
            libc::FALLOC_FL_ZERO_RANGE
        } else {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        };
        let (off, n) = (offset as libc::off_t, len as libc::off_t);
        // SAFETY: fallocate takes a file descriptor we own (kept open by
        // `self.file` for the duration of the call) and two integers; it
        // reads or writes no memory of ours.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, n) };
        if rc == 0 {
            return Ok(());
        }
        // Not every filesystem supports every mode: write the zeroes.
        self.write_zeroes(offset, len)
    }

    fn sync(&self) -> io::Result<()> {
        crate::blocking::about_to_block();
        self.file.sync_data()
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_device_reads_back_writes_and_zeroes_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open_or_create(&dir.path().join("d"), 64 * 4096, false).unwrap();
        let data = vec![0xabu8; 2 * 4096];
        dev.write_at(&data, 4096).unwrap();
        let mut back = vec![0u8; 2 * 4096];
        dev.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, data);
        for keep in [true, false] {
            dev.write_at(&data, 4096).unwrap();
            dev.zero_range(4096, 4096, keep).unwrap();
            dev.read_at(&mut back, 4096).unwrap();
            assert!(back[..4096].iter().all(|&b| b == 0));
            assert!(
                back[4096..].iter().all(|&b| b == 0xab),
                "zeroing stayed in range"
            );
        }
    }

    #[test]
    fn a_leading_thread_reads_the_page_cache_without_letting_go_and_lets_go_for_a_sync() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU32, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open_or_create(&dir.path().join("d"), 64 * 4096, false).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        dev.write_at(&data, 8 * 4096).unwrap();
        let let_go = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&let_go);
        crate::blocking::lead(Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        // Just written: in the page cache.
        let mut back = vec![0u8; 4096];
        dev.read_at(&mut back, 8 * 4096).unwrap();
        assert_eq!(back, data);
        assert_eq!(let_go.load(Ordering::SeqCst), 0, "a cached read let go");
        assert!(crate::blocking::leading());
        // A sync waits for the device: it lets go, once.
        dev.sync().unwrap();
        dev.sync().unwrap();
        assert_eq!(let_go.load(Ordering::SeqCst), 1);
        assert!(!crate::blocking::leading());
    }

    #[test]
    fn unaligned_or_out_of_range_io_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open_or_create(&dir.path().join("d"), 4 * 4096, false).unwrap();
        let mut buf = vec![0u8; 4096];
        assert!(dev.read_at(&mut buf, 100).is_err());
        assert!(dev.read_at(&mut buf, 4 * 4096).is_err());
        assert!(dev.write_at(&buf[..100], 0).is_err());
        assert!(dev.read_at(&mut buf, u64::MAX - 10).is_err());
        assert!(dev.zero_range(0, 5 * 4096, false).is_err());
    }

    #[test]
    fn an_existing_device_of_the_wrong_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d");
        FileDevice::open_or_create(&p, 8 * 4096, false).unwrap();
        let err = FileDevice::open_or_create(&p, 16 * 4096, false).unwrap_err();
        assert!(err.to_string().contains("needs"), "{err}");
    }
}

/// Modelled device service time, for experiments (none by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyConfig {
    /// Fixed cost per device I/O, microseconds.
    pub fixed_us: u64,
    /// Cost per KiB transferred, microseconds.
    pub per_kib_us: u64,
}

impl LatencyConfig {
    /// The modelled service time of an I/O of `bytes`.
    pub fn service_time(&self, bytes: usize) -> Duration {
        let kib = (bytes as u64).div_ceil(1024);
        Duration::from_micros(self.fixed_us + self.per_kib_us.saturating_mul(kib))
    }

    /// Whether any latency is modelled.
    pub fn is_zero(&self) -> bool {
        self.fixed_us == 0 && self.per_kib_us == 0
    }
}
