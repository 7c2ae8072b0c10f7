//! The admin socket's server in-process: it answers requests, sleeps in
//! `accept` while nobody calls (no polling), and stops promptly.

use std::sync::Arc;
use std::time::Duration;

use crate::control::admin::{AdminServer, request_within};
use crate::controller::Controller;

/// Voluntary context switches of this process's thread named `name`.
fn wakeups_of(name: &str) -> Option<u64> {
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let status = std::fs::read_to_string(task.path().join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse().ok());
        }
    }
    None
}

#[test]
fn idle_admin_socket_never_wakes_and_answers_and_stops() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ctl = Controller::open(super::temp_config(dir.path())).expect("opening the controller");
    let path = dir.path().join("admin.sock");
    let server = AdminServer::start(&path, &Arc::clone(&ctl)).expect("starting the admin socket");
    let limit = Duration::from_secs(5);
    assert_eq!(
        request_within(&path, "health", limit).unwrap().trim(),
        "healthy"
    );

    // Idle: the accept thread sleeps in the kernel. A polling loop (as
    // this server once had, every 20 ms) would wake 25 times in 500 ms.
    let before = wakeups_of("rebound-admin").expect("the admin thread is running");
    std::thread::sleep(Duration::from_millis(500));
    let after = wakeups_of("rebound-admin").expect("the admin thread is running");
    assert!(
        after - before <= 2,
        "an idle admin thread woke {} times in 500 ms",
        after - before
    );

    // Still answering after the idle spell; then dropped: the blocked
    // accept is woken, the thread ends and the socket file goes.
    assert_eq!(
        request_within(&path, "health", limit).unwrap().trim(),
        "healthy"
    );
    drop(server);
    assert!(
        wakeups_of("rebound-admin").is_none(),
        "the admin thread outlived its server"
    );
    assert!(!path.exists(), "the socket file outlived its server");
    ctl.shutdown().expect("shutting the controller down");
}
