//! The volume: its label (identity and geometry, kept in `data_dir`), and
//! the mapping of tracks to devices (striped track by track:
//! track `t` lives on device `t % D` at byte `(t / D) * 4 KiB`).
//!
//! The label binds the NVS to its volume: NVS records carry the volume id,
//! and an NVS whose id differs is refused rather than replayed onto the
//! wrong data.
//!
//! Label file `volume.toml`:
//! ```toml
//! id = 1234567890          # random, chosen at creation
//! size_bytes = 1073741824
//! track_bytes = 4096
//! devices = 1
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::device::{Device, FileDevice};
use crate::limits::TRACK_BYTES;

/// Identity and geometry of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Label {
    /// Random id chosen at creation.
    pub id: u64,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Track size.
    pub track_bytes: u32,
    /// Devices striped over.
    pub devices: u32,
}

/// Why a volume could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// File system trouble.
    #[error("volume in {dir}: {source}")]
    Io {
        /// The data directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The label is damaged.
    #[error("volume label {path} is not valid: {message}")]
    BadLabel {
        /// The label file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The configuration asks for a different geometry than the label's.
    #[error(
        "the volume in {dir} was created with {setting} = {existing}, but the configuration says {configured}; use the original value or another data directory"
    )]
    Mismatch {
        /// The data directory.
        dir: PathBuf,
        /// Which setting.
        setting: &'static str,
        /// In the label.
        existing: u64,
        /// In the configuration.
        configured: u64,
    },
}

/// An open volume.
#[derive(Debug)]
pub struct Volume {
    label: Label,
    devices: Vec<Arc<dyn Device>>,
}

impl Volume {
    /// Open the volume in `dir`, creating it (label and device files) when
    /// the directory holds none.
    pub fn open_or_create(
        dir: &Path,
        size_bytes: u64,
        devices: u32,
        direct: bool,
    ) -> Result<Self, VolumeError> {
        let io = |source| VolumeError::Io {
            dir: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let label_path = dir.join("volume.toml");
        let label = match std::fs::read_to_string(&label_path) {
            Ok(text) => {
                let label: Label = toml::from_str(&text).map_err(|e| VolumeError::BadLabel {
                    path: label_path.clone(),
                    message: e.to_string(),
                })?;
                Self::check(dir, &label, size_bytes, devices)?;
                label
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let label = Label {
                    id: fastrand_id(),
                    size_bytes,
                    track_bytes: TRACK_BYTES as u32,
                    devices,
                };
                let text = toml::to_string(&label).expect("label serialises");
                let tmp = dir.join("volume.toml.tmp");
                std::fs::write(&tmp, text).map_err(io)?;
                std::fs::rename(&tmp, &label_path).map_err(io)?;
                label
            }
            Err(e) => return Err(io(e)),
        };
        let tracks = label.size_bytes / TRACK_BYTES as u64;
        let devices = (0..label.devices)
            .map(|d| {
                let per_device = tracks.div_ceil(u64::from(label.devices)) * TRACK_BYTES as u64;
                let path = dir.join(format!("device{d}.img"));
                FileDevice::open_or_create(&path, per_device, direct)
                    .map(|dev| Arc::new(dev) as Arc<dyn Device>)
                    .map_err(io)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { label, devices })
    }

    fn check(dir: &Path, label: &Label, size: u64, devices: u32) -> Result<(), VolumeError> {
        let mismatch = |setting, existing, configured| VolumeError::Mismatch {
            dir: dir.to_owned(),
            setting,
            existing,
            configured,
        };
        if label.track_bytes as usize != TRACK_BYTES {
            return Err(VolumeError::BadLabel {
                path: dir.join("volume.toml"),
                message: format!("track_bytes {} is not {TRACK_BYTES}", label.track_bytes),
            });
        }
        if label.size_bytes != size {
            return Err(mismatch("volume_size", label.size_bytes, size));
        }
        if label.devices != devices {
            return Err(mismatch("devices", label.devices.into(), devices.into()));
        }
        Ok(())
    }

    /// The label.
    pub fn label(&self) -> Label {
        self.label
    }

    /// Tracks in the volume.
    pub fn tracks(&self) -> u64 {
        self.label.size_bytes / TRACK_BYTES as u64
    }

    /// Where track `t` lives: its device and byte offset there.
    pub fn locate(&self, track: u64) -> (&Arc<dyn Device>, u64) {
        debug_assert!(track < self.tracks());
        let d = self.devices.len() as u64;
        (
            &self.devices[(track % d) as usize],
            (track / d) * TRACK_BYTES as u64,
        )
    }

    /// The devices.
    pub fn devices(&self) -> &[Arc<dyn Device>] {
        &self.devices
    }

    /// Make tracks `[first, end)` read as zeroes on the devices.
    pub fn zero_tracks(&self, first: u64, end: u64, keep_allocated: bool) -> std::io::Result<()> {
        let d = self.devices.len() as u64;
        for (i, dev) in self.devices.iter().enumerate() {
            let i = i as u64;
            // Device-local track indices of volume tracks in [first, end) on device i.
            let lo = if first <= i {
                0
            } else {
                (first - i).div_ceil(d)
            };
            let hi = if end <= i { 0 } else { (end - i).div_ceil(d) };
            if hi > lo {
                let t = TRACK_BYTES as u64;
                dev.zero_range(lo * t, (hi - lo) * t, keep_allocated)?;
            }
        }
        Ok(())
    }

    /// `fdatasync` every device.
    pub fn sync(&self) -> std::io::Result<()> {
        self.devices.iter().try_for_each(|d| d.sync())
    }
}

fn fastrand_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = crc32c::crc32c(&nanos.to_le_bytes()) as u64;
    (mixed << 32) ^ nanos ^ u64::from(std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striping_places_consecutive_tracks_on_consecutive_devices() {
        let dir = tempfile::tempdir().unwrap();
        let v = Volume::open_or_create(dir.path(), 10 * 4096, 3, false).unwrap();
        let places: Vec<(String, u64)> = (0..10)
            .map(|t| {
                let (d, off) = v.locate(t);
                (
                    d.path().file_name().unwrap().to_string_lossy().into_owned(),
                    off / 4096,
                )
            })
            .collect();
        assert_eq!(places[0], ("device0.img".into(), 0));
        assert_eq!(places[4], ("device1.img".into(), 1));
        assert_eq!(places[9], ("device0.img".into(), 3));
    }

    #[test]
    fn zero_tracks_zeroes_exactly_the_range_on_every_device() {
        for devices in [1u32, 2, 3] {
            let dir = tempfile::tempdir().unwrap();
            let v = Volume::open_or_create(dir.path(), 12 * 4096, devices, false).unwrap();
            let ones = vec![1u8; 4096];
            for t in 0..12 {
                let (d, off) = v.locate(t);
                d.write_at(&ones, off).unwrap();
            }
            v.zero_tracks(3, 8, false).unwrap();
            for t in 0..12 {
                let (d, off) = v.locate(t);
                let mut b = vec![9u8; 4096];
                d.read_at(&mut b, off).unwrap();
                let zero = (3..8).contains(&t);
                assert_eq!(b[0] == 0, zero, "devices {devices} track {t}");
            }
        }
    }

    #[test]
    fn reopening_with_another_geometry_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let id = Volume::open_or_create(dir.path(), 8 * 4096, 1, false)
            .unwrap()
            .label()
            .id;
        let again = Volume::open_or_create(dir.path(), 8 * 4096, 1, false).unwrap();
        assert_eq!(again.label().id, id);
        let e = Volume::open_or_create(dir.path(), 16 * 4096, 1, false).unwrap_err();
        assert!(e.to_string().contains("volume_size"), "{e}");
        std::fs::write(dir.path().join("volume.toml"), "garbage = [").unwrap();
        let e = Volume::open_or_create(dir.path(), 8 * 4096, 1, false).unwrap_err();
        assert!(matches!(e, VolumeError::BadLabel { .. }), "{e}");
    }
}
