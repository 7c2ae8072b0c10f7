//! The volume label (`volume.toml`): identity, geometry, redundancy and
//! the lost devices with how far their replacements are rebuilt. Written
//! to a temporary file, synced, renamed, and the directory synced; checked
//! against the configuration at open (format: see the parent module).

use super::*;

pub(super) fn write_label(dir: &Path, label: &Label) -> std::io::Result<()> {
    use std::io::Write;
    let text = toml::to_string(label).map_err(std::io::Error::other)?;
    let tmp = dir.join("volume.toml.tmp");
    let mut f = crate::files::create_temporary(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_data()?;
    std::fs::rename(&tmp, dir.join("volume.toml"))?;
    // The rename is durable only once the directory is.
    crate::files::sync_dir(dir)
}

impl Volume {
    /// A device file missing from an existing volume: lost (rebuilt from
    /// the others, recorded in the label first) when the volume has
    /// redundancy, else an error, never a device of zeroes served as data.
    pub(super) fn adopt_missing_devices(dir: &Path, label: &mut Label) -> Result<(), VolumeError> {
        let mut changed = false;
        for d in 0..label.devices as usize {
            let path = device_path(dir, d);
            if path.exists() {
                continue;
            }
            if !label.raid.redundant() {
                return Err(VolumeError::BadLabel {
                    path,
                    message: "the device file of an existing volume is missing, and the volume has no redundancy to rebuild it from (raid = \"none\")".into(),
                });
            }
            tracing::warn!(device = d, path = %path.display(), "device file missing: treating the device as lost");
            label.degraded.retain(|g| g.device as usize != d);
            label.degraded.push(Degraded {
                device: d as u32,
                rebuilt_slots: 0,
                generation: new_generation(),
            });
            changed = true;
        }
        if changed {
            write_label(dir, label).map_err(|source| VolumeError::Io {
                dir: dir.to_owned(),
                source,
            })?;
        }
        Ok(())
    }

    pub(super) fn check(
        dir: &Path,
        label: &Label,
        size: u64,
        devices: u32,
        raid: Raid,
    ) -> Result<(), VolumeError> {
        let mismatch = |setting, existing: String, configured: String| VolumeError::Mismatch {
            dir: dir.to_owned(),
            setting,
            existing,
            configured,
        };
        let bad = |message: String| VolumeError::BadLabel {
            path: dir.join("volume.toml"),
            message,
        };
        if label.track_bytes as usize != TRACK_BYTES {
            return Err(bad(format!(
                "track_bytes {} is not {TRACK_BYTES}",
                label.track_bytes
            )));
        }
        if label.size_bytes != size {
            return Err(mismatch(
                "volume_size",
                label.size_bytes.to_string(),
                size.to_string(),
            ));
        }
        if label.devices != devices {
            return Err(mismatch(
                "devices",
                label.devices.to_string(),
                devices.to_string(),
            ));
        }
        if label.raid != raid {
            return Err(mismatch("raid", label.raid.to_string(), raid.to_string()));
        }
        if label.devices < label.raid.min_devices() {
            return Err(bad(format!(
                "raid {} needs {} devices, the label has {}",
                label.raid,
                label.raid.min_devices(),
                label.devices
            )));
        }
        if let Some(g) = label.degraded.iter().find(|g| g.device >= label.devices) {
            return Err(bad(format!("degraded device {} does not exist", g.device)));
        }
        let slots = Layout::new(
            label.raid,
            label.devices,
            label.size_bytes / TRACK_BYTES as u64,
        )
        .slots_per_device();
        if let Some(g) = label.degraded.iter().find(|g| g.rebuilt_slots > slots) {
            return Err(bad(format!(
                "degraded device {} is rebuilt to slot {}, past its {slots} slots",
                g.device, g.rebuilt_slots
            )));
        }
        let mut seen: Vec<u32> = label.degraded.iter().map(|g| g.device).collect();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(bad("a device is recorded degraded twice".into()));
        }
        if !label.raid.redundant() && !label.degraded.is_empty() {
            return Err(bad("a volume without redundancy cannot be degraded".into()));
        }
        Ok(())
    }
}

pub(super) fn fastrand_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = crc32c::crc32c(&nanos.to_le_bytes()) as u64;
    (mixed << 32) ^ nanos ^ u64::from(std::process::id())
}
