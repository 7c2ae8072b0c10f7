//! Device redundancy of a volume: where each track's copies, or its stripe,
//! live on the devices. The controller's side of the failure model's "lost
//! device" (DESIGN.md): with redundancy a lost device costs no data; the
//! volume serves degraded ([`crate::backend::volume`]) until the device is replaced
//! and rebuilt. The parity placement and the XOR are the `redundancy`
//! crate's, the same code the smart-storage nodes use (smart-storage paper,
//! section 3.4: "data recovery is performed by XORing ... the remaining SDs
//! with those on the parity disk").
//!
//! | `raid` | devices | track `t` | capacity of each device |
//! |---|---|---|---|
//! | `none` | D >= 1 | device `t % D`, slot `t / D` | `ceil(T / D)` tracks |
//! | `mirror` | D >= 2 | primary on device `t % D`, slot `t / D`; copy on device `(t + 1) % D`, slot `ceil(T / D) + t / D` (chained declustering: a lost device's reads fall on both neighbours) | `2 ceil(T / D)` tracks |
//! | `parity` | D >= 3 | stripe `s = t / (D - 1)`, member `t % (D - 1)`: slot `s` of [`RotatedParity::data_node`]; the stripe's parity in slot `s` of [`RotatedParity::parity_node`] (RAID-5, left-symmetric) | `ceil(T / (D - 1))` tracks |
//!
//! A slot is one 4 KiB track at byte `slot * 4096` of its device. The slots
//! of a last, partial parity stripe that no track maps to stay zero, so a
//! stripe's parity is always the XOR of all its data slots.

use std::fmt;
use std::str::FromStr;

use redundancy::RotatedParity;
use serde::{Deserialize, Serialize};

use crate::limits::TRACK_BYTES;

/// How a volume's tracks are protected against the loss of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Raid {
    /// Striped, no redundancy: a lost device loses its tracks.
    #[default]
    None,
    /// Two copies of every track on neighbouring devices.
    Mirror,
    /// Rotated parity (RAID-5) over the devices.
    Parity,
}

impl Raid {
    /// The fewest devices the layout needs.
    pub fn min_devices(self) -> u32 {
        match self {
            Raid::None => 1,
            Raid::Mirror => 2,
            Raid::Parity => 3,
        }
    }

    /// Whether a device can be lost without losing data.
    pub fn redundant(self) -> bool {
        self != Raid::None
    }
}

impl fmt::Display for Raid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Raid::None => "none",
            Raid::Mirror => "mirror",
            Raid::Parity => "parity",
        })
    }
}

impl FromStr for Raid {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Raid::None),
            "mirror" => Ok(Raid::Mirror),
            "parity" => Ok(Raid::Parity),
            _ => Err(format!("{s:?} is not a raid layout (none, mirror, parity)")),
        }
    }
}

/// A slot: device index and slot number on it.
pub type Slot = (usize, u64);

/// Where a track lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// One copy.
    Single(Slot),
    /// Primary and copy.
    Mirror([Slot; 2]),
    /// A member of a parity stripe: the track's slot, the parity's, and the
    /// stripe's other data slots (all at slot `stripe` of their devices).
    Parity {
        /// The stripe (also the slot number on every device).
        stripe: u64,
        /// The track's device.
        data: usize,
        /// The parity's device.
        parity: usize,
        /// The devices of the stripe's other data members.
        others: Vec<usize>,
    },
}

/// What a device slot holds, for rebuilding it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// Nothing (past the volume's end).
    Unused,
    /// A copy of `track`, whose other copy is `from`.
    Copy {
        /// The track.
        track: u64,
        /// The other copy.
        from: Slot,
    },
    /// A member (data or parity) of parity stripe `stripe`.
    Stripe(u64),
}

/// The layout of one volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    raid: Raid,
    devices: u64,
    tracks: u64,
}

impl Layout {
    /// The layout of `tracks` tracks over `devices` devices.
    ///
    /// # Panics
    /// If there are fewer devices than `raid` needs (the configuration is
    /// validated before).
    pub fn new(raid: Raid, devices: u32, tracks: u64) -> Self {
        assert!(devices >= raid.min_devices(), "{raid} needs more devices");
        Layout {
            raid,
            devices: u64::from(devices),
            tracks,
        }
    }

    /// The redundancy.
    pub fn raid(&self) -> Raid {
        self.raid
    }

    /// Tracks.
    pub fn tracks(&self) -> u64 {
        self.tracks
    }

    /// Devices.
    pub fn devices(&self) -> usize {
        self.devices as usize
    }

    fn per_device(&self) -> u64 {
        self.tracks.div_ceil(self.devices)
    }

    fn rotated(&self) -> RotatedParity {
        RotatedParity {
            nodes: self.devices as usize,
            block: TRACK_BYTES,
        }
    }

    /// Slots on each device.
    pub fn slots_per_device(&self) -> u64 {
        match self.raid {
            Raid::None => self.per_device(),
            Raid::Mirror => 2 * self.per_device(),
            Raid::Parity => self.tracks.div_ceil(self.devices - 1),
        }
    }

    /// Bytes on each device.
    pub fn device_bytes(&self) -> u64 {
        self.slots_per_device() * TRACK_BYTES as u64
    }

    /// Where `track` lives.
    pub fn place(&self, track: u64) -> Place {
        debug_assert!(track < self.tracks);
        let d = self.devices;
        match self.raid {
            Raid::None => Place::Single(((track % d) as usize, track / d)),
            Raid::Mirror => Place::Mirror([
                ((track % d) as usize, track / d),
                (((track + 1) % d) as usize, self.per_device() + track / d),
            ]),
            Raid::Parity => {
                let stripe = track / (d - 1);
                let member = (track % (d - 1)) as usize;
                let rp = self.rotated();
                let s = stripe as usize;
                Place::Parity {
                    stripe,
                    data: rp.data_node(s, member),
                    parity: rp.parity_node(s),
                    others: (0..d as usize - 1)
                        .filter(|&m| m != member)
                        .map(|m| rp.data_node(s, m))
                        .collect(),
                }
            }
        }
    }

    /// What slot `slot` of device `device` holds.
    pub fn owner(&self, device: usize, slot: u64) -> Owner {
        let d = self.devices;
        let dev = device as u64;
        match self.raid {
            Raid::None => {
                let track = slot * d + dev;
                if track < self.tracks {
                    Owner::Copy {
                        track,
                        from: (device, slot),
                    }
                } else {
                    Owner::Unused
                }
            }
            Raid::Mirror => {
                let per = self.per_device();
                if slot < per {
                    let track = slot * d + dev;
                    if track >= self.tracks {
                        return Owner::Unused;
                    }
                    Owner::Copy {
                        track,
                        from: (((dev + 1) % d) as usize, per + slot),
                    }
                } else {
                    let primary = (dev + d - 1) % d;
                    let track = (slot - per) * d + primary;
                    if track >= self.tracks {
                        return Owner::Unused;
                    }
                    Owner::Copy {
                        track,
                        from: (primary as usize, slot - per),
                    }
                }
            }
            Raid::Parity => {
                if slot < self.slots_per_device() {
                    Owner::Stripe(slot)
                } else {
                    Owner::Unused
                }
            }
        }
    }

    /// The devices of stripe `stripe`, parity first.
    pub fn stripe_devices(&self, stripe: u64) -> Vec<usize> {
        let rp = self.rotated();
        let s = stripe as usize;
        std::iter::once(rp.parity_node(s))
            .chain((0..self.devices as usize - 1).map(|m| rp.data_node(s, m)))
            .collect()
    }

    /// The slot ranges of tracks `[first, end)` on each device, for
    /// zeroing a range where it is a run of whole slots: `(device,
    /// first_slot, end_slot)`. Mirror gives each device two ranges
    /// (primaries and copies); parity gives whole stripes only, with the
    /// tracks of partly covered stripes at either end returned apart.
    pub fn zero_runs(&self, first: u64, end: u64) -> (Vec<(usize, u64, u64)>, Vec<u64>) {
        let d = self.devices;
        let mut runs = Vec::new();
        let mut loose = Vec::new();
        // Device-local slots of volume tracks in [first, end) on device i
        // when striped round-robin: i + k*d in range.
        let striped = |i: u64| {
            let lo = if first <= i {
                0
            } else {
                (first - i).div_ceil(d)
            };
            let hi = if end <= i { 0 } else { (end - i).div_ceil(d) };
            (lo, hi)
        };
        match self.raid {
            Raid::None => {
                for i in 0..d {
                    let (lo, hi) = striped(i);
                    if hi > lo {
                        runs.push((i as usize, lo, hi));
                    }
                }
            }
            Raid::Mirror => {
                let per = self.per_device();
                for i in 0..d {
                    let (lo, hi) = striped(i);
                    if hi > lo {
                        runs.push((i as usize, lo, hi));
                        runs.push((((i + 1) % d) as usize, per + lo, per + hi));
                    }
                }
            }
            Raid::Parity => {
                let w = d - 1;
                let s_lo = first.div_ceil(w);
                let s_hi = end / w;
                if s_hi > s_lo {
                    for i in 0..d {
                        runs.push((i as usize, s_lo, s_hi));
                    }
                    loose.extend(first..(s_lo * w).min(end));
                    loose.extend((s_hi * w).max(first)..end);
                } else {
                    loose.extend(first..end);
                }
            }
        }
        (runs, loose)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn layouts() -> Vec<Layout> {
        let mut v = Vec::new();
        for tracks in [1u64, 7, 12, 13, 64] {
            for d in 1..=5u32 {
                for raid in [Raid::None, Raid::Mirror, Raid::Parity] {
                    if d >= raid.min_devices() {
                        v.push(Layout::new(raid, d, tracks));
                    }
                }
            }
        }
        v
    }

    fn slots_of(l: &Layout, t: u64) -> Vec<Slot> {
        match l.place(t) {
            Place::Single(s) => vec![s],
            Place::Mirror(c) => c.to_vec(),
            Place::Parity { stripe, data, .. } => vec![(data, stripe)],
        }
    }

    #[test]
    fn every_track_has_its_own_slots_inside_the_devices() {
        for l in layouts() {
            let mut seen = HashSet::new();
            for t in 0..l.tracks {
                for (dev, slot) in slots_of(&l, t) {
                    assert!(dev < l.devices(), "{l:?} track {t}");
                    assert!(slot < l.slots_per_device(), "{l:?} track {t}");
                    assert!(seen.insert((dev, slot)), "{l:?}: slot reused by {t}");
                }
            }
        }
    }

    #[test]
    fn mirror_copies_are_on_different_devices() {
        for l in layouts().into_iter().filter(|l| l.raid() == Raid::Mirror) {
            for t in 0..l.tracks {
                let Place::Mirror([a, b]) = l.place(t) else {
                    unreachable!()
                };
                assert_ne!(a.0, b.0, "{l:?} track {t}");
            }
        }
    }

    #[test]
    fn a_stripe_has_one_member_per_device_and_parity_apart() {
        for l in layouts().into_iter().filter(|l| l.raid() == Raid::Parity) {
            for t in 0..l.tracks {
                let Place::Parity {
                    stripe,
                    data,
                    parity,
                    others,
                } = l.place(t)
                else {
                    unreachable!()
                };
                let mut all: Vec<usize> = others.clone();
                all.push(data);
                all.push(parity);
                all.sort_unstable();
                assert_eq!(all, (0..l.devices()).collect::<Vec<_>>(), "{l:?} {t}");
                let mut sd = l.stripe_devices(stripe);
                sd.sort_unstable();
                assert_eq!(sd, all);
            }
        }
    }

    #[test]
    fn owner_inverts_place() {
        for l in layouts() {
            for t in 0..l.tracks {
                match l.place(t) {
                    Place::Single((d, s)) => {
                        assert!(matches!(l.owner(d, s), Owner::Copy { track, .. } if track == t));
                    }
                    Place::Mirror([a, b]) => {
                        assert_eq!(l.owner(a.0, a.1), Owner::Copy { track: t, from: b });
                        assert_eq!(l.owner(b.0, b.1), Owner::Copy { track: t, from: a });
                    }
                    Place::Parity { stripe, data, .. } => {
                        assert_eq!(l.owner(data, stripe), Owner::Stripe(stripe));
                    }
                }
            }
        }
    }

    #[test]
    fn zero_runs_cover_exactly_the_range() {
        for l in layouts() {
            for first in 0..l.tracks {
                for end in first + 1..=l.tracks {
                    let (runs, loose) = l.zero_runs(first, end);
                    let mut covered: HashSet<u64> = loose.iter().copied().collect();
                    assert_eq!(covered.len(), loose.len(), "loose tracks repeat");
                    for (dev, lo, hi) in runs {
                        for slot in lo..hi {
                            match l.owner(dev, slot) {
                                Owner::Copy { track, .. } => {
                                    assert!((first..end).contains(&track), "{l:?}");
                                    covered.insert(track);
                                }
                                Owner::Stripe(s) => {
                                    for t in s * (l.devices - 1)..(s + 1) * (l.devices - 1) {
                                        if t < l.tracks {
                                            assert!((first..end).contains(&t), "{l:?}");
                                            covered.insert(t);
                                        }
                                    }
                                }
                                Owner::Unused => {}
                            }
                        }
                    }
                    assert_eq!(
                        covered,
                        (first..end).collect::<HashSet<_>>(),
                        "{l:?} [{first}, {end})"
                    );
                }
            }
        }
    }

    #[test]
    fn raid_names_parse_and_unknown_ones_are_refused() {
        for r in [Raid::None, Raid::Mirror, Raid::Parity] {
            assert_eq!(r.to_string().parse::<Raid>().unwrap(), r);
        }
        assert!(
            "raid5"
                .parse::<Raid>()
                .unwrap_err()
                .contains("none, mirror, parity")
        );
    }
}
