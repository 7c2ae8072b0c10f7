//! Track I/O on the volume's devices through its layout: reads and
//! writes of a striped, mirrored or parity volume, degraded around a lost
//! device, with the partial parity log closing the RAID-5 write hole, and
//! the replay of that log at open.

use super::*;

/// An error of the partial parity log, naming its file.
pub(super) fn ppl_error(log: &PartialParityLog, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(
        e.kind(),
        format!("partial parity log {}: {e}", log.path().display()),
    )
}

impl Inner {
    /// Run `op`; a device error is returned as it is, except on a
    /// redundant volume whose device has now failed often enough to be
    /// declared lost ([`Inner::strike`]): then `op` is tried again around
    /// it, at most once per device.
    pub(super) fn retry<T>(
        self: &Arc<Self>,
        mut op: impl FnMut(&Arc<Self>) -> Result<T, Fault>,
    ) -> std::io::Result<T> {
        for _ in 0..=self.members.len() {
            match op(self) {
                Ok(v) => return Ok(v),
                Err(Fault::Io(e)) => return Err(e),
                Err(Fault::Device(d, e)) => {
                    if !Self::strike(self, d, &e)? {
                        return Err(e);
                    }
                }
            }
        }
        Err(std::io::Error::other("every device of the volume failed"))
    }

    /// Count device `d`'s error `e` towards declaring it lost; whether it
    /// is lost now (the I/O may go around it). Never for a volume without
    /// redundancy, never for `ENOSPC` (a full file system is not a failed
    /// device, and losing one over it could cascade into a second loss on
    /// the same file system). An error when the loss cannot be recorded in
    /// the label: the device is not skipped then.
    pub(super) fn strike(self: &Arc<Self>, d: usize, e: &std::io::Error) -> std::io::Result<bool> {
        if !self.layout.raid().redundant() || e.kind() == std::io::ErrorKind::StorageFull {
            return Ok(false);
        }
        let m = &self.members[d];
        if m.state.load(Ordering::Acquire) == LOST {
            return Ok(true);
        }
        let strikes = m.strikes.fetch_add(1, Ordering::AcqRel) + 1;
        if strikes < self.options.error_limit && !m.pulled.load(Ordering::Acquire) {
            tracing::warn!(device = d, strikes, limit = self.options.error_limit, error = %e, "device error");
            return Ok(false);
        }
        Self::fail(self, d, e).map(|()| true)
    }

    /// Device `d`'s I/O `f` of kind `op`; an error (other than a refused
    /// request) is the device's fault, counted in its health.
    pub(super) fn on<T>(
        &self,
        d: usize,
        op: DeviceOp,
        f: impl FnOnce(&dyn Device) -> std::io::Result<T>,
    ) -> Result<T, Fault> {
        let m = &self.members[d];
        let result = if m.pulled.load(Ordering::Acquire) {
            Err(std::io::Error::other(format!(
                "device {d} is pulled (injected loss)"
            )))
        } else {
            let dev = m.dev.read().clone();
            f(&*dev)
        };
        result.map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                Fault::Io(e)
            } else {
                m.errors[op as usize].fetch_add(1, Ordering::Relaxed);
                *m.last_error.lock() = Some(format!("{}: {e}", op.name()));
                Fault::Device(d, e)
            }
        })
    }

    pub(super) fn read_slot(&self, d: usize, slot: u64, out: &mut [u8]) -> Result<(), Fault> {
        self.on(d, DeviceOp::Read, |dev| {
            dev.read_at(out, slot * TRACK_BYTES as u64)
        })
    }

    pub(super) fn write_slot(&self, d: usize, slot: u64, data: &[u8]) -> Result<(), Fault> {
        self.on(d, DeviceOp::Write, |dev| {
            dev.write_at(data, slot * TRACK_BYTES as u64)
        })
    }

    pub(super) fn usable(&self, d: usize, slot: u64) -> Use {
        let m = &self.members[d];
        match m.state.load(Ordering::Acquire) {
            ONLINE => Use::Good,
            LOST => Use::Missing,
            _ => {
                if slot < m.durable.load(Ordering::Acquire) || m.ahead.lock().contains(&slot) {
                    Use::Good
                } else if slot < m.rebuilt.load(Ordering::Acquire) {
                    Use::Unrecorded
                } else {
                    Use::Missing
                }
            }
        }
    }

    pub(super) fn lock(&self, key: u64) -> MutexGuard<'_, ()> {
        self.locks[(key % STRIPE_LOCKS as u64) as usize].lock()
    }

    pub(super) fn unavailable(what: String) -> Fault {
        Fault::Io(std::io::Error::other(what))
    }

    pub(super) fn wait_for_rebuild(what: String) -> Fault {
        Fault::Io(std::io::Error::new(std::io::ErrorKind::ResourceBusy, what))
    }

    pub(super) fn read_once(&self, track: u64, out: &mut [u8]) -> Result<(), Fault> {
        match self.layout.place(track) {
            Place::Single((d, slot)) => self.read_slot(d, slot, out),
            Place::Mirror(copies) => {
                let mut failed = None;
                for (d, slot) in copies {
                    if self.usable(d, slot) == Use::Missing {
                        continue;
                    }
                    match self.read_slot(d, slot, out) {
                        Ok(()) => {
                            if let Some((bad, bad_slot, _)) = failed {
                                // Read again under the track's lock, so no
                                // write lands between the read and the
                                // rewrite.
                                let _g = self.lock(track);
                                self.read_slot(d, slot, out)?;
                                self.correct(bad, bad_slot, track, out);
                            }
                            return Ok(());
                        }
                        Err(Fault::Device(d, e)) if failed.is_none() => {
                            failed = Some((d, slot, e));
                        }
                        Err(f) => return Err(f),
                    }
                }
                Err(match failed {
                    Some((d, _, e)) => Fault::Device(d, e),
                    None => {
                        Self::unavailable(format!("track {track}: both copies are on lost devices"))
                    }
                })
            }
            Place::Parity {
                stripe,
                data,
                parity,
                others,
            } => {
                let mut failed = None;
                if self.usable(data, stripe) != Use::Missing {
                    match self.read_slot(data, stripe, out) {
                        Err(Fault::Device(d, e)) => failed = Some((d, e)),
                        read => return read,
                    }
                }
                // Degraded read, or a read error (served from the XOR of
                // the rest of the stripe, then the slot rewritten, as md
                // does): under the stripe's lock so no write is half done.
                let _g = self.lock(stripe);
                if failed.is_none() && self.usable(data, stripe) != Use::Missing {
                    // The rebuild passed the slot meanwhile.
                    match self.read_slot(data, stripe, out) {
                        Err(Fault::Device(d, e)) => failed = Some((d, e)),
                        read => return read,
                    }
                }
                let rebuilt = self.xor_of(stripe, std::iter::once(parity).chain(others), out);
                match (rebuilt, failed) {
                    (Ok(()), Some((d, _))) => {
                        self.correct(d, stripe, track, out);
                        Ok(())
                    }
                    (Ok(()), None) => Ok(()),
                    (Err(_), Some((d, e))) => Err(Fault::Device(d, e)),
                    (Err(Fault::Io(e)), None) => Err(Self::unavailable(format!(
                        "track {track} (stripe {stripe}) cannot be reconstructed: {e}"
                    ))),
                    (Err(f), None) => Err(f),
                }
            }
        }
    }

    /// After a read error on device `d` at `slot`, served from the
    /// redundancy: rewrite the slot with `data` (md's read-error
    /// correction; the caller holds the track's or stripe's lock). A failed
    /// rewrite is a write error: it counts towards declaring `d` lost.
    fn correct(&self, d: usize, slot: u64, track: u64, data: &[u8]) {
        match self.write_slot(d, slot, data) {
            Ok(()) => tracing::warn!(
                device = d,
                slot,
                track,
                "read error served from the redundancy; slot rewritten"
            ),
            Err(Fault::Device(_, e) | Fault::Io(e)) => {
                let m = &self.members[d];
                m.strikes.fetch_add(1, Ordering::AcqRel);
                tracing::error!(device = d, slot, track, error = %e, "rewriting a slot after a read error failed");
            }
        }
    }

    /// XOR of slot `stripe` of `devices` into `out` (zeroed first); every
    /// one must be readable.
    pub(super) fn xor_of(
        &self,
        stripe: u64,
        devices: impl IntoIterator<Item = usize>,
        out: &mut [u8],
    ) -> Result<(), Fault> {
        out.fill(0);
        let mut buf = vec![0u8; TRACK_BYTES];
        for d in devices {
            if self.usable(d, stripe) == Use::Missing {
                return Err(Fault::Io(std::io::Error::other(format!(
                    "device {d} is lost too"
                ))));
            }
            self.read_slot(d, stripe, &mut buf)?;
            xor_into(out, &buf);
        }
        Ok(())
    }

    pub(super) fn write_once(&self, track: u64, data: &[u8]) -> Result<(), Fault> {
        match self.layout.place(track) {
            Place::Single((d, slot)) => self.write_slot(d, slot, data),
            Place::Mirror(copies) => {
                let _g = self.lock(track);
                let uses = copies.map(|(d, slot)| self.usable(d, slot));
                if !uses.contains(&Use::Good) {
                    return Err(if uses.contains(&Use::Unrecorded) {
                        Self::wait_for_rebuild(format!(
                            "track {track}: its one readable copy is rebuilt but not yet recorded"
                        ))
                    } else {
                        Self::unavailable(format!("track {track}: both copies are on lost devices"))
                    });
                }
                for (d, slot) in copies {
                    // A copy not rebuilt yet is written too: the rebuild
                    // copies the same data under this lock later.
                    if self.members[d].state.load(Ordering::Acquire) != LOST {
                        self.write_slot(d, slot, data)?;
                    }
                }
                Ok(())
            }
            Place::Parity {
                stripe,
                data: dd,
                parity: pd,
                others,
            } => {
                let _g = self.lock(stripe);
                let du = self.usable(dd, stripe);
                let pu = self.usable(pd, stripe);
                let ou: Vec<Use> = others.iter().map(|&o| self.usable(o, stripe)).collect();
                if du == Use::Unrecorded || pu == Use::Unrecorded || ou.contains(&Use::Unrecorded) {
                    return Err(Self::wait_for_rebuild(format!(
                        "stripe {stripe} is rebuilt but not yet recorded"
                    )));
                }
                let missing = usize::from(du == Use::Missing)
                    + usize::from(pu == Use::Missing)
                    + ou.iter().filter(|&&u| u == Use::Missing).count();
                if missing > 1 {
                    return Err(Self::unavailable(format!(
                        "track {track}: stripe {stripe} has {missing} members on lost devices"
                    )));
                }
                let entry = (stripe % STRIPE_LOCKS as u64) as usize;
                if pu == Use::Missing {
                    // No parity to keep: the data alone (and no partial
                    // parity: an older record of this entry must not be
                    // replayed over what this write changes).
                    self.ppl_clear(entry)?;
                    return self.write_slot(dd, stripe, data);
                }
                if let Some(i) = ou.iter().position(|&u| u == Use::Missing) {
                    // Rebuild that member ahead (module doc), or wait.
                    self.rebuild_ahead(others[i], stripe).map_err(|why| {
                        Self::wait_for_rebuild(format!(
                            "track {track}: stripe {stripe} misses another data member ({why}); a read-modify-write could lose it in a crash"
                        ))
                    })?;
                }
                // Reconstruct-write: parity from the new data and the other
                // members as they are on the devices; idempotent, so an
                // interrupted one is made whole by the redo.
                let mut p = vec![0u8; TRACK_BYTES];
                self.xor_of(stripe, others.iter().copied(), &mut p)?;
                // `p` is the partial parity now: logged before the data
                // slot changes, so a crash between the two writes leaves a
                // stripe the replay makes whole (crate::backend::ppl).
                match (&self.ppl, du) {
                    (Some(log), Use::Good) => log
                        .record_write(entry, stripe, dd, &p)
                        .map_err(|e| Fault::Io(ppl_error(log, e)))?,
                    _ => self.ppl_clear(entry)?,
                }
                xor_into(&mut p, data);
                let written = if du != Use::Missing {
                    self.write_slot(dd, stripe, data)
                } else {
                    Ok(())
                }
                .and_then(|()| self.write_slot(pd, stripe, &p));
                // Cleared however the write ended: after an error the
                // failing device is lost (the stripe is served degraded and
                // the NVS redoes the write), and an entry left behind could
                // later be replayed over contents changed without the log
                // (a whole-stripe zeroing).
                let cleared = self.ppl_clear(entry);
                written.and(cleared)
            }
        }
    }

    /// Empties partial parity log entry `entry` (parity volumes).
    pub(super) fn ppl_clear(&self, entry: usize) -> Result<(), Fault> {
        match &self.ppl {
            Some(log) => log.clear(entry).map_err(|e| Fault::Io(ppl_error(log, e))),
            None => Ok(()),
        }
    }

    /// Replays the partial parity log (at open, before rebuilds start):
    /// each torn track write's stripe gets the parity `partial XOR data`
    /// when its written member and its parity are both readable (a lost
    /// written member is rebuilt from the rest and its write redone from
    /// the NVS; a lost parity is rebuilt from the data), and each
    /// interrupted zeroing is done again. Then the log is emptied.
    pub(super) fn replay_partial_parity(&self) -> std::io::Result<()> {
        let Some(log) = &self.ppl else {
            return Ok(());
        };
        let intents = log.intents()?;
        if intents.is_empty() {
            return Ok(());
        }
        let slots = self.layout.slots_per_device();
        let (mut stripes, mut zeroed) = (0u64, 0u64);
        let mut buf = vec![0u8; TRACK_BYTES];
        for intent in intents {
            match intent {
                Intent::Write {
                    stripe,
                    device,
                    partial,
                } => {
                    let members = if stripe < slots {
                        self.layout.stripe_devices(stripe)
                    } else {
                        Vec::new()
                    };
                    if members.is_empty() || !members[1..].contains(&device) {
                        tracing::warn!(
                            stripe,
                            device,
                            "partial parity log entry names no data member of its stripe; ignored"
                        );
                        continue;
                    }
                    let pd = members[0];
                    if self.usable(device, stripe) != Use::Good
                        || self.usable(pd, stripe) != Use::Good
                    {
                        continue;
                    }
                    let io = |f: Fault| match f {
                        Fault::Device(_, e) | Fault::Io(e) => e,
                    };
                    self.read_slot(device, stripe, &mut buf).map_err(io)?;
                    xor_into(&mut buf, &partial);
                    self.write_slot(pd, stripe, &buf).map_err(io)?;
                    stripes += 1;
                }
                Intent::Zero { first, end } => {
                    if first > end || end > self.layout.tracks() {
                        tracing::warn!(
                            first,
                            end,
                            "partial parity log zeroing intent out of range; ignored"
                        );
                        continue;
                    }
                    let (runs, _) = self.layout.zero_runs(first, end);
                    let t = TRACK_BYTES as u64;
                    for (d, lo, hi) in runs {
                        if self.members[d].state.load(Ordering::Acquire) != LOST {
                            self.members[d]
                                .dev
                                .read()
                                .zero_range(lo * t, (hi - lo) * t, true)?;
                        }
                    }
                    zeroed += 1;
                }
            }
        }
        for m in &self.members {
            if m.state.load(Ordering::Acquire) != LOST {
                m.dev.read().sync()?;
            }
        }
        tracing::warn!(
            stripes,
            zeroed,
            "replayed the partial parity log: torn stripes made whole"
        );
        log.reset()
    }
}
