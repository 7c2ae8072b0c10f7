//! Admission: a framed request takes a control block, reserves its WRITE's
//! NVS slots and enters the pipeline inside rung 4's admission gate, then
//! starts at `host.receive`. The host layer admits what it frames; tests
//! admit requests in-process the same way.
//!
//! Waiting happens here, on the admitting thread, never on a worker: for a
//! control block (exhaustion is rung 1: leaked blocks are reclaimed by
//! audit, see [`crate::engine::ctlblock`]) and for NVS space (destage is
//! kicked; a full NVS pushes back on the client through TCP). It waits
//! outside the gate, so a system recovery never waits behind a full NVS.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::engine::Engine;
use crate::engine::ctlblock::Exhausted;
use crate::engine::datapath;
use crate::engine::request::Request;
use crate::nbd::proto::NbdError;
use crate::recovery::Rung;

/// Take a control block for `req`, reserve `slots` NVS slots for it and
/// enter it in the pipeline, inside the admission gate (wait for a block or
/// NVS space outside it); then start it, outside the gate: its first stages
/// may run on this thread (`affiliate`), and a recovery that closes the
/// gate meanwhile finds it counted and parks it at its next stage.
pub(crate) fn admit(
    engine: &Arc<Engine>,
    mut req: Box<Request>,
    slots: u32,
    affiliate: Option<&mut rcs::Affiliate>,
) {
    take_block(engine, &mut req);
    loop {
        let admission = engine.system.admission();
        if slots > 0 {
            match engine.nvs.reserve(slots, Duration::from_millis(10)) {
                Ok(reserved) => req.slots = reserved,
                Err(crate::store::nvs::NvsError::Timeout(_)) => {
                    if let Some((kind, why)) = engine.destage.failing() {
                        // The NVS is full and no destage can free it: the
                        // devices fail. Answer now instead of hanging.
                        tracing::error!(error = %why, "NVS full and destage failing: write refused");
                        req.early_error = Some(if kind == std::io::ErrorKind::StorageFull {
                            (NbdError::NoSpc, "the NVS is full and the devices are full")
                        } else {
                            (
                                NbdError::Io,
                                "the NVS is full and destaging to the devices fails",
                            )
                        });
                    } else {
                        drop(admission);
                        crate::engine::destage::kick(engine);
                        engine.destage.hurry();
                        continue;
                    }
                }
                Err(_) => {
                    req.early_error = Some((NbdError::Shutdown, "the server is shutting down"));
                }
            }
        }
        datapath::enter(&mut req);
        drop(admission);
        datapath::start(req, affiliate);
        return;
    }
}

/// Take a request control block, handling exhaustion (rung 1, see
/// [`crate::engine::ctlblock`]): reclaim leaked blocks, or wait for live requests to
/// finish.
fn take_block(engine: &Arc<Engine>, req: &mut Request) {
    let Some(alive) = req.alive.clone() else {
        return;
    };
    let mut waits = 0u32;
    // The clock is read only once a block is not there at once (every
    // request passes here).
    let mut started = None;
    loop {
        let result = engine.blocks.acquire(&alive);
        if result.is_err() {
            started.get_or_insert_with(std::time::Instant::now);
        }
        let waited = || started.map_or(Duration::ZERO, |t| t.elapsed());
        match result {
            Ok(block) => {
                if waits > 0 {
                    engine.recoveries.record(
                        Rung::Task,
                        format!(
                            "control blocks exhausted ({} in use by live requests): admission waited",
                            engine.blocks.capacity()
                        ),
                        waited(),
                        1,
                    );
                }
                req.block = Some(block);
                return;
            }
            Err(Exhausted::Reclaimed(n)) => {
                tracing::warn!(
                    reclaimed = n,
                    "control blocks exhausted; leaked blocks reclaimed"
                );
                engine.recoveries.record(
                    Rung::Task,
                    format!("control blocks exhausted: {n} leaked blocks (owners gone) reclaimed"),
                    waited(),
                    1,
                );
            }
            Err(Exhausted::Busy) => {
                if engine.stopping.load(Ordering::SeqCst) {
                    req.early_error = Some((NbdError::Shutdown, "the server is shutting down"));
                    return;
                }
                crate::blocking::about_to_block();
                std::thread::sleep(crate::backend::devqueue::backoff(waits));
                waits += 1;
            }
        }
    }
}
