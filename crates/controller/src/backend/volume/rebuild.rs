//! Losing a device and rebuilding its replacement while the volume serves
//! (rung 7): the loss is recorded in the label before any write skips the
//! device; the rebuild walks the slots, persists its progress in the label,
//! and stops and tries again after a growing wait when the replacement
//! fails.

use super::*;

impl Inner {
    /// Mark device `d` lost (after `why`), record it in the label before
    /// any write skips it, and start rebuilding a replacement.
    pub(super) fn fail(self: &Arc<Self>, d: usize, why: &std::io::Error) -> std::io::Result<()> {
        let m = &self.members[d];
        {
            let mut label = self.label.lock();
            if m.state.load(Ordering::Acquire) == LOST {
                return Ok(());
            }
            let before = label.degraded.clone();
            label.degraded.retain(|g| g.device as usize != d);
            label.degraded.push(Degraded {
                device: d as u32,
                rebuilt_slots: 0,
                generation: new_generation(),
            });
            label.degraded.sort_by_key(|g| g.device);
            if let Err(e) = write_label(&self.dir, &label) {
                // A restart would trust the stale device again: it is not
                // skipped, and the I/O that failed on it fails.
                label.degraded = before;
                tracing::error!(device = d, error = %e, "could not record a lost device in the volume label; the device is not skipped");
                return Err(std::io::Error::new(
                    e.kind(),
                    format!(
                        "device {d} failed ({why}) and its loss cannot be recorded in the volume label: {e}"
                    ),
                ));
            }
            m.losses.fetch_add(1, Ordering::AcqRel);
            m.strikes.store(0, Ordering::Release);
            m.state.store(LOST, Ordering::Release);
            m.ahead.lock().clear();
            *m.ahead_log.lock() = None;
            m.rebuilt.store(0, Ordering::Release);
            m.durable.store(0, Ordering::Release);
        }
        tracing::error!(device = d, error = %why, "device lost; the volume serves degraded");
        if let Some(log) = self.log.get() {
            log.record(
                Rung::Reconstruct,
                format!(
                    "device {d} lost ({why}): serving degraded from {}",
                    self.layout.raid()
                ),
                Duration::ZERO,
                0,
            );
        }
        Self::spawn_rebuild(self, d);
        Ok(())
    }

    /// Open a replacement for lost device `d` (a fresh file, unless the
    /// device is already rebuilding from a restart) and rebuild it in the
    /// background.
    pub(super) fn spawn_rebuild(self: &Arc<Self>, d: usize) {
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("rebound-rebuild-{d}"))
            .spawn(move || me.rebuild(d));
        match spawned {
            Ok(h) => self.rebuilds.lock().push(h),
            Err(e) => tracing::error!(device = d, error = %e, "could not start a rebuild"),
        }
    }

    pub(super) fn replace(&self, d: usize) -> std::io::Result<()> {
        let path = device_path(&self.dir, d);
        let failed = self.dir.join(format!("device{d}.failed.img"));
        if let Err(e) = std::fs::rename(&path, &failed) {
            tracing::warn!(device = d, error = %e, "could not move the lost device's file aside");
        }
        let dev =
            FileDevice::open_or_create(&path, self.layout.device_bytes(), self.options.direct)?;
        let dev = FaultyDevice::new(
            dev,
            d,
            Arc::clone(&self.plans[d]),
            self.options.power_loss_tracking,
        );
        crate::files::sync_dir(&self.dir)?;
        let m = &self.members[d];
        *m.dev.write() = Arc::new(dev);
        m.pulled.store(false, Ordering::Release);
        Ok(())
    }

    /// Rebuild device `d` (creating its replacement first if it is lost),
    /// trying again after a growing wait while what stops it is not a
    /// second loss: a replacement that cannot be created or written, a
    /// label that cannot be recorded (a full or failing disk may recover).
    pub(super) fn rebuild(self: Arc<Self>, d: usize) {
        let m = &self.members[d];
        let loss = m.losses.load(Ordering::Acquire);
        // A stop of an earlier loss's rebuild is no news about this one.
        *m.stalled.lock() = None;
        let mut wait = REBUILD_RETRY_MIN;
        loop {
            let why = match Arc::clone(&self).rebuild_once(d, loss) {
                Stopped::Done => return,
                Stopped::Fatal(why) => {
                    tracing::error!(device = d, %why, "rebuild stopped; the volume stays degraded");
                    *m.stalled.lock() = Some(format!("stopped: {why}"));
                    if let Some(log) = self.log.get() {
                        log.record(
                            Rung::Reconstruct,
                            format!("rebuild of device {d} stopped for good: {why}"),
                            Duration::ZERO,
                            0,
                        );
                    }
                    return;
                }
                Stopped::Retry(why) => why,
            };
            tracing::error!(device = d, %why, ?wait, "rebuild stopped; trying again");
            *m.stalled.lock() = Some(format!("stopped ({why}); trying again in {wait:?}"));
            if let Some(log) = self.log.get() {
                log.record(
                    Rung::Reconstruct,
                    format!("rebuild of device {d} stopped ({why}); trying again in {wait:?}"),
                    Duration::ZERO,
                    0,
                );
            }
            // In short naps, so closing the volume is not held up.
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if self.closing.load(Ordering::Acquire) || m.losses.load(Ordering::Acquire) != loss
                {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
            }
            *m.stalled.lock() = None;
            wait = (wait * 2).min(REBUILD_RETRY_MAX);
        }
    }

    /// One try of [`Inner::rebuild`], from the rebuilt prefix the label
    /// records.
    #[expect(
        clippy::too_many_lines,
        reason = "one state machine over the slots: each slot's stripe or track lock is held from before its rebuild until it counts as rebuilt, progress is recorded under the label lock, and any step may end the try (Done, Retry, Fatal); read top to bottom, the lock scopes and exits stay in view"
    )]
    pub(super) fn rebuild_once(self: Arc<Self>, d: usize, loss: u64) -> Stopped {
        let m = &self.members[d];
        if self.closing.load(Ordering::Acquire) || m.losses.load(Ordering::Acquire) != loss {
            return Stopped::Done;
        }
        if m.state.load(Ordering::Acquire) == LOST {
            if let Err(e) = self.replace(d) {
                return Stopped::Retry(format!("no replacement device: {e}"));
            }
            m.state.store(REBUILDING, Ordering::Release);
        }
        let started = Instant::now();
        let slots = self.layout.slots_per_device();
        let from = m.durable.load(Ordering::Acquire);
        tracing::info!(
            device = d,
            from_slot = from,
            slots,
            "rebuilding a lost device"
        );
        let mut buf = vec![0u8; TRACK_BYTES];
        let mut last_report = Instant::now();
        let mut last_persist = (from, Instant::now());
        let mut slot = from;
        let outcome: Result<(), Stopped> = loop {
            if self.closing.load(Ordering::Acquire) {
                return Stopped::Done;
            }
            if m.state.load(Ordering::Acquire) != REBUILDING
                || m.losses.load(Ordering::Acquire) != loss
            {
                return Stopped::Done; // lost again; a new rebuild starts over
            }
            if slot < slots {
                let owner = self.layout.owner(d, slot);
                // The lock the writes of this slot take, held until the
                // slot counts as rebuilt: a write in between would see the
                // slot missing and skip it (parity: write only the parity)
                // after the rebuild had copied the old data into it.
                let mut guard = match owner {
                    Owner::Unused => None,
                    Owner::Copy { track, .. } => Some(self.lock(track)),
                    Owner::Stripe(stripe) => Some(self.lock(stripe)),
                };
                let rebuilt = match owner {
                    Owner::Unused => {
                        buf.fill(0);
                        self.write_slot(d, slot, &buf)
                    }
                    Owner::Copy { track, from } => {
                        if self.usable(from.0, from.1) == Use::Missing {
                            break Err(Stopped::Fatal(format!(
                                "track {track}: its other copy is lost too"
                            )));
                        }
                        self.read_slot(from.0, from.1, &mut buf)
                            .and_then(|()| self.injected_rebuild_fault(d))
                            .and_then(|()| self.write_slot(d, slot, &buf))
                    }
                    // Rebuilt ahead for a write, and kept current since:
                    // never rebuilt again from a stripe a crash may have
                    // left half written.
                    Owner::Stripe(stripe) if m.ahead.lock().contains(&stripe) => Ok(()),
                    Owner::Stripe(stripe) => {
                        let rest = self
                            .layout
                            .stripe_devices(stripe)
                            .into_iter()
                            .filter(|&x| x != d);
                        self.xor_of(stripe, rest, &mut buf)
                            .and_then(|()| self.injected_rebuild_fault(d))
                            .and_then(|()| self.write_slot(d, slot, &buf))
                    }
                };
                if rebuilt.is_err() {
                    guard = None;
                }
                match rebuilt {
                    Ok(()) => {}
                    Err(Fault::Device(x, e)) if x != d => {
                        // Another device failed: that one is lost too, and
                        // what this one held with it cannot be rebuilt.
                        let _ = Self::fail(&self, x, &e);
                        break Err(Stopped::Fatal(format!("device {x}: {e}")));
                    }
                    // The replacement failed: a full or failing disk,
                    // perhaps for a while only.
                    Err(Fault::Device(_, e)) => {
                        break Err(Stopped::Retry(format!("replacement device {d}: {e}")));
                    }
                    // The data cannot be read now (a stripe missing
                    // another member): a second loss.
                    Err(Fault::Io(e)) => break Err(Stopped::Fatal(e.to_string())),
                }
                #[cfg(test)]
                if let Some(hook) = &*self.slot_written.lock() {
                    (hook.0)(d, slot);
                }
                slot += 1;
                m.rebuilt.store(slot, Ordering::Release);
                drop(guard.take());
                let rate = self.rebuild_rate.load(Ordering::Relaxed);
                if rate > 0 {
                    let due = Duration::from_secs_f64(
                        ((slot - from) * TRACK_BYTES as u64) as f64 / rate as f64,
                    );
                    // In short naps, so closing the volume is not held up.
                    while let Some(ahead) = due.checked_sub(started.elapsed())
                        && ahead > Duration::from_millis(1)
                        && !self.closing.load(Ordering::Acquire)
                    {
                        std::thread::sleep(ahead.min(Duration::from_millis(20)));
                    }
                }
            }
            if slot == slots
                || slot - last_persist.0 >= REBUILD_PERSIST_SLOTS
                || last_persist.1.elapsed() >= REBUILD_PERSIST_INTERVAL
            {
                last_persist = (slot, Instant::now());
                if let Err(e) = self.on(d, DeviceOp::Sync, |dev| dev.sync()) {
                    break Err(Stopped::Retry(match e {
                        Fault::Device(_, e) | Fault::Io(e) => {
                            format!("syncing replacement device {d}: {e}")
                        }
                    }));
                }
                let mut label = self.label.lock();
                if m.state.load(Ordering::Acquire) != REBUILDING
                    || m.losses.load(Ordering::Acquire) != loss
                {
                    return Stopped::Done;
                }
                if slot == slots {
                    label.degraded.retain(|g| g.device as usize != d);
                } else if let Some(g) = label.degraded.iter_mut().find(|g| g.device as usize == d) {
                    g.rebuilt_slots = slot;
                }
                if let Err(e) = write_label(&self.dir, &label) {
                    break Err(Stopped::Retry(format!(
                        "recording the rebuild in the label: {e}"
                    )));
                }
                m.durable.store(slot, Ordering::Release);
                m.ahead.lock().retain(|&a| a >= slot);
                if slot == slots {
                    m.state.store(ONLINE, Ordering::Release);
                    // Its records are of a finished loss's generation now.
                    *m.ahead_log.lock() = None;
                    let _ = std::fs::remove_file(ahead_path(&self.dir, d));
                    break Ok(());
                }
                if last_report.elapsed() >= Duration::from_secs(2) {
                    last_report = Instant::now();
                    tracing::info!(
                        device = d,
                        percent = slot * 100 / slots.max(1),
                        "rebuild progress"
                    );
                }
            }
        };
        match outcome {
            Ok(()) => {
                let took = started.elapsed();
                tracing::info!(device = d, slots = slots - from, ?took, "device rebuilt");
                if let Some(log) = self.log.get() {
                    log.record(
                        Rung::Reconstruct,
                        format!(
                            "device {d} rebuilt from {} ({} MiB)",
                            self.layout.raid(),
                            ((slots - from) * TRACK_BYTES as u64) >> 20
                        ),
                        took,
                        0,
                    );
                }
                *m.stalled.lock() = None;
                Stopped::Done
            }
            Err(stopped) => stopped,
        }
    }

    /// An injected write error of replacement `d` during its rebuild, if
    /// one is armed.
    pub(super) fn injected_rebuild_fault(&self, d: usize) -> Result<(), Fault> {
        let armed = self
            .rebuild_faults
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if armed {
            return Err(Fault::Device(
                d,
                std::io::Error::other("injected write error on the replacement"),
            ));
        }
        Ok(())
    }
}

/// How one try of a rebuild ended.
pub(super) enum Stopped {
    /// Rebuilt, or no longer this try's business (closing, lost again).
    Done,
    /// Stopped by what may pass: try again later.
    Retry(String),
    /// Stopped by a second loss: what the device held with the other
    /// cannot be rebuilt.
    Fatal(String),
}
