//! The ahead log of a replacement device: slots rebuilt out of order,
//! ahead of the rebuilt prefix the label records (a write to a stripe
//! not rebuilt yet rebuilds that stripe first). One 16-byte record per
//! slot, tagged with the loss's generation so a stale log is never read
//! as this loss's.

use super::*;

pub(super) fn ahead_path(dir: &Path, d: usize) -> PathBuf {
    dir.join(format!("device{d}.ahead"))
}

/// A number for a new loss, distinct from earlier ones' (a stale ahead log
/// is never read as this loss's).
pub(super) fn new_generation() -> u32 {
    (fastrand_id() >> 16) as u32
}

/// The slots of device `d` rebuilt ahead in loss `generation`.
pub(super) fn read_ahead_log(
    dir: &Path,
    d: usize,
    generation: u32,
    slots: u64,
) -> std::collections::BTreeSet<u64> {
    let bytes = crate::files::read_state_file(&ahead_path(dir, d)).unwrap_or_default();
    let mut ahead = std::collections::BTreeSet::new();
    for r in bytes.chunks_exact(AHEAD_RECORD) {
        let crc = u32::from_le_bytes(r[12..].try_into().expect("4 bytes"));
        if crc32c::crc32c(&r[..12]) != crc {
            break;
        }
        let slot = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
        let g = u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"));
        if g == generation && slot < slots {
            ahead.insert(slot);
        }
    }
    ahead
}

impl Inner {
    /// Rebuild slot `stripe` of replacement `d` now, out of order: compute
    /// it from the rest of the stripe (under the stripe's lock, held by the
    /// caller), write and sync it, and record it in the label. An error
    /// (no replacement, too many ahead, an I/O failure) says why not.
    pub(super) fn rebuild_ahead(&self, d: usize, stripe: u64) -> Result<(), String> {
        let m = &self.members[d];
        if m.state.load(Ordering::Acquire) != REBUILDING {
            return Err(format!("device {d} has no replacement yet"));
        }
        if m.ahead.lock().len() >= AHEAD_MAX {
            return Err(format!(
                "{AHEAD_MAX} slots of device {d} rebuilt ahead already"
            ));
        }
        let mut buf = vec![0u8; TRACK_BYTES];
        let rest = self
            .layout
            .stripe_devices(stripe)
            .into_iter()
            .filter(|&x| x != d);
        let fault = |f: Fault| match f {
            Fault::Device(x, e) => format!("device {x}: {e}"),
            Fault::Io(e) => e.to_string(),
        };
        self.xor_of(stripe, rest, &mut buf).map_err(fault)?;
        self.write_slot(d, stripe, &buf).map_err(fault)?;
        self.on(d, DeviceOp::Sync, |dev| dev.sync())
            .map_err(fault)?;
        let label = self.label.lock();
        if m.state.load(Ordering::Acquire) != REBUILDING {
            return Err(format!("device {d} was lost again"));
        }
        let Some(g) = label.degraded.iter().find(|g| g.device as usize == d) else {
            return Err(format!("device {d} is not recorded degraded"));
        };
        let mut record = [0u8; AHEAD_RECORD];
        record[..8].copy_from_slice(&stripe.to_le_bytes());
        record[8..12].copy_from_slice(&g.generation.to_le_bytes());
        let crc = crc32c::crc32c(&record[..12]);
        record[12..].copy_from_slice(&crc.to_le_bytes());
        let mut log = m.ahead_log.lock();
        let appended = (|| -> std::io::Result<()> {
            use std::io::Write;
            if log.is_none() {
                let mut opts = crate::files::state_options(crate::files::Create::IfMissing, 0);
                opts.append(true);
                *log = Some(crate::files::open_with(&ahead_path(&self.dir, d), &opts)?);
            }
            let f = log.as_mut().expect("opened above");
            f.write_all(&record)?;
            f.sync_data()
        })();
        if let Err(e) = appended {
            // A partial record fails its check at the next open.
            *log = None;
            return Err(format!("recording it in the ahead log: {e}"));
        }
        m.ahead.lock().insert(stripe);
        Ok(())
    }
}
